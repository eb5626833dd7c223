//! The ConfigMap holding the kvfleet worker's `worker.yaml`, and the hash of it that rolls
//! the pods when it changes (kvfleet runtime only).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;

use super::worker::worker_config_yaml;
use super::{config_map_name, DesiredError, Owner};
use crate::api::InferenceDeploymentSpec;
use crate::validate::Verdict;

pub use crate::contract::{CONFIG_HASH_ANNOTATION, WORKER_CONFIG_KEY};

/// The worker's ConfigMap and the hash of its `worker.yaml` (for [`CONFIG_HASH_ANNOTATION`]).
pub(super) fn worker_config_map(
    owner: &Owner,
    spec: &InferenceDeploymentSpec,
    verdict: &Verdict,
) -> Result<(ConfigMap, String), DesiredError> {
    let yaml = worker_config_yaml(spec, verdict)?;
    let hash = format!("{:016x}", fnv1a64(yaml.as_bytes()));
    let cm = ConfigMap {
        metadata: owner.meta(config_map_name(&owner.name)),
        data: Some(BTreeMap::from([(WORKER_CONFIG_KEY.to_string(), yaml)])),
        ..ConfigMap::default()
    };
    Ok((cm, hash))
}

/// FNV-1a, 64 bit: a hash that stays the same across Rust releases (unlike `DefaultHasher`),
/// so upgrading the controller does not roll every pod.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{desired, Settings, WORKER_CLUSTER_ROLE};
    use super::*;
    use crate::api::{AttentionBackend, KvCacheDtype};
    use crate::contract::config::WorkerConfig;
    use crate::contract::model::ModelSource;

    #[test]
    fn kvfleet_worker_reads_the_resolved_config_from_the_config_map() {
        let obj = fixture(KVFLEET_RTX3090_TP2);
        let v = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let cm = d.config_map.as_ref().unwrap();
        assert_eq!(cm.metadata.name.as_deref(), Some("llama-config"));
        let yaml = &cm.data.as_ref().unwrap()[WORKER_CONFIG_KEY];
        let cfg = WorkerConfig::parse(yaml).expect("the worker accepts what the controller renders");
        let r = cfg.resolved.unwrap();
        assert_eq!(
            r.kv_cache_dtype,
            KvCacheDtype::Bfloat16,
            "auto resolved by the verdict"
        );
        assert_eq!(r.attention_backend, AttentionBackend::KvfleetCuda);
        assert_eq!(cfg.engine.tensor_parallel_size, 2);
        assert_eq!(cfg.geometry.as_ref().unwrap().kv_heads, 8);
        assert_eq!(cfg.weight_bytes, 16 << 30);
        assert_eq!(
            cfg.model_name.as_deref(),
            Some("meta-llama/Llama-3.1-8B-Instruct")
        );
        let c = container(&d);
        assert_eq!(c.command.unwrap(), vec!["kvfleet"]);
        let args = c.args.unwrap();
        assert_eq!(args[..3], ["worker", "--config", "/etc/kvfleet/worker.yaml"]);
        assert_eq!(
            arg_after(&args, "--model"),
            None,
            "no weights: no model path, never a default model"
        );
        assert_eq!(
            cfg.model,
            Some(ModelSource::default()),
            "the worker refuses to start without weights"
        );
        assert!(c
            .volume_mounts
            .unwrap()
            .iter()
            .any(|m| m.mount_path == "/etc/kvfleet"));
        let ann = template(&d).metadata.clone().unwrap().annotations.unwrap();
        assert!(ann.contains_key(CONFIG_HASH_ANNOTATION));
        let rb = d.role_binding.unwrap();
        assert_eq!(rb.role_ref.name, WORKER_CLUSTER_ROLE);
    }

    #[test]
    fn config_hash_is_stable_and_follows_the_resolved_config() {
        let obj = fixture(KVFLEET_RTX3090_TP2);
        let hash = |v: &Verdict| {
            let d = desired(&obj, v, &Settings::default(), None).unwrap();
            d.deployment
                .unwrap()
                .spec
                .unwrap()
                .template
                .metadata
                .unwrap()
                .annotations
                .unwrap()[CONFIG_HASH_ANNOTATION]
                .clone()
        };
        let a = verdict("bfloat16", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        let b = verdict("fp8_e5m2", "KVFLEET_CUDA", "8.6", "NVIDIA-GeForce-RTX-3090");
        assert_eq!(hash(&a), hash(&a));
        assert_ne!(hash(&a), hash(&b));
    }
}

//! The kvfleet runtime's serving process: `kvfleet worker` with its arguments, its
//! configuration (`worker.yaml`, see `config_map.rs`), the model source it reads, and the
//! volumes that carry them.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::{ConfigMapVolumeSource, KeyToPath, Volume, VolumeMount};

use super::container::{mount, ServingProcess, WEIGHTS_DIR};
use super::{config_map_name, resolved, DesiredError, Settings, WORKER_CONFIG_KEY};
use crate::api::{EngineQuantization, InferenceDeploymentSpec, SpeculativeSpec, WeightsFormat};
use crate::contract::config::{ResolvedEngine, WorkerConfig};
use crate::contract::model::{ModelSource, Weights};
use crate::plan::memory::parse_quantity_bytes;
use crate::validate::Verdict;

/// Where the worker's ConfigMap is mounted.
const CONFIG_DIR: &str = "/etc/kvfleet";
/// Where the `model.config` ConfigMap's `config.json` is mounted.
const MODEL_CONFIG_DIR: &str = "/etc/kvfleet/model";

/// `kvfleet worker` in the spec's image (else the controller's), probed on its own
/// readiness and health endpoints.
pub(super) fn serving_process(
    spec: &InferenceDeploymentSpec,
    verdict: &Verdict,
    settings: &Settings,
) -> ServingProcess {
    let mut args = worker_args(spec, verdict);
    args.extend(spec.engine.extra_args.iter().cloned());
    ServingProcess {
        image: spec
            .engine
            .image
            .clone()
            .unwrap_or_else(|| settings.worker_image.clone()),
        command: vec!["kvfleet".to_string()],
        args,
        env: Vec::new(),
        ready_path: "/readyz",
        live_path: "/healthz",
    }
}

/// The worker's ConfigMap at [`CONFIG_DIR`], and the spec's `model.config` ConfigMap (when
/// set) at [`MODEL_CONFIG_DIR`], both read-only.
pub(super) fn config_volumes(name: &str, spec: &InferenceDeploymentSpec) -> Vec<(Volume, VolumeMount)> {
    let mut volumes = vec![(
        Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: config_map_name(name),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        },
        mount("config", CONFIG_DIR, Some(true)),
    )];
    if let Some(src) = &spec.model.config {
        volumes.push((
            Volume {
                name: "model-config".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: src.config_map_ref.name.clone(),
                    items: Some(vec![KeyToPath {
                        key: src.config_map_ref.key.clone(),
                        path: "config.json".into(),
                        ..KeyToPath::default()
                    }]),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            },
            mount("model-config", MODEL_CONFIG_DIR, Some(true)),
        ));
    }
    volumes
}

/// Where the worker (and the router) read `worker.yaml`.
pub fn config_path() -> String {
    format!("{CONFIG_DIR}/{WORKER_CONFIG_KEY}")
}

/// `kvfleet worker` arguments: the rendered config, and on top of it the values a reader of
/// `kubectl describe pod` looks for (they equal the config's): the model path on the weights
/// volume, the served name, the resolved KV dtype, the engine limits, `--quantization` when
/// the weights are quantized at load, and `--speculative-config` when it speculates.
pub fn worker_args(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Vec<String> {
    let (dtype, _) = resolved(spec, verdict);
    let e = &spec.engine;
    let mut args = vec![
        "worker".to_string(),
        "--config".to_string(),
        format!("{CONFIG_DIR}/{WORKER_CONFIG_KEY}"),
    ];
    let source = worker_model_source(spec);
    if let Some(p) = &source.path {
        args.extend(["--model".to_string(), p.display().to_string()]);
    }
    if source.weights == Weights::Dummy {
        args.extend(["--model-weights".to_string(), "dummy".to_string()]);
    }
    for (flag, value) in [
        ("--served-model-name", spec.model.name.clone()),
        ("--kv-cache-dtype", dtype.as_str().to_string()),
        ("--max-model-len", e.max_model_len.to_string()),
        ("--max-num-seqs", e.max_num_seqs.to_string()),
        ("--max-num-batched-tokens", e.max_num_batched_tokens.to_string()),
        ("--block-size", e.block_size.to_string()),
        ("--gpu-memory-utilization", e.gpu_memory_utilization.to_string()),
    ] {
        args.extend([flag.to_string(), value]);
    }
    if e.quantization != EngineQuantization::None {
        args.extend(["--quantization".to_string(), e.quantization.as_str().to_string()]);
    }
    if let Some(s) = &e.speculative {
        args.extend([
            "--speculative-config".to_string(),
            worker_speculative_config(s).to_string(),
        ]);
    }
    args
}

/// The worker's `--speculative-config`: vLLM's JSON keys with kvfleet's effective values, keys
/// only for what the method uses. `disable_by_batch_size` is always written (the worker's
/// default is [`crate::api::DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE`]). A drafter method names its
/// checkpoint on the draft volume (`model`, where the pod mounts it); the worker reads only
/// volumes, not Hub repositories.
pub fn worker_speculative_config(s: &SpeculativeSpec) -> serde_json::Value {
    let mut c = s.common_config();
    c["disable_by_batch_size"] = s.disable_by_batch_size().into();
    if let Some(d) = s
        .draft_model
        .as_ref()
        .filter(|d| s.method.needs_draft_model() && d.has_volume())
    {
        let dir = super::container::DRAFT_WEIGHTS_DIR;
        c["model"] = match d.path.as_deref().map(|p| p.trim_matches('/')) {
            Some(p) if !p.is_empty() => format!("{dir}/{p}"),
            _ => dir.to_string(),
        }
        .into();
    }
    c
}

/// The kvfleet worker's configuration ([`WorkerConfig`], read by `kvfleet worker --config`):
/// the spec's geometry and engine with the verdict's resolution of `auto`. `None` when the spec
/// has no inline geometry (the worker needs it; see docs/controller.md).
pub fn worker_config(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Option<WorkerConfig> {
    let geometry = spec.model.geometry.clone()?;
    let (kv_cache_dtype, attention_backend) = resolved(spec, verdict);
    let resolved = Some(ResolvedEngine {
        kv_cache_dtype,
        attention_backend,
    });
    Some(WorkerConfig {
        model_name: Some(spec.model.name.clone()),
        model: Some(worker_model_source(spec)),
        geometry: Some(geometry),
        weight_bytes: spec
            .model
            .weight_bytes
            .as_ref()
            .and_then(|q| parse_quantity_bytes(&q.0).ok())
            .unwrap_or(0),
        engine: spec.engine.clone(),
        resolved,
        activation_reserve_bytes: None,
        cpu_memory_bytes: None,
        max_kv_tokens: None,
        max_waiting: None,
        kv_events_endpoint: None,
        seed: 0,
    })
}

/// Where the worker reads the model: `/models/<weights.path>` on the weights volume, or
/// dummy weights (of the `model.config` ConfigMap's geometry when there is one, else of the
/// inline geometry). No weights at all renders a source without a path, which the worker
/// refuses at start with the fix (never the embedded model, never random weights).
pub fn worker_model_source(spec: &InferenceDeploymentSpec) -> ModelSource {
    let w = spec.model.weights.as_ref();
    match w.map(|w| w.format) {
        Some(WeightsFormat::Dummy) => ModelSource {
            path: None,
            weights: Weights::Dummy,
            config: spec
                .model
                .config
                .as_ref()
                .map(|_| PathBuf::from(format!("{MODEL_CONFIG_DIR}/config.json"))),
        },
        Some(_) => ModelSource {
            path: w.map(|w| {
                let rel = w.path.as_deref().unwrap_or("").trim_matches('/');
                PathBuf::from(WEIGHTS_DIR).join(rel)
            }),
            weights: Weights::Load,
            config: None,
        },
        None => ModelSource::default(),
    }
}

/// `worker.yaml`: [`worker_config`] as YAML.
pub fn worker_config_yaml(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Result<String, DesiredError> {
    let cfg = worker_config(spec, verdict).ok_or(DesiredError::GeometryRequired)?;
    serde_yaml::to_string(&cfg).map_err(DesiredError::WorkerConfig)
}

#[cfg(test)]
mod tests {
    use super::super::desired;
    use super::super::fixtures::*;
    use super::*;
    use crate::api::SpeculativeMethod;

    const KVFLEET_H100_PVC: &str = llama_8b!(
        r#"
    weights: {format: safetensors, pvcName: llama-weights, path: /llama-3.1-8b-instruct/}
  engine:
    runtime: kvfleet
    kvCacheDtype: fp8
    maxModelLen: 32768
    maxNumSeqs: 48
    maxNumBatchedTokens: 4096
    gpuMemoryUtilization: 0.92
  gpu:
    selector: {products: [NVIDIA-H100-80GB-HBM3]}
"#
    );

    #[test]
    fn the_worker_config_carries_prefix_caching_and_kv_events_to_the_worker() {
        let v = verdict("fp8_e4m3", "KVFLEET_CUDA", "9.0", "NVIDIA-H100-80GB-HBM3");
        let plain = desired(&fixture(KVFLEET_H100_PVC), &v, &Settings::default(), None).unwrap();
        let yaml = &plain.config_map.as_ref().unwrap().data.as_ref().unwrap()[WORKER_CONFIG_KEY];
        assert!(
            !yaml.contains("prefixCaching") && !yaml.contains("kvEvents"),
            "defaults stay out: {yaml}"
        );
        let cfg = WorkerConfig::parse(yaml).unwrap();
        assert!(cfg.engine.prefix_caching, "on by default");
        assert_eq!(cfg.kv_events(), None);
        let spec = KVFLEET_H100_PVC.replace(
            "    gpuMemoryUtilization: 0.92\n",
            "    gpuMemoryUtilization: 0.92\n    prefixCaching: false\n    kvEvents: {port: 5600, topic: kv}\n",
        );
        let d = render(&spec, &v);
        let yaml = &d.config_map.as_ref().unwrap().data.as_ref().unwrap()[WORKER_CONFIG_KEY];
        let cfg = WorkerConfig::parse(yaml).unwrap();
        assert!(!cfg.engine.prefix_caching, "{yaml}");
        assert_eq!(
            cfg.kv_events(),
            Some(("tcp://*:5600".to_string(), "kv".to_string()))
        );
        let ports = container(&d).ports.unwrap();
        assert!(ports
            .iter()
            .any(|p| p.name.as_deref() == Some("kv-events") && p.container_port == 5600));
    }

    #[test]
    fn kvfleet_pod_args_name_the_model_on_the_mounted_weights_volume_with_dtype_and_limits() {
        let v = verdict("fp8_e4m3", "KVFLEET_CUDA", "9.0", "NVIDIA-H100-80GB-HBM3");
        let d = render(KVFLEET_H100_PVC, &v);
        let c = container(&d);
        let args = c.args.clone().unwrap();
        let model = arg_after(&args, "--model").expect("--model");
        assert_eq!(model, "/models/llama-3.1-8b-instruct");
        assert_flags(
            &args,
            &[
                ("--served-model-name", "meta-llama/Llama-3.1-8B-Instruct"),
                ("--kv-cache-dtype", "fp8_e4m3"),
                ("--max-model-len", "32768"),
                ("--max-num-seqs", "48"),
                ("--max-num-batched-tokens", "4096"),
                ("--block-size", "16"),
                ("--gpu-memory-utilization", "0.92"),
            ],
        );
        assert_eq!(arg_after(&args, "--model-weights"), None, "real weights");
        // The volume holding the weights is mounted, read-only, at the directory --model is in.
        let mount = c
            .volume_mounts
            .unwrap()
            .into_iter()
            .find(|m| model.starts_with(&format!("{}/", m.mount_path)))
            .expect("a mount under --model");
        assert_eq!(mount.read_only, Some(true));
        let vol = volume(&d, &mount.name);
        let pvc = vol.persistent_volume_claim.unwrap();
        assert_eq!(pvc.claim_name, "llama-weights");
        // The config file says the same.
        let yaml = &d.config_map.as_ref().unwrap().data.as_ref().unwrap()[WORKER_CONFIG_KEY];
        let cfg = WorkerConfig::parse(yaml).unwrap();
        let src = cfg.model.unwrap();
        assert_eq!(src.path.unwrap().display().to_string(), model);
        assert_eq!(src.weights, Weights::Load);

        // hostPath weights: a Directory volume at the same place.
        let host = KVFLEET_H100_PVC.replace("pvcName: llama-weights", "hostPath: /mnt/nvme/models");
        let d = render(&host, &v);
        let vol = volume(&d, "weights");
        let hp = vol.host_path.unwrap();
        assert_eq!(
            (hp.path.as_str(), hp.type_.as_deref()),
            ("/mnt/nvme/models", Some("Directory"))
        );

        // Dummy weights only when asked, with no model path.
        let dummy = KVFLEET_H100_PVC.replace(
            "weights: {format: safetensors, pvcName: llama-weights, path: /llama-3.1-8b-instruct/}",
            "weights: {format: dummy}",
        );
        let d = render(&dummy, &v);
        let args = container(&d).args.unwrap();
        assert_eq!(arg_after(&args, "--model-weights").as_deref(), Some("dummy"));
        assert_eq!(arg_after(&args, "--model"), None);
    }

    #[test]
    fn ngram_speculation_renders_one_speculative_config_argument_with_the_effective_values() {
        let v = verdict("fp8_e4m3", "KVFLEET_CUDA", "9.0", "NVIDIA-H100-80GB-HBM3");
        let plain = render(KVFLEET_H100_PVC, &v);
        let args = container(&plain).args.unwrap();
        assert!(
            !args.iter().any(|a| a.contains("speculative")),
            "nothing without engine.speculative: {args:?}"
        );
        let spec = KVFLEET_H100_PVC.replace(
            "    gpuMemoryUtilization: 0.92\n",
            "    gpuMemoryUtilization: 0.92\n    speculative: {method: ngram, numSpeculativeTokens: 5}\n",
        );
        let d = render(&spec, &v);
        let args = container(&d).args.unwrap();
        assert_eq!(
            args.iter().filter(|a| *a == "--speculative-config").count(),
            1,
            "{args:?}"
        );
        let json = arg_after(&args, "--speculative-config").unwrap();
        let cfg: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            cfg,
            serde_json::json!({"method": "ngram", "num_speculative_tokens": 5,
                "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 32})
        );
        assert!(!json.contains(' '), "compact JSON: {json}");
        // Written values win over the defaults; the config file carries the same spec.
        let spec = spec.replace(
            "numSpeculativeTokens: 5}",
            "numSpeculativeTokens: 3, promptLookupMax: 6, promptLookupMin: 2, disableByBatchSize: 8}",
        );
        let d = render(&spec, &v);
        let cfg: serde_json::Value =
            serde_json::from_str(&arg_after(&container(&d).args.unwrap(), "--speculative-config").unwrap())
                .unwrap();
        assert_eq!(
            cfg,
            serde_json::json!({"method": "ngram", "num_speculative_tokens": 3,
                "prompt_lookup_max": 6, "prompt_lookup_min": 2, "disable_by_batch_size": 8})
        );
        let yaml = &d.config_map.as_ref().unwrap().data.as_ref().unwrap()[WORKER_CONFIG_KEY];
        let s = WorkerConfig::parse(yaml).unwrap().engine.speculative.unwrap();
        assert_eq!(
            (s.method, s.prompt_lookup_max(), s.disable_by_batch_size()),
            (SpeculativeMethod::Ngram, 6, 8)
        );
        // n-gram needs no drafter: none is mounted.
        assert!(container(&d)
            .volume_mounts
            .unwrap()
            .iter()
            .all(|m| m.name != "draft-weights"));
    }

    #[test]
    fn an_eagle3_drafter_is_mounted_for_the_worker_and_named_in_its_config() {
        let v = verdict("bfloat16", "KVFLEET_CUDA", "9.0", "NVIDIA-H100-80GB-HBM3");
        let spec = KVFLEET_H100_PVC.replace(
            "    gpuMemoryUtilization: 0.92\n",
            "    gpuMemoryUtilization: 0.92\n    speculative: {method: eagle3, numSpeculativeTokens: 3, draftModel: {pvcName: drafts, path: /llama-eagle3/}}\n",
        );
        let d = render(&spec, &v);
        let c = container(&d);
        let cfg: serde_json::Value =
            serde_json::from_str(&arg_after(c.args.as_ref().unwrap(), "--speculative-config").unwrap())
                .unwrap();
        assert_eq!(cfg["model"], "/draft-models/llama-eagle3");
        let mount = c
            .volume_mounts
            .unwrap()
            .into_iter()
            .find(|m| m.name == "draft-weights")
            .expect("the drafter's volume is mounted");
        assert_eq!(
            (mount.mount_path.as_str(), mount.read_only),
            ("/draft-models", Some(true))
        );
    }

    #[test]
    fn a_drafter_method_renders_its_checkpoint_on_the_draft_volume_for_the_worker() {
        let s: SpeculativeSpec = serde_yaml::from_str(
            "{method: eagle3, numSpeculativeTokens: 3, draftModel: {pvcName: d, path: e3/}}",
        )
        .unwrap();
        assert_eq!(
            worker_speculative_config(&s),
            serde_json::json!({"method": "eagle3", "num_speculative_tokens": 3, "disable_by_batch_size": 32,
                "model": "/draft-models/e3"})
        );
    }

    #[test]
    fn engine_quantization_fp8_renders_the_workers_quantization_flag_and_only_then() {
        let mut obj = fixture(KVFLEET_H100_PVC);
        let v = verdict("fp8_e4m3", "KVFLEET_CUDA", "9.0", "NVIDIA-H100-80GB-HBM3");
        let args = worker_args(&obj.spec, &v);
        assert_eq!(arg_after(&args, "--quantization"), None, "{args:?}");
        obj.spec.engine.quantization = EngineQuantization::Fp8;
        let args = worker_args(&obj.spec, &v);
        assert_eq!(
            arg_after(&args, "--quantization").as_deref(),
            Some("fp8"),
            "{args:?}"
        );
        // The config file carries the same value for the worker.
        let cfg = WorkerConfig::parse(&worker_config_yaml(&obj.spec, &v).unwrap()).unwrap();
        assert_eq!(cfg.engine.quantization, EngineQuantization::Fp8);
    }
}

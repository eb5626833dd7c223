//! The vllm runtime's serving process: the vLLM OpenAI server's image, release, flags and
//! environment, and the Hugging Face cache it downloads into.

use k8s_openapi::api::core::v1::{EnvVar, PersistentVolumeClaimVolumeSource, Volume, VolumeMount};

use super::container::{mount, plain_env, secret_env, ServingProcess, DRAFT_WEIGHTS_DIR, WEIGHTS_DIR};
use super::{resolved, Settings, HTTP_PORT};
use crate::api::{
    AttentionBackend, DraftModel, EngineQuantization, InferenceDeploymentSpec, KvCacheDtype, SpeculativeSpec,
    WeightsFormat,
};
use crate::compat::vllm_versions::{self, VllmVersion};
use crate::validate::Verdict;

/// Where a Hugging Face download cache PVC is mounted (`HF_HOME`).
pub const HF_CACHE_DIR: &str = "/cache/huggingface";

/// The OpenAI server of the release the image holds, with that release's flags; vLLM's
/// server answers `/health` once the engine is up.
pub(super) fn serving_process(
    spec: &InferenceDeploymentSpec,
    verdict: &Verdict,
    settings: &Settings,
) -> ServingProcess {
    let image = vllm_image(spec, settings);
    let version = rendered_vllm_version(spec, &image);
    let mut env = cache_env(spec);
    env.extend(vllm_env(spec, verdict, version));
    ServingProcess {
        image,
        command: vec![
            "python3".to_string(),
            "-m".to_string(),
            "vllm.entrypoints.openai.api_server".to_string(),
        ],
        args: vllm_args_at(spec, verdict, version),
        env,
        ready_path: "/health",
        live_path: "/health",
    }
}

/// The PVC of `weights.huggingFace.cachePvcName`, if any.
fn hf_cache_pvc(spec: &InferenceDeploymentSpec) -> Option<String> {
    let hf = spec.model.weights.as_ref().and_then(|w| w.hugging_face.as_ref());
    hf.and_then(|h| h.cache_pvc_name.clone())
}

/// The Hub download cache outlives the pod: a restart reads it, not the network.
pub(super) fn hf_cache_volume(spec: &InferenceDeploymentSpec) -> Option<(Volume, VolumeMount)> {
    let pvc = hf_cache_pvc(spec)?;
    let volume = Volume {
        name: "hf-cache".into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: pvc,
            read_only: Some(false),
        }),
        ..Volume::default()
    };
    Some((volume, mount("hf-cache", HF_CACHE_DIR, None)))
}

/// vLLM writes caches under $HOME / XDG paths; the root filesystem is read-only, so they go
/// to `/tmp`, and the Hub's to the cache PVC when there is one. The Hub token, if any.
fn cache_env(spec: &InferenceDeploymentSpec) -> Vec<EnvVar> {
    let hf = spec.model.weights.as_ref().and_then(|w| w.hugging_face.as_ref());
    let mut env = vec![plain_env("XDG_CACHE_HOME", "/tmp/.cache")];
    env.push(match hf_cache_pvc(spec) {
        Some(_) => plain_env("HF_HOME", HF_CACHE_DIR),
        None => plain_env("HF_HOME", "/tmp/.cache/huggingface"),
    });
    // One token per pod: the model's, else the drafter's (admission denies two different ones).
    let draft_hf = spec
        .engine
        .speculative
        .as_ref()
        .and_then(|s| s.draft_model.as_ref())
        .and_then(|d| d.hugging_face.as_ref());
    let token = hf
        .and_then(|h| h.token_secret_ref.as_ref())
        .or_else(|| draft_hf.and_then(|h| h.token_secret_ref.as_ref()));
    if let Some(secret) = token {
        env.push(secret_env("HF_TOKEN", &secret.name, &secret.key));
    }
    env.push(plain_env("VLLM_CACHE_ROOT", "/tmp/.cache/vllm"));
    env.push(plain_env("TRITON_CACHE_DIR", "/tmp/.cache/triton"));
    env
}

/// The vLLM image of a spec: its own, else the official image of `engine.vllm.version`, else
/// the controller's default (`--vllm-image`).
pub fn vllm_image(spec: &InferenceDeploymentSpec, settings: &Settings) -> String {
    let field = spec.engine.vllm.as_ref().and_then(|v| v.version.as_deref());
    match (&spec.engine.image, field.and_then(VllmVersion::parse)) {
        (Some(i), _) => i.clone(),
        (None, Some(v)) => v.image(),
        (None, None) => settings.vllm_image.clone(),
    }
}

/// The vLLM release the pod runs: `engine.vllm.version`, else the tag of the image rendered
/// (the controller's `--vllm-image` when the spec names none), else kvfleet's default.
pub fn rendered_vllm_version(spec: &InferenceDeploymentSpec, image: &str) -> VllmVersion {
    vllm_versions::resolve(
        Some(image),
        spec.engine.vllm.as_ref().and_then(|v| v.version.as_deref()),
    )
    .map(|(v, _)| v)
    .unwrap_or(vllm_versions::DEFAULT_VERSION)
}

/// The KV dtype and backend strings vLLM gets: `auto` stays `auto` (vLLM keeps the model
/// dtype, which is what the verdict resolved it to, and `auto` exists in every release while
/// `bfloat16`/`float16` do not).
fn vllm_dtype_backend(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> (String, String) {
    let (dtype, backend) = resolved(spec, verdict);
    let dtype = if spec.engine.kv_cache_dtype == KvCacheDtype::Auto {
        KvCacheDtype::Auto
    } else {
        dtype
    };
    (dtype.as_str().to_string(), backend.as_str().to_string())
}

/// Environment of the vLLM container that depends on the release: before 0.12 the attention
/// backend is chosen by `VLLM_ATTENTION_BACKEND` (vllm#26315 made it a flag).
pub fn vllm_env(spec: &InferenceDeploymentSpec, verdict: &Verdict, version: VllmVersion) -> Vec<EnvVar> {
    let (_, backend) = vllm_dtype_backend(spec, verdict);
    if backend != AttentionBackend::Auto.as_str()
        && vllm_versions::backend_choice(version) == vllm_versions::BackendChoice::Env
    {
        vec![plain_env(vllm_versions::ATTENTION_BACKEND_ENV, &backend)]
    } else {
        Vec::new()
    }
}

/// [`vllm_args_at`] for the spec's own release (or kvfleet's default image's).
pub fn vllm_args(spec: &InferenceDeploymentSpec, verdict: &Verdict) -> Vec<String> {
    let version = spec.vllm_version().unwrap_or(vllm_versions::DEFAULT_VERSION);
    vllm_args_at(spec, verdict, version)
}

/// Command-line flags of the vLLM OpenAI server of release `version`, from the resolved
/// configuration, so the server runs exactly what admission checked.
pub fn vllm_args_at(spec: &InferenceDeploymentSpec, verdict: &Verdict, version: VllmVersion) -> Vec<String> {
    let e = &spec.engine;
    let (dtype, backend) = vllm_dtype_backend(spec, verdict);
    let w = spec.model.weights.as_ref();
    let hf = w.and_then(|w| w.hugging_face.as_ref());
    let mut args = vec![
        "--model".to_string(),
        model_arg(spec),
        "--served-model-name".to_string(),
        spec.model.name.clone(),
        "--host".to_string(),
        "0.0.0.0".to_string(),
        "--port".to_string(),
        HTTP_PORT.to_string(),
        "--kv-cache-dtype".to_string(),
        dtype,
    ];
    if backend != AttentionBackend::Auto.as_str()
        && vllm_versions::backend_choice(version) == vllm_versions::BackendChoice::Flag
    {
        args.push("--attention-backend".into());
        args.push(backend);
    }
    let numeric: [(&str, String); 6] = [
        ("--max-model-len", e.max_model_len.to_string()),
        ("--max-num-seqs", e.max_num_seqs.to_string()),
        ("--max-num-batched-tokens", e.max_num_batched_tokens.to_string()),
        ("--block-size", e.block_size.to_string()),
        ("--gpu-memory-utilization", e.gpu_memory_utilization.to_string()),
        ("--tensor-parallel-size", e.tensor_parallel_size.to_string()),
    ];
    for (flag, value) in numeric {
        args.push(flag.into());
        args.push(value);
    }
    // An FP8 checkpoint needs no flag: vLLM reads its quantization_config.
    if e.quantization != EngineQuantization::None {
        args.push("--quantization".into());
        args.push(e.quantization.as_str().into());
    }
    if e.pipeline_parallel_size > 1 {
        args.push("--pipeline-parallel-size".into());
        args.push(e.pipeline_parallel_size.to_string());
    }
    if let Some(rev) = hf.and_then(|h| h.revision.clone()) {
        args.push("--revision".into());
        args.push(rev);
    }
    // Random weights only when the spec says so (admission denies a vllm spec without weights).
    if w.is_some_and(|w| w.format == WeightsFormat::Dummy && !w.has_source()) {
        args.push("--load-format".into());
        args.push("dummy".into());
    }
    if !e.prefix_caching {
        args.push("--no-enable-prefix-caching".into());
    }
    if let Some(sp) = &e.speculative {
        args.push("--speculative-config".into());
        args.push(speculative_config(sp).to_string());
    }
    if let Some(k) = e.kv_events.as_ref().filter(|k| k.enabled) {
        args.push("--kv-events-config".into());
        args.push(
            serde_json::json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": format!("tcp://*:{}", k.port),
                "topic": k.topic,
            })
            .to_string(),
        );
    }
    args.extend(e.extra_args.iter().cloned());
    args
}

/// vLLM's `--speculative-config` (vllm/config/speculative.py SpeculativeConfig), the same in
/// every release of the table (`method` values per release are admission's:
/// `vllm.speculative-method-needs-release`):
/// - `prompt_lookup_max`/`min` for `ngram`, always both: vLLM's defaults when one is absent
///   differ from kvfleet's (both 5 when neither is set), so the effective values are written;
/// - `model` (and `revision`) for a drafter: its directory on the draft volume, or its Hub
///   repository;
/// - no `disable_by_batch_size`: V1 never reads it (vllm#25112; vllm#35060 removed the key),
///   so it would only pretend (`vllm_versions::SPEC_DISABLE_BY_BATCH_SIZE`).
pub fn speculative_config(s: &SpeculativeSpec) -> serde_json::Value {
    let mut c = s.common_config();
    if let Some(d) = s.draft_model.as_ref().filter(|_| s.method.needs_draft_model()) {
        if let Some(model) = draft_model_arg(d) {
            c["model"] = model.into();
        }
        if let Some(rev) = d.hugging_face.as_ref().and_then(|h| h.revision.clone()) {
            c["revision"] = rev.into();
        }
    }
    c
}

/// The drafter vLLM loads: its Hub repository, or its directory on the draft volume.
fn draft_model_arg(d: &DraftModel) -> Option<String> {
    if let Some(h) = &d.hugging_face {
        return h.repo.clone();
    }
    d.has_volume()
        .then(|| in_dir(DRAFT_WEIGHTS_DIR, d.path.as_deref()))
}

/// `path` (slashes trimmed) inside the volume mounted at `dir`.
fn in_dir(dir: &str, path: Option<&str>) -> String {
    match path.map(|p| p.trim_matches('/')) {
        Some(p) if !p.is_empty() => format!("{dir}/{p}"),
        _ => dir.to_string(),
    }
}

/// `--model`: a Hub repository, a directory on the weights volume, or the model's name.
fn model_arg(spec: &InferenceDeploymentSpec) -> String {
    let w = spec.model.weights.as_ref();
    let hf = w.and_then(|w| w.hugging_face.as_ref());
    match (w, hf) {
        (_, Some(h)) => h.repo.clone().unwrap_or_else(|| spec.model.name.clone()),
        (Some(w), None) if w.has_source() => in_dir(WEIGHTS_DIR, w.path.as_deref()),
        // Dummy weights: vLLM reads the model's config.json by its name.
        _ => spec.model.name.clone(),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Container;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::super::fixtures::*;
    use super::super::{desired, CAPACITY_SIDECAR, WORKER_CLUSTER_ROLE};
    use super::*;

    #[test]
    fn vllm_on_sm120_runs_triton_attn_with_every_flag_from_the_resolved_config() {
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let d = render(VLLM_RTX5090, &v);
        let c = container(&d);
        let args = c.args.clone().unwrap();
        assert_flags(
            &args,
            &[
                ("--kv-cache-dtype", "fp8"),
                ("--attention-backend", "TRITON_ATTN"),
                ("--max-model-len", "32768"),
                ("--max-num-seqs", "32"),
                ("--max-num-batched-tokens", "4096"),
                ("--block-size", "32"),
                ("--gpu-memory-utilization", "0.85"),
                ("--tensor-parallel-size", "1"),
                ("--port", "8000"),
                ("--served-model-name", "google/gemma-3-12b-it"),
                ("--load-format", "dummy"),
            ],
        );
        assert_eq!(c.image.as_deref(), Some(Settings::default().vllm_image.as_str()));
        assert_eq!(
            c.resources.unwrap().limits.unwrap().get("nvidia.com/gpu"),
            Some(&Quantity("1".into()))
        );
        assert!(d.config_map.is_none());
        // The capacity sidecar annotates the pod: the pod's identity may do so.
        assert_eq!(d.role_binding.clone().unwrap().role_ref.name, WORKER_CLUSTER_ROLE);
        let p = pod(&d);
        assert_eq!(p.automount_service_account_token, Some(true));
        assert_eq!(p.service_account_name.as_deref(), Some("gemma-worker"));
        let sidecar = p
            .containers
            .iter()
            .find(|c| c.name == CAPACITY_SIDECAR)
            .expect("sidecar");
        assert_eq!(
            sidecar.args.as_ref().unwrap()[..3],
            ["capacity-sidecar", "--metrics", "127.0.0.1:8000/metrics"]
        );
        assert_eq!(sidecar.image, Some(Settings::default().worker_image));
        assert!(sidecar
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap()
            .get("nvidia.com/gpu")
            .is_none());
    }

    #[test]
    fn engine_quantization_fp8_renders_as_vllms_quantization_flag_and_only_then() {
        let mut obj = fixture(VLLM_RTX5090);
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        assert!(!vllm_args(&obj.spec, &v).contains(&"--quantization".to_string()));
        obj.spec.engine.quantization = EngineQuantization::Fp8;
        let args = vllm_args(&obj.spec, &v);
        assert_eq!(
            arg_after(&args, "--quantization").as_deref(),
            Some("fp8"),
            "{args:?}"
        );
    }

    fn speculative_json(args: &[String]) -> serde_json::Value {
        let json = arg_after(args, "--speculative-config").expect("--speculative-config");
        serde_json::from_str(&json).unwrap()
    }

    #[test]
    fn ngram_speculation_renders_vllms_speculative_config_without_disable_by_batch_size() {
        let mut obj = fixture(VLLM_RTX5090);
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let args = vllm_args(&obj.spec, &v);
        assert!(
            !args.contains(&"--speculative-config".to_string()),
            "nothing without engine.speculative: {args:?}"
        );
        obj.spec.engine.speculative = Some(
            serde_yaml::from_str(
                "{method: ngram, numSpeculativeTokens: 4, promptLookupMax: 5, disableByBatchSize: 16}",
            )
            .unwrap(),
        );
        let args = vllm_args(&obj.spec, &v);
        assert_eq!(
            speculative_json(&args),
            serde_json::json!({"method": "ngram", "num_speculative_tokens": 4,
                "prompt_lookup_max": 5, "prompt_lookup_min": 1})
        );
        assert_eq!(
            vllm_versions::flag_at("--speculative-config", vllm_versions::oldest()),
            Some(true)
        );
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        assert!(pod(&d).volumes.unwrap().iter().all(|v| v.name != "draft-weights"));
    }

    #[test]
    fn a_drafter_on_a_volume_is_mounted_at_draft_models_and_named_in_the_config() {
        let mut obj = fixture(VLLM_RTX5090);
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        obj.spec.engine.speculative = Some(
            serde_yaml::from_str(
                "{method: eagle3, numSpeculativeTokens: 3, draftModel: {pvcName: drafts, path: /eagle3-gemma/}}",
            )
            .unwrap(),
        );
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let c = container(&d);
        assert_eq!(
            speculative_json(c.args.as_ref().unwrap()),
            serde_json::json!({"method": "eagle3", "num_speculative_tokens": 3,
                "model": "/draft-models/eagle3-gemma"})
        );
        let mount = c
            .volume_mounts
            .unwrap()
            .into_iter()
            .find(|m| m.mount_path == "/draft-models")
            .expect("draft mount");
        assert_eq!(mount.read_only, Some(true));
        let vol = volume(&d, &mount.name);
        assert_eq!(vol.persistent_volume_claim.unwrap().claim_name, "drafts");
    }

    #[test]
    fn a_drafter_from_the_hub_is_its_repository_with_its_revision_and_token() {
        let mut obj = fixture(VLLM_RTX5090);
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        obj.spec.engine.speculative = Some(
            serde_yaml::from_str(
                "{method: dflash, numSpeculativeTokens: 15, draftModel: {huggingFace: {repo: z-lab/gemma-DFlash, revision: v2, tokenSecretRef: {name: hf}}}}",
            )
            .unwrap(),
        );
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let c = container(&d);
        assert_eq!(
            speculative_json(c.args.as_ref().unwrap()),
            serde_json::json!({"method": "dflash", "num_speculative_tokens": 15,
                "model": "z-lab/gemma-DFlash", "revision": "v2"})
        );
        let token = env_value(&c, "HF_TOKEN").expect("the drafter's token");
        assert_eq!(token.value_from.unwrap().secret_key_ref.unwrap().name, "hf");
        assert!(pod(&d).volumes.unwrap().iter().all(|v| v.name != "draft-weights"));
    }

    #[test]
    fn vllm_without_a_resolved_backend_leaves_the_choice_to_vllm() {
        let obj = fixture(VLLM_RTX5090);
        let v = Verdict {
            resolved: None,
            ..Verdict::default()
        };
        let args = vllm_args(&obj.spec, &v);
        assert!(!args.contains(&"--attention-backend".to_string()), "{args:?}");
        assert_eq!(arg_after(&args, "--kv-cache-dtype").as_deref(), Some("fp8"));
    }

    #[test]
    fn prefix_caching_off_and_kv_events_render_as_vllm_flags_and_a_named_port() {
        let mut obj = fixture(VLLM_RTX5090);
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let args = vllm_args(&obj.spec, &v);
        assert!(
            !args
                .iter()
                .any(|a| a.contains("prefix-caching") || a == "--kv-events-config"),
            "defaults render nothing (vLLM caches prefixes by default): {args:?}"
        );
        obj.spec.engine.prefix_caching = false;
        obj.spec.engine.kv_events = Some(crate::api::KvEventsSpec {
            enabled: true,
            port: 5557,
            topic: "kv".into(),
        });
        let args = vllm_args(&obj.spec, &v);
        assert!(
            args.contains(&"--no-enable-prefix-caching".to_string()),
            "{args:?}"
        );
        let cfg: serde_json::Value =
            serde_json::from_str(&arg_after(&args, "--kv-events-config").expect("--kv-events-config"))
                .unwrap();
        assert_eq!(
            cfg,
            serde_json::json!({"enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": "tcp://*:5557", "topic": "kv"})
        );
        for flag in ["--no-enable-prefix-caching", "--kv-events-config"] {
            let version = vllm_versions::DEFAULT_VERSION;
            assert_eq!(vllm_versions::flag_at(flag, version), Some(true), "{flag}");
        }
        let d = desired(&obj, &v, &Settings::default(), None).unwrap();
        let ports = container(&d).ports.unwrap();
        let kv = ports
            .iter()
            .find(|p| p.name.as_deref() == Some("kv-events"))
            .expect("kv-events port");
        assert_eq!(kv.container_port, 5557);
    }

    fn env_value(c: &Container, name: &str) -> Option<EnvVar> {
        c.env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .find(|e| e.name == name)
    }

    #[test]
    fn vllm_downloads_hub_weights_with_the_token_secret_into_the_cache_pvc() {
        let yaml = VLLM_RTX5090.replace(
            "weights: {format: dummy}",
            "weights: {format: safetensors, huggingFace: {revision: v1, tokenSecretRef: {name: hf-token}, cachePvcName: hf-cache}}\n    weightBytes: 24Gi",
        );
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        let d = render(&yaml, &v);
        let c = container(&d);
        let args = c.args.clone().unwrap();
        assert_eq!(
            arg_after(&args, "--model").as_deref(),
            Some("google/gemma-3-12b-it")
        );
        assert_eq!(arg_after(&args, "--revision").as_deref(), Some("v1"));
        assert_eq!(arg_after(&args, "--load-format"), None, "real weights: no dummy");
        let token = env_value(&c, "HF_TOKEN").expect("HF_TOKEN");
        let sel = token.value_from.unwrap().secret_key_ref.unwrap();
        assert_eq!((sel.name.as_str(), sel.key.as_str()), ("hf-token", "token"));
        assert_eq!(
            env_value(&c, "HF_HOME").unwrap().value.as_deref(),
            Some(HF_CACHE_DIR)
        );
        let mount = c
            .volume_mounts
            .clone()
            .unwrap()
            .into_iter()
            .find(|m| m.mount_path == HF_CACHE_DIR)
            .unwrap();
        assert_ne!(mount.read_only, Some(true), "the cache is written");
        let vol = volume(&d, &mount.name);
        assert_eq!(vol.persistent_volume_claim.unwrap().claim_name, "hf-cache");
        // A Hub download of 24 GiB gets more than the 10 minutes of a dummy start.
        let probe = c.startup_probe.unwrap();
        assert_eq!(probe.http_get.unwrap().path.as_deref(), Some("/health"));
        let seconds = probe.failure_threshold.unwrap() * probe.period_seconds.unwrap();
        assert!(seconds >= 600 + 24 * 10, "{seconds}");
        assert_eq!(
            c.readiness_probe.unwrap().http_get.unwrap().path.as_deref(),
            Some("/health")
        );
    }

    #[test]
    fn vllm_loads_local_weights_from_a_pvc_host_path_or_image_volume_at_models() {
        let v = verdict("fp8", "TRITON_ATTN", "12.0", "NVIDIA-GeForce-RTX-5090");
        for (source, check) in [
            ("pvcName: w", "pvc"),
            ("hostPath: /mnt/nvme", "hostPath"),
            ("image: registry.example/weights/gemma:1", "image"),
        ] {
            let yaml = VLLM_RTX5090.replace(
                "weights: {format: dummy}",
                &format!("weights: {{format: safetensors, {source}, path: /gemma-3-12b/}}"),
            );
            let d = render(&yaml, &v);
            let c = container(&d);
            let args = c.args.clone().unwrap();
            assert_eq!(
                arg_after(&args, "--model").as_deref(),
                Some("/models/gemma-3-12b"),
                "{source}"
            );
            assert_eq!(arg_after(&args, "--load-format"), None, "{source}");
            let vol = volume(&d, "weights");
            match check {
                "pvc" => assert_eq!(vol.persistent_volume_claim.unwrap().claim_name, "w"),
                "hostPath" => assert_eq!(vol.host_path.unwrap().path, "/mnt/nvme"),
                _ => assert_eq!(
                    vol.image.unwrap().reference.as_deref(),
                    Some("registry.example/weights/gemma:1")
                ),
            }
            assert!(env_value(&c, "HF_TOKEN").is_none());
        }
    }
}

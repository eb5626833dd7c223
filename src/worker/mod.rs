//! `kvfleet worker`: load the deployment's model, refuse what cannot run here, size the
//! engine's KV pools for it, and serve it through an OpenAI-compatible API on the batched
//! paged-attention engine, with the KV-capacity metrics of that served model.
//!
//! Start-up: config (file or embedded default, flags on top) -> listen -> load the model
//! (GGUF, HF checkpoint or dummy weights) -> NVML probe -> [`preflight`] on the model's real
//! geometry (one log line, `/dev/termination-log` and a distinct exit code on failure, see
//! [`preflight::exit`]) -> the model on its device with the engine's KV pools (on a GPU:
//! sized from the memory measured free after weights and activations) -> kernel self-test
//! -> serving loop -> ready.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::api::EngineQuantization;
use crate::compat::{AttentionBackend, KvCacheDtype};
use crate::serving::runtime::ModelRuntime;
use crate::serving::serve::{self, LoadedModel, ModelSource, Weights};
use kvfleet_engine::engine::speculative::{self, SpecConfig};

use crate::contract::config;
pub mod http;
pub mod nvml;
pub mod preflight;

use config::WorkerConfig;
use preflight::{exit, PreflightError};

/// The longest time a flag may give (`--request-timeout-seconds`, `--drain-seconds`): one year.
/// Deadlines are `Instant + Duration` (which panics past the clock's range) on tokio's timer,
/// whose wheel reaches 2^36 ms (about 2.2 years); a year keeps every deadline inside both.
pub const MAX_SECONDS: u64 = 365 * 24 * 3600;

/// The most requests `--max-waiting` may queue: the scheduler's queue (maxNumSeqs + maxWaiting
/// entries) is searched linearly on cancellation, and 2^20 waiting requests of the smallest
/// prompt (16 tokens) already exceed any pool's KV; more only delays the 429 that should come.
pub const MAX_WAITING: u64 = 1 << 20;

/// Options of `kvfleet worker`. Flags override the config file.
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Worker config (YAML or JSON, the ConfigMap the controller renders; see
    /// docs/worker.md). Absent: the embedded default (SmolLM2 on the CPU).
    #[arg(long, env = "KVFLEET_WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to serve the API and metrics on.
    #[arg(long, default_value = "0.0.0.0:8000", env = "KVFLEET_WORKER_LISTEN")]
    pub listen: SocketAddr,
    /// Model to serve: a GGUF file, a Hugging Face checkpoint directory (config.json,
    /// safetensors, tokenizer.json) or its config.json (default: the config's `model.path`,
    /// else the embedded SmolLM2-135M-Instruct).
    #[arg(long = "model", env = "KVFLEET_MODEL")]
    pub model: Option<PathBuf>,
    /// `load` reads the weights from --model; `dummy` makes random weights of the geometry in
    /// --model-config (capacity and throughput runs, not text).
    #[arg(
        long = "model-weights",
        env = "KVFLEET_MODEL_WEIGHTS",
        value_parser = clap::builder::TypedValueParser::map(
            clap::builder::PossibleValuesParser::new(Weights::NAMES),
            |s: String| s.parse::<Weights>().expect("one of the possible values"),
        )
    )]
    pub weights: Option<Weights>,
    /// config.json (or a checkpoint directory) with the geometry for --model-weights dummy
    /// (default: --model).
    #[arg(long = "model-config", env = "KVFLEET_MODEL_CONFIG")]
    pub model_config: Option<PathBuf>,
    /// Model id in the OpenAI API (default: the config's modelName, else from the file).
    #[arg(long, env = "KVFLEET_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Quantize the weights at load (vLLM's flag): `fp8` turns every linear layer into FP8
    /// e4m3 with one scale per output channel and its input into FP8 with one scale per token
    /// (on the GPU, FP8 GEMMs; on the CPU, the same arithmetic in f32); embeddings and the LM
    /// head stay as loaded. `none` (default: the config's engine.quantization) keeps the
    /// weights. Not for a checkpoint that is FP8 already.
    #[arg(
        long,
        value_parser = clap::builder::TypedValueParser::map(
            clap::builder::PossibleValuesParser::new(["none", "fp8"]),
            |s: String| match s.as_str() {
                "fp8" => EngineQuantization::Fp8,
                _ => EngineQuantization::None,
            },
        )
    )]
    pub quantization: Option<EngineQuantization>,
    /// KV-cache dtype (auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, nvfp4).
    #[arg(long)]
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// Attention backend, which is also where the model runs: auto (the GPU when its
    /// kernels, NVRTC and cuBLAS are usable, else the CPU), KVFLEET_CUDA, KVFLEET_CPU.
    #[arg(long)]
    pub attention_backend: Option<AttentionBackend>,
    #[arg(long)]
    pub max_model_len: Option<i64>,
    #[arg(long)]
    pub max_num_seqs: Option<i32>,
    #[arg(long)]
    pub max_num_batched_tokens: Option<i32>,
    #[arg(long)]
    pub block_size: Option<i32>,
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Memory the CPU backend treats as its device (KV pools), in bytes.
    #[arg(long)]
    pub cpu_memory_bytes: Option<u64>,
    /// Caps the KV pools at this many tokens (tests, benchmarks, sharing a GPU).
    #[arg(long, env = "KVFLEET_MAX_KV_TOKENS")]
    pub max_kv_tokens: Option<u64>,
    /// Requests queued beyond this are answered 429 with Retry-After (at least 1: with no
    /// queue, a request that arrives while the serving loop takes the previous one is refused).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_WAITING))]
    pub max_waiting: Option<usize>,
    /// Automatic prefix caching (on unless the config's engine.prefixCaching is false): a
    /// request reuses the KV blocks earlier requests computed for its prefix.
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turns automatic prefix caching off: every request computes its whole prompt.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Publish KV-cache events (vLLM's ZMQ wire format: BlockStored, BlockRemoved,
    /// AllBlocksCleared) on this endpoint, e.g. `tcp://*:5557` (default: the config's
    /// engine.kvEvents, else off).
    #[arg(long, env = "KVFLEET_KV_EVENTS_ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// Topic of every KV-event message (vLLM's default: empty).
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// On SIGTERM/ctrl-c, let running requests finish for this long, then fail the rest.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=MAX_SECONDS))]
    pub drain_seconds: u64,
    /// Largest request body accepted (413 above it).
    #[arg(long, default_value_t = crate::serving::openai::ApiLimits::default().max_body_bytes,
          value_parser = crate::serving::openai::body_bytes_parser())]
    pub max_request_bytes: usize,
    /// Bytes of request bodies held at once, across requests (default: 64 MiB, or
    /// --max-request-bytes when larger); a request that finds no room within 2 s is answered
    /// 503 with Retry-After. At least --max-request-bytes.
    #[arg(
        long,
        env = "KVFLEET_MAX_REQUEST_BYTES_IN_FLIGHT",
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
            .range(crate::serving::openai::MIN_BODY_BYTES as u64..=(4 * crate::serving::openai::MAX_BODY_BYTES) as u64)
    )]
    pub max_request_bytes_in_flight: Option<usize>,
    /// A request still generating this long after it arrived is ended (504, or an error
    /// chunk on a stream) and its KV freed.
    #[arg(
        long,
        default_value_t = crate::serving::openai::ApiLimits::default().request_timeout.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS)
    )]
    pub request_timeout_seconds: u64,
    /// Speculative decoding, as vLLM's flag takes it: JSON with `method` (`ngram`, or `eagle3`
    /// with the drafter checkpoint directory in `model`, on the CPU engine; `dflash` is not
    /// implemented here), `num_speculative_tokens`
    /// (1-16), and for n-gram `prompt_lookup_max` (default 4) and `prompt_lookup_min` (default
    /// 1); `disable_by_batch_size` (default 32) turns it off while that many requests run.
    /// Default: the config's engine.speculative, else off.
    #[arg(long, env = "KVFLEET_SPECULATIVE_CONFIG")]
    pub speculative_config: Option<String>,
    /// Require `Authorization: Bearer <key>` on the OpenAI API (the controller sets it from
    /// the Secret in spec.apiKey). Probes, /metrics and /v1/capacity stay open.
    #[arg(long, env = "KVFLEET_API_KEY", hide_env_values = true)]
    pub api_key: Option<crate::serving::openai::ApiKey>,
    /// Render a chat template sent in a request's `chat_template` (vLLM's flag); without it a
    /// request may only name one of the model's own templates.
    #[arg(long, env = "KVFLEET_TRUST_REQUEST_CHAT_TEMPLATE")]
    pub trust_request_chat_template: bool,
}

impl WorkerArgs {
    /// The effective configuration: the file (or the embedded default) with flags on top.
    pub fn resolve_config(&self) -> Result<WorkerConfig, config::ConfigError> {
        let mut c = match &self.config {
            Some(p) => WorkerConfig::load(p)?,
            None => WorkerConfig::embedded_default(),
        };
        if self.model.is_some() || self.weights.is_some() || self.model_config.is_some() {
            let m = c.model.get_or_insert_with(ModelSource::default);
            if let Some(p) = &self.model {
                m.path = Some(p.clone());
            }
            if let Some(w) = self.weights {
                m.weights = w;
            }
            if let Some(p) = &self.model_config {
                m.config = Some(p.clone());
            }
        }
        if let Some(n) = &self.served_model_name {
            c.model_name = Some(n.clone());
        }
        if let Some(q) = self.quantization {
            c.engine.quantization = q;
        }
        if let Some(v) = self.kv_cache_dtype {
            c.engine.kv_cache_dtype = v;
            c.resolved = c.resolved.map(|r| config::ResolvedEngine {
                kv_cache_dtype: v,
                ..r
            });
        }
        if let Some(v) = self.attention_backend {
            c.engine.attention_backend = v;
            c.resolved = c.resolved.map(|r| config::ResolvedEngine {
                attention_backend: v,
                ..r
            });
        }
        let e = &mut c.engine;
        if let Some(v) = self.max_model_len {
            e.max_model_len = v;
        }
        if let Some(v) = self.max_num_seqs {
            e.max_num_seqs = v;
        }
        if let Some(v) = self.max_num_batched_tokens {
            e.max_num_batched_tokens = v;
        }
        if let Some(v) = self.block_size {
            e.block_size = v;
        }
        if let Some(v) = self.gpu_memory_utilization {
            e.gpu_memory_utilization = v;
        }
        if let Some(v) = self.cpu_memory_bytes {
            c.cpu_memory_bytes = Some(v);
        }
        if let Some(v) = self.max_kv_tokens {
            c.max_kv_tokens = Some(v);
        }
        if let Some(v) = self.max_waiting {
            c.max_waiting = Some(v);
        }
        if self.enable_prefix_caching {
            c.engine.prefix_caching = true;
        }
        if self.no_enable_prefix_caching {
            c.engine.prefix_caching = false;
        }
        if let Some(ep) = &self.kv_events_endpoint {
            c.engine.kv_events = Some(crate::api::KvEventsSpec {
                enabled: true,
                port: 0,
                topic: self.kv_events_topic.clone(),
            });
            c.kv_events_endpoint = Some(ep.clone());
        }
        Ok(c)
    }
}

/// The budget of request bodies in flight: the flag, else the default or --max-request-bytes
/// when larger; never under --max-request-bytes (a request of that size could never be read).
fn bodies_in_flight_bytes(args: &WorkerArgs) -> Result<usize, String> {
    let max = args.max_request_bytes;
    match args.max_request_bytes_in_flight {
        Some(n) if n < max => Err(format!(
            "--max-request-bytes-in-flight ({n}) is under --max-request-bytes ({max}): a request of the largest size could never be read; raise it or lower --max-request-bytes"
        )),
        Some(n) => Ok(n),
        None => Ok(crate::serving::openai::DEFAULT_BODIES_IN_FLIGHT_BYTES.max(max)),
    }
}

/// Limits the config file and flags share, checked before anything is loaded: a value the
/// engine would round or that would refuse every request is an error naming it.
fn check_limits(cfg: &WorkerConfig) -> Result<(), String> {
    if let Some(w) = cfg.max_waiting {
        if w == 0 || w as u64 > MAX_WAITING {
            return Err(format!(
                "maxWaiting (--max-waiting) is {w}; it must be in 1..={MAX_WAITING}"
            ));
        }
    }
    if let Some(t) = cfg.max_kv_tokens {
        // The pools are allocated in whole blocks: any other value would be rounded up.
        let block = u64::try_from(cfg.engine.block_size).unwrap_or(0).max(1);
        if t == 0 || t % block != 0 {
            let up = t.div_ceil(block).max(1) * block;
            return Err(format!(
                "--max-kv-tokens (maxKvTokens) is {t}; KV pools are allocated in blocks of {block} tokens \
                 (blockSize), so it must be a positive multiple of {block}: pass {up}"
            ));
        }
    }
    Ok(())
}

/// Where a failed start-up writes its reason, so `kubectl describe pod` shows it (the
/// container's `terminationMessagePath`).
pub const TERMINATION_LOG: &str = "/dev/termination-log";

/// Logs a start-up failure, writes it to the termination log when there is one, and returns
/// its exit code.
fn fail(code: u8, what: &str, error: &dyn std::fmt::Display) -> ExitCode {
    tracing::error!(%error, "{what}");
    let path = std::env::var_os("KVFLEET_TERMINATION_LOG")
        .map_or_else(|| PathBuf::from(TERMINATION_LOG), PathBuf::from);
    if path.exists() {
        // Best effort: a read-only or absent log must not hide the real failure.
        let _ = std::fs::write(&path, format!("{what}: {error}\n"));
    }
    ExitCode::from(code)
}

fn fail_preflight(error: &PreflightError) -> ExitCode {
    let code = match error {
        PreflightError::Config(_) => exit::CONFIG,
        PreflightError::Incompatible(_) => exit::INCOMPATIBLE,
        PreflightError::NoMemory(_) => exit::NO_MEMORY,
    };
    fail(code, "preflight failed", error)
}

/// The speculative decoding to run: `--speculative-config`, else the config's
/// engine.speculative; checked against what this engine runs.
fn speculative(args: &WorkerArgs, cfg: &WorkerConfig) -> Result<Option<SpecConfig>, String> {
    if let Some(json) = args.speculative_config.as_deref() {
        return SpecConfig::from_json(json).map(Some);
    }
    let Some(s) = &cfg.engine.speculative else {
        return Ok(None);
    };
    let n = |v: i32| usize::try_from(v).unwrap_or(0);
    let method = match s.method {
        crate::api::SpeculativeMethod::Ngram => speculative::SpecMethod::Ngram,
        crate::api::SpeculativeMethod::Eagle3 => speculative::SpecMethod::Eagle3,
        crate::api::SpeculativeMethod::Dflash => speculative::SpecMethod::Dflash,
    };
    let ngram = method == speculative::SpecMethod::Ngram;
    // A drafter on a volume is mounted at /draft-models (the pod renders it so).
    let model = s.draft_model.as_ref().filter(|d| d.has_volume()).map(|d| {
        match d.path.as_deref().map(|p| p.trim_matches('/')) {
            Some(p) if !p.is_empty() => format!("/draft-models/{p}"),
            _ => "/draft-models".to_string(),
        }
    });
    let c = SpecConfig {
        method,
        num_speculative_tokens: n(s.num_speculative_tokens),
        prompt_lookup_max: ngram.then(|| n(s.prompt_lookup_max())),
        prompt_lookup_min: ngram.then(|| n(s.prompt_lookup_min())),
        disable_by_batch_size: Some(n(s.disable_by_batch_size())),
        model: model.filter(|_| !ngram),
        declared: s.draft_model.as_ref().and_then(|d| d.geometry.clone()),
    };
    c.check()
        .map_err(|e| format!("engine.speculative: {e}"))
        .map(|()| Some(c))
}

pub fn main(args: WorkerArgs) -> ExitCode {
    let cfg = match args.resolve_config() {
        Ok(c) => c,
        Err(error) => {
            return fail(
                exit::CONFIG,
                "worker config unusable",
                &crate::error_chain(&error),
            )
        }
    };
    if let Err(error) = check_limits(&cfg)
        .and_then(|()| speculative(&args, &cfg).map(|_| ()))
        .and_then(|()| bodies_in_flight_bytes(&args).map(|_| ()))
    {
        return fail(exit::CONFIG, "worker config unusable", &error);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(error) => {
            tracing::error!(%error, "cannot start the async runtime");
            return ExitCode::from(exit::RUNTIME);
        }
    };
    rt.block_on(serve(args, cfg))
}

/// The spec's geometry against the loaded model's: the fields the engine and the planner
/// use must agree.
fn check_geometry(
    spec: &crate::api::ModelGeometry,
    model: &crate::api::ModelGeometry,
) -> Result<(), PreflightError> {
    let pairs = [
        ("layers", spec.layers, model.layers),
        ("queryHeads", spec.query_heads, model.query_heads),
        ("kvHeads", spec.kv_heads, model.kv_heads),
        ("headDim", spec.head_dim, model.head_dim),
    ];
    let diff: Vec<String> = pairs
        .iter()
        .filter(|(_, s, m)| s != m)
        .map(|(n, s, m)| format!("{n} {s} (the model has {m})"))
        .collect();
    let windows = spec.sliding_window.is_some() || spec.layer_types.is_some();
    if !diff.is_empty() || windows != (model.sliding_window.is_some() || model.layer_types.is_some()) {
        let mut why = diff.join(", ");
        if windows {
            why.push_str(if why.is_empty() { "" } else { ", " });
            why.push_str("sliding-window layers (the model has none)");
        }
        return Err(PreflightError::Config(format!(
            "spec.model.geometry does not match the model that was loaded: {why}; fix spec.model.geometry or point spec.model.weights at the right model"
        )));
    }
    Ok(())
}

/// The loaded model on its device: the GPU (weights, activations, then KV pools in the memory
/// measured free, after the kernels' self-test) or the CPU (pools sized by preflight).
struct Placed {
    forward: Box<dyn kvfleet_engine::model::forward::Forward>,
    gpu: Option<kvfleet_cuda::gpu::GpuCapacity>,
    pf: preflight::Preflight,
}

fn place(
    model: LoadedModel,
    cfg: &mut WorkerConfig,
    probe: &nvml::Probe,
    spec: Option<&SpecConfig>,
) -> Result<(Placed, kvfleet_engine::model::tokenizer::Tokenizer), PreflightError> {
    // On a GPU the model stores each KV head `kv_rep` times where its GQA group is not one the
    // kernels build (SmolLM2: 9 over 3 is stored as 9 over 9); preflight checks what is stored.
    let real = model.geometry();
    let stored = {
        let c = model.config();
        let mut g = real.clone();
        if let Ok((rep, _)) = kvfleet_cuda::gpu::kv_replication(c.n_heads, c.n_kv_heads) {
            g.kv_heads = i32::try_from(c.n_kv_heads * rep).unwrap_or(g.kv_heads);
        }
        g
    };
    let gpu_present = matches!(probe, nvml::Probe::Gpus(g) if !g.is_empty());
    let wants_gpu = gpu_present && cfg.attention_backend() != AttentionBackend::KvfleetCpu;
    cfg.geometry = Some(if wants_gpu { stored } else { real.clone() });
    let ctx = model.config().context_len;
    if cfg.engine.max_model_len > ctx as i64 {
        return Err(PreflightError::Config(format!(
            "maxModelLen {} exceeds the context length of the model ({ctx}); lower maxModelLen",
            cfg.engine.max_model_len
        )));
    }
    // The device first (the kernels' rules on the stored heads, a usable GPU path), then one
    // preflight on the geometry that device stores.
    if preflight::backend(cfg, probe)?.0 == preflight::BackendKind::Cuda {
        if let Err(e) = kvfleet_cuda::gpu::check_available() {
            if cfg.attention_backend() == AttentionBackend::KvfleetCuda {
                return Err(PreflightError::Incompatible(format!(
                    "attentionBackend KVFLEET_CUDA, but the GPU path cannot start: {e}"
                )));
            }
            tracing::warn!(reason = %e, "the GPU path is not usable: the model runs on the CPU");
            cfg.force_cpu();
            cfg.geometry = Some(real);
        }
    } else if wants_gpu {
        // Auto fell back to the CPU: its pools hold the model's own KV heads.
        cfg.geometry = Some(real);
    }
    let pf = preflight::run(cfg, probe)?;
    let crate::serving::serve::LoadedModel {
        weights, tokenizer, ..
    } = model;
    let placed = match pf.backend {
        preflight::BackendKind::Cpu => {
            let mut pools = pf.backend_config.clone();
            if let Some(cap) = cfg.max_kv_tokens {
                let blocks = (cap as usize).div_ceil(pools.block_size);
                for g in &mut pools.groups {
                    g.num_blocks = g.num_blocks.min(blocks);
                }
            }
            let forward = serve::on_cpu(weights, pools, cfg.seed, cfg.engine.quantization)
                .map_err(|e| PreflightError::NoMemory(e.to_string()))?;
            // `KVFLEET_PROFILE=1` times the serving loop on the CPU too; the GPU knobs read
            // beside it do not apply here, so a bad one is not this worker's error.
            if let Ok(tuning) = kvfleet_cuda::gpu::GpuTuning::from_env() {
                kvfleet_cuda::profile::enable(tuning.profile);
            }
            Placed {
                forward,
                gpu: None,
                pf,
            }
        }
        preflight::BackendKind::Cuda => {
            let opts = kvfleet_cuda::gpu::GpuOptions {
                ordinal: pf.gpu.as_ref().map_or(0, |g| g.index as usize),
                kv_dtype: pf.dtype,
                max_batched_tokens: pf.scheduler.max_num_batched_tokens,
                max_num_seqs: pf.scheduler.max_num_seqs,
                max_kv_tokens: cfg.max_kv_tokens.map(|v| v as usize),
                block_size: pf.scheduler.block_size,
                gpu_memory_utilization: cfg.engine.gpu_memory_utilization,
                memory_margin_bytes: None,
                reported_total_bytes: pf.gpu.as_ref().map(|g| g.memory_total_bytes as usize),
                self_test: true,
                max_model_len: Some(pf.scheduler.max_model_len),
                single_token_gemv: true,
                single_token_append: true,
                // FP8 at load, or an FP8 checkpoint kept in FP8 (quantized again per row from
                // its dequantized weights: the same bytes for per-channel amax scales).
                fp8_weights: cfg.engine.quantization == EngineQuantization::Fp8
                    || cfg.model.as_ref().is_some_and(serve::fp8_checkpoint),
                drafter: None,
                tuning: Default::default(),
            };
            // The lab knobs (and `KVFLEET_SINGLE_TOKEN_APPEND=0`) from the environment, once.
            let opts = opts
                .with_env()
                .map_err(|e| PreflightError::Incompatible(e.to_string()))?;
            kvfleet_cuda::profile::enable(opts.tuning.profile);
            tracing::info!(tuning = ?opts.tuning, single_token_append = opts.single_token_append, "GPU tuning");
            let (forward, cap) = serve::on_gpu_with(weights, &opts, cfg.seed, spec).map_err(|e| match e {
                crate::serving::runtime::RuntimeError::Gpu(kvfleet_cuda::gpu::GpuError::Memory(m)) => {
                    PreflightError::NoMemory(m)
                }
                other => PreflightError::Incompatible(other.to_string()),
            })?;
            Placed {
                forward,
                gpu: Some(cap),
                pf,
            }
        }
    };
    Ok((placed, tokenizer))
}

async fn serve(args: WorkerArgs, cfg: WorkerConfig) -> ExitCode {
    let metrics = match crate::serving::metrics::Metrics::new() {
        Ok(m) => Arc::new(m),
        Err(error) => {
            tracing::error!(%error, "cannot register metrics");
            return ExitCode::from(exit::RUNTIME);
        }
    };
    let listener = match crate::serving::bind(args.listen) {
        Ok(l) => l,
        Err(error) => {
            tracing::error!(%error, listen = %args.listen, "cannot listen; pass a free address to --listen");
            return ExitCode::from(exit::RUNTIME);
        }
    };
    let addr = listener.local_addr().unwrap_or(args.listen);
    tracing::info!(%addr, "listening; loading the model");

    // The model, as the spec names it.
    // No config and no --model: the embedded SmolLM2. A config without weights is an error.
    let source = match cfg.model.clone() {
        Some(source) => source,
        None => match serve::embedded_source() {
            Ok(source) => source,
            Err(error) => return fail(exit::CONFIG, "cannot load the model", &error),
        },
    };
    if let Err(error) = serve::check_quantization(&source, cfg.engine.quantization) {
        return fail(exit::CONFIG, "cannot load the model", &crate::error_chain(&error));
    }
    let name = cfg.model_name.clone();
    let geometry = cfg.geometry.clone();
    let max_len = usize::try_from(cfg.engine.max_model_len).unwrap_or(0);
    let loaded = tokio::task::spawn_blocking(move || {
        serve::load(&source, name.as_deref(), geometry.as_ref(), max_len)
    })
    .await;
    let model = match loaded {
        Ok(Ok(m)) => m,
        Ok(Err(error)) => return fail(exit::CONFIG, "cannot load the model", &crate::error_chain(&error)),
        Err(error) => return fail(exit::RUNTIME, "model loader task failed", &error),
    };
    if let Some(spec) = &cfg.geometry {
        if let Err(e) = check_geometry(spec, &model.geometry()) {
            return fail_preflight(&e);
        }
    }
    let (served_name, model_path) = (model.name.clone(), model.path.display().to_string());
    let weight_bytes = model.device_weight_bytes();
    tracing::info!(model = %served_name, path = %model_path, "model read");

    // Preflight on what is served.
    let probe = tokio::task::spawn_blocking(nvml::probe)
        .await
        .unwrap_or(nvml::Probe::NoGpu {
            reason: "NVML probe task failed".into(),
        });
    if let nvml::Probe::NoGpu { reason } = &probe {
        tracing::info!(%reason, "no NVIDIA GPU");
    }
    let placed = {
        let mut cfg2 = cfg.clone();
        let wants_gpu = !matches!(cfg2.attention_backend(), AttentionBackend::KvfleetCpu);
        // The planner's prediction on a GPU subtracts the weights; CPU pools have their own budget.
        cfg2.weight_bytes = if wants_gpu && matches!(probe, nvml::Probe::Gpus(_)) {
            weight_bytes
        } else {
            0
        };
        // A drafter on a GPU is placed with the model (its memory comes out of the KV budget).
        let spec = speculative(&args, &cfg).ok().flatten();
        let r = tokio::task::spawn_blocking(move || {
            place(model, &mut cfg2, &probe, spec.as_ref()).map(|p| (p, cfg2))
        })
        .await;
        match r {
            Ok(Ok(((p, tok), _placed_cfg))) => (p, tok),
            Ok(Err(e)) => return fail_preflight(&e),
            Err(error) => return fail(exit::RUNTIME, "model placement task failed", &error),
        }
    };
    let (
        Placed {
            mut forward,
            gpu: gpu_cap,
            pf,
        },
        tokenizer,
    ) = placed;
    for w in &pf.warnings {
        tracing::warn!("{w}");
    }
    let device = forward.device();
    let mut sched_cfg = pf.scheduler.clone();
    sched_cfg.block_size = forward.kv_config().block_size;
    let mut hooks = crate::serving::runtime::RuntimeHooks {
        // Checked at start (`main`).
        speculative: speculative(&args, &cfg).ok().flatten(),
        ..Default::default()
    };
    if let Some(spec) = &hooks.speculative {
        tracing::info!(
            method = spec.method.as_str(),
            tokens = spec.num_speculative_tokens,
            lookup_min = spec.lookup_min(),
            lookup_max = spec.lookup_max(),
            disable_at = spec.disable_at(),
            "speculative decoding on"
        );
    }
    if let Some((endpoint, topic)) = cfg.kv_events() {
        let medium = if device == "cuda" { "GPU" } else { "CPU" };
        let counters = crate::serving::zmtp::publisher::Counters {
            rejected: metrics.kv_events_rejected.clone(),
            dropped: metrics.kv_events_dropped.clone(),
        };
        let format = crate::serving::kv_events::KvEventsFormat::default();
        match crate::serving::kv_events::KvEventPublisher::start_counted(
            &endpoint, topic, medium, format, counters,
        ) {
            Ok(publisher) => {
                tracing::info!(endpoint = %publisher.local_addr(), "publishing KV events");
                hooks.kv_events = Some(Box::new(move |events| publisher.publish(events)));
            }
            Err(error) => return fail(exit::CONFIG, "cannot publish KV events", &error),
        }
    }
    // A drafter that cannot run with this model here stops the start, before the port opens.
    if let Err(error) = serve::attach_drafter(forward.as_mut(), hooks.speculative.as_ref()) {
        return fail(exit::CONFIG, "cannot load the speculative drafter", &error);
    }
    let runtime = match ModelRuntime::start_with(
        forward,
        tokenizer,
        served_name.clone(),
        sched_cfg,
        metrics.clone(),
        hooks,
    ) {
        Ok(mut rt) => {
            rt.gpu_capacity = gpu_cap.clone();
            Arc::new(rt)
        }
        // A warm-up that fails on the device says it cannot serve this model here.
        Err(error @ crate::serving::runtime::RuntimeError::WarmUp { .. }) => {
            return fail(exit::INCOMPATIBLE, "cannot start the engine", &error)
        }
        Err(error) => return fail(exit::CONFIG, "cannot start the engine", &error),
    };

    // Capacity: the pools the engine allocated for the served model; the planner's
    // prediction beside it.
    let c = &pf.scheduler;
    let pool = &runtime.pool;
    // Each layer group by its window (what the scheduler admits), and beside it what the
    // same pools would admit under a full-layer budget.
    let max_concurrency = pool.admission.max_concurrency;
    let capacity_tokens = (max_concurrency * c.max_model_len as f64) as u64;
    let info = http::CapacityInfo {
        model_name: served_name.clone(),
        model_path,
        backend: device.to_string(),
        kv_cache_dtype: pool.kv_cache_dtype.to_string(),
        gpu: pf.gpu.clone(),
        block_size: pool.block_size,
        max_model_len: c.max_model_len,
        max_num_seqs: c.max_num_seqs,
        max_num_batched_tokens: c.max_num_batched_tokens,
        memory_bytes: gpu_cap.as_ref().map_or(pf.memory_bytes, |g| g.total_bytes as u64),
        available_kv_bytes: gpu_cap.as_ref().map_or(pf.available_kv_bytes, |g| {
            (g.kv_tokens * g.kv_bytes_per_token) as u64
        }),
        total_blocks: pool.total_blocks,
        kv_tokens: (pool.total_blocks * pool.block_size) as u64,
        capacity_tokens,
        max_concurrency,
        predicted_capacity_tokens: pf.pools.capacity_tokens,
        full_layer_max_concurrency: pool.admission.full_layer_max_concurrency,
        full_layer_capacity_tokens: (pool.admission.full_layer_max_concurrency * c.max_model_len as f64)
            as u64,
        tokens_per_request: pool.admission.tokens_per_request.clone(),
        pools: pf.pools.clone(),
        gpu_memory: gpu_cap.as_ref().map(|g| http::GpuMemory {
            total_bytes: g.total_bytes as u64,
            weight_bytes: g.weight_bytes as u64,
            activation_bytes: g.activation_bytes as u64,
            free_before_kv_bytes: g.free_bytes as u64,
            margin_bytes: g.margin_bytes as u64,
            kv_budget_bytes: g.kv_budget_bytes as u64,
            kv_bytes: g.kv_bytes as u64,
            kv_bytes_per_token: g.kv_bytes_per_token as u64,
            drafter_bytes: g.drafter_bytes as u64,
        }),
    };
    metrics.capacity_tokens.set(capacity_tokens as i64);
    metrics
        .predicted_capacity_tokens
        .set(info.predicted_capacity_tokens as i64);
    metrics.max_concurrency.set(max_concurrency);
    metrics
        .full_layer_max_concurrency
        .set(pool.admission.full_layer_max_concurrency);
    match &pf.gpu {
        Some(g) if device == "cuda" => metrics
            .gpu_info
            .with_label_values(&[g.product.as_str(), g.compute_capability_label().as_str()])
            .set(1.0),
        _ => metrics.gpu_info.with_label_values(&["cpu", "none"]).set(1.0),
    }
    tracing::info!(
        model = %served_name,
        device,
        kv_cache_dtype = %info.kv_cache_dtype,
        blocks = pool.total_blocks,
        kv_tokens = info.kv_tokens,
        capacity_tokens,
        max_concurrency,
        "KV pool allocated for the served model"
    );
    let state = Arc::new(http::AppState {
        ready: AtomicBool::new(false),
        capacity: RwLock::new(Some(info)),
        metrics: metrics.clone(),
    });
    let in_flight = bodies_in_flight_bytes(&args).unwrap_or(args.max_request_bytes);
    tracing::info!(max_request_bytes_in_flight = in_flight, "request body budget");
    let limits = crate::serving::openai::ApiLimits {
        max_body_bytes: args.max_request_bytes,
        max_bodies_in_flight_bytes: in_flight,
        request_timeout: Duration::from_secs(args.request_timeout_seconds),
        trust_request_chat_template: args.trust_request_chat_template,
        ..Default::default()
    };
    if args.api_key.is_some() {
        tracing::info!("the OpenAI API requires an API key");
    }
    let app = crate::serving::openai::router_with(runtime.clone(), limits, args.api_key.clone())
        .merge(http::router(state.clone()));
    let handle = axum_server::Handle::new();
    let server = {
        let handle = handle.clone();
        tokio::spawn(async move {
            listener.set_nonblocking(true)?;
            // Streams go out a token at a time: without TCP_NODELAY, Nagle's algorithm holds a
            // chunk until the peer's delayed ACK (tens of milliseconds) on a reused connection,
            // such as a router's pooled one.
            // Idle connections are closed and their number held under the file limit, so
            // that probes always get in (crate::serving::connections).
            let connections = crate::serving::connections::Connections::new(
                crate::serving::connection_policy(crate::serving::FIRST_REQUEST_TIMEOUT),
            );
            let policy = connections.policy();
            tracing::info!(
                max_connections = policy.max_connections,
                first_request_s = policy.first_request.as_secs(),
                idle_s = policy.idle.as_secs(),
                "connection limits"
            );
            let mut server = axum_server::from_tcp(listener)?
                .acceptor(connections.acceptor(axum_server::accept::NoDelayAcceptor::new()));
            crate::serving::limit_connection_time(
                &mut server,
                crate::serving::HEADER_READ_TIMEOUT,
                crate::serving::HTTP2_KEEP_ALIVE,
            );
            server.handle(handle).serve(app.into_make_service()).await
        })
    };
    state.ready.store(true, Ordering::SeqCst);
    tracing::info!(%addr, model = %served_name, "ready");
    tokio::spawn(crate::publish::publish_measured_capacity(capacity_tokens));

    crate::serving::shutdown_signal().await;
    tracing::info!("shutdown requested: not ready; draining");
    state.ready.store(false, Ordering::SeqCst);
    let drain = Duration::from_secs(args.drain_seconds);
    let rt = runtime.clone();
    let _ = tokio::task::spawn_blocking(move || rt.shutdown(drain)).await;
    tracing::info!("engine drained");
    handle.graceful_shutdown(Some(Duration::from_secs(5)));
    match tokio::time::timeout(Duration::from_secs(10), server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(error))) => tracing::warn!(%error, "server stopped with an error"),
        _ => tracing::warn!("server did not stop within 10 s"),
    }
    ExitCode::SUCCESS
}

//! `kvfleet worker`: probe the GPU, refuse configurations it cannot run, size the KV pool,
//! serve the batched paged-attention engine on a synthetic workload, and its metrics.
//!
//! Start-up: config (file or embedded default, flags on top) -> listen (`/healthz` answers,
//! `/readyz` does not yet) -> NVML probe -> [`preflight`] (one log line and a distinct exit
//! code on failure, see [`preflight::exit`]) -> KV pools -> engine thread -> ready.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::compat::{AttentionBackend, KvCacheDtype};

pub mod config;
pub mod cuda;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod nvml;
pub mod preflight;
pub mod publish;
pub mod runner;

use config::WorkerConfig;
use preflight::exit;

/// Options of `kvfleet worker`. Flags override the config file.
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Worker config (YAML or JSON, the ConfigMap the controller renders; see
    /// docs/worker.md). Absent: the embedded default, a small synthetic model on the CPU.
    #[arg(long, env = "KVFLEET_WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to serve the API and metrics on.
    #[arg(long, default_value = "0.0.0.0:8000", env = "KVFLEET_WORKER_LISTEN")]
    pub listen: SocketAddr,
    /// KV-cache dtype (auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, nvfp4).
    #[arg(long)]
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// Attention backend (auto, KVFLEET_CUDA, KVFLEET_CPU).
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
    /// Memory the CPU backend treats as its device, in bytes.
    #[arg(long)]
    pub cpu_memory_bytes: Option<u64>,
    /// Weight bytes (all ranks) to subtract from the KV budget.
    #[arg(long)]
    pub weight_bytes: Option<u64>,
    /// On SIGTERM/ctrl-c, let running requests finish for this long, then fail the rest.
    #[arg(long, default_value_t = 20)]
    pub drain_seconds: u64,
    /// The language model served through the OpenAI-compatible API (`/v1/chat/completions`).
    #[command(flatten)]
    pub model: crate::model::serve::ModelArgs,
}

impl WorkerArgs {
    /// The effective configuration.
    pub fn resolve_config(&self) -> Result<WorkerConfig, config::ConfigError> {
        let mut c = match &self.config {
            Some(p) => WorkerConfig::load(p)?,
            None => WorkerConfig::embedded_default(),
        };
        let e = &mut c.engine;
        if let Some(v) = self.kv_cache_dtype {
            e.kv_cache_dtype = v;
            c.resolved = c.resolved.map(|r| config::ResolvedEngine {
                kv_cache_dtype: v,
                ..r
            });
        }
        if let Some(v) = self.attention_backend {
            e.attention_backend = v;
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
        if let Some(v) = self.weight_bytes {
            c.weight_bytes = v;
        }
        Ok(c)
    }
}

pub fn main(args: WorkerArgs) -> ExitCode {
    let cfg = match args.resolve_config() {
        Ok(c) => c,
        Err(error) => {
            tracing::error!(error = %crate::cli::error_chain(&error), "worker config unusable");
            return ExitCode::from(exit::CONFIG);
        }
    };
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

/// The OpenAI-compatible routes of the model, when there is one: `--model FILE`, else the
/// embedded SmolLM2 when `.tools/` holds it, and where its forward pass runs (`None`: no
/// model). An explicit model that cannot load is fatal.
async fn mount_model(
    args: &WorkerArgs,
    registry: &prometheus::Registry,
) -> Result<(axum::Router, Option<&'static str>), ExitCode> {
    use crate::model::serve::{mount_on, MountError};
    let model_args = args.model.clone();
    let registry = registry.clone();
    let loaded =
        tokio::task::spawn_blocking(move || mount_on(axum::Router::new(), &model_args, &registry)).await;
    match loaded {
        Ok(Ok((app, device))) => Ok((app, Some(device))),
        Ok(Err(MountError::NoModel)) => {
            tracing::info!("no model file: serving the attention workload only (pass --model FILE.gguf or CHECKPOINT_DIR)");
            Ok((axum::Router::new(), None))
        }
        Ok(Err(error)) => {
            let explicit = args.model.model.is_some()
                || args.model.model_config.is_some()
                || args.model.weights == crate::model::serve::Weights::Dummy;
            tracing::error!(error = %crate::cli::error_chain(&error), "cannot load the model");
            if explicit {
                Err(ExitCode::from(exit::CONFIG))
            } else {
                tracing::warn!("serving the attention workload only");
                Ok((axum::Router::new(), None))
            }
        }
        Err(error) => {
            tracing::error!(%error, "model loader task failed");
            Err(ExitCode::from(exit::RUNTIME))
        }
    }
}

/// The attention backend the engine thread runs.
enum EngineBackend {
    Cpu(engine::cpu::CpuBackend),
    Cuda(Box<cuda::backend::CudaBackend>),
}

async fn serve(args: WorkerArgs, mut cfg: WorkerConfig) -> ExitCode {
    let metrics = match metrics::Metrics::new() {
        Ok(m) => Arc::new(m),
        Err(error) => {
            tracing::error!(%error, "cannot register metrics");
            return ExitCode::from(exit::RUNTIME);
        }
    };
    let state = Arc::new(http::AppState {
        ready: AtomicBool::new(false),
        commands: Mutex::new(None),
        capacity: RwLock::new(None),
        live: Arc::new(Mutex::new(runner::LiveStats::default())),
        metrics: metrics.clone(),
    });
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(error) => {
            tracing::error!(%error, listen = %args.listen, "cannot listen; pass a free address to --listen");
            return ExitCode::from(exit::RUNTIME);
        }
    };
    let addr = listener.local_addr().unwrap_or(args.listen);
    tracing::info!(%addr, "listening");
    let stop_server = Arc::new(tokio::sync::Notify::new());
    let stop = stop_server.clone();
    let app = match mount_model(&args, &metrics.registry).await {
        Ok((app, device)) => {
            if device == Some("cuda") {
                tracing::info!("the model's forward pass and KV cache hold the GPU: the attention workload engine runs on the CPU");
                cfg.attention_on_cpu();
            }
            app.merge(http::router(state.clone()))
        }
        Err(code) => return code,
    };
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.notified().await })
            .await
    });

    // Preflight: everything knowable before the first request.
    let probe = tokio::task::spawn_blocking(nvml::probe)
        .await
        .unwrap_or(nvml::Probe::NoGpu {
            reason: "NVML probe task failed".into(),
        });
    if let nvml::Probe::NoGpu { reason } = &probe {
        tracing::info!(%reason, "no NVIDIA GPU");
    }
    let pf = match preflight::run(&cfg, &probe) {
        Ok(p) => p,
        Err(error) => {
            tracing::error!(%error, "preflight failed");
            return error.exit_code();
        }
    };
    for w in &pf.warnings {
        tracing::warn!("{w}");
    }
    let backend = match pf.backend {
        preflight::BackendKind::Cpu => match engine::cpu::CpuBackend::new(pf.backend_config.clone()) {
            Ok(b) => EngineBackend::Cpu(b),
            Err(error) => {
                tracing::error!(%error, "preflight failed: cannot allocate the KV pools");
                return ExitCode::from(exit::INCOMPATIBLE);
            }
        },
        preflight::BackendKind::Cuda => {
            let ordinal = pf.gpu.as_ref().map_or(0, |g| g.index as usize);
            let bc = pf.backend_config.clone();
            let seed = cfg.seed;
            let opened = tokio::task::spawn_blocking(move || cuda::backend::open_checked(ordinal, bc, seed))
                .await
                .unwrap_or_else(|e| Err(format!("CUDA preflight task failed: {e}")));
            match opened {
                Ok((b, lines)) => {
                    for l in lines {
                        tracing::info!("CUDA kernels {l}");
                    }
                    EngineBackend::Cuda(Box::new(b))
                }
                Err(error) => {
                    tracing::error!(%error, "preflight failed: the CUDA backend cannot run; fix the GPU setup or use KVFLEET_CPU");
                    return ExitCode::from(exit::INCOMPATIBLE);
                }
            }
        }
    };
    let sched = engine::scheduler::Scheduler::new(pf.scheduler.clone(), &pf.backend_config.groups);
    // Measured: the pools as allocated; predicted: the planner on the same inputs.
    let measured = measured_capacity(&sched, &pf);
    let info = http::CapacityInfo {
        model_name: cfg.model_name.clone(),
        backend: format!("{:?}", pf.backend).to_lowercase(),
        kv_cache_dtype: pf.dtype.to_string(),
        gpu: pf.gpu.clone(),
        block_size: pf.scheduler.block_size,
        max_model_len: pf.scheduler.max_model_len,
        max_num_seqs: pf.scheduler.max_num_seqs,
        max_num_batched_tokens: pf.scheduler.max_num_batched_tokens,
        memory_bytes: pf.memory_bytes,
        available_kv_bytes: pf.available_kv_bytes,
        capacity_tokens: measured.0,
        max_concurrency: measured.1,
        predicted_capacity_tokens: pf.pools.capacity_tokens,
        pools: pf.pools.clone(),
    };
    let measured_tokens = info.capacity_tokens as u64;
    metrics.capacity_tokens.set(info.capacity_tokens as i64);
    metrics
        .predicted_capacity_tokens
        .set(info.predicted_capacity_tokens as i64);
    metrics.max_concurrency.set(info.max_concurrency);
    match &pf.gpu {
        Some(g) => metrics
            .gpu_info
            .with_label_values(&[g.product.as_str(), g.compute_capability_label().as_str()])
            .set(1.0),
        None => metrics.gpu_info.with_label_values(&["cpu", "none"]).set(1.0),
    }
    tracing::info!(
        backend = %info.backend,
        kv_cache_dtype = %info.kv_cache_dtype,
        capacity_tokens = info.capacity_tokens,
        max_concurrency = info.max_concurrency,
        blocks = pf.backend_config.groups.iter().map(|g| g.num_blocks).sum::<usize>(),
        "KV pool sized"
    );
    if let Ok(mut c) = state.capacity.write() {
        *c = Some(info);
    }

    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let live = state.live.clone();
    let m = metrics.clone();
    let seed = cfg.seed;
    let engine = std::thread::Builder::new()
        .name("kvfleet-engine".into())
        .spawn(move || {
            let r = match backend {
                EngineBackend::Cpu(b) => runner::run(b, sched, rx, m, live, seed),
                EngineBackend::Cuda(b) => runner::run(*b, sched, rx, m, live, seed),
            };
            let _ = done_tx.send(r);
        });
    if let Err(error) = engine {
        tracing::error!(%error, "cannot start the engine thread");
        return ExitCode::from(exit::RUNTIME);
    }
    if let Ok(mut c) = state.commands.lock() {
        *c = Some(tx);
    }
    state.ready.store(true, Ordering::SeqCst);
    tracing::info!(%addr, "ready");
    tokio::spawn(publish::publish_measured_capacity(measured_tokens));

    let mut code = ExitCode::SUCCESS;
    let mut done_rx = done_rx;
    tokio::select! {
        _ = crate::cli::shutdown_signal() => {
            tracing::info!("shutdown requested");
            state.ready.store(false, Ordering::SeqCst);
            let tx = state.commands.lock().ok().and_then(|mut c| c.take());
            if let Some(tx) = tx {
                let _ = tx.send(runner::Command::Shutdown { drain: Duration::from_secs(args.drain_seconds) });
            }
            match (&mut done_rx).await {
                Ok(Err(error)) => {
                    tracing::error!(%error, "engine failed");
                    code = ExitCode::from(exit::RUNTIME);
                }
                Ok(Ok(())) => tracing::info!("engine drained"),
                Err(_) => code = ExitCode::from(exit::RUNTIME),
            }
        }
        r = &mut done_rx => {
            state.ready.store(false, Ordering::SeqCst);
            tracing::error!(result = ?r, "engine stopped");
            code = ExitCode::from(exit::RUNTIME);
        }
    }
    stop_server.notify_one();
    match tokio::time::timeout(Duration::from_secs(10), server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(error))) => tracing::warn!(%error, "server stopped with an error"),
        _ => tracing::warn!("server did not stop within 10 s"),
    }
    code
}

/// Capacity of the pools the scheduler really manages: (tokens at maxModelLen, concurrency).
fn measured_capacity(sched: &engine::scheduler::Scheduler, pf: &preflight::Preflight) -> (u64, f64) {
    let kv = sched.kv();
    let c = &pf.scheduler;
    let conc = kv
        .groups
        .iter()
        .map(|g| {
            g.pool.total() as f64
                / kv.max_pages_per_request(g.window, c.max_model_len, c.max_num_batched_tokens)
                    .max(1) as f64
        })
        .fold(f64::INFINITY, f64::min);
    ((conc * c.max_model_len as f64) as u64, conc)
}

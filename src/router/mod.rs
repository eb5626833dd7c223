//! `kvfleet router`: an OpenAI-compatible reverse proxy in front of one InferenceDeployment's
//! workers that sends each request to the replica already holding its prompt's prefix, unless
//! that replica has no KV room for the rest or is much busier (see [`score`]).
//!
//! - [`fleet`]: the replicas (EndpointSlices of the workers' Service, or `--worker` URLs), a
//!   KV-event subscription and a `/v1/capacity` scrape for each;
//! - [`events`]: the KV-event subscriptions: bounded ZMTP, reconnected with backoff, bad
//!   input counted and dropped;
//! - [`index`]: what each replica's prefix cache holds, from its KV events;
//! - [`score`]: the ranking;
//! - [`proxy`]: the HTTP side: tokenize once (as the workers do), rank, forward, stream back,
//!   fall back to the next replica on a connection failure before the first byte;
//! - [`body`]: request bodies under size and time limits and a budget for those in flight;
//! - [`stream`]: a started response watched for stalls and a replica marked down;
//! - [`hold`]: while no replica is ready (scale from zero), requests wait in a bounded queue
//!   and their KV demand is published for the autoscaler;
//! - [`metrics`]: the router's own series.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::{connect::HttpConnector, Client};

use crate::contract::config::{ConfigError, WorkerConfig};
use crate::serving::serve::{self, ModelSource, MountError, Weights};
use kvfleet_engine::model::gguf::Gguf;

pub mod body;
pub mod events;
pub mod fleet;
pub mod hold;
pub mod index;
pub mod metrics;
pub mod proxy;
pub mod score;
pub mod stream;

/// The upstream HTTP client.
pub type HttpClient = Client<HttpConnector, axum::body::Body>;

/// Options of `kvfleet router`.
#[derive(clap::Args, Debug, Clone)]
pub struct RouterArgs {
    /// Address to serve the API, /health, /livez and /metrics on.
    #[arg(long, default_value = "0.0.0.0:8000", env = "KVFLEET_ROUTER_LISTEN")]
    pub listen: SocketAddr,
    /// The workers' config (the ConfigMap the controller renders): the router reads the model
    /// source to tokenize requests as the workers do. Absent: the embedded default (SmolLM2).
    #[arg(long, env = "KVFLEET_WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Model whose tokenizer to use, as the worker's --model (default: the config's).
    #[arg(long = "model", env = "KVFLEET_MODEL")]
    pub model: Option<PathBuf>,
    /// `dummy`: the model is dummy weights of --model-config (its tokenizer, else raw bytes).
    #[arg(long = "model-weights", value_parser = ["load", "dummy"])]
    pub weights: Option<String>,
    /// config.json (or a checkpoint directory) for --model-weights dummy.
    #[arg(long = "model-config")]
    pub model_config: Option<PathBuf>,
    /// Service whose EndpointSlices list the worker pods (ports named `http` and `kv-events`).
    #[arg(long, env = "KVFLEET_WORKERS_SERVICE", conflicts_with = "worker")]
    pub workers_service: Option<String>,
    /// Namespace of that Service.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// A worker outside Kubernetes: `URL` or `URL,KV_EVENTS_ENDPOINT`, e.g.
    /// `http://127.0.0.1:8001,tcp://127.0.0.1:5601` (repeat for each).
    #[arg(long = "worker")]
    pub worker: Vec<String>,
    /// How often each worker's /v1/capacity is read, in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub scrape_interval_ms: u64,
    /// Largest request body accepted (413 above it). Keep it at the workers'
    /// --max-request-bytes (the default is theirs): a larger body would only reach a worker to
    /// be refused there.
    #[arg(long, default_value_t = crate::serving::openai::ApiLimits::default().max_body_bytes,
          value_parser = crate::serving::openai::body_bytes_parser())]
    pub max_request_bytes: usize,
    /// What a client gets to send its whole request body (408 after it).
    #[arg(long, default_value_t = body::DEFAULT_BODY_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub body_timeout_seconds: u64,
    /// Bytes of request bodies being read or forwarded at once; a body that would take them
    /// past this is answered 503 with Retry-After (the router's memory stays bounded whatever
    /// its clients send).
    #[arg(long, default_value_t = body::DEFAULT_BUDGET_BYTES,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1 << 20..=1 << 34))]
    pub body_budget_bytes: usize,
    /// From sending a streamed request (or any request but completions) to a worker to its
    /// response head (a worker sends it when it admits the request): 504 after it.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub upstream_first_byte_timeout_seconds: u64,
    /// From sending a non-streamed completion to a worker to its answer, which comes whole:
    /// above the workers' --request-timeout-seconds (600), which ends a request first.
    #[arg(long, default_value_t = 630, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub upstream_response_timeout_seconds: u64,
    /// Between two chunks of a worker's started response (its first token after a long prefill
    /// included): the response is ended after it (a stream with an error event and [DONE]).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub upstream_chunk_timeout_seconds: u64,
    /// A replica whose /v1/capacity scrape has failed (no whole answer within 2 s) for this long
    /// is marked down: its requests in flight fail over (non-streamed, nothing answered yet) or
    /// end (streams: an error event and [DONE]).
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub replica_down_after_ms: u64,
    /// Model id in the OpenAI API, as the workers' --served-model-name (default: the config's
    /// modelName, else from the model file, as the worker derives it). The router answers
    /// /v1/models with it while no replica is ready.
    #[arg(long, env = "KVFLEET_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// The workers' maxModelLen (default: the config's engine.maxModelLen): caps the KV demand
    /// of a held request.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_model_len: Option<u64>,
    /// While no replica is ready, hold at most this many generation requests until one is;
    /// more are answered 503 with Retry-After.
    #[arg(long, default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(hold::MAX_REQUESTS_RANGE))]
    pub hold_max_requests: u64,
    /// A request held this long without a ready replica is answered 503 with Retry-After.
    #[arg(long, default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(hold::TIMEOUT_SECONDS_RANGE))]
    pub hold_timeout_seconds: u64,
    /// Weight of the fraction of a prompt a replica's prefix cache serves (docs/routing.md).
    #[arg(long, default_value_t = score::DEFAULT_PREFIX_WEIGHT, value_parser = weight)]
    pub prefix_weight: f64,
    /// Weight of a replica's load relative to the others' (0 for the least busy, all of it for
    /// the busiest).
    #[arg(long, default_value_t = score::DEFAULT_LOAD_WEIGHT, value_parser = weight)]
    pub load_weight: f64,
    /// The imbalance guard: the least busy replica goes first when the best-scored one has at
    /// least this many more requests in flight...
    #[arg(long, default_value_t = score::DEFAULT_IMBALANCE_REQUESTS as u64,
          value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub imbalance_requests: u64,
    /// ...and more than this many times as many.
    #[arg(long, default_value_t = score::DEFAULT_IMBALANCE_RATIO, value_parser = ratio)]
    pub imbalance_ratio: f64,
}

/// A score weight: a finite number from 0 to 1000.
fn weight(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if !(0.0..=1000.0).contains(&v) {
        return Err(format!("{v} is outside 0..=1000"));
    }
    Ok(v)
}

/// The imbalance ratio: a finite number from 1 to 1000.
fn ratio(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if !(1.0..=1000.0).contains(&v) {
        return Err(format!("{v} is outside 1..=1000"));
    }
    Ok(v)
}

/// What the router needs of the model the workers serve.
struct ModelInfo {
    source: ModelSource,
    block_size: usize,
    /// The config's modelName (or --served-model-name).
    name: Option<String>,
    max_model_len: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("worker config: {0}")]
    Config(#[from] ConfigError),
    #[error("loading the model's tokenizer: {0}")]
    Model(#[from] MountError),
    #[error("no workers to route to: give --workers-service (in Kubernetes) or --worker URL")]
    NoWorkers,
    #[error("`--worker {0}`: expected URL or URL,KV_EVENTS_ENDPOINT with an http:// URL")]
    BadWorker(String),
    #[error("Kubernetes client: {0}")]
    Kube(#[from] kube::Error),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serving: {0}")]
    Serve(std::io::Error),
}

impl RouterArgs {
    /// The model source whose tokenizer the router uses, the workers' block size, served name
    /// and maxModelLen.
    fn model(&self) -> Result<ModelInfo, RouterError> {
        let mut cfg = match &self.config {
            Some(p) => WorkerConfig::load(p)?,
            None => WorkerConfig::embedded_default(),
        };
        if self.model.is_some() || self.weights.is_some() || self.model_config.is_some() {
            let m = cfg.model.get_or_insert_with(ModelSource::default);
            if let Some(p) = &self.model {
                m.path = Some(p.clone());
            }
            if let Some(w) = &self.weights {
                m.weights = if w == "dummy" {
                    Weights::Dummy
                } else {
                    Weights::Load
                };
            }
            if let Some(p) = &self.model_config {
                m.config = Some(p.clone());
            }
        }
        let block_size = usize::try_from(cfg.engine.block_size).unwrap_or(16).max(1);
        let max_model_len = self
            .max_model_len
            .map_or(cfg.engine.max_model_len, |n| i64::try_from(n).unwrap_or(i64::MAX));
        let source = match cfg.model {
            Some(source) => source,
            None => serve::embedded_source()?,
        };
        Ok(ModelInfo {
            source,
            block_size,
            name: self.served_model_name.clone().or(cfg.model_name),
            max_model_len: usize::try_from(max_model_len).unwrap_or(0),
        })
    }

    /// The static workers of `--worker`.
    fn static_workers(&self) -> Result<Vec<fleet::Endpoint>, RouterError> {
        self.worker
            .iter()
            .map(|w| {
                let (url, kv) = match w.split_once(',') {
                    Some((u, k)) => (u, Some(k.to_string())),
                    None => (w.as_str(), None),
                };
                let url = url.trim_end_matches('/');
                if !url.starts_with("http://") || kv.as_deref().is_some_and(|k| !k.starts_with("tcp://")) {
                    return Err(RouterError::BadWorker(w.clone()));
                }
                Ok(fleet::Endpoint {
                    name: url.to_string(),
                    url: url.to_string(),
                    kv_events: kv,
                })
            })
            .collect()
    }
}

/// The id a worker serves `source` under when no name is given (`serve::load`'s rule): a
/// Hugging Face checkpoint's directory name, a GGUF's `general.name` for the embedded SmolLM2
/// else its file stem, `dummy-<dir>` for dummy weights of a config.
fn served_name_of(source: &ModelSource) -> String {
    let dir_name = |dir: &Path| {
        std::fs::canonicalize(dir)
            .ok()
            .and_then(|d| d.file_name().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into())
    };
    let hf_dir = |p: &Path| {
        if p.is_dir() {
            Some(p.to_path_buf())
        } else if p.file_name().is_some_and(|f| f == "config.json") {
            p.parent().map(Path::to_path_buf)
        } else {
            None
        }
    };
    if source.weights == Weights::Dummy {
        return match source.config.as_ref().or(source.path.as_ref()) {
            Some(c) if c.is_dir() => format!("dummy-{}", dir_name(c)),
            Some(c) => format!("dummy-{}", dir_name(c.parent().unwrap_or(Path::new(".")))),
            None => "dummy".into(),
        };
    }
    let Some(path) = &source.path else {
        return "model".into();
    };
    if let Some(dir) = hf_dir(path) {
        return dir_name(&dir);
    }
    let smollm2 = Gguf::open(path).ok().is_some_and(|g| {
        g.get_str("general.name")
            .is_ok_and(|n| n.to_ascii_lowercase().starts_with("smollm2 135m"))
    });
    if smollm2 {
        return "SmolLM2-135M-Instruct".into();
    }
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// Runs the router until SIGTERM or ctrl-c.
pub async fn run(args: RouterArgs) -> Result<(), RouterError> {
    let statics = args.static_workers()?;
    if statics.is_empty() && args.workers_service.is_none() {
        return Err(RouterError::NoWorkers);
    }
    let ModelInfo {
        source,
        block_size,
        name,
        max_model_len,
    } = args.model()?;
    let (tokenizer, name) = tokio::task::spawn_blocking(move || {
        serve::load_tokenizer(&source).map(|t| (t, name.unwrap_or_else(|| served_name_of(&source))))
    })
    .await
    .map_err(|e| RouterError::Serve(std::io::Error::other(e.to_string())))??;
    tracing::info!(model = %name, max_model_len, "serving as");
    let metrics = Arc::new(metrics::RouterMetrics::new()?);
    let client = fleet::http_client();
    let fleet = fleet::Fleet::new(
        client.clone(),
        metrics.clone(),
        Duration::from_millis(args.scrape_interval_ms.max(10)),
        Duration::from_millis(args.replica_down_after_ms),
    );
    if statics.is_empty() {
        let kube = kube::Client::try_default().await?;
        let service = args.workers_service.clone().unwrap_or_default();
        tracing::info!(namespace = %args.namespace, %service, "following the workers' EndpointSlices");
        tokio::spawn(fleet::watch_endpoint_slices(
            fleet.clone(),
            kube,
            args.namespace.clone(),
            service,
        ));
    } else {
        fleet.sync(statics);
    }
    {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            loop {
                fleet.observe();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
    let hold = hold::Hold::new(
        hold::HoldLimits {
            max_requests: usize::try_from(args.hold_max_requests).unwrap_or(usize::MAX),
            timeout: Duration::from_secs(args.hold_timeout_seconds),
        },
        metrics.clone(),
    );
    let max_token_bytes = tokenizer.max_token_bytes();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let state = Arc::new(proxy::State {
        fleet,
        hold,
        model: proxy::ServedModel { name, max_model_len },
        client,
        tokenizer: Arc::new(tokenizer),
        block_size,
        metrics,
        bodies: body::BodyLimits::new(
            args.max_request_bytes,
            Duration::from_secs(args.body_timeout_seconds),
            args.body_budget_bytes,
        ),
        timeouts: proxy::UpstreamTimeouts {
            first_byte: Duration::from_secs(args.upstream_first_byte_timeout_seconds),
            response: Duration::from_secs(args.upstream_response_timeout_seconds),
            chunk: Duration::from_secs(args.upstream_chunk_timeout_seconds),
        },
        tokenizing: Arc::new(tokio::sync::Semaphore::new(cores)),
        max_token_bytes,
        turn: Default::default(),
        weights: score::Weights {
            prefix: args.prefix_weight,
            load: args.load_weight,
            imbalance_requests: args.imbalance_requests as usize,
            imbalance_ratio: args.imbalance_ratio,
        },
    });
    let bind_error = |source| RouterError::Bind {
        addr: args.listen,
        source,
    };
    let listener = crate::serving::bind(args.listen).map_err(bind_error)?;
    listener.set_nonblocking(true).map_err(bind_error)?;
    // Idle connections are closed and their number held under the file limit, so that probes
    // always get in (crate::serving::connections); headers must come within the header read
    // timeout. Streams pass through a token at a time: without TCP_NODELAY, Nagle's algorithm
    // holds a small SSE chunk until the client's delayed ACK (tens of milliseconds).
    let connections = crate::serving::connections::Connections::new(crate::serving::connection_policy(
        crate::serving::FIRST_REQUEST_TIMEOUT,
    ));
    let policy = connections.policy();
    tracing::info!(
        listen = %args.listen,
        max_connections = policy.max_connections,
        first_request_s = policy.first_request.as_secs(),
        idle_s = policy.idle.as_secs(),
        max_request_bytes = args.max_request_bytes,
        body_budget_bytes = args.body_budget_bytes,
        "router serving"
    );
    let mut server = axum_server::from_tcp(listener)
        .map_err(RouterError::Serve)?
        .acceptor(connections.acceptor(axum_server::accept::NoDelayAcceptor::new()));
    crate::serving::limit_connection_time(
        &mut server,
        crate::serving::HEADER_READ_TIMEOUT,
        crate::serving::HTTP2_KEEP_ALIVE,
    );
    let handle = axum_server::Handle::new();
    {
        let handle = handle.clone();
        tokio::spawn(async move {
            crate::serving::shutdown_signal().await;
            handle.graceful_shutdown(Some(Duration::from_secs(10)));
        });
    }
    server
        .handle(handle)
        .serve(proxy::app(state).into_make_service())
        .await
        .map_err(RouterError::Serve)
}

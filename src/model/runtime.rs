//! The generation loop: one thread owns the model and its KV cache and steps every active
//! sequence together (continuous batching: new requests join between steps, finished or
//! cancelled ones leave), with chunked prefill under a token budget per step.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, Opts, Registry};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::forward::{CpuForward, Forward};
use super::gguf::{Gguf, GgufError};
use super::gpu::{GpuCapacity, GpuError, GpuLlama, GpuOptions};
use super::hf::{self, HfError};
use super::kv::{ContiguousKv, KvAttention, SeqId};
use super::llama::{Llama, LoadError, SeqChunk};
use super::sampling::{Sampler, SamplingParams, StopMatcher};
use super::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

/// Errors of starting the runtime or submitting to it.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("invalid runtime config: {0}")]
    Config(String),
    #[error("cannot register model metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("the prompt has {prompt} tokens; the model's context is {ctx} (shorten the prompt)")]
    PromptTooLong { prompt: usize, ctx: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the generation loop has stopped; restart the worker")]
    Stopped,
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// Where the forward pass runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Placement {
    Cpu,
    Cuda(GpuOptions),
}

/// Limits of the generation loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Sequences stepped together at most.
    pub max_num_seqs: usize,
    /// Tokens (prefill chunks plus decodes) per step at most.
    pub max_batched_tokens: usize,
    /// Tokens the KV cache holds over all sequences; a request reserves prompt + max_tokens.
    pub kv_capacity_tokens: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            max_num_seqs: 256,
            max_batched_tokens: 1024,
            kv_capacity_tokens: 131072,
        }
    }
}

/// Why a generation ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the loop reports to a request.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// New text (always complete UTF-8, never part of a stop string).
    Text(String),
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(String),
}

struct Submit {
    prompt: Vec<u32>,
    params: SamplingParams,
    events: UnboundedSender<GenEvent>,
    arrived: Instant,
}

/// Prometheus metrics of generation.
#[derive(Clone)]
pub struct ModelMetrics {
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub generation_tokens: IntCounter,
    pub prompt_tokens: IntCounter,
    pub output_tokens_per_second: Gauge,
    pub running: IntGauge,
    pub waiting: IntGauge,
}

impl ModelMetrics {
    /// Creates the metrics and registers them into `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let lat = vec![
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ];
        let m = ModelMetrics {
            ttft: Histogram::with_opts(
                HistogramOpts::new(
                    "kvfleet_model_time_to_first_token_seconds",
                    "Time from a request's arrival to its first output token.",
                )
                .buckets(lat.clone()),
            )?,
            tpot: Histogram::with_opts(
                HistogramOpts::new(
                    "kvfleet_model_time_per_output_token_seconds",
                    "Time between consecutive output tokens of a request.",
                )
                .buckets(lat),
            )?,
            generation_tokens: IntCounter::new(
                "kvfleet_model_generation_tokens_total",
                "Output tokens generated.",
            )?,
            prompt_tokens: IntCounter::new("kvfleet_model_prompt_tokens_total", "Prompt tokens prefilled.")?,
            output_tokens_per_second: Gauge::with_opts(Opts::new(
                "kvfleet_model_output_tokens_per_second",
                "Output tokens per second of the last decode step (all sequences).",
            ))?,
            running: IntGauge::new("kvfleet_model_requests_running", "Requests in the running batch.")?,
            waiting: IntGauge::new(
                "kvfleet_model_requests_waiting",
                "Requests waiting for KV space or a batch slot.",
            )?,
        };
        registry.register(Box::new(m.ttft.clone()))?;
        registry.register(Box::new(m.tpot.clone()))?;
        registry.register(Box::new(m.generation_tokens.clone()))?;
        registry.register(Box::new(m.prompt_tokens.clone()))?;
        registry.register(Box::new(m.output_tokens_per_second.clone()))?;
        registry.register(Box::new(m.running.clone()))?;
        registry.register(Box::new(m.waiting.clone()))?;
        Ok(m)
    }
}

/// A handle to the generation loop; cheap to share between HTTP handlers.
pub struct ModelRuntime {
    pub name: String,
    pub tokenizer: Arc<Tokenizer>,
    pub context_len: usize,
    /// Where the forward pass runs (`cpu`, `cuda`).
    pub device: &'static str,
    /// Tokens the KV cache holds over all sequences (the admission limit).
    pub kv_capacity_tokens: usize,
    /// The GPU's memory split and KV capacity when the model runs on CUDA.
    pub gpu_capacity: Option<GpuCapacity>,
    submit: mpsc::Sender<Submit>,
}

impl std::fmt::Debug for ModelRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRuntime").field("name", &self.name).finish()
    }
}

impl ModelRuntime {
    /// Loads a GGUF model and starts its loop on the CPU with a contiguous KV cache.
    pub fn load_gguf(
        path: &Path,
        name: Option<&str>,
        cfg: RuntimeConfig,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        Self::load_gguf_on(path, name, cfg, &Placement::Cpu, registry)
    }

    /// Loads a GGUF model onto `placement`: the CPU (contiguous KV cache) or a GPU.
    pub fn load_gguf_on(
        path: &Path,
        name: Option<&str>,
        cfg: RuntimeConfig,
        placement: &Placement,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        let g = Gguf::open(path)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let model = Llama::from_gguf(&g)?;
        let name = match name {
            Some(n) => n.to_string(),
            None => default_name(&g, path),
        };
        Self::start_on(model, tokenizer, name, cfg, placement, registry)
    }

    /// Loads a Hugging Face checkpoint directory (`config.json`, safetensors, `tokenizer.json`)
    /// and starts its loop on the CPU. The default name is the directory's.
    pub fn load_hf(
        dir: &Path,
        name: Option<&str>,
        cfg: RuntimeConfig,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        Self::load_hf_on(dir, name, cfg, &Placement::Cpu, registry)
    }

    /// [`ModelRuntime::load_hf`] onto `placement`.
    pub fn load_hf_on(
        dir: &Path,
        name: Option<&str>,
        cfg: RuntimeConfig,
        placement: &Placement,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        let tokenizer = hf::load_tokenizer(dir)?;
        let model = hf::load_model(dir)?;
        let name = name.map(str::to_string).unwrap_or_else(|| dir_name(dir));
        Self::start_on(model, tokenizer, name, cfg, placement, registry)
    }

    /// Random weights of the geometry in `config` (a `config.json` or a checkpoint
    /// directory), for capacity and throughput runs; see [`hf::load_dummy`].
    pub fn load_dummy(
        config: &Path,
        name: Option<&str>,
        cfg: RuntimeConfig,
        placement: &Placement,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        let (model, tokenizer) = hf::load_dummy(config, 0)?;
        let name = name.map(str::to_string).unwrap_or_else(|| {
            let dir = if config.is_dir() {
                config
            } else {
                config.parent().unwrap_or(config)
            };
            format!("dummy-{}", dir_name(dir))
        });
        Self::start_on(model, tokenizer, name, cfg, placement, registry)
    }

    /// Starts a loaded model's loop on `placement`.
    pub fn start_on(
        model: Llama,
        tokenizer: Tokenizer,
        name: String,
        cfg: RuntimeConfig,
        placement: &Placement,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        match placement {
            Placement::Cpu => {
                let kv = ContiguousKv::new(model.config.attn_geometry(), cfg.kv_capacity_tokens);
                Self::start(Arc::new(model), Box::new(kv), tokenizer, name, cfg, registry)
            }
            Placement::Cuda(opts) => Self::start_gpu(model, tokenizer, name, cfg, opts, registry),
        }
    }

    /// Uploads `model` to the GPU and starts the loop there. The KV cache takes the GPU
    /// memory left (see [`GpuOptions`]); `cfg.kv_capacity_tokens` is replaced by what it holds.
    pub fn start_gpu(
        model: Llama,
        tokenizer: Tokenizer,
        name: String,
        mut cfg: RuntimeConfig,
        opts: &GpuOptions,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        let gpu = GpuLlama::open_gpu(opts.ordinal)?;
        let m = GpuLlama::from_llama(gpu, &model, opts)?;
        drop(model);
        let cap = m.capacity().clone();
        cfg.kv_capacity_tokens = cap.admission_tokens(cfg.max_num_seqs);
        let mut rt = Self::start_forward(Box::new(m), tokenizer, name, cfg, registry)?;
        rt.gpu_capacity = Some(cap);
        Ok(rt)
    }

    /// Starts the loop for a CPU model, a KV backend and a tokenizer.
    pub fn start(
        model: Arc<Llama>,
        kv: Box<dyn KvAttention>,
        tokenizer: Tokenizer,
        name: String,
        cfg: RuntimeConfig,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        Self::start_forward(
            Box::new(CpuForward::new(model, kv)),
            tokenizer,
            name,
            cfg,
            registry,
        )
    }

    /// Starts the loop for any [`Forward`] (CPU or GPU) and a tokenizer.
    pub fn start_forward(
        model: Box<dyn Forward>,
        tokenizer: Tokenizer,
        name: String,
        cfg: RuntimeConfig,
        registry: &Registry,
    ) -> Result<Self, RuntimeError> {
        if cfg.max_num_seqs == 0 || cfg.max_batched_tokens == 0 || cfg.kv_capacity_tokens == 0 {
            return Err(RuntimeError::Config(format!(
                "every limit must be positive: {cfg:?}"
            )));
        }
        let metrics = ModelMetrics::new(registry)?;
        let tokenizer = Arc::new(tokenizer);
        let (tx, rx) = mpsc::channel();
        let context_len = model.config().context_len;
        let device = model.device();
        let kv_capacity_tokens = cfg.kv_capacity_tokens;
        let tok = tokenizer.clone();
        std::thread::Builder::new()
            .name("kvfleet-model".into())
            .spawn(move || Loop::new(model, tok, cfg, metrics).run(rx))
            .map_err(|e| RuntimeError::Config(format!("cannot start the model thread: {e}")))?;
        Ok(ModelRuntime {
            name,
            tokenizer,
            context_len,
            device,
            kv_capacity_tokens,
            gpu_capacity: None,
            submit: tx,
        })
    }

    /// Queues a generation; events arrive on the returned receiver. Dropping the receiver
    /// cancels the request at the next step.
    pub fn generate(
        &self,
        prompt: Vec<u32>,
        mut params: SamplingParams,
    ) -> Result<UnboundedReceiver<GenEvent>, RuntimeError> {
        if prompt.is_empty() {
            return Err(RuntimeError::EmptyPrompt);
        }
        if prompt.len() >= self.context_len {
            return Err(RuntimeError::PromptTooLong {
                prompt: prompt.len(),
                ctx: self.context_len,
            });
        }
        params.max_tokens = params.max_tokens.min(self.context_len - prompt.len());
        let (tx, rx) = unbounded_channel();
        self.submit
            .send(Submit {
                prompt,
                params,
                events: tx,
                arrived: Instant::now(),
            })
            .map_err(|_| RuntimeError::Stopped)?;
        Ok(rx)
    }
}

fn dir_name(dir: &Path) -> String {
    std::fs::canonicalize(dir)
        .ok()
        .and_then(|d| d.file_name().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}

fn default_name(g: &Gguf, path: &Path) -> String {
    if let Ok(n) = g.get_str("general.name") {
        if n.to_ascii_lowercase().starts_with("smollm2 135m") {
            return "SmolLM2-135M-Instruct".into();
        }
    }
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

struct Active {
    id: SeqId,
    prompt: Vec<u32>,
    /// Prompt tokens already in the KV cache.
    prefilled: usize,
    output: Vec<u32>,
    sampler: Sampler,
    decoder: StreamDecoder,
    stops: StopMatcher,
    events: UnboundedSender<GenEvent>,
    arrived: Instant,
    last_token_at: Option<Instant>,
    reserved: usize,
}

struct Loop {
    model: Box<dyn Forward>,
    tok: Arc<Tokenizer>,
    cfg: RuntimeConfig,
    metrics: ModelMetrics,
    waiting: VecDeque<Submit>,
    active: Vec<Active>,
    reserved: usize,
    next_id: SeqId,
}

impl Loop {
    fn new(model: Box<dyn Forward>, tok: Arc<Tokenizer>, cfg: RuntimeConfig, metrics: ModelMetrics) -> Self {
        Loop {
            model,
            tok,
            cfg,
            metrics,
            waiting: VecDeque::new(),
            active: Vec::new(),
            reserved: 0,
            next_id: 1,
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Submit>) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(s) => self.waiting.push_back(s),
                    Err(_) => return,
                }
            }
            while let Ok(s) = rx.try_recv() {
                self.waiting.push_back(s);
            }
            self.admit();
            self.drop_cancelled();
            self.metrics.running.set(self.active.len() as i64);
            self.metrics.waiting.set(self.waiting.len() as i64);
            if !self.active.is_empty() {
                self.step();
            }
        }
    }

    fn admit(&mut self) {
        while self.active.len() < self.cfg.max_num_seqs {
            let Some(s) = self.waiting.front() else { break };
            if s.events.is_closed() {
                self.waiting.pop_front();
                continue;
            }
            let need = s.prompt.len() + s.params.max_tokens;
            if need > self.cfg.kv_capacity_tokens {
                let s = self.waiting.pop_front().expect("front exists");
                let _ = s.events.send(GenEvent::Error(format!(
                    "prompt plus max_tokens is {need} tokens, more than the KV cache's {}; lower max_tokens",
                    self.cfg.kv_capacity_tokens
                )));
                continue;
            }
            if self.reserved + need > self.cfg.kv_capacity_tokens {
                break;
            }
            let s = self.waiting.pop_front().expect("front exists");
            self.reserved += need;
            let id = self.next_id;
            self.next_id += 1;
            self.active.push(Active {
                id,
                sampler: Sampler::new(s.params.clone()),
                stops: StopMatcher::new(s.params.stop.clone()),
                prompt: s.prompt,
                prefilled: 0,
                output: Vec::new(),
                decoder: StreamDecoder::new(),
                events: s.events,
                arrived: s.arrived,
                last_token_at: None,
                reserved: need,
            });
        }
    }

    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].events.is_closed() {
                let a = self.active.swap_remove(i);
                self.retire(&a);
            } else {
                i += 1;
            }
        }
    }

    fn retire(&mut self, a: &Active) {
        self.model.release(a.id);
        self.reserved -= a.reserved;
    }

    fn step(&mut self) {
        // Decodes first (one token each), then prefill chunks within the token budget.
        let mut budget = self.cfg.max_batched_tokens;
        let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (active index, start, len)
        for (i, a) in self.active.iter().enumerate() {
            if a.prefilled == a.prompt.len() && budget > 0 {
                plan.push((i, a.prompt.len() + a.output.len() - 1, 1));
                budget -= 1;
            }
        }
        for (i, a) in self.active.iter().enumerate() {
            if a.prefilled < a.prompt.len() && budget > 0 {
                let n = (a.prompt.len() - a.prefilled).min(budget);
                plan.push((i, a.prefilled, n));
                budget -= n;
            }
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|&(i, start, len)| {
                let a = &self.active[i];
                let tokens = if a.prefilled < a.prompt.len() {
                    &a.prompt[start..start + len]
                } else {
                    &a.output[a.output.len() - 1..]
                };
                SeqChunk {
                    seq: a.id,
                    start_pos: start,
                    tokens,
                    want_logits: a.prefilled + len >= a.prompt.len(),
                }
            })
            .collect();
        let started = Instant::now();
        let result = self.model.forward(&chunks);
        drop(chunks);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                // A failed step fails the sequences in it; the loop keeps serving others.
                let msg = format!("generation failed: {e}");
                let mut idx: Vec<usize> = plan.iter().map(|p| p.0).collect();
                idx.sort_unstable_by(|a, b| b.cmp(a));
                for i in idx {
                    let a = self.active.swap_remove(i);
                    let _ = a.events.send(GenEvent::Error(msg.clone()));
                    self.retire(&a);
                }
                return;
            }
        };
        let vocab = self.model.config().vocab;
        let now = Instant::now();
        let mut row = 0;
        let mut finished = Vec::new();
        let mut decoded = 0usize;
        for &(i, _, len) in &plan {
            let a = &mut self.active[i];
            if a.prefilled < a.prompt.len() {
                a.prefilled += len;
                self.metrics.prompt_tokens.inc_by(len as u64);
                if a.prefilled < a.prompt.len() {
                    continue;
                }
            }
            let next = a.sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
            row += 1;
            decoded += 1;
            self.metrics.generation_tokens.inc();
            match a.last_token_at {
                None => self.metrics.ttft.observe((now - a.arrived).as_secs_f64()),
                Some(t) => self.metrics.tpot.observe((now - t).as_secs_f64()),
            }
            a.last_token_at = Some(now);
            let mut reason = None;
            let mut text = String::new();
            // Held-back text is flushed unless a stop string ended the generation.
            let mut flush = false;
            if self.tok.stop_tokens.contains(&next) {
                reason = Some(FinishReason::Stop);
                flush = true;
            } else {
                a.output.push(next);
                let piece = a.decoder.push(&self.tok, next);
                let (t, hit) = a.stops.push(&piece);
                text = t;
                if hit {
                    reason = Some(FinishReason::Stop);
                } else if a.output.len() >= a.sampler.params().max_tokens {
                    reason = Some(FinishReason::Length);
                    flush = true;
                }
            }
            if flush {
                let tail = a.decoder.finish();
                let (t, hit) = a.stops.push(&tail);
                text.push_str(&t);
                if !hit {
                    text.push_str(&a.stops.finish());
                }
            }
            if !text.is_empty() {
                let _ = a.events.send(GenEvent::Text(text));
            }
            if let Some(reason) = reason {
                let _ = a.events.send(GenEvent::Done {
                    reason,
                    prompt_tokens: a.prompt.len(),
                    completion_tokens: a.output.len(),
                });
                finished.push(i);
            }
        }
        self.model.recycle(logits);
        let secs = started.elapsed().as_secs_f64();
        if decoded > 0 && secs > 0.0 {
            self.metrics.output_tokens_per_second.set(decoded as f64 / secs);
        }
        finished.sort_unstable_by(|a, b| b.cmp(a));
        for i in finished {
            let a = self.active.swap_remove(i);
            self.retire(&a);
        }
    }
}

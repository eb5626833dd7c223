//! The serving loop: one thread owns the served model (a [`Forward`]: its weights and the
//! engine's KV pools) and the engine's [`Scheduler`], which decides every step: continuous
//! batching under `maxNumSeqs`, chunked prefill mixed with decodes under
//! `maxNumBatchedTokens`, FCFS admission, and preemption by recompute when KV pages run out.
//! The loop feeds the scheduled tokens through the model, samples the requests whose chunk
//! reached their last known token, streams text back and keeps the worker's metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::metrics::Metrics;
use kvfleet_cuda::gpu::{GpuCapacity, GpuError};
use kvfleet_cuda::profile::{self, Shape, Table};
use kvfleet_engine::engine::prefix::{CacheKey, KvEvent};
use kvfleet_engine::engine::scheduler::{
    Counters, Event, RequestId, Scheduler, SchedulerConfig, SubmitError,
};
use kvfleet_engine::engine::speculative::{Backoff, SpecConfig};
use kvfleet_engine::engine::StepPlan;
use kvfleet_engine::model::forward::{Forward, Picked};
use kvfleet_engine::model::gguf::GgufError;
use kvfleet_engine::model::hf::HfError;
use kvfleet_engine::model::llama::{LoadError, SeqChunk};
use kvfleet_engine::model::proposer::{Ngram, Proposer};
use kvfleet_engine::model::sampling::{
    token_logprobs, RowPick, RowSample, Sampler, SamplingParams, StopMatcher, TokenLogprobs,
};
use kvfleet_engine::model::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

mod output;
mod scoring;
mod speculative;
mod warm_up;
use output::{flush, push_token};
use speculative::{Rows, Spec};
use warm_up::{largest_request, WARM_UP_TOKENS};
pub use warm_up::{run_greedy, warm_up};

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
    #[error("the prompt has {prompt} tokens; maxModelLen is {max_model_len} (shorten the prompt)")]
    PromptTooLong { prompt: usize, max_model_len: usize },
    #[error("the prompt has {prompt} tokens but the KV cache holds at most {capacity} tokens for one request; shorten the prompt")]
    PromptOverCapacity { prompt: usize, capacity: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the worker already holds {queued} requests, as many as it runs and queues at once (maxNumSeqs + maxWaiting = {limit}); retry later")]
    QueueFull { queued: usize, limit: usize },
    #[error("the worker is shutting down; retry on another replica")]
    ShuttingDown,
    #[error("the generation loop has stopped; restart the worker")]
    Stopped,
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("the warm-up generation failed on the {device}, so it cannot serve this model: {reason}")]
    WarmUp { device: &'static str, reason: String },
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
    /// New text of one sampled token (always complete UTF-8, never part of a stop string;
    /// empty while bytes are held back).
    Text(String),
    /// The log-probabilities of the token whose `Text` comes next (requests with `logprobs`).
    Logprobs(TokenLogprobs),
    /// Every prompt token's log-probability after the first, before any generated token
    /// (requests with `prompt_logprobs`).
    PromptLogprobs(Vec<TokenLogprobs>),
    Done {
        reason: FinishReason,
        /// Text held back until the end (a stop string's prefix that never completed, the
        /// bytes of a character the last token left split): no token of its own, so it goes
        /// with the finish, as vLLM's last delta does; usually empty.
        text: String,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens whose KV came from the prefix cache.
        cached_tokens: usize,
    },
    Error(String),
    /// The worker is shutting down: the request was refused, never ran, or was cut by the end
    /// of the drain. Retryable on another replica (503 with Retry-After).
    Unavailable(String),
}

enum Command {
    Submit {
        prompt: Vec<u32>,
        /// Boxed: the sampling settings (logit bias, stop lists) dwarf the other commands.
        params: Box<SamplingParams>,
        key: CacheKey,
        events: UnboundedSender<GenEvent>,
        arrived: Instant,
        deadline: Option<Instant>,
    },
    /// Stop taking requests, finish what runs until `drain` elapses, fail the rest, exit.
    Shutdown { drain: Duration },
}

/// What the served model's KV pools hold, as allocated.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSummary {
    pub block_size: usize,
    pub total_blocks: usize,
    pub kv_cache_dtype: &'static str,
    /// Tokens of prompt + output one request may hold at most (maxModelLen or the pool).
    pub max_request_tokens: usize,
    /// What the pools admit for maxModelLen requests, window-aware and under a full-layer
    /// budget (`/v1/capacity`, `kvfleet_kv_cache_*max_concurrency`).
    pub admission: kvfleet_engine::engine::capacity::Admission,
}

/// A handle to the serving loop; cheap to share between HTTP handlers.
pub struct ModelRuntime {
    pub name: String,
    pub tokenizer: Arc<Tokenizer>,
    /// Prompt + output tokens of one request at most (the engine's maxModelLen).
    pub max_model_len: usize,
    /// Token ids the model knows.
    pub vocab_size: usize,
    /// Bytes of text one token covers at most ([`Tokenizer::max_token_bytes`]).
    pub max_token_bytes: usize,
    /// Where the forward pass runs (`cpu`, `cuda`).
    pub device: &'static str,
    /// Whether the model scores prompts (`prompt_logprobs`: completions' `echo` + `logprobs`).
    pub scores_prompts: bool,
    pub pool: PoolSummary,
    /// The GPU's memory split when the model runs on CUDA.
    pub gpu_capacity: Option<GpuCapacity>,
    pub metrics: Arc<Metrics>,
    /// Requests the worker holds at most: maxNumSeqs running and maxWaiting that cannot run now.
    max_admitted: usize,
    /// Submitted and not yet ended (running, or waiting to run), for 429.
    admitted: Arc<AtomicUsize>,
    submit: std::sync::Mutex<Option<mpsc::Sender<Command>>>,
    done: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

impl std::fmt::Debug for ModelRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRuntime").field("name", &self.name).finish()
    }
}

impl ModelRuntime {
    /// Starts the loop for a model on its device with the engine's scheduler over the
    /// model's KV pools.
    pub fn start(
        model: Box<dyn Forward>,
        tokenizer: Tokenizer,
        name: String,
        sched: SchedulerConfig,
        metrics: Arc<Metrics>,
    ) -> Result<Self, RuntimeError> {
        Self::start_with(model, tokenizer, name, sched, metrics, RuntimeHooks::default())
    }

    /// [`ModelRuntime::start`] with optional parts (KV events).
    pub fn start_with(
        mut model: Box<dyn Forward>,
        tokenizer: Tokenizer,
        name: String,
        sched: SchedulerConfig,
        metrics: Arc<Metrics>,
        hooks: RuntimeHooks,
    ) -> Result<Self, RuntimeError> {
        sched.check().map_err(RuntimeError::Config)?;
        let mut proposer: Option<Box<dyn Proposer>> = None;
        if let Some(spec) = &hooks.speculative {
            spec.check().map_err(RuntimeError::Config)?;
            proposer = Some(if spec.method.needs_drafter() {
                model.take_proposer().ok_or_else(|| {
                    RuntimeError::Config(format!(
                        "speculative method {}: no drafter is attached to the model (serve::attach_drafter)",
                        spec.method.as_str()
                    ))
                })?
            } else {
                Box::new(Ngram::new(spec))
            });
            metrics
                .set_speculative(spec.num_speculative_tokens)
                .map_err(|e| RuntimeError::Config(format!("speculative-decoding metrics: {e}")))?;
        }
        let ctx = model.config().context_len;
        if sched.max_model_len > ctx {
            return Err(RuntimeError::Config(format!(
                "maxModelLen {} exceeds the model's context length {ctx}; lower maxModelLen",
                sched.max_model_len
            )));
        }
        let kv = model.kv_config().clone();
        if kv.block_size != sched.block_size {
            return Err(RuntimeError::Config(format!(
                "the KV pools use blocks of {} tokens, the scheduler {}",
                kv.block_size, sched.block_size
            )));
        }
        // The bound on requests held is kept here, at submission (`generate`), where a refusal
        // is still a 429: at most maxNumSeqs + maxWaiting, so the scheduler's own queue (which
        // also holds preempted requests) gets that much room and never refuses inside the loop.
        let mut scheduler = Scheduler::new(
            SchedulerConfig {
                max_waiting: sched.max_waiting.saturating_add(sched.max_num_seqs),
                ..sched.clone()
            },
            &kv.groups,
        );
        scheduler.record_kv_events(hooks.kv_events.is_some());
        let max_request_tokens = largest_request(&scheduler);
        if max_request_tokens < 2 {
            return Err(RuntimeError::Config(format!(
                "the KV pools ({} blocks of {} tokens) cannot hold one request",
                kv.groups.iter().map(|g| g.num_blocks).sum::<usize>(),
                kv.block_size
            )));
        }
        let mut model = model;
        if model.device() == "cuda" && max_request_tokens > WARM_UP_TOKENS {
            let t0 = Instant::now();
            let steps = warm_up(model.as_mut(), &sched).map_err(|reason| RuntimeError::WarmUp {
                device: "cuda",
                reason,
            })?;
            tracing::info!(
                steps,
                ms = t0.elapsed().as_millis() as u64,
                "warmed up: the device's kernels ran once before the first request"
            );
        }
        let pool = PoolSummary {
            block_size: kv.block_size,
            total_blocks: scheduler.kv().total_blocks(),
            kv_cache_dtype: kv.layers.first().map_or("bfloat16", |l| l.dtype.as_str()),
            max_request_tokens,
            admission: kvfleet_engine::engine::capacity::admitted(
                &kv,
                sched.max_model_len,
                sched.max_num_batched_tokens,
            ),
        };
        metrics.max_concurrency.set(pool.admission.max_concurrency);
        metrics
            .full_layer_max_concurrency
            .set(pool.admission.full_layer_max_concurrency);
        metrics.set_cache_config(pool.block_size, pool.total_blocks, pool.kv_cache_dtype);
        metrics.set_served(&name, sched.max_model_len);
        // The empty pool, published before the first request can arrive (the loop thread
        // publishes from its first iteration on).
        metrics.blocks.with_label_values(&["used"]).set(0);
        metrics
            .blocks
            .with_label_values(&["free"])
            .set(pool.total_blocks as i64);
        let max_token_bytes = tokenizer.max_token_bytes();
        let tokenizer = Arc::new(tokenizer);
        let (tx, rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let device = model.device();
        let scores_prompts = model.can_score_prompts();
        let vocab_size = model.config().vocab;
        let admitted = Arc::new(AtomicUsize::new(0));
        let lp = Loop {
            model,
            tok: tokenizer.clone(),
            sched: scheduler,
            metrics: metrics.clone(),
            live: HashMap::new(),
            next_id: 1,
            admitted: admitted.clone(),
            last: Counters::default(),
            profile: profile::enabled().then(|| Table::new("serving loop (host)", HOST_PARTS)),
            kv_events: hooks.kv_events,
            spec: hooks.speculative.zip(proposer).map(|(config, proposer)| Spec {
                proposer,
                stats: super::metrics::SpecStats {
                    method: config.method.as_str(),
                    num_speculative_tokens: config.num_speculative_tokens,
                    accepted_per_position: vec![0; config.num_speculative_tokens],
                    ..Default::default()
                },
                config,
            }),
        };
        std::thread::Builder::new()
            .name("kvfleet-engine".into())
            .spawn(move || {
                lp.run(rx);
                let _ = done_tx.send(());
            })
            .map_err(|e| RuntimeError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(ModelRuntime {
            name,
            tokenizer,
            max_model_len: sched.max_model_len,
            vocab_size,
            max_token_bytes,
            device,
            scores_prompts,
            pool,
            gpu_capacity: None,
            metrics,
            max_admitted: sched.max_num_seqs.saturating_add(sched.max_waiting),
            admitted,
            submit: std::sync::Mutex::new(Some(tx)),
            done: std::sync::Mutex::new(Some(done_rx)),
        })
    }

    /// Queues a generation; events arrive on the returned receiver. Dropping the receiver
    /// cancels the request at the next step (its KV pages are freed then).
    pub fn generate(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<UnboundedReceiver<GenEvent>, RuntimeError> {
        self.generate_with(prompt, params, CacheKey::default(), None)
    }

    /// [`ModelRuntime::generate`] in the prefix-cache partition `key` (a request shares cached
    /// blocks only with requests of an equal key: vLLM's `cache_salt`). A receiver dropped at
    /// or past `deadline` (the request timeout) counts as timed out, not as a client that left.
    pub fn generate_with(
        &self,
        prompt: Vec<u32>,
        mut params: SamplingParams,
        key: CacheKey,
        deadline: Option<Instant>,
    ) -> Result<UnboundedReceiver<GenEvent>, RuntimeError> {
        if prompt.is_empty() {
            return Err(RuntimeError::EmptyPrompt);
        }
        if prompt.len() >= self.max_model_len {
            return Err(RuntimeError::PromptTooLong {
                prompt: prompt.len(),
                max_model_len: self.max_model_len,
            });
        }
        if prompt.len() >= self.pool.max_request_tokens {
            return Err(RuntimeError::PromptOverCapacity {
                prompt: prompt.len(),
                capacity: self.pool.max_request_tokens - 1,
            });
        }
        // 0 only scores the prompt (`echo` with `logprobs`); checked by the caller.
        let least = usize::from(params.prompt_logprobs.is_none() || params.max_tokens > 0);
        params.max_tokens = params
            .max_tokens
            .min(self.pool.max_request_tokens - prompt.len())
            .max(least);
        let (tx, rx) = unbounded_channel();
        let submit = self.submit.lock().map_err(|_| RuntimeError::Stopped)?;
        let Some(submit) = submit.as_ref() else {
            return Err(RuntimeError::ShuttingDown);
        };
        // A request is counted from submission to its end, so the bound holds however far the
        // loop is behind: a burst of up to maxNumSeqs + maxWaiting is never refused (the first
        // maxNumSeqs run as soon as the loop takes them), and the waiting ones never exceed
        // maxWaiting while maxNumSeqs run. Checked and counted in one step, so that concurrent
        // submissions never overshoot.
        self.admitted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.max_admitted).then_some(n + 1)
            })
            .map_err(|queued| RuntimeError::QueueFull {
                queued,
                limit: self.max_admitted,
            })?;
        submit
            .send(Command::Submit {
                prompt,
                params: Box::new(params),
                key,
                events: tx,
                arrived: Instant::now(),
                deadline,
            })
            .map_err(|_| {
                self.admitted.fetch_sub(1, Ordering::SeqCst);
                RuntimeError::Stopped
            })?;
        Ok(rx)
    }

    /// Stops taking requests, lets running ones finish for up to `drain`, ends the rest with
    /// an error event, and waits for the loop to exit (blocking: call from
    /// `spawn_blocking`). Later calls return at once.
    pub fn shutdown(&self, drain: Duration) {
        let tx = self.submit.lock().ok().and_then(|mut s| s.take());
        if let Some(tx) = tx {
            let _ = tx.send(Command::Shutdown { drain });
        }
        let rx = self.done.lock().ok().and_then(|mut d| d.take());
        if let Some(rx) = rx {
            let _ = rx.recv_timeout(drain + Duration::from_secs(30));
        }
    }
}

struct Live {
    /// Prompt then output tokens (a preempted request recomputes from them).
    tokens: Vec<u32>,
    prompt_len: usize,
    sampler: Sampler,
    decoder: StreamDecoder,
    stops: StopMatcher,
    events: UnboundedSender<GenEvent>,
    arrived: Instant,
    /// When the request was first scheduled, and when its first token came (vLLM's queue,
    /// prefill and decode phases).
    started_at: Option<Instant>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    started: bool,
    /// Prompt tokens the prefix cache held when the request started.
    cached: usize,
    /// Set once the end was reported to the client.
    ended: Option<FinishReason>,
    /// Ended by the shutdown (never started, or cut when the drain ran out): retryable.
    cut_by_shutdown: bool,
    /// When the request timeout ends it ([`ModelRuntime::generate_with`]).
    deadline: Option<Instant>,
    /// This step's proposed tokens (speculative decoding), and the request's back-off.
    draft: Vec<u32>,
    backoff: Backoff,
}

impl Live {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

struct Loop {
    model: Box<dyn Forward>,
    tok: Arc<Tokenizer>,
    sched: Scheduler,
    metrics: Arc<Metrics>,
    live: HashMap<RequestId, Live>,
    next_id: RequestId,
    /// [`ModelRuntime`]'s count of requests held: the loop ends them.
    admitted: Arc<AtomicUsize>,
    last: Counters,
    /// Host time per step part, when `KVFLEET_PROFILE=1`.
    profile: Option<Table>,
    /// Where prefix-cache changes go (KV events), when someone subscribes.
    kv_events: Option<KvEventSink>,
    /// Speculative decoding, when configured.
    spec: Option<Spec>,
}

/// Receives each batch of prefix-cache changes (on the serving thread: queue, never block).
pub type KvEventSink = Box<dyn FnMut(Vec<KvEvent>) + Send>;

/// Optional parts of a runtime.
#[derive(Default)]
pub struct RuntimeHooks {
    /// Publishes prefix-cache changes (`--kv-events-endpoint`).
    pub kv_events: Option<KvEventSink>,
    /// Speculative decoding (`--speculative-config`), checked by [`SpecConfig::check`].
    pub speculative: Option<SpecConfig>,
}

/// The serving loop's parts a profile times: commands and cancellations, scheduling, the
/// forward pass (wall time, the device's included), sampling and streaming, metrics.
const HOST_PARTS: &[&str] = &["intake", "schedule", "forward", "sample", "publish"];

impl Loop {
    fn run(mut self, rx: mpsc::Receiver<Command>) {
        let mut plan = StepPlan::default();
        let mut events = Vec::new();
        let mut drain_until: Option<Instant> = None;
        self.publish();
        let mut intake_from = Instant::now();
        loop {
            // Commands: block while idle, poll while busy.
            loop {
                let cmd = if self.sched.is_idle() && drain_until.is_none() {
                    match rx.recv_timeout(Duration::from_millis(500)) {
                        Ok(c) => c,
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => {
                            drain_until.get_or_insert_with(Instant::now);
                            break;
                        }
                    }
                } else {
                    match rx.try_recv() {
                        Ok(c) => c,
                        Err(_) => break,
                    }
                };
                match cmd {
                    Command::Submit {
                        prompt,
                        params,
                        key,
                        events: tx,
                        arrived,
                        deadline,
                    } => {
                        if drain_until.is_some() {
                            self.admitted.fetch_sub(1, Ordering::SeqCst);
                            let _ = tx.send(GenEvent::Unavailable(RuntimeError::ShuttingDown.to_string()));
                            continue;
                        }
                        self.submit(prompt, *params, key, tx, arrived, deadline);
                    }
                    Command::Shutdown { drain } => {
                        drain_until = Some(Instant::now() + drain);
                        tracing::info!(
                            running = self.sched.num_running(),
                            waiting = self.sched.num_waiting(),
                            ?drain,
                            "draining"
                        );
                        // The drain is for requests that run: those that never started fail at
                        // once, retryable, instead of at the drain's end.
                        let queued: Vec<RequestId> = self
                            .live
                            .iter_mut()
                            .filter(|(_, l)| !l.started)
                            .map(|(id, l)| {
                                l.cut_by_shutdown = true;
                                *id
                            })
                            .collect();
                        for id in queued {
                            self.sched.abort(
                                id,
                                "the worker is shutting down and this request had not started; retry it on another replica",
                                &mut events,
                            );
                        }
                        self.handle(&mut events, None, &[]);
                    }
                }
            }
            self.drop_cancelled(&mut events);
            if let Some(deadline) = drain_until {
                if self.sched.is_idle() || Instant::now() >= deadline {
                    for l in self.live.values_mut() {
                        l.cut_by_shutdown = true;
                    }
                    self.sched.abort_all(
                        "the worker is shutting down and the drain time ran out; retry the request",
                        &mut events,
                    );
                    self.handle(&mut events, None, &[]);
                    self.publish();
                    if let Some(p) = self.profile.as_mut() {
                        p.report();
                    }
                    return;
                }
            }
            if self.sched.is_idle() {
                self.publish();
                intake_from = Instant::now();
                continue;
            }
            let intake = intake_from.elapsed();
            let shape = self.step(&mut plan, &mut events);
            let published = Instant::now();
            self.publish();
            if let (Some(p), Some((shape, tokens, mut ms))) = (self.profile.as_mut(), shape) {
                ms[0] = intake.as_secs_f64() * 1e3;
                ms[4] = published.elapsed().as_secs_f64() * 1e3;
                p.add(shape, tokens, &ms);
                p.maybe_report();
            }
            intake_from = Instant::now();
        }
    }

    fn submit(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        key: CacheKey,
        tx: UnboundedSender<GenEvent>,
        arrived: Instant,
        deadline: Option<Instant>,
    ) {
        if let Some(top) = params.prompt_logprobs {
            if !self.score_prompt(&prompt, top, params.max_tokens, &tx) {
                return;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        if let Err(e) = self.sched.submit_tokens(id, &prompt, params.max_tokens, key) {
            self.admitted.fetch_sub(1, Ordering::SeqCst);
            let msg = match e {
                SubmitError::QueueFull { .. } => RuntimeError::QueueFull {
                    queued: self.sched.num_waiting(),
                    limit: self.sched.config().max_waiting,
                }
                .to_string(),
                other => other.to_string(),
            };
            let _ = tx.send(GenEvent::Error(msg));
            return;
        }
        self.live.insert(
            id,
            Live {
                prompt_len: prompt.len(),
                sampler: Sampler::for_request(
                    params.clone(),
                    &prompt,
                    if params.ignore_eos {
                        &[]
                    } else {
                        &self.tok.stop_tokens
                    },
                ),
                tokens: prompt,
                stops: StopMatcher::new(params.stop.clone())
                    .including_stop(params.include_stop_str_in_output),
                decoder: StreamDecoder::new(),
                events: tx,
                arrived,
                started_at: None,
                first_token_at: None,
                last_token_at: None,
                started: false,
                cached: 0,
                ended: None,
                cut_by_shutdown: false,
                deadline,
                draft: Vec::new(),
                backoff: Backoff::default(),
            },
        );
    }

    /// Requests whose client went away leave the scheduler (their pages free at once): timed
    /// out when their receiver was dropped at their deadline (the handler's 504), else cancelled.
    fn drop_cancelled(&mut self, events: &mut Vec<Event>) {
        let now = Instant::now();
        let gone: Vec<(RequestId, bool)> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, l)| (*id, l.deadline.is_some_and(|d| now >= d)))
            .collect();
        for (id, timed_out) in gone {
            if timed_out {
                self.sched.time_out(id, events);
            } else {
                self.sched.cancel(id, events);
            }
        }
        self.handle(events, None, &[]);
    }

    /// One step; returns its shape, tokens and host times (ms of schedule, forward, sample in
    /// `HOST_PARTS` order) when a forward pass ran.
    fn step(&mut self, plan: &mut StepPlan, events: &mut Vec<Event>) -> Option<(Shape, usize, [f64; 5])> {
        let scheduling = Instant::now();
        let scheduled_tokens = self.schedule(plan, events);
        if scheduled_tokens == 0 {
            // Nothing fits this step (every request preempted or waiting): apply and retry.
            self.sched.complete(events);
            self.handle(events, None, &[]);
            return None;
        }
        let scheduled = scheduling.elapsed();
        let chunks: Vec<_> = self.sched.scheduled().collect();
        let drafted = self.draft_ahead(&chunks);
        // vLLM's queue time ends when the request is first scheduled, before its prefill runs;
        // the `Started` event comes only after this step, with the step's time in it.
        for c in &chunks {
            if let Some(l) = self.live.get_mut(&c.id) {
                l.started_at.get_or_insert(scheduling);
            }
        }
        // Each sampled row takes its request's next key before the step: the device draws with
        // it (one u64 of the request's stream a token, on either device), after the row's
        // adjustments (penalties, bias, min_tokens) from the request's token counts. A request
        // verifying proposals takes a row for each, its proposed tokens appended to its tokens
        // for the step (taken off again after it).
        let mut rows: Vec<Rows> = Vec::new();
        let mut picks: Vec<RowSample> = Vec::new();
        for c in chunks.iter().filter(|c| c.samples) {
            rows.push(Rows {
                id: c.id,
                first: picks.len(),
                drafts: c.drafts,
                emit: 1,
            });
            match self.live.get_mut(&c.id) {
                Some(l) if c.drafts > 0 => {
                    l.draft.truncate(c.drafts);
                    picks.extend(l.sampler.verify_rows(&l.draft));
                    l.tokens.extend_from_slice(&l.draft);
                }
                Some(l) => picks.push(l.sampler.next_row()),
                None => picks.extend((0..=c.drafts).map(|_| RowSample::from(RowPick::Greedy))),
            }
        }
        let started = Instant::now();
        let result = {
            let mut batch = Vec::with_capacity(chunks.len());
            let mut bad = None;
            for c in &chunks {
                match self.live.get(&c.id) {
                    Some(l) if c.start + c.len <= l.tokens.len() => batch.push(SeqChunk {
                        seq: c.id,
                        start_pos: c.start,
                        tokens: &l.tokens[c.start..c.start + c.len],
                        logits: if c.samples { 1 + c.drafts } else { 0 },
                    }),
                    _ => bad = Some(c.id),
                }
            }
            match (bad, drafted) {
                (_, Err(e)) => Err(e),
                (Some(id), _) => Err(format!("request {id} was scheduled without its tokens")),
                (None, Ok(())) => self
                    .model
                    .forward_samples(&batch, plan, &picks)
                    .map_err(|e| e.to_string()),
            }
        };
        let elapsed = started.elapsed();
        let sampling = Instant::now();
        self.verify(&mut rows, result.as_deref().ok());
        if let Ok(out) = &result {
            self.catch_up(&chunks, &rows, out);
        }
        self.sched.complete(events);
        let tokens: usize = chunks.iter().map(|c| c.len).sum();
        let shape = Shape::new(tokens, picks.len());
        match result {
            Ok(out) => {
                if let Some(t) = self.model.last_attention_time() {
                    self.metrics.attention_seconds.observe(t.as_secs_f64());
                }
                for &n in self.model.last_expert_tokens().unwrap_or_default() {
                    self.metrics.moe_expert_tokens.observe(n as f64);
                }
                self.metrics.step_seconds.observe(elapsed.as_secs_f64());
                self.metrics.vllm_iteration_tokens.observe(tokens as f64);
                let now = Instant::now();
                self.handle(events, Some((&out, now)), &rows);
                let ms = |d: Duration| d.as_secs_f64() * 1e3;
                Some((
                    shape,
                    tokens,
                    [0.0, ms(scheduled), ms(elapsed), ms(sampling.elapsed()), 0.0],
                ))
            }
            Err(e) => {
                // A failed step fails the requests in it; the loop keeps serving others.
                tracing::error!(error = %e, "step failed");
                events.retain(|e| !matches!(e, Event::Token { .. }));
                for c in &chunks {
                    if let Some(l) = self.live.get_mut(&c.id) {
                        let _ = l.events.send(GenEvent::Error(format!("generation failed: {e}")));
                        l.ended = Some(FinishReason::Stop);
                    }
                    self.sched.cancel(c.id, events);
                }
                self.handle(events, None, &[]);
                None
            }
        }
    }

    /// Applies scheduler events: takes the token the step picked for every request it yielded
    /// one for (token `i` of the step's output belongs to `rows[i]`), streams text, ends
    /// requests.
    fn handle(&mut self, events: &mut Vec<Event>, out: Option<(&[Picked], Instant)>, rows: &[Rows]) {
        let row_of: HashMap<RequestId, Rows> = rows.iter().map(|r| (r.id, *r)).collect();
        let mut stopped = Vec::new();
        loop {
            for e in events.drain(..) {
                match e {
                    Event::Started { id, cached } => {
                        if let Some(l) = self.live.get_mut(&id) {
                            if !l.started {
                                l.started = true;
                                l.started_at.get_or_insert_with(Instant::now);
                                l.cached = cached;
                            }
                        }
                    }
                    Event::Token { id, .. } => {
                        let (Some((out, now)), Some(r)) = (out, row_of.get(&id).copied()) else {
                            continue;
                        };
                        let Some(l) = self.live.get_mut(&id) else { continue };
                        let Some(picked) = out.get(r.first..r.first + r.emit) else {
                            tracing::error!(id, row = r.first, "the step returned no token for a row");
                            continue;
                        };
                        // The step's tokens for this request: the next one, or the accepted
                        // proposals and the one after them. vLLM observes one inter-token gap a
                        // request a step, however many tokens the step gave it.
                        for picked in picked {
                            if l.ended.is_some() {
                                break;
                            }
                            let next = picked.token;
                            let logprobs = match (l.sampler.params().logprobs, &picked.logits) {
                                (Some(top), Some(row)) => Some(token_logprobs(row, next, top)),
                                _ => None,
                            };
                            self.metrics.vllm_generation_tokens.inc();
                            match l.last_token_at {
                                None => {
                                    self.metrics.vllm_ttft.observe((now - l.arrived).as_secs_f64());
                                    self.metrics.vllm_prompt_tokens.inc_by(l.prompt_len as u64);
                                    self.metrics.vllm_prompt_tokens_cached.inc_by(l.cached as u64);
                                    l.first_token_at = Some(now);
                                }
                                Some(t) if t != now => {
                                    self.metrics.observe_inter_token((now - t).as_secs_f64())
                                }
                                Some(_) => {}
                            }
                            l.last_token_at = Some(now);
                            let pushed = l.tokens.len();
                            if let Some(reason) = push_token(&self.tok, l, next, logprobs, &self.metrics) {
                                l.ended = Some(reason);
                                stopped.push(id);
                            } else if l.tokens.len() > pushed {
                                // Its blocks become cacheable once computed.
                                self.sched.append_token(id, next);
                            }
                        }
                    }
                    Event::Preempted { id } => {
                        tracing::debug!(id, "preempted: recomputes when pages free");
                    }
                    Event::Finished { id } => {
                        self.forget_draft(id);
                        if let Some(mut l) = self.live.remove(&id) {
                            self.admitted.fetch_sub(1, Ordering::SeqCst);
                            if l.ended.is_none() {
                                // The scheduler's output budget (max_tokens) ran out.
                                flush(&mut l, FinishReason::Length, &self.metrics);
                            }
                        }
                    }
                    Event::Failed { id, reason } => {
                        self.forget_draft(id);
                        if let Some(l) = self.live.remove(&id) {
                            self.admitted.fetch_sub(1, Ordering::SeqCst);
                            if l.ended.is_none() {
                                // Cancelled (the client left), timed out, failed or cut at shutdown.
                                self.metrics.observe_aborted();
                                let _ = l.events.send(if l.cut_by_shutdown {
                                    GenEvent::Unavailable(reason)
                                } else {
                                    GenEvent::Error(reason)
                                });
                            }
                        }
                    }
                }
            }
            // Requests that hit a stop token or string leave the scheduler now.
            if stopped.is_empty() {
                break;
            }
            for id in stopped.drain(..) {
                self.sched.finish(id, events);
            }
        }
    }

    fn publish(&mut self) {
        let kv = self.sched.kv();
        let m = &self.metrics;
        let max_len = self.sched.config().max_model_len;
        let free_tokens = kv
            .free_tokens(self.sched.config().max_num_batched_tokens)
            .map_or(max_len, |t| t.min(max_len));
        let (used, total, cached) = (kv.used_blocks(), kv.total_blocks(), kv.cached_blocks());
        let prefix_caching = kv.caching();
        let usage = kv.usage();
        let (demand_tokens, capacity_tokens, kv_free) = m.set_kv_demand(&self.sched.kv_demand());
        m.blocks.with_label_values(&["used"]).set(used as i64);
        m.blocks.with_label_values(&["free"]).set((total - used) as i64);
        m.blocks.with_label_values(&["cached"]).set(cached as i64);
        m.usage_ratio.set(usage);
        m.vllm_usage.set(usage);
        let (running, waiting) = (self.sched.num_running(), self.sched.num_waiting());
        m.requests.with_label_values(&["running"]).set(running as i64);
        m.requests.with_label_values(&["waiting"]).set(waiting as i64);
        m.vllm_running.set(running as i64);
        m.vllm_waiting.set(waiting as i64);
        let c = self.sched.counters();
        m.preemptions.inc_by(c.preemptions - self.last.preemptions);
        m.vllm_preemptions.inc_by(c.preemptions - self.last.preemptions);
        m.finished.inc_by(c.finished - self.last.finished);
        m.failed.inc_by(c.failed - self.last.failed);
        m.cancelled.inc_by(c.cancelled - self.last.cancelled);
        m.timed_out.inc_by(c.timed_out - self.last.timed_out);
        m.tokens.inc_by(c.tokens - self.last.tokens);
        m.vllm_prefix_queries
            .inc_by(c.prefix_queries - self.last.prefix_queries);
        m.vllm_prefix_hits.inc_by(c.prefix_hits - self.last.prefix_hits);
        self.last = c;
        if let Some(sink) = self.kv_events.as_mut() {
            let events = self.sched.take_kv_events();
            if !events.is_empty() {
                sink(events);
            }
        }
        m.set_live(super::metrics::LiveStats {
            used_blocks: used,
            free_tokens,
            kv_demand_tokens: demand_tokens,
            kv_capacity_tokens: capacity_tokens,
            kv_free_tokens: kv_free,
            free_blocks: total - used,
            cached_blocks: cached,
            prefix_caching,
            prefix_cache_queries: c.prefix_queries,
            prefix_cache_hits: c.prefix_hits,
            prefix_cache_hit_rate: if c.prefix_queries == 0 {
                0.0
            } else {
                c.prefix_hits as f64 / c.prefix_queries as f64
            },
            usage_ratio: usage,
            running,
            waiting,
            preemptions: c.preemptions,
            finished: c.finished,
            failed: c.failed,
            steps: c.steps,
            tokens: c.tokens,
            speculative: self.spec.as_ref().map(|s| super::metrics::SpecStats {
                acceptance_rate: if s.stats.draft_tokens == 0 {
                    0.0
                } else {
                    s.stats.accepted_tokens as f64 / s.stats.draft_tokens as f64
                },
                ..s.stats.clone()
            }),
        });
    }
}

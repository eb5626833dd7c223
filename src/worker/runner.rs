//! The engine loop on its own thread: takes loads, schedules steps, runs the backend with
//! synthetic Q/K/V and reports progress and metrics.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::{mpsc::UnboundedSender, oneshot};

use super::engine::backend::{run_step, Backend, StepBuffers};
use super::engine::layout::StepPlan;
use super::engine::scheduler::{Event, RequestId, Scheduler, SubmitError};
use super::metrics::Metrics;

/// One request of a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadRequest {
    pub prompt: usize,
    pub output: usize,
}

/// Why a load was refused (nothing of it was queued).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("request {index}: {error}")]
    Invalid { index: usize, error: SubmitError },
    #[error("the queue holds {waiting} requests and this load adds {adding} (limit {limit}); retry later")]
    QueueFull {
        waiting: usize,
        adding: usize,
        limit: usize,
    },
    #[error("the worker is shutting down")]
    ShuttingDown,
}

/// Progress of one request, streamed to the client as one JSON line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "lowercase")]
pub enum Progress {
    Started { id: RequestId },
    Token { id: RequestId, generated: usize },
    Preempted { id: RequestId },
    Finished { id: RequestId },
    Failed { id: RequestId, reason: String },
}

impl Progress {
    pub fn is_end(&self) -> bool {
        matches!(self, Progress::Finished { .. } | Progress::Failed { .. })
    }
}

/// Commands to the engine thread.
pub enum Command {
    Load {
        requests: Vec<LoadRequest>,
        progress: Option<UnboundedSender<Progress>>,
        reply: oneshot::Sender<Result<Vec<RequestId>, LoadError>>,
    },
    /// Stop taking loads, finish what runs until `drain` elapses, fail the rest, exit.
    Shutdown { drain: Duration },
}

/// Live numbers for `/v1/capacity`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LiveStats {
    pub used_blocks: usize,
    pub free_blocks: usize,
    pub usage_ratio: f64,
    pub running: usize,
    pub waiting: usize,
    pub preemptions: u64,
    pub finished: u64,
    pub failed: u64,
    pub steps: u64,
    pub tokens: u64,
}

/// Runs until shutdown. Returns an error message when the backend failed.
pub fn run<B: Backend>(
    mut backend: B,
    mut sched: Scheduler,
    rx: Receiver<Command>,
    metrics: Arc<Metrics>,
    live: Arc<Mutex<LiveStats>>,
    seed: u64,
) -> Result<(), String> {
    let cfg = backend.config().clone();
    let max_tokens = sched.config().max_num_batched_tokens;
    let qo = cfg
        .layers
        .iter()
        .map(|l| l.attn.q_heads * l.attn.head_dim)
        .max()
        .unwrap_or(0);
    let kv = cfg
        .layers
        .iter()
        .map(|l| l.attn.kv_heads * l.attn.head_dim)
        .max()
        .unwrap_or(0);
    // Synthetic activations, drawn once: the engine's cost does not depend on the values.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rand_buf = |n: usize| -> Result<B::Buf, String> {
        let host: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut buf = backend.alloc(n).map_err(|e| e.to_string())?;
        backend.upload(&host, &mut buf).map_err(|e| e.to_string())?;
        Ok(buf)
    };
    let q = rand_buf(max_tokens * qo)?;
    let k = rand_buf(max_tokens * kv)?;
    let v = rand_buf(max_tokens * kv)?;
    let out = backend.alloc(max_tokens * qo).map_err(|e| e.to_string())?;
    let mut bufs = StepBuffers { q, k, v, out };

    let mut plan = StepPlan::default();
    let mut events = Vec::new();
    let mut listeners: HashMap<RequestId, UnboundedSender<Progress>> = HashMap::new();
    let mut next_id: RequestId = 1;
    let mut drain_until: Option<Instant> = None;
    let mut last_preemptions = 0u64;
    let mut last = sched.counters();
    publish(&sched, &metrics, &live, &mut last_preemptions, &mut last);
    loop {
        // Commands: block while idle, poll while busy.
        loop {
            let cmd = if sched.is_idle() && drain_until.is_none() {
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
                Command::Load {
                    requests,
                    progress,
                    reply,
                } => {
                    let result = if drain_until.is_some() {
                        Err(LoadError::ShuttingDown)
                    } else {
                        admit(&mut sched, &requests, &mut next_id)
                    };
                    if let (Ok(ids), Some(tx)) = (&result, &progress) {
                        for id in ids {
                            listeners.insert(*id, tx.clone());
                        }
                    }
                    let _ = reply.send(result);
                }
                Command::Shutdown { drain } => {
                    drain_until = Some(Instant::now() + drain);
                    tracing::info!(
                        running = sched.num_running(),
                        waiting = sched.num_waiting(),
                        ?drain,
                        "draining"
                    );
                }
            }
        }
        if let Some(deadline) = drain_until {
            if sched.is_idle() || Instant::now() >= deadline {
                sched.abort_all("the worker is shutting down", &mut events);
                route(&mut events, &mut listeners);
                publish(&sched, &metrics, &live, &mut last_preemptions, &mut last);
                return Ok(());
            }
        }
        if sched.is_idle() {
            continue;
        }
        let n = sched.schedule(&mut plan, &mut events);
        if n > 0 {
            let t0 = Instant::now();
            if let Err(e) = run_step(&mut backend, &plan, &mut bufs) {
                let reason = format!("attention backend failed: {e}");
                sched.abort_all(&reason, &mut events);
                route(&mut events, &mut listeners);
                publish(&sched, &metrics, &live, &mut last_preemptions, &mut last);
                return Err(reason);
            }
            metrics.attention_seconds.observe(t0.elapsed().as_secs_f64());
        }
        sched.complete(&mut events);
        route(&mut events, &mut listeners);
        publish(&sched, &metrics, &live, &mut last_preemptions, &mut last);
    }
}

fn admit(
    sched: &mut Scheduler,
    requests: &[LoadRequest],
    next_id: &mut RequestId,
) -> Result<Vec<RequestId>, LoadError> {
    for (index, r) in requests.iter().enumerate() {
        sched
            .check(r.prompt, r.output)
            .map_err(|error| LoadError::Invalid { index, error })?;
    }
    let limit = sched.config().max_waiting;
    if sched.num_waiting() + requests.len() > limit {
        return Err(LoadError::QueueFull {
            waiting: sched.num_waiting(),
            adding: requests.len(),
            limit,
        });
    }
    let mut ids = Vec::with_capacity(requests.len());
    for (index, r) in requests.iter().enumerate() {
        let id = *next_id;
        *next_id += 1;
        // Checked above; an error here would be a duplicate id, which fresh ids exclude.
        sched
            .submit(id, r.prompt, r.output)
            .map_err(|error| LoadError::Invalid { index, error })?;
        ids.push(id);
    }
    Ok(ids)
}

fn route(events: &mut Vec<Event>, listeners: &mut HashMap<RequestId, UnboundedSender<Progress>>) {
    for e in events.drain(..) {
        let p = match e {
            Event::Started { id } => Progress::Started { id },
            Event::Token { id, generated } => Progress::Token { id, generated },
            Event::Preempted { id } => Progress::Preempted { id },
            Event::Finished { id } => Progress::Finished { id },
            Event::Failed { id, reason } => Progress::Failed { id, reason },
        };
        let id = match &p {
            Progress::Started { id }
            | Progress::Token { id, .. }
            | Progress::Preempted { id }
            | Progress::Finished { id }
            | Progress::Failed { id, .. } => *id,
        };
        let end = p.is_end();
        if let Some(tx) = listeners.get(&id) {
            // A gone client does not stop its requests: they run to the end.
            let _ = tx.send(p);
        }
        if end {
            listeners.remove(&id);
        }
    }
}

fn publish(
    sched: &Scheduler,
    m: &Metrics,
    live: &Mutex<LiveStats>,
    last_preemptions: &mut u64,
    last: &mut super::engine::scheduler::Counters,
) {
    let kv = sched.kv();
    let used = kv.used_blocks();
    let free = kv.total_blocks() - used;
    let usage = kv.usage();
    m.blocks.with_label_values(&["used"]).set(used as i64);
    m.blocks.with_label_values(&["free"]).set(free as i64);
    m.usage_ratio.set(usage);
    m.vllm_usage.set(usage);
    m.requests
        .with_label_values(&["running"])
        .set(sched.num_running() as i64);
    m.requests
        .with_label_values(&["waiting"])
        .set(sched.num_waiting() as i64);
    m.vllm_running.set(sched.num_running() as i64);
    m.vllm_waiting.set(sched.num_waiting() as i64);
    let c = sched.counters();
    m.preemptions.inc_by(c.preemptions - *last_preemptions);
    *last_preemptions = c.preemptions;
    m.finished.inc_by(c.finished - last.finished);
    m.failed.inc_by(c.failed - last.failed);
    m.tokens.inc_by(c.tokens - last.tokens);
    *last = c;
    if let Ok(mut l) = live.lock() {
        *l = LiveStats {
            used_blocks: used,
            free_blocks: free,
            usage_ratio: usage,
            running: sched.num_running(),
            waiting: sched.num_waiting(),
            preemptions: c.preemptions,
            finished: c.finished,
            failed: c.failed,
            steps: c.steps,
            tokens: c.tokens,
        };
    }
}

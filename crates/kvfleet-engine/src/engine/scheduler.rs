//! Continuous batching: FCFS admission under `max_num_seqs` and a token budget of
//! `max_num_batched_tokens` per step, chunked prefill mixed with decodes in one step,
//! preemption by recompute when pages run out (the newest running request goes back to
//! the head of the queue and recomputes its prompt and generated tokens later), and the
//! host-side [`StepPlan`] of each step.
//!
//! A request with prompt `P` and output `O` tokens holds at most `P + O - 1` positions:
//! the step that computes the last known token also yields the next one, and the last
//! output token is never fed back.

use std::collections::VecDeque;

use super::block::{BlockError, BlockTable, KvManager};
use super::layout::{GroupSpec, StepPlan};
use super::prefix::{CacheKey, KvEvent, TokenBlocks};

/// Request id chosen by the caller.
pub type RequestId = u64;

/// Engine limits (the InferenceDeployment's `engine` section).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// Requests queued beyond this are refused (back-pressure instead of unbounded memory).
    pub max_waiting: usize,
    /// Automatic prefix caching: a request starts from the longest prefix of full blocks an
    /// earlier request computed (vLLM's `--enable-prefix-caching`, on by default there too).
    pub prefix_caching: bool,
}

impl SchedulerConfig {
    /// Limits the scheduler can make progress under.
    pub fn check(&self) -> Result<(), String> {
        if self.block_size == 0 || self.max_num_seqs == 0 || self.max_model_len == 0 {
            return Err("blockSize, maxNumSeqs and maxModelLen must be at least 1".into());
        }
        if self.max_num_batched_tokens < self.block_size.max(self.max_num_seqs) {
            return Err(format!(
                "maxNumBatchedTokens {} must be at least blockSize {} and maxNumSeqs {} (prefill chunks are whole blocks; every sequence decodes each step)",
                self.max_num_batched_tokens, self.block_size, self.max_num_seqs
            ));
        }
        Ok(())
    }
}

/// Why a request was refused at submission.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("promptTokens and outputTokens must be at least 1")]
    ZeroLength,
    #[error("promptTokens + outputTokens = {total} exceeds maxModelLen {max_model_len}; shorten the request or raise maxModelLen")]
    TooLong { total: usize, max_model_len: usize },
    #[error("the request needs {need} KV pages in one group but the pool has {have}; it can never run here")]
    NeverFits { need: usize, have: usize },
    #[error("{waiting} requests are already waiting (limit {limit}); retry later")]
    QueueFull { waiting: usize, limit: usize },
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
}

/// What happened to a request during a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Left the queue and got its first pages; `cached` prompt tokens came from the prefix
    /// cache (OpenAI's `usage.prompt_tokens_details.cached_tokens`).
    Started { id: RequestId, cached: usize },
    /// Produced output token number `generated` (1-based) after computing `computed` positions.
    Token { id: RequestId, generated: usize },
    /// Lost its pages; it will recompute from the head of the queue.
    Preempted { id: RequestId },
    /// All output tokens produced.
    Finished { id: RequestId },
    /// Will not finish (shutdown, cancel, or a block-accounting error).
    Failed { id: RequestId, reason: String },
}

/// Tokens to compute this step: all `want` when they fit the budget (a prompt's last chunk
/// or a decode), else a whole number of blocks, so that every chunk but the last starts on
/// a block boundary and a sliding group needs at most `cdiv(window - 1, block) +
/// cdiv(chunk, block)` pages (the bound `plan::kvfleet` sizes pools with).
fn chunk_len(want: usize, budget: usize, block_size: usize) -> usize {
    if want <= budget {
        want
    } else {
        budget / block_size * block_size
    }
}

#[derive(Clone, Debug)]
struct Request {
    id: RequestId,
    prompt: usize,
    output: usize,
    /// Positions whose K/V are in the cache.
    computed: usize,
    generated: usize,
    /// Tokens scheduled in the current step.
    scheduled: usize,
    /// Of those, proposed tokens to verify (speculative decoding): the step computes the last
    /// known token and these after it, and yields logits for each.
    drafts: usize,
    /// Proposed tokens the caller accepted after the step ([`Scheduler::accept_drafts`]).
    accepted: usize,
    tables: Vec<BlockTable>,
    preemptions: u32,
    started: bool,
    /// Token ids and block addresses (absent: the caller gave lengths only; no caching).
    blocks: Option<TokenBlocks>,
    /// Leading blocks already offered to the prefix cache.
    registered: usize,
}

impl Request {
    fn known(&self) -> usize {
        self.prompt + self.generated
    }
}

/// One request's share of a step, as [`Scheduler::scheduled`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub id: RequestId,
    /// First position computed this step.
    pub start: usize,
    /// Positions computed this step.
    pub len: usize,
    /// Whether this chunk ends at the request's last known token, so the step yields the
    /// request's next token (its logits are needed).
    pub samples: bool,
    /// Proposed tokens at the chunk's end, after its last known token (speculative decoding):
    /// the step yields `1 + drafts` rows of logits for the chunk, the last known token's and
    /// one a proposed token. The caller accepts a prefix of them with
    /// [`Scheduler::accept_drafts`] before [`Scheduler::complete`].
    pub drafts: usize,
}

/// Counters since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Prompt tokens looked up in the prefix cache at admission (vLLM's
    /// `prefix_cache_queries`) and those found (`prefix_cache_hits`).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    pub finished: u64,
    pub failed: u64,
    /// Requests dropped because their client went away ([`Scheduler::cancel`]): no failure of
    /// the server, so not in `failed`.
    pub cancelled: u64,
    /// Requests stopped at the server's request timeout ([`Scheduler::time_out`]): neither the
    /// client's choice nor a failed step, so in neither `cancelled` nor `failed`.
    pub timed_out: u64,
    pub steps: u64,
    pub tokens: u64,
}

/// Continuous-batching scheduler over a [`KvManager`].
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvManager,
    running: Vec<Request>,
    waiting: VecDeque<Request>,
    counters: Counters,
    stepping: bool,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, groups: &[GroupSpec]) -> Self {
        let mut kv = KvManager::new(cfg.block_size, groups);
        kv.set_caching(cfg.prefix_caching);
        Self {
            cfg,
            kv,
            running: Vec::new(),
            waiting: VecDeque::new(),
            counters: Counters::default(),
            stepping: false,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Records prefix-cache changes for [`Scheduler::take_kv_events`] (KV events).
    pub fn record_kv_events(&mut self, on: bool) {
        self.kv.record_events(on);
    }

    /// Prefix-cache changes since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.kv.take_events()
    }

    /// Forgets every cached block (`AllCleared`); blocks in use stay.
    pub fn reset_prefix_cache(&mut self) {
        self.kv.clear_cache();
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// KV the running and waiting requests need to finish (prompt plus output budget each),
    /// with the pool's capacity and room, in tokens of maxModelLen requests
    /// ([`super::demand`]).
    pub fn kv_demand(&self) -> super::demand::KvDemand {
        let lengths = self
            .running
            .iter()
            .chain(self.waiting.iter())
            .map(|r| r.prompt + r.output);
        self.kv
            .demand(lengths, self.cfg.max_model_len, self.cfg.max_num_batched_tokens)
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Checks a request against the limits without queueing it.
    pub fn check(&self, prompt: usize, output: usize) -> Result<(), SubmitError> {
        if prompt == 0 || output == 0 {
            return Err(SubmitError::ZeroLength);
        }
        let total = prompt + output;
        if total > self.cfg.max_model_len {
            return Err(SubmitError::TooLong {
                total,
                max_model_len: self.cfg.max_model_len,
            });
        }
        let held = total - 1;
        for g in &self.kv.groups {
            let need = self
                .kv
                .max_pages_per_request(g.window, held, self.cfg.max_num_batched_tokens);
            if need > g.pool.total() {
                return Err(SubmitError::NeverFits {
                    need,
                    have: g.pool.total(),
                });
            }
        }
        Ok(())
    }

    /// Queues a request of `prompt` tokens whose ids the caller keeps (FCFS); it computes its
    /// whole prompt (no prefix cache without token ids).
    pub fn submit(&mut self, id: RequestId, prompt: usize, output: usize) -> Result<(), SubmitError> {
        self.enqueue(id, prompt, output, None)
    }

    /// Queues a request with its prompt's token ids: it starts from the longest cached prefix
    /// when prefix caching is on, and its full blocks are cached for later requests with the
    /// same `key`. Feed it each generated token with [`Scheduler::append_token`].
    pub fn submit_tokens(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        output: usize,
        key: CacheKey,
    ) -> Result<(), SubmitError> {
        let blocks = self
            .cfg
            .prefix_caching
            .then(|| TokenBlocks::new(key, prompt, self.cfg.block_size));
        self.enqueue(id, prompt.len(), output, blocks)
    }

    /// The token request `id` generated (its blocks become cacheable once computed).
    pub fn append_token(&mut self, id: RequestId, token: u32) {
        let bs = self.cfg.block_size;
        if let Some(b) = self
            .running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|r| r.id == id)
            .and_then(|r| r.blocks.as_mut())
        {
            b.extend(&[token], bs);
        }
    }

    fn enqueue(
        &mut self,
        id: RequestId,
        prompt: usize,
        output: usize,
        blocks: Option<TokenBlocks>,
    ) -> Result<(), SubmitError> {
        self.check(prompt, output)?;
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(SubmitError::QueueFull {
                waiting: self.waiting.len(),
                limit: self.cfg.max_waiting,
            });
        }
        if self.running.iter().chain(&self.waiting).any(|r| r.id == id) {
            return Err(SubmitError::DuplicateId(id));
        }
        self.waiting.push_back(Request {
            id,
            prompt,
            output,
            computed: 0,
            generated: 0,
            scheduled: 0,
            drafts: 0,
            accepted: 0,
            tables: self.kv.new_tables(),
            preemptions: 0,
            started: false,
            blocks,
            registered: 0,
        });
        Ok(())
    }

    /// Fails every request (shutdown) and releases their pages.
    pub fn abort_all(&mut self, reason: &str, events: &mut Vec<Event>) {
        let all: Vec<Request> = self.running.drain(..).chain(self.waiting.drain(..)).collect();
        for mut r in all {
            let _ = self.kv.free_all(&mut r.tables);
            self.counters.failed += 1;
            events.push(Event::Failed {
                id: r.id,
                reason: reason.to_string(),
            });
        }
        self.stepping = false;
    }

    /// Drops a request (client gone); `false` when unknown or already done.
    pub fn cancel(&mut self, id: RequestId, events: &mut Vec<Event>) -> bool {
        self.drop_request(id, "cancelled", events, |c| &mut c.cancelled)
    }

    /// Drops a request that ran past the server's request timeout (counted in `timed_out`);
    /// `false` when unknown or already done.
    pub fn time_out(&mut self, id: RequestId, events: &mut Vec<Event>) -> bool {
        self.drop_request(id, "timed out", events, |c| &mut c.timed_out)
    }

    /// Fails one request for `reason` (counted in `failed`, as [`Scheduler::abort_all`] counts
    /// each); `false` when unknown or its tokens are in flight.
    pub fn abort(&mut self, id: RequestId, reason: &str, events: &mut Vec<Event>) -> bool {
        self.drop_request(id, reason, events, |c| &mut c.failed)
    }

    /// Removes request `id`, frees its pages and counts it in `counter`; `false` when unknown
    /// or its tokens are in flight.
    fn drop_request(
        &mut self,
        id: RequestId,
        reason: &str,
        events: &mut Vec<Event>,
        counter: fn(&mut Counters) -> &mut u64,
    ) -> bool {
        let Some(mut r) = self.take(id) else {
            return false;
        };
        let _ = self.kv.free_all(&mut r.tables);
        *counter(&mut self.counters) += 1;
        events.push(Event::Failed {
            id,
            reason: reason.to_string(),
        });
        true
    }

    /// Removes request `id` from the queue, or from the running set unless its tokens are in
    /// flight (a step between `schedule` and `complete`).
    fn take(&mut self, id: RequestId) -> Option<Request> {
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            return if self.stepping {
                None
            } else {
                Some(self.running.remove(i))
            };
        }
        let i = self.waiting.iter().position(|r| r.id == id)?;
        self.waiting.remove(i)
    }

    fn preempt(&mut self, mut r: Request, events: &mut Vec<Event>) {
        if let Err(e) = self.kv.free_all(&mut r.tables) {
            self.fail(r, e, events);
            return;
        }
        r.computed = 0;
        r.scheduled = 0;
        r.drafts = 0;
        r.registered = 0;
        r.preemptions += 1;
        self.counters.preemptions += 1;
        events.push(Event::Preempted { id: r.id });
        self.waiting.push_front(r);
    }

    fn fail(&mut self, mut r: Request, e: BlockError, events: &mut Vec<Event>) {
        let _ = self.kv.free_all(&mut r.tables);
        self.counters.failed += 1;
        events.push(Event::Failed {
            id: r.id,
            reason: format!("internal KV accounting error: {e}"),
        });
    }

    /// Chooses this step's tokens, allocates their pages and writes the step's plan.
    /// Returns the number of tokens scheduled (0: nothing to run). Call
    /// [`Scheduler::complete`] after the backend ran the plan.
    pub fn schedule(&mut self, plan: &mut StepPlan, events: &mut Vec<Event>) -> usize {
        self.schedule_with(plan, events, &mut |_, _| 0)
    }

    /// [`Scheduler::schedule`] with speculative decoding: for every running request that
    /// decodes this step, `propose(id, most)` returns how many tokens (at most `most`) the
    /// caller proposes after the request's last known token; the step verifies them in the
    /// same forward pass as everything else ([`ScheduledChunk::drafts`]). Proposals take step
    /// budget and pages like any token, never more than the request's output budget, and at
    /// most `maxNumSeqs` logits rows a step in all (what the device's buffers are sized for):
    /// they are dropped before anyone is preempted for them.
    pub fn schedule_with(
        &mut self,
        plan: &mut StepPlan,
        events: &mut Vec<Event>,
        propose: &mut dyn FnMut(RequestId, usize) -> usize,
    ) -> usize {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted = false;
        // Logits rows beyond one a running request, taken by proposals.
        let mut draft_rows = 0;
        let mut i = 0;
        while i < self.running.len() {
            let (want, start) = {
                let r = &self.running[i];
                (r.known() - r.computed, r.computed)
            };
            let mut n = chunk_len(want, budget, self.cfg.block_size);
            self.running[i].scheduled = 0;
            self.running[i].drafts = 0;
            self.running[i].accepted = 0;
            if n == 0 {
                i += 1;
                continue;
            }
            let mut drafts = 0;
            if want == 1 {
                let r = &self.running[i];
                let most = (r.output - r.generated - 1).min(budget - 1).min(
                    self.cfg
                        .max_num_seqs
                        .saturating_sub(self.running.len() + draft_rows),
                );
                if most > 0 {
                    drafts = propose(r.id, most).min(most);
                    n += drafts;
                }
            }
            if let Err(e) = self.kv.free_out_of_window(&mut self.running[i].tables, start) {
                let r = self.running.remove(i);
                self.fail(r, e, events);
                continue;
            }
            let mut scheduled = true;
            while !self.kv.allocate(&mut self.running[i].tables, start + n) {
                if drafts > 0 {
                    // Proposals are the first to go when pages run short.
                    n -= drafts;
                    drafts = 0;
                    continue;
                }
                preempted = true;
                // Newest first; when only this request is left after `i`, it yields itself.
                let victim = self.running.len() - 1;
                let r = self.running.remove(victim);
                self.preempt(r, events);
                if victim == i {
                    scheduled = false;
                    break;
                }
            }
            if scheduled {
                self.running[i].scheduled = n;
                self.running[i].drafts = drafts;
                draft_rows += drafts;
                budget -= n;
                i += 1;
            }
        }
        // Admit from the queue head only when nothing was preempted this step (a preempted
        // request must not be overtaken) and the head fits: strict FCFS.
        while !preempted && budget > 0 && self.running.len() + draft_rows < self.cfg.max_num_seqs {
            let Some(front) = self.waiting.front_mut() else {
                break;
            };
            let bs = self.cfg.block_size;
            // The longest cached prefix, short of the last known token (its logits are needed).
            let hit = match &front.blocks {
                Some(b) => self.kv.cached_prefix(&b.hashes, (front.known() - 1) / bs),
                None => 0,
            };
            if hit > 0 {
                let hashes: &[_] = front.blocks.as_ref().map_or(&[], |b| &b.hashes[..hit]);
                if let Err(e) = self.kv.take_prefix(&mut front.tables, hashes) {
                    let Some(r) = self.waiting.pop_front() else { break };
                    self.fail(r, e, events);
                    continue;
                }
            }
            let start = hit * bs;
            let n = chunk_len(front.known() - start, budget, bs);
            if n == 0 || !self.kv.allocate(&mut front.tables, start + n) {
                // Give the prefix back: it stays cached, and is looked up again next step.
                let _ = self.kv.free_all(&mut front.tables);
                break;
            }
            let Some(mut r) = self.waiting.pop_front() else {
                break;
            };
            r.computed = start;
            r.registered = hit;
            r.scheduled = n;
            budget -= n;
            if r.blocks.is_some() {
                self.counters.prefix_queries += r.known() as u64;
                self.counters.prefix_hits += start as u64;
            }
            if !r.started {
                r.started = true;
                events.push(Event::Started {
                    id: r.id,
                    cached: start.min(r.prompt),
                });
            }
            self.running.push(r);
        }
        self.build_plan(plan);
        self.stepping = true;
        self.cfg.max_num_batched_tokens - budget
    }

    fn build_plan(&self, plan: &mut StepPlan) {
        let rows = self
            .running
            .iter()
            .filter(|r| r.scheduled > 0)
            .map(|r| (r.tables.as_slice(), r.computed, r.scheduled));
        write_plan(plan, self.cfg.block_size, self.kv.groups.len(), rows);
    }

    /// Writes a plan over layer group `group` alone for `rows` `(id, first position, tokens)` of
    /// running requests, on the pages they hold now: a drafter's plan (its layers are paged by
    /// the full-attention group, `BackendConfig::draft_group`). Every position must lie within
    /// the request's pages and its window of the group.
    pub fn write_group_plan(
        &self,
        plan: &mut StepPlan,
        group: usize,
        rows: &[(RequestId, usize, usize)],
    ) -> Result<(), String> {
        let bs = self.cfg.block_size;
        let mut tables = Vec::with_capacity(rows.len());
        for &(id, start, len) in rows {
            let r = self
                .running
                .iter()
                .find(|r| r.id == id)
                .ok_or_else(|| format!("request {id} is not running"))?;
            let t = r
                .tables
                .get(group..group + 1)
                .ok_or_else(|| format!("layer group {group} does not exist"))?;
            if len == 0 || start + len > t[0].blocks.len() * bs || start < t[0].freed * bs {
                return Err(format!(
                    "request {id}: positions {start}..{} are outside its pages of group {group} ({} held, {} freed)",
                    start + len,
                    t[0].blocks.len(),
                    t[0].freed
                ));
            }
            tables.push((t, start, len));
        }
        write_plan(plan, bs, 1, tables);
        Ok(())
    }

    /// How many of request `id`'s proposed tokens this step's verification accepted (a prefix
    /// of [`ScheduledChunk::drafts`]; the step then yields `accepted + 1` tokens for it). Call
    /// between [`Scheduler::schedule_with`] and [`Scheduler::complete`]; a request not named
    /// accepts none.
    pub fn accept_drafts(&mut self, id: RequestId, accepted: usize) {
        if let Some(r) = self.running.iter_mut().find(|r| r.id == id) {
            r.accepted = accepted.min(r.drafts);
        }
    }

    /// Applies the step the backend just ran: advances positions, emits tokens, finishes
    /// requests and frees their pages. A request that verified proposals keeps the KV of the
    /// accepted ones and gives back the pages that held only rejected ones; its `Token` event
    /// counts every token the step yielded for it.
    pub fn complete(&mut self, events: &mut Vec<Event>) {
        if !self.stepping {
            return;
        }
        self.stepping = false;
        self.counters.steps += 1;
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            if r.scheduled > 0 {
                let rejected = r.drafts - r.accepted;
                let yields = r.computed + r.scheduled - r.drafts == r.known();
                r.computed += r.scheduled - rejected;
                self.counters.tokens += r.scheduled as u64;
                r.scheduled = 0;
                if rejected > 0 {
                    // The rejected proposals' KV is garbage: their slots are written again by
                    // the next step; pages past the accepted positions go back now.
                    if let Err(e) = self.kv.truncate(&mut r.tables, r.computed) {
                        let r = self.running.remove(i);
                        self.fail(r, e, events);
                        continue;
                    }
                }
                if let Some(b) = &r.blocks {
                    let upto = r.computed / self.cfg.block_size;
                    self.kv
                        .register(&r.tables, &b.hashes, &b.tokens, upto, &mut r.registered);
                }
                if yields {
                    r.generated += 1 + r.accepted;
                    events.push(Event::Token {
                        id: r.id,
                        generated: r.generated,
                    });
                }
                r.drafts = 0;
                r.accepted = 0;
            }
            if r.generated >= r.output {
                let mut r = self.running.remove(i);
                match self.kv.free_all(&mut r.tables) {
                    Ok(()) => {
                        self.counters.finished += 1;
                        events.push(Event::Finished { id: r.id });
                    }
                    Err(e) => self.fail(r, e, events),
                }
                continue;
            }
            i += 1;
        }
    }

    /// The step's batch in plan order (`qo_indptr` order): `(id, first position, tokens)`.
    /// The last chunk of a request whose end reaches its known tokens yields its next token.
    pub fn scheduled(&self) -> impl Iterator<Item = ScheduledChunk> + '_ {
        self.running
            .iter()
            .filter(|r| r.scheduled > 0)
            .map(|r| ScheduledChunk {
                id: r.id,
                start: r.computed,
                len: r.scheduled,
                samples: r.computed + r.scheduled - r.drafts == r.known(),
                drafts: r.drafts,
            })
    }

    /// Ends a running or waiting request early (a stop token or stop string) and frees its
    /// pages; counted as finished. `false` when unknown or while a step is in flight.
    pub fn finish(&mut self, id: RequestId, events: &mut Vec<Event>) -> bool {
        if self.stepping {
            return false;
        }
        let Some(mut r) = self.take(id) else {
            return false;
        };
        match self.kv.free_all(&mut r.tables) {
            Ok(()) => {
                self.counters.finished += 1;
                events.push(Event::Finished { id });
            }
            Err(e) => self.fail(r, e, events),
        }
        true
    }

    /// Whether some running request is still in prefill (benchmarks warm up past it).
    pub fn schedule_peek_prefilling(&self) -> bool {
        self.running.iter().any(|r| r.known() - r.computed > 1)
    }

    /// Pages held by each running request in each group (tests, debugging).
    pub fn held_pages(&self) -> Vec<(RequestId, Vec<usize>)> {
        self.running
            .iter()
            .map(|r| (r.id, r.tables.iter().map(|t| t.live().len()).collect()))
            .collect()
    }
}

/// Writes a step's plan: for each `(tables, computed, scheduled)` in batch order, the query
/// rows `computed..computed + scheduled` and, per group, the live pages, the last page's fill,
/// the first position still held and the slots of the new tokens.
pub fn write_plan<'a>(
    plan: &mut StepPlan,
    block_size: usize,
    num_groups: usize,
    rows: impl IntoIterator<Item = (&'a [BlockTable], usize, usize)>,
) {
    let bs = block_size;
    plan.qo_indptr.clear();
    plan.qo_indptr.push(0);
    plan.groups.resize_with(num_groups, Default::default);
    for t in plan.groups.iter_mut() {
        t.clear();
        t.kv_indptr.push(0);
    }
    let mut total_q = 0u32;
    for (tables, computed, scheduled) in rows {
        total_q += scheduled as u32;
        plan.qo_indptr.push(total_q);
        let new_len = computed + scheduled;
        // The pages up to the last new token (a table may hold more: a drafter's plan runs
        // positions short of what the step allocated).
        let pages = new_len.div_ceil(bs);
        for (t, bt) in plan.groups.iter_mut().zip(tables) {
            let upto = pages.min(bt.blocks.len());
            t.kv_indices
                .extend_from_slice(&bt.blocks[bt.freed.min(upto)..upto]);
            t.kv_indptr.push(t.kv_indices.len() as u32);
            t.kv_last_page_len.push((new_len - (upto - 1) * bs) as u32);
            t.kv_first_pos.push((bt.freed * bs) as u32);
            for p in computed..new_len {
                t.slot_mapping
                    .push(bt.blocks[p / bs] * bs as u32 + (p % bs) as u32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;
    use crate::engine::layout::BackendConfig;
    use crate::engine::prefix::TokenBlocks;

    fn sched(
        bs: usize,
        blocks: &[(Option<u32>, usize)],
        seqs: usize,
        budget: usize,
        max_len: usize,
    ) -> Scheduler {
        let groups: Vec<GroupSpec> = blocks
            .iter()
            .map(|&(window, num_blocks)| GroupSpec { window, num_blocks })
            .collect();
        Scheduler::new(
            SchedulerConfig {
                block_size: bs,
                max_num_seqs: seqs,
                max_num_batched_tokens: budget,
                max_model_len: max_len,
                max_waiting: 1000,
                prefix_caching: true,
            },
            &groups,
        )
    }

    fn plan_cfg(s: &Scheduler) -> BackendConfig {
        BackendConfig {
            block_size: s.cfg.block_size,
            groups: s
                .kv
                .groups
                .iter()
                .map(|g| GroupSpec {
                    window: g.window,
                    num_blocks: g.pool.total(),
                })
                .collect(),
            layers: Vec::new(),
        }
    }

    /// Every page's reference count equals its holders, and the pools agree.
    fn check_accounting(s: &Scheduler) {
        for (g, group) in s.kv.groups.iter().enumerate() {
            let mut holders: BTreeMap<u32, u32> = BTreeMap::new();
            for r in s.running.iter().chain(&s.waiting) {
                let mut own = BTreeSet::new();
                for &id in r.tables[g].live() {
                    assert!(own.insert(id), "page {id} of group {g} twice in one table");
                    *holders.entry(id).or_default() += 1;
                }
            }
            for (&id, &n) in &holders {
                assert_eq!(group.pool.refcount(id), n, "page {id} of group {g}");
            }
            assert_eq!(holders.len(), group.pool.num_used(), "group {g} leaks pages");
        }
    }

    #[test]
    fn prefill_chunks_and_decodes_share_one_step() {
        let mut s = sched(16, &[(None, 100)], 8, 64, 4096);
        let mut ev = Vec::new();
        let mut plan = StepPlan::default();
        s.submit(1, 10, 5).unwrap();
        assert_eq!(s.schedule(&mut plan, &mut ev), 10);
        s.complete(&mut ev);
        s.submit(2, 100, 3).unwrap();
        // Request 1 decodes one token; request 2's first chunk is the whole blocks that fit
        // in the other 63 tokens of the budget.
        assert_eq!(s.schedule(&mut plan, &mut ev), 49);
        assert_eq!(plan.qo_indptr, vec![0, 1, 49]);
        plan.check(&plan_cfg(&s)).unwrap();
        assert_eq!(plan.groups[0].kv_len(0, 16), 11);
        assert_eq!(plan.groups[0].kv_len(1, 16), 48);
        s.complete(&mut ev);
        assert!(ev.contains(&Event::Token { id: 1, generated: 2 }));
        assert!(
            !ev.contains(&Event::Token { id: 2, generated: 1 }),
            "prefill not done yet"
        );
        // The prompt's last chunk (52 tokens) need not be whole blocks.
        assert_eq!(s.schedule(&mut plan, &mut ev), 53);
        s.complete(&mut ev);
        assert!(ev.contains(&Event::Token { id: 2, generated: 1 }));
    }

    #[test]
    fn running_out_of_pages_preempts_the_newest_request_which_recomputes_later() {
        // 4 pages of 4 tokens: two requests of 6 + 6 tokens cannot both finish.
        let mut s = sched(4, &[(None, 4)], 4, 64, 64);
        let mut ev = Vec::new();
        let mut plan = StepPlan::default();
        s.submit(1, 6, 6).unwrap();
        s.submit(2, 6, 6).unwrap();
        for _ in 0..100 {
            if s.is_idle() {
                break;
            }
            s.schedule(&mut plan, &mut ev);
            check_accounting(&s);
            s.complete(&mut ev);
        }
        assert!(s.is_idle());
        assert!(ev.contains(&Event::Preempted { id: 2 }));
        assert!(
            !ev.contains(&Event::Preempted { id: 1 }),
            "the oldest is never preempted"
        );
        let fin: Vec<_> = ev
            .iter()
            .filter(|e| matches!(e, Event::Finished { .. }))
            .collect();
        assert_eq!(fin, [&Event::Finished { id: 1 }, &Event::Finished { id: 2 }]);
        assert_eq!(
            s.counters().preemptions,
            ev.iter().filter(|e| matches!(e, Event::Preempted { .. })).count() as u64
        );
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        let mut s = sched(16, &[(None, 4)], 4, 64, 1000);
        assert_eq!(s.submit(1, 0, 4), Err(SubmitError::ZeroLength));
        assert!(matches!(s.submit(1, 990, 20), Err(SubmitError::TooLong { .. })));
        assert!(matches!(
            s.submit(1, 100, 1),
            Err(SubmitError::NeverFits { need: 7, have: 4 })
        ));
        s.submit(1, 10, 1).unwrap();
        assert_eq!(s.submit(1, 10, 1), Err(SubmitError::DuplicateId(1)));
    }

    #[test]
    fn a_sliding_group_admits_long_requests_a_full_group_could_not_hold() {
        // 8 pages of 16 = 128 tokens, but a window of 32 needs only cdiv(31, 16) + cdiv(64, 16) = 6.
        let mut s = sched(16, &[(Some(32), 8)], 4, 64, 4096);
        s.submit(1, 1000, 10).unwrap();
        let mut ev = Vec::new();
        let mut plan = StepPlan::default();
        while !s.is_idle() {
            s.schedule(&mut plan, &mut ev);
            for (_, held) in s.held_pages() {
                assert!(held[0] <= 6, "{held:?}");
            }
            s.complete(&mut ev);
        }
        assert!(ev.contains(&Event::Finished { id: 1 }));
    }

    fn run_to_end(s: &mut Scheduler, ev: &mut Vec<Event>) {
        let mut plan = StepPlan::default();
        let mut guard = 0;
        while !s.is_idle() {
            s.schedule(&mut plan, ev);
            check_accounting(s);
            s.complete(ev);
            guard += 1;
            assert!(guard < 10_000, "no progress");
        }
    }

    fn started(ev: &[Event], id: RequestId) -> usize {
        ev.iter()
            .find_map(|e| match e {
                Event::Started { id: i, cached } if *i == id => Some(*cached),
                _ => None,
            })
            .expect("started")
    }

    #[test]
    fn a_second_request_starts_from_the_blocks_the_first_one_computed() {
        let mut s = sched(4, &[(None, 64)], 4, 64, 256);
        let prompt: Vec<u32> = (0..40).collect();
        let mut ev = Vec::new();
        s.submit_tokens(1, &prompt, 3, CacheKey::default()).unwrap();
        run_to_end(&mut s, &mut ev);
        assert_eq!(started(&ev, 1), 0);
        assert_eq!(s.kv().used_blocks(), 0);
        assert_eq!(
            s.kv().cached_blocks(),
            10,
            "40 prompt tokens = 10 full blocks, cached"
        );
        // Same prompt: 9 blocks come from the cache (the last prompt token is computed for
        // its logits), so the first step computes 4 tokens, not 40.
        s.submit_tokens(2, &prompt, 3, CacheKey::default()).unwrap();
        let mut plan = StepPlan::default();
        assert_eq!(s.schedule(&mut plan, &mut ev), 4);
        assert_eq!(started(&ev, 2), 36);
        plan.check(&plan_cfg(&s)).unwrap();
        assert_eq!(plan.groups[0].kv_len(0, 4), 40);
        s.complete(&mut ev);
        run_to_end(&mut s, &mut ev);
        let c = s.counters();
        assert_eq!((c.prefix_queries, c.prefix_hits), (80, 36));
        // A prompt that differs in block 5 hits blocks 0..5 only.
        let mut other = prompt.clone();
        other[22] = 999;
        s.submit_tokens(3, &other, 1, CacheKey::default()).unwrap();
        run_to_end(&mut s, &mut ev);
        assert_eq!(started(&ev, 3), 20);
    }

    #[test]
    fn requests_with_different_salts_never_share_a_block() {
        let mut s = sched(4, &[(None, 64)], 4, 64, 256);
        let prompt: Vec<u32> = (0..32).collect();
        let salt = |x: &str| CacheKey {
            salt: Some(x.into()),
            adapter: None,
        };
        let mut ev = Vec::new();
        s.submit_tokens(1, &prompt, 1, salt("a")).unwrap();
        run_to_end(&mut s, &mut ev);
        for (id, key) in [(2, salt("b")), (3, CacheKey::default())] {
            s.submit_tokens(id, &prompt, 1, key).unwrap();
            run_to_end(&mut s, &mut ev);
            assert_eq!(started(&ev, id), 0, "request {id} hit another salt's blocks");
        }
        s.submit_tokens(4, &prompt, 1, salt("a")).unwrap();
        s.submit_tokens(5, &prompt, 1, CacheKey::default()).unwrap();
        run_to_end(&mut s, &mut ev);
        assert_eq!(started(&ev, 4), 28, "same salt shares");
        assert_eq!(started(&ev, 5), 28, "unsalted requests share with each other");
    }

    #[test]
    fn a_sliding_group_needs_only_the_window_of_a_cached_prefix() {
        // Full group + window of 8 tokens (2 blocks of 4). The sliding group frees the
        // blocks that left the window while the first request runs; they stay cached
        // until evicted, and a hit needs only the last window's blocks there.
        let mut s = sched(4, &[(None, 64), (Some(8), 16)], 4, 64, 256);
        let prompt: Vec<u32> = (100..140).collect();
        let mut ev = Vec::new();
        s.submit_tokens(1, &prompt, 2, CacheKey::default()).unwrap();
        run_to_end(&mut s, &mut ev);
        // Evict the sliding group's early blocks: another request takes the 6 plain free
        // pages and the 6 least recently released cached ones (blocks 0..6 of the prompt).
        let filler: Vec<u32> = (500..548).collect();
        s.submit_tokens(2, &filler, 1, CacheKey::default()).unwrap();
        run_to_end(&mut s, &mut ev);
        let g1 = &s.kv().groups[1].pool;
        let early = TokenBlocks::new(CacheKey::default(), &prompt, 4);
        assert!(
            g1.lookup(early.hashes[0]).is_none(),
            "block 0 evicted in the sliding group"
        );
        assert!(s.kv().groups[0].pool.lookup(early.hashes[0]).is_some());
        s.submit_tokens(3, &prompt, 2, CacheKey::default()).unwrap();
        let mut plan = StepPlan::default();
        s.schedule(&mut plan, &mut ev);
        assert_eq!(started(&ev, 3), 36, "the window's blocks are enough");
        let held = s.held_pages();
        assert_eq!(
            held[0].1,
            vec![10, 3],
            "full: 9 hit + 1 new; sliding: blocks 7, 8 + 1 new"
        );
        plan.check(&plan_cfg(&s)).unwrap();
        s.complete(&mut ev);
        run_to_end(&mut s, &mut ev);
        // A prefix whose window block was evicted in the sliding group hits less.
        let mut s = sched(4, &[(None, 64), (Some(8), 16)], 4, 64, 256);
        s.submit_tokens(1, &prompt, 2, CacheKey::default()).unwrap();
        run_to_end(&mut s, &mut ev);
        s.submit_tokens(2, &filler, 1, CacheKey::default()).unwrap();
        run_to_end(&mut s, &mut ev);
        // Prompt of 30 tokens: 7 full blocks wanted; the sliding group lost blocks 0..6.
        let short = &prompt[..30];
        let k = s
            .kv()
            .cached_prefix(&TokenBlocks::new(CacheKey::default(), short, 4).hashes, 29 / 4);
        let g1 = &s.kv().groups[1].pool;
        let present: Vec<bool> = early.hashes[..7]
            .iter()
            .map(|h| g1.lookup(*h).is_some())
            .collect();
        // k is the largest prefix whose window blocks are all present.
        let ok = |k: usize| {
            let first = (k * 4 + 1).saturating_sub(8) / 4;
            (first..k).all(|i| present[i])
        };
        assert!(ok(k));
        assert!(((k + 1)..=7).all(|j| !ok(j)), "k={k} present={present:?}");
    }

    #[test]
    fn allocation_evicts_cached_blocks_before_it_preempts_anyone() {
        // 16 pages: request 1 leaves 10 cached; requests 2 and 3 need 8 each.
        let mut s = sched(4, &[(None, 16)], 4, 64, 64);
        let mut ev = Vec::new();
        s.submit_tokens(1, &(0..40).collect::<Vec<u32>>(), 1, CacheKey::default())
            .unwrap();
        run_to_end(&mut s, &mut ev);
        assert_eq!(s.kv().cached_blocks(), 10);
        s.submit_tokens(2, &(1000..1028).collect::<Vec<u32>>(), 4, CacheKey::default())
            .unwrap();
        s.submit_tokens(3, &(2000..2028).collect::<Vec<u32>>(), 4, CacheKey::default())
            .unwrap();
        run_to_end(&mut s, &mut ev);
        assert_eq!(s.counters().preemptions, 0);
        assert!(s.kv().cached_blocks() <= 16);
        let removed = s
            .take_kv_events()
            .iter()
            .any(|e| matches!(e, KvEvent::Removed { .. }));
        assert!(!removed, "events are off unless asked for");
    }

    #[test]
    fn kv_events_describe_the_cache_of_the_full_group() {
        let mut s = sched(4, &[(Some(8), 16), (None, 12)], 4, 64, 64);
        s.record_kv_events(true);
        let mut ev = Vec::new();
        let prompt: Vec<u32> = (0..20).collect();
        s.submit_tokens(1, &prompt, 1, CacheKey::default()).unwrap();
        run_to_end(&mut s, &mut ev);
        let events = s.take_kv_events();
        let hashes = TokenBlocks::new(CacheKey::default(), &prompt, 4).hashes;
        assert_eq!(
            events,
            vec![KvEvent::Stored {
                block_hashes: hashes.iter().map(|h| h.external()).collect(),
                parent_block_hash: None,
                token_ids: prompt.clone(),
                block_size: 4,
            }]
        );
        s.submit_tokens(2, &(100..148).collect::<Vec<u32>>(), 1, CacheKey::default())
            .unwrap();
        run_to_end(&mut s, &mut ev);
        let events = s.take_kv_events();
        assert!(matches!(&events[0], KvEvent::Removed { block_hashes } if !block_hashes.is_empty()));
        s.reset_prefix_cache();
        assert_eq!(s.take_kv_events(), vec![KvEvent::AllCleared]);
        assert_eq!(s.kv().cached_blocks(), 0);
    }

    /// A fingerprint of `(key, tokens[..=p])`: what the K/V written at position `p` depends on.
    fn fingerprints(salt: u64, tokens: &[u32]) -> Vec<u64> {
        let mut h = 0xcbf2_9ce4_8422_2325u64 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        tokens
            .iter()
            .map(|&t| {
                h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(17);
                h
            })
            .collect()
    }

    /// Random operations on a scheduler with a prefix cache over a full and a sliding group,
    /// checked after each one against a model: reference counts equal holders, free pages are
    /// referenced by nobody, cached + free + used = the pool, the cache's addresses resolve to
    /// pages that carry them (an evicted one resolves no more), the KV events replay to the
    /// cache's content, and every page a request reads holds what its own tokens would write.
    /// Steps carry speculative proposals half of the time, of which a random prefix is
    /// accepted: a rejected proposal's KV must never be read or cached.
    fn random_operations(seed: u64, ops: usize) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut proposer = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
        let bs = [1usize, 2, 4, 16][rng.random_range(0..4)];
        let window = rng.random_range(2u32..40);
        let (full_blocks, sliding_blocks) = (rng.random_range(24..120), rng.random_range(16..80));
        let budget = rng.random_range(bs.max(16)..96);
        let mut s = sched(
            bs,
            &[(None, full_blocks), (Some(window), sliding_blocks)],
            8,
            budget,
            160,
        );
        s.record_kv_events(true);
        // Prompts come from a few stems so that prefixes repeat.
        let stems: Vec<Vec<u32>> = (0..4)
            .map(|_| {
                (0..rng.random_range(8..100))
                    .map(|_| rng.random_range(0..6))
                    .collect()
            })
            .collect();
        struct Req {
            salt: u64,
            tokens: Vec<u32>,
            output: usize,
        }
        let mut live: BTreeMap<RequestId, Req> = BTreeMap::new();
        let mut content: Vec<Vec<Option<u64>>> =
            vec![vec![None; full_blocks * bs], vec![None; sliding_blocks * bs]];
        let mut published: BTreeSet<u64> = BTreeSet::new();
        let (mut ev, mut plan, mut next) = (Vec::new(), StepPlan::default(), 0u64);
        let (mut hits, mut steps, mut proposals) = (0u64, 0u64, 0u64);
        for _ in 0..ops {
            match rng.random_range(0..20) {
                0..=4 => {
                    let stem = &stems[rng.random_range(0..stems.len())];
                    let cut = rng.random_range(1..=stem.len());
                    let mut tokens = stem[..cut].to_vec();
                    for _ in 0..rng.random_range(0..8) {
                        tokens.push(rng.random_range(0..6));
                    }
                    let salt = rng.random_range(0..3u64);
                    let key = CacheKey {
                        salt: (salt > 0).then(|| salt.to_string()),
                        adapter: None,
                    };
                    let output = rng.random_range(1..24);
                    if s.submit_tokens(next, &tokens, output, key).is_ok() {
                        live.insert(next, Req { salt, tokens, output });
                    }
                    next += 1;
                }
                5..=15 => {
                    steps += 1;
                    let speculate = rng.random_bool(0.5);
                    let mut drafts: BTreeMap<RequestId, Vec<u32>> = BTreeMap::new();
                    s.schedule_with(&mut plan, &mut ev, &mut |id, most| {
                        if !speculate {
                            return 0;
                        }
                        let k = proposer.random_range(0..=most.min(5));
                        drafts.insert(id, (0..k).map(|_| proposer.random_range(0..6)).collect());
                        k
                    });
                    let mut accepted: BTreeMap<RequestId, usize> = BTreeMap::new();
                    for c in s.scheduled().collect::<Vec<_>>() {
                        let r = &live[&c.id];
                        let mut tokens = r.tokens.clone();
                        if c.drafts > 0 {
                            proposals += 1;
                            tokens.extend_from_slice(&drafts[&c.id][..c.drafts]);
                            let m = rng.random_range(0..=c.drafts);
                            s.accept_drafts(c.id, m);
                            accepted.insert(c.id, m);
                        }
                        let fp = fingerprints(r.salt, &tokens);
                        let held = s.running.iter().find(|x| x.id == c.id).unwrap();
                        for (g, t) in held.tables.iter().enumerate() {
                            // What is already held reads as this request's own prefix.
                            let slot = |p: usize| t.blocks[p / bs] as usize * bs + p % bs;
                            for (p, f) in fp.iter().enumerate().take(c.start).skip(t.freed * bs) {
                                assert_eq!(content[g][slot(p)], Some(*f), "seed {seed}: group {g} pos {p}");
                            }
                            for (p, f) in fp.iter().enumerate().take(c.start + c.len).skip(c.start) {
                                content[g][slot(p)] = Some(*f);
                            }
                        }
                    }
                    check_accounting(&s);
                    s.complete(&mut ev);
                    for e in &ev {
                        match e {
                            Event::Token { id, generated } => {
                                let r = live.get_mut(id).unwrap();
                                // The accepted proposals, then the step's own token (the last
                                // output token is never fed back).
                                let m = accepted.get(id).copied().unwrap_or(0);
                                for &t in &drafts.get(id).map_or(&[][..], |d| &d[..m]).to_vec() {
                                    r.tokens.push(t);
                                    s.append_token(*id, t);
                                }
                                if *generated < r.output {
                                    let t = rng.random_range(0..6);
                                    r.tokens.push(t);
                                    s.append_token(*id, t);
                                }
                            }
                            Event::Started { cached, .. } => hits += *cached as u64,
                            Event::Finished { id } | Event::Failed { id, .. } => {
                                live.remove(id);
                            }
                            _ => {}
                        }
                    }
                    ev.clear();
                }
                16 | 17 => {
                    let id = rng.random_range(next.saturating_sub(12)..=next);
                    s.cancel(id, &mut ev);
                    if rng.random_bool(0.5) {
                        s.finish(id.wrapping_add(1), &mut ev);
                    }
                    for e in ev.drain(..) {
                        if let Event::Finished { id } | Event::Failed { id, .. } = e {
                            live.remove(&id);
                        }
                    }
                }
                18 if rng.random_bool(0.02) => s.reset_prefix_cache(),
                _ => {}
            }
            check_accounting(&s);
            for (g, group) in s.kv.groups.iter().enumerate() {
                let pool = &group.pool;
                let queue = pool.free_queue();
                assert_eq!(queue.len(), pool.num_free(), "group {g}");
                let mut seen = BTreeSet::new();
                let mut cached_free = 0;
                for &id in &queue {
                    assert!(seen.insert(id), "page {id} twice in the free queue");
                    assert_eq!(pool.refcount(id), 0, "page {id} free and referenced");
                    cached_free += pool.hash_of(id).is_some() as usize;
                }
                assert_eq!(cached_free, pool.num_cached());
                assert_eq!(pool.num_used() + pool.num_free(), pool.total());
                for (h, id) in pool.cached_blocks() {
                    assert_eq!(pool.hash_of(id), Some(h), "address resolves to a page without it");
                }
                let addressed = (0..pool.total() as u32)
                    .filter(|&i| pool.hash_of(i).is_some())
                    .count();
                assert_eq!(addressed, pool.cached_blocks().count());
            }
            for e in s.take_kv_events() {
                match e {
                    KvEvent::Stored { block_hashes, .. } => published.extend(block_hashes),
                    KvEvent::Removed { block_hashes } => {
                        for h in block_hashes {
                            assert!(published.remove(&h), "removed {h} that was never stored");
                        }
                    }
                    KvEvent::AllCleared => published.clear(),
                }
            }
            let anchor = &s.kv.groups[s.kv.anchor_group()].pool;
            let actual: BTreeSet<u64> = anchor.cached_blocks().map(|(h, _)| h.external()).collect();
            assert_eq!(
                published, actual,
                "seed {seed}: the events' view differs from the cache"
            );
        }
        assert!(
            steps > 0 && hits > 0,
            "seed {seed}: the workload never hit the cache"
        );
        assert!(proposals > 0, "seed {seed}: no step verified a proposal");
    }

    #[test]
    fn a_million_random_block_manager_operations_keep_every_invariant() {
        for seed in 0..8 {
            random_operations(seed, 125_000);
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Submit { prompt: usize, output: usize },
        Step,
        Cancel(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (1usize..120, 1usize..40).prop_map(|(prompt, output)| Op::Submit { prompt, output }),
            5 => Just(Op::Step),
            1 => (0u64..30).prop_map(Op::Cancel),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn blocks_never_leak_windows_hold_and_every_request_ends(
            bs in prop_oneof![Just(1usize), Just(4), Just(16)],
            full_blocks in 8usize..200,
            window in 2u32..48,
            sliding_blocks in 8usize..100,
            seqs in 1usize..12,
            budget in 16usize..96,
            ops in prop::collection::vec(op(), 1..80),
        ) {
            let mut s = sched(bs, &[(None, full_blocks), (Some(window), sliding_blocks)], seqs, budget, 160);
            let cfg = plan_cfg(&s);
            let cap = s.kv.max_pages_per_request(Some(window), 160, budget);
            let mut ev = Vec::new();
            let mut plan = StepPlan::default();
            let mut accepted = BTreeMap::new();
            let mut next = 0u64;
            let step = |s: &mut Scheduler, ev: &mut Vec<Event>, plan: &mut StepPlan| {
                let n = s.schedule(plan, ev);
                prop_assert!(n <= budget);
                prop_assert_eq!(plan.total_q(), n);
                prop_assert!(plan.num_requests() <= seqs);
                if n > 0 {
                    plan.check(&cfg).map_err(TestCaseError::fail)?;
                }
                for (_, held) in s.held_pages() {
                    prop_assert!(held[1] <= cap, "sliding group holds {} pages > {}", held[1], cap);
                }
                check_accounting(s);
                s.complete(ev);
                check_accounting(s);
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Submit { prompt, output } => {
                        if s.submit(next, prompt, output).is_ok() {
                            accepted.insert(next, output);
                        }
                        next += 1;
                    }
                    Op::Step => step(&mut s, &mut ev, &mut plan)?,
                    Op::Cancel(id) => {
                        s.cancel(id, &mut ev);
                        check_accounting(&s);
                    }
                }
            }
            let mut guard = 0;
            while !s.is_idle() {
                step(&mut s, &mut ev, &mut plan)?;
                guard += 1;
                prop_assert!(guard < 20_000, "no progress");
            }
            prop_assert_eq!(s.kv.used_blocks(), 0);
            let mut ended = BTreeMap::new();
            for e in &ev {
                match e {
                    Event::Finished { id } | Event::Failed { id, .. } => {
                        prop_assert!(ended.insert(*id, e.clone()).is_none(), "{} ended twice", id);
                    }
                    _ => {}
                }
            }
            for (id, output) in &accepted {
                match ended.get(id) {
                    Some(Event::Finished { .. }) => {
                        let last = ev.iter().filter_map(|e| match e {
                            Event::Token { id: i, generated } if i == id => Some(*generated),
                            _ => None,
                        }).max();
                        prop_assert_eq!(last, Some(*output));
                    }
                    Some(Event::Failed { reason, .. }) => prop_assert_eq!(reason.as_str(), "cancelled"),
                    _ => prop_assert!(false, "request {} neither finished nor failed", id),
                }
            }
        }
    }
}

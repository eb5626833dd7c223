//! Speculative decoding in the serving loop: each step's verification rows, and what their
//! picks accept (the proposals themselves come from `engine::speculative`).

use std::collections::HashMap;

use kvfleet_engine::engine::scheduler::{Event, RequestId, ScheduledChunk};
use kvfleet_engine::engine::speculative::{self, SpecConfig, SpecMethod};
use kvfleet_engine::engine::StepPlan;
use kvfleet_engine::model::drafter::{BlockRow, CatchUp, ChainRow};
use kvfleet_engine::model::forward::Picked;

use super::Loop;

/// Speculative decoding's settings and counts since start.
pub(super) struct Spec {
    pub(super) config: SpecConfig,
    pub(super) stats: crate::serving::metrics::SpecStats,
}

/// One sampled row group of a step: request `id`'s rows `first..first + 1 + drafts` of the
/// step's output (its next token's, then one a proposed token).
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub(super) id: RequestId,
    pub(super) first: usize,
    pub(super) drafts: usize,
    /// Tokens the step yields for the request: 1, or the accepted proposals and one more.
    pub(super) emit: usize,
}

impl Loop {
    /// Schedules a step, with each decoding request's proposals when speculation is on and
    /// the batch is small enough: n-gram proposals now, a drafter's first (EAGLE-3) or none
    /// (DFlash) with the rest drafted once the pages are allocated ([`Loop::draft_ahead`]).
    pub(super) fn schedule(&mut self, plan: &mut StepPlan, events: &mut Vec<Event>) -> usize {
        match self.spec.as_mut() {
            Some(spec) if self.sched.num_running() < spec.config.disable_at() => {
                let (live, config) = (&mut self.live, &spec.config);
                let drafter = config.method.needs_drafter();
                self.sched.schedule_with(plan, events, &mut |id, most| {
                    let Some(l) = live.get_mut(&id) else { return 0 };
                    l.draft.clear();
                    if !l.backoff.ready() {
                        return 0;
                    }
                    let k = most.min(config.num_speculative_tokens);
                    if drafter {
                        // EAGLE-3's first token is drafted; the rest (DFlash: all) are drafted
                        // once the step's pages are allocated (`draft_ahead`).
                        if !l.drafter_ready {
                            return 0;
                        }
                        l.draft.extend(l.drafted);
                        return k;
                    }
                    config.propose(&l.tokens, k, &mut l.draft);
                    l.draft.len()
                })
            }
            Some(spec) => {
                spec.stats.disabled_steps += 1;
                self.sched.schedule(plan, events)
            }
            None => self.sched.schedule(plan, events),
        }
    }

    /// After a step: takes each verifying request's proposed tokens off its tokens again, and
    /// accepts the leading ones its rows picked (none when the step failed), which the
    /// scheduler then keeps; counts the proposals.
    pub(super) fn verify(&mut self, rows: &mut [Rows], out: Option<&[Picked]>) {
        for r in rows.iter_mut().filter(|r| r.drafts > 0) {
            let Some(l) = self.live.get_mut(&r.id) else {
                continue;
            };
            l.tokens.truncate(l.tokens.len() - r.drafts);
            let Some(picked) = out.and_then(|o| o.get(r.first..r.first + 1 + r.drafts)) else {
                continue;
            };
            let picks: Vec<u32> = picked.iter().map(|p| p.token).collect();
            let accepted = speculative::accepted(&picks, &l.draft);
            r.emit = accepted + 1;
            l.backoff.record(r.drafts, accepted);
            self.sched.accept_drafts(r.id, accepted);
            self.metrics.observe_proposal(r.drafts, accepted);
            if let Some(spec) = self.spec.as_mut() {
                let st = &mut spec.stats;
                st.drafts += 1;
                st.draft_tokens += r.drafts as u64;
                st.accepted_tokens += accepted as u64;
                for p in st.accepted_per_position.iter_mut().take(accepted) {
                    *p += 1;
                }
            }
        }
        if let Some(spec) = self.spec.as_mut() {
            if rows.iter().any(|r| r.drafts > 0) {
                spec.stats.speculative_steps += 1;
            }
        }
    }
}

impl Loop {
    /// Drafts each verifying request's proposal now that the step's pages are allocated (the
    /// drafter writes its K/V at the positions the step then verifies): DFlash in one pass of
    /// blocks, EAGLE-3 chaining the rest after the first (drafted by the last step's catch-up,
    /// [`Loop::catch_up`]).
    pub(super) fn draft_ahead(&mut self, chunks: &[ScheduledChunk]) -> Result<(), String> {
        if !self.model.has_drafter() {
            return Ok(());
        }
        if self.spec.as_ref().map(|s| s.config.method) == Some(SpecMethod::Dflash) {
            return self.draft_blocks(chunks);
        }
        let most = chunks.iter().map(|c| c.drafts).max().unwrap_or(0);
        let mut plan = StepPlan::default();
        for j in 1..most {
            let mut rows = Vec::new();
            for c in chunks.iter().filter(|c| c.drafts > j) {
                let l = self
                    .live
                    .get(&c.id)
                    .ok_or_else(|| format!("request {} verifies proposals it does not hold", c.id))?;
                let token = *l.draft.get(j - 1).ok_or_else(|| {
                    format!("request {} has {} drafted tokens, needs {j}", c.id, l.draft.len())
                })?;
                rows.push(ChainRow {
                    seq: c.id,
                    pos: c.start + j - 1,
                    token,
                });
            }
            let planned: Vec<_> = rows.iter().map(|r| (r.seq, r.pos, 1)).collect();
            let group = self.model.kv_config().draft_group();
            self.sched.write_group_plan(&mut plan, group, &planned)?;
            let next = self
                .model
                .draft_chain(&rows, &plan)
                .map_err(|e| format!("drafting: {e}"))?;
            for (r, t) in rows.iter().zip(next) {
                if let Some(l) = self.live.get_mut(&r.seq) {
                    l.draft.push(t);
                }
            }
        }
        Ok(())
    }

    /// DFlash: every verifying request's block (its newest token and a mask token a proposal)
    /// through the drafter in one pass.
    fn draft_blocks(&mut self, chunks: &[ScheduledChunk]) -> Result<(), String> {
        let mut rows = Vec::new();
        for c in chunks.iter().filter(|c| c.drafts > 0) {
            let l = self
                .live
                .get(&c.id)
                .ok_or_else(|| format!("request {} verifies proposals it does not hold", c.id))?;
            let token = *l
                .tokens
                .get(c.start)
                .ok_or_else(|| format!("request {} has no token at {}", c.id, c.start))?;
            rows.push(BlockRow {
                seq: c.id,
                pos: c.start,
                token,
                drafts: c.drafts,
            });
        }
        if rows.is_empty() {
            return Ok(());
        }
        let planned: Vec<_> = rows.iter().map(|r| (r.seq, r.pos, 1 + r.drafts)).collect();
        let mut plan = StepPlan::default();
        let group = self.model.kv_config().draft_group();
        self.sched.write_group_plan(&mut plan, group, &planned)?;
        let drafted = self
            .model
            .draft_blocks(&rows, &plan)
            .map_err(|e| format!("drafting: {e}"))?;
        let mut at = 0;
        for r in &rows {
            if let Some(l) = self.live.get_mut(&r.seq) {
                l.draft.clear();
                l.draft.extend_from_slice(&drafted[at..at + r.drafts]);
            }
            at += r.drafts;
        }
        Ok(())
    }

    /// After a step's verification (drafter methods): the drafter reads the target features of every
    /// position the step computed and kept (a prefill chunk's, a decode's, the accepted
    /// proposals'), each with the token after it, so its own K/V cover what the target's do;
    /// the last position of a request that sampled drafts the token after its new one.
    pub(super) fn catch_up(&mut self, chunks: &[ScheduledChunk], rows: &[Rows], out: &[Picked]) {
        if !self.model.has_drafter() {
            return;
        }
        let emitted: HashMap<RequestId, Rows> = rows.iter().map(|r| (r.id, *r)).collect();
        let mut nexts: Vec<(ScheduledChunk, usize, Vec<u32>)> = Vec::new();
        let mut row = 0;
        for c in chunks {
            let first = row;
            row += c.len;
            let Some(l) = self.live.get(&c.id) else {
                continue;
            };
            let next: Option<Vec<u32>> = if c.samples {
                let r = emitted.get(&c.id);
                let accepted = r.map_or(0, |r| r.emit - 1).min(c.drafts);
                let bonus = r.and_then(|r| out.get(r.first + accepted)).map(|p| p.token);
                match (l.tokens.get(c.start + 1..), l.draft.get(..accepted), bonus) {
                    (Some(known), Some(acc), Some(b)) => {
                        Some(known.iter().chain(acc).copied().chain([b]).collect())
                    }
                    _ => None,
                }
            } else {
                l.tokens
                    .get(c.start + 1..c.start + c.len + 1)
                    .map(<[u32]>::to_vec)
            };
            match next {
                Some(n) if !n.is_empty() => nexts.push((*c, first, n)),
                _ => tracing::warn!(
                    id = c.id,
                    "drafter catch-up skipped: the step's tokens are not all known"
                ),
            }
        }
        for c in chunks {
            if let Some(l) = self.live.get_mut(&c.id) {
                l.drafter_ready = false;
                l.drafted = None;
            }
        }
        if nexts.is_empty() {
            return;
        }
        let catch: Vec<CatchUp<'_>> = nexts
            .iter()
            .map(|(c, first, n)| CatchUp {
                seq: c.id,
                start_pos: c.start,
                next: n,
                row: *first,
                draft: c.samples,
            })
            .collect();
        let planned: Vec<_> = catch.iter().map(|c| (c.seq, c.start_pos, c.next.len())).collect();
        let mut plan = StepPlan::default();
        let group = self.model.kv_config().draft_group();
        let drafted = self
            .sched
            .write_group_plan(&mut plan, group, &planned)
            .and_then(|()| {
                self.model
                    .draft_catch_up(&catch, &plan)
                    .map_err(|e| e.to_string())
            });
        match drafted {
            Ok(tokens) => {
                // EAGLE-3 drafted a token a sampled row; DFlash drafts at the next step.
                let mut tokens = tokens.into_iter();
                for id in catch.iter().filter(|c| c.draft).map(|c| c.seq) {
                    if let Some(l) = self.live.get_mut(&id) {
                        l.drafter_ready = true;
                        l.drafted = tokens.next();
                    }
                }
            }
            // Verification keeps the output exact whatever the drafter does: serve on.
            Err(e) => tracing::warn!(error = %e, "drafter catch-up failed; no proposals next step"),
        }
    }
}

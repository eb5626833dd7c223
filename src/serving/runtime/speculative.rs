//! Speculative decoding in the serving loop: each step's verification rows, and what their
//! picks accept. The proposals come from the method's [`Proposer`] (n-gram lookup, or a drafter
//! beside the model), which the loop asks at scheduling, once the step's pages are allocated,
//! and after the step, never knowing which method it is.

use std::collections::HashMap;

use kvfleet_engine::engine::scheduler::{Event, RequestId, ScheduledChunk};
use kvfleet_engine::engine::speculative::{self, SpecConfig};
use kvfleet_engine::engine::StepPlan;
use kvfleet_engine::model::forward::Picked;
use kvfleet_engine::model::proposer::{CatchUp, DraftRow, ProposeError, Proposer};

use super::Loop;

/// Speculative decoding's settings, proposer and counts since start.
pub(super) struct Spec {
    pub(super) config: SpecConfig,
    pub(super) proposer: Box<dyn Proposer>,
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
    /// the batch is small enough: what the proposer knows now (n-gram: all of it; a drafter:
    /// its first token or none), the rest drafted once the pages are allocated
    /// ([`Loop::draft_ahead`]).
    pub(super) fn schedule(&mut self, plan: &mut StepPlan, events: &mut Vec<Event>) -> usize {
        match self.spec.as_mut() {
            Some(spec) if self.sched.num_running() < spec.config.disable_at() => {
                let live = &mut self.live;
                let (k, proposer) = (spec.config.num_speculative_tokens, &mut spec.proposer);
                self.sched.schedule_with(plan, events, &mut |id, most| {
                    let Some(l) = live.get_mut(&id) else { return 0 };
                    l.draft.clear();
                    if !l.backoff.ready() {
                        return 0;
                    }
                    proposer.propose(id, &l.tokens, most.min(k), &mut l.draft)
                })
            }
            Some(spec) => {
                spec.stats.disabled_steps += 1;
                self.sched.schedule(plan, events)
            }
            None => self.sched.schedule(plan, events),
        }
    }

    /// Drops what the proposer keeps for `id` (it left).
    pub(super) fn forget_draft(&mut self, id: RequestId) {
        if let Some(spec) = self.spec.as_mut() {
            spec.proposer.forget(id);
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
    /// Completes each verifying request's proposal now that the step's pages are allocated (a
    /// drafter writes its K/V at the positions the step then verifies).
    pub(super) fn draft_ahead(&mut self, chunks: &[ScheduledChunk]) -> Result<(), String> {
        let Some(spec) = self.spec.as_mut().filter(|s| s.proposer.follows_target()) else {
            return Ok(());
        };
        let mut rows = Vec::new();
        for c in chunks.iter().filter(|c| c.drafts > 0) {
            let l = self
                .live
                .get_mut(&c.id)
                .ok_or_else(|| format!("request {} verifies proposals it does not hold", c.id))?;
            let token = *l
                .tokens
                .get(c.start)
                .ok_or_else(|| format!("request {} has no token at {}", c.id, c.start))?;
            rows.push(DraftRow {
                seq: c.id,
                pos: c.start,
                token,
                drafts: c.drafts,
                proposal: std::mem::take(&mut l.draft),
            });
        }
        let (sched, group) = (&mut self.sched, self.model.kv_config().draft_group());
        let drafted = spec
            .proposer
            .draft(self.model.as_mut(), &mut rows, &mut |planned, plan| {
                sched.write_group_plan(plan, group, planned)
            });
        for r in rows {
            if let Some(l) = self.live.get_mut(&r.seq) {
                l.draft = r.proposal;
            }
        }
        drafted.map_err(|e| e.to_string())
    }

    /// After a step's verification (drafter methods): the drafter reads the target features of every
    /// position the step computed and kept (a prefill chunk's, a decode's, the accepted
    /// proposals'), each with the token after it, so its own K/V cover what the target's do;
    /// the last position of a request that sampled drafts the token after its new one.
    pub(super) fn catch_up(&mut self, chunks: &[ScheduledChunk], rows: &[Rows], out: &[Picked]) {
        let Some(spec) = self.spec.as_mut().filter(|s| s.proposer.follows_target()) else {
            return;
        };
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
        let stepped: Vec<RequestId> = chunks
            .iter()
            .map(|c| c.id)
            .filter(|id| self.live.contains_key(id))
            .collect();
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
        let (sched, group) = (&mut self.sched, self.model.kv_config().draft_group());
        let caught = spec
            .proposer
            .catch_up(self.model.as_mut(), &stepped, &catch, &mut |planned, plan| {
                sched.write_group_plan(plan, group, planned)
            });
        // Verification keeps the output exact whatever the drafter does: serve on.
        match caught {
            Ok(()) => {}
            Err(ProposeError::Device(e)) => {
                tracing::warn!(error = %e, "drafter catch-up failed; no proposals next step")
            }
            Err(e) => tracing::warn!(error = %e, "drafter catch-up failed; no proposals next step"),
        }
    }
}

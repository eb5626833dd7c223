//! Speculative decoding in the serving loop: each step's verification rows, and what their
//! picks accept (the proposals themselves come from `engine::speculative`).

use kvfleet_engine::engine::scheduler::RequestId;
use kvfleet_engine::engine::speculative::{self, SpecConfig};
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

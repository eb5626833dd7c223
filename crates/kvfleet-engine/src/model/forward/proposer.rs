//! Speculative decoding's proposers, one a method (vLLM's `v1/spec_decode/`: `NgramProposer`,
//! `EagleProposer`, ...). The serving loop holds a `Box<dyn Proposer>` and asks it at three
//! points of a step, never knowing which method runs:
//! 1. when it schedules: how many tokens a request proposes ([`Proposer::propose`]);
//! 2. once the step's pages are allocated: the rest of each proposal, a drafter writing its K/V
//!    at the positions the step verifies ([`Proposer::draft`]);
//! 3. after the verified step: a drafter reads the target's hidden states of every position the
//!    step kept ([`Proposer::catch_up`]).
//!
//! A drafter runs on its target's device, in the target's buffers: the method's proposer here
//! ([`Drafting::eagle3`], [`Drafting::dflash`]) drives the device's passes ([`Eagle3Passes`],
//! [`DflashPasses`], implemented on the CPU in `forward::cpu_drafter` and on the GPU in
//! `kvfleet-cuda`), which get the target as `&mut dyn Forward` and read it as their device's
//! model. Adding a method is its passes trait and completion here, the passes on each device,
//! and its `Drafter` variant.

use std::collections::HashMap;

use super::Forward;
use crate::engine::speculative::{ngram_propose, SpecConfig};
use crate::engine::StepPlan;
use crate::model::kv::SeqId;
use crate::model::llama::ForwardError;

/// Writes the plan of a drafter pass over rows `(request, first position, tokens)`: the
/// target's full-attention pages, which a drafter's K/V follow (the scheduler's draft group).
pub type DraftPlans<'a> = dyn FnMut(&[(SeqId, usize, usize)], &mut StepPlan) -> Result<(), String> + 'a;

/// Why a proposal could not be drafted.
#[derive(Debug, thiserror::Error)]
pub enum ProposeError {
    /// The scheduler could not plan the drafter's pass.
    #[error("{0}")]
    Plan(String),
    /// The drafter's pass failed on its device.
    #[error("drafting: {0}")]
    Device(#[source] ForwardError),
    /// The rows the loop gave do not hold what the method needs.
    #[error("{0}")]
    Rows(String),
}

/// One request's rows for [`Proposer::catch_up`]: positions `start_pos..start_pos +
/// next.len()`, computed by the last step at its rows `row..`, and the token after each.
#[derive(Debug, Clone)]
pub struct CatchUp<'a> {
    pub seq: SeqId,
    pub start_pos: usize,
    pub next: &'a [u32],
    /// The step row (token index in the step's batch) of `start_pos`.
    pub row: usize,
    /// Draft the token after the last `next` token.
    pub draft: bool,
}

/// One verifying request for [`Proposer::draft`]: its newest token `token` at `pos`, the
/// `drafts` tokens the step verifies after it, and its proposal so far (what
/// [`Proposer::propose`] gave), completed in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftRow {
    pub seq: SeqId,
    pub pos: usize,
    pub token: u32,
    pub drafts: usize,
    pub proposal: Vec<u32>,
}

/// A speculation method as the serving loop drives it.
pub trait Proposer: Send {
    /// vLLM's method name (`ngram`, `eagle3`, `dflash`).
    fn method(&self) -> &'static str;

    /// Whether it runs a drafter beside the target: the loop then calls [`Proposer::draft`]
    /// once a step's pages are allocated and [`Proposer::catch_up`] after every step.
    fn follows_target(&self) -> bool {
        false
    }

    /// At scheduling: request `seq`'s proposal after `tokens` (prompt and output so far), at
    /// most `k` tokens. What is known now goes into `out` (empty on entry); returns how many
    /// tokens the step verifies for the request (0: none this step).
    fn propose(&mut self, seq: SeqId, tokens: &[u32], k: usize, out: &mut Vec<u32>) -> usize;

    /// Once the step's pages are allocated: completes each row's proposal to its `drafts`
    /// tokens, planning its drafter's passes with `plans`.
    fn draft(
        &mut self,
        _target: &mut dyn Forward,
        _rows: &mut [DraftRow],
        _plans: &mut DraftPlans<'_>,
    ) -> Result<(), ProposeError> {
        Ok(())
    }

    /// After a verified step of the requests `stepped`: the drafter reads the target's hidden
    /// states of the positions `rows` name, each paired with the token after it, so that its
    /// own K/V cover what the target's do; a request of `stepped` proposes at the next step
    /// only when its row here caught up with `draft`.
    fn catch_up(
        &mut self,
        _target: &mut dyn Forward,
        _stepped: &[SeqId],
        _rows: &[CatchUp<'_>],
        _plans: &mut DraftPlans<'_>,
    ) -> Result<(), ProposeError> {
        Ok(())
    }

    /// Drops what is kept for `seq` (it finished).
    fn forget(&mut self, _seq: SeqId) {}
}

/// Prompt lookup ([`ngram_propose`]): the whole proposal at scheduling, no drafter.
pub struct Ngram {
    min_n: usize,
    max_n: usize,
}

impl Ngram {
    pub fn new(config: &SpecConfig) -> Self {
        Ngram {
            min_n: config.lookup_min(),
            max_n: config.lookup_max(),
        }
    }
}

impl Proposer for Ngram {
    fn method(&self) -> &'static str {
        "ngram"
    }

    fn propose(&mut self, _seq: SeqId, tokens: &[u32], k: usize, out: &mut Vec<u32>) -> usize {
        ngram_propose(tokens, self.min_n, self.max_n, k, out);
        out.len()
    }
}

/// Plans `planned` with `plans` into `plan`.
fn plan_rows(
    plans: &mut DraftPlans<'_>,
    planned: &[(SeqId, usize, usize)],
    plan: &mut StepPlan,
) -> Result<(), ProposeError> {
    plans(planned, plan).map_err(ProposeError::Plan)
}

/// What a drafter pass returns: the tokens it drafted.
pub type Drafted = Result<Vec<u32>, ForwardError>;

/// A drafter's passes on a device, whatever its method.
pub trait DraftPasses: Send {
    /// The catch-up (see [`Proposer::catch_up`]) under `plan`; returns, for each row with
    /// `draft`, the first token it drafted, or none where the method drafts nothing then.
    fn catch_up(&mut self, target: &mut dyn Forward, rows: &[CatchUp<'_>], plan: &StepPlan) -> Drafted;

    /// Drops what is kept for `seq`.
    fn forget(&mut self, _seq: SeqId) {}
}

/// How a method completes the proposals of [`Proposer::draft`] with its passes `P`.
type Complete<P> =
    fn(&mut P, &mut dyn Forward, &mut [DraftRow], &mut DraftPlans<'_>) -> Result<(), ProposeError>;

/// A drafter beside the target as the loop's proposer: a request proposes at a step only when
/// the drafter caught up on it at the last, with the token the catch-up drafted (if any) first;
/// the method's `complete` drafts the rest.
pub struct Drafting<P> {
    passes: P,
    method: &'static str,
    complete: Complete<P>,
    /// The requests that caught up at the last step, each with its first drafted token.
    first: HashMap<SeqId, Option<u32>>,
}

impl<P: DraftPasses> Drafting<P> {
    fn new(passes: P, method: &'static str, complete: Complete<P>) -> Self {
        Drafting {
            passes,
            method,
            complete,
            first: HashMap::new(),
        }
    }
}

impl<P: DraftPasses> Proposer for Drafting<P> {
    fn method(&self) -> &'static str {
        self.method
    }

    fn follows_target(&self) -> bool {
        true
    }

    fn propose(&mut self, seq: SeqId, _tokens: &[u32], k: usize, out: &mut Vec<u32>) -> usize {
        match self.first.get(&seq) {
            Some(first) => {
                out.extend(*first);
                k
            }
            None => 0,
        }
    }

    fn draft(
        &mut self,
        target: &mut dyn Forward,
        rows: &mut [DraftRow],
        plans: &mut DraftPlans<'_>,
    ) -> Result<(), ProposeError> {
        (self.complete)(&mut self.passes, target, rows, plans)
    }

    fn catch_up(
        &mut self,
        target: &mut dyn Forward,
        stepped: &[SeqId],
        rows: &[CatchUp<'_>],
        plans: &mut DraftPlans<'_>,
    ) -> Result<(), ProposeError> {
        for seq in stepped {
            self.first.remove(seq);
        }
        if rows.is_empty() {
            return Ok(());
        }
        let planned: Vec<_> = rows.iter().map(|c| (c.seq, c.start_pos, c.next.len())).collect();
        let mut plan = StepPlan::default();
        plan_rows(plans, &planned, &mut plan)?;
        let tokens = self
            .passes
            .catch_up(target, rows, &plan)
            .map_err(ProposeError::Device)?;
        let mut tokens = tokens.into_iter();
        for r in rows.iter().filter(|r| r.draft) {
            self.first.insert(r.seq, tokens.next());
        }
        Ok(())
    }

    fn forget(&mut self, seq: SeqId) {
        self.first.remove(&seq);
        self.passes.forget(seq);
    }
}

/// One request's row for [`Eagle3Passes::chain`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainRow {
    pub seq: SeqId,
    pub pos: usize,
    pub token: u32,
}

/// An EAGLE-3 drafter's passes on a device; its catch-up drafts a token for each row with
/// `draft`.
pub trait Eagle3Passes: DraftPasses {
    /// One drafting step ahead for each row: the row's drafted token at `pos`, with the
    /// drafter's own feature of the position before; returns the next drafted token of each.
    fn chain(&mut self, target: &mut dyn Forward, rows: &[ChainRow], plan: &StepPlan) -> Drafted;
}

impl<P: Eagle3Passes> Drafting<P> {
    /// EAGLE-3 (vLLM's `EagleProposer`): the first token is drafted by the catch-up after the
    /// last step, the rest chained on the drafter's own outputs once the step's pages are
    /// allocated.
    pub fn eagle3(passes: P) -> Self {
        Self::new(passes, "eagle3", chain_ahead::<P>)
    }
}

/// EAGLE-3's completion: each row's proposal chained from its first token, one position a pass
/// for every row that needs it.
fn chain_ahead<P: Eagle3Passes>(
    passes: &mut P,
    target: &mut dyn Forward,
    rows: &mut [DraftRow],
    plans: &mut DraftPlans<'_>,
) -> Result<(), ProposeError> {
    let most = rows.iter().map(|r| r.drafts).max().unwrap_or(0);
    let mut plan = StepPlan::default();
    for j in 1..most {
        let mut chain = Vec::new();
        for r in rows.iter().filter(|r| r.drafts > j) {
            let token = *r.proposal.get(j - 1).ok_or_else(|| {
                ProposeError::Rows(format!(
                    "request {} has {} drafted tokens, needs {j}",
                    r.seq,
                    r.proposal.len()
                ))
            })?;
            chain.push(ChainRow {
                seq: r.seq,
                pos: r.pos + j - 1,
                token,
            });
        }
        let planned: Vec<_> = chain.iter().map(|r| (r.seq, r.pos, 1)).collect();
        plan_rows(plans, &planned, &mut plan)?;
        let next = passes
            .chain(target, &chain, &plan)
            .map_err(ProposeError::Device)?;
        for (r, t) in rows.iter_mut().filter(|r| r.drafts > j).zip(next) {
            r.proposal.push(t);
        }
    }
    Ok(())
}

/// One request's DFlash block for [`DflashPasses::blocks`]: the newest token at `pos` and
/// `drafts` mask tokens after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRow {
    pub seq: SeqId,
    pub pos: usize,
    pub token: u32,
    pub drafts: usize,
}

/// A DFlash drafter's passes on a device; its catch-up stores each drafter layer's context K/V
/// of the rows and drafts nothing.
pub trait DflashPasses: DraftPasses {
    /// Each row's block (its newest token, then `drafts` mask tokens) through the drafter in
    /// one pass, over the context its catch-ups stored; returns every row's `drafts`
    /// proposals, in row order.
    fn blocks(&mut self, target: &mut dyn Forward, rows: &[BlockRow], plan: &StepPlan) -> Drafted;
}

impl<P: DflashPasses> Drafting<P> {
    /// DFlash: the whole proposal is one block pass once the step's pages are allocated.
    pub fn dflash(passes: P) -> Self {
        Self::new(passes, "dflash", draft_blocks::<P>)
    }
}

/// DFlash's completion: every row's block through the drafter in one pass.
fn draft_blocks<P: DflashPasses>(
    passes: &mut P,
    target: &mut dyn Forward,
    rows: &mut [DraftRow],
    plans: &mut DraftPlans<'_>,
) -> Result<(), ProposeError> {
    let blocks: Vec<BlockRow> = rows
        .iter()
        .map(|r| BlockRow {
            seq: r.seq,
            pos: r.pos,
            token: r.token,
            drafts: r.drafts,
        })
        .collect();
    if blocks.is_empty() {
        return Ok(());
    }
    let planned: Vec<_> = blocks.iter().map(|r| (r.seq, r.pos, 1 + r.drafts)).collect();
    let mut plan = StepPlan::default();
    plan_rows(plans, &planned, &mut plan)?;
    let drafted = passes
        .blocks(target, &blocks, &plan)
        .map_err(ProposeError::Device)?;
    let mut at = 0;
    for r in rows.iter_mut() {
        r.proposal.clear();
        r.proposal.extend_from_slice(&drafted[at..at + r.drafts]);
        at += r.drafts;
    }
    Ok(())
}

//! Runs before serving and outside it: the warm-up of a GPU model's kernels, a scratch greedy
//! loop over a model's pools (tests, benchmarks), and the longest request the pools hold.

use kvfleet_engine::engine::scheduler::{Event, RequestId, Scheduler, SchedulerConfig};
use kvfleet_engine::engine::StepPlan;
use kvfleet_engine::model::forward::Forward;
use kvfleet_engine::model::llama::SeqChunk;
use kvfleet_engine::model::sampling::RowPick;

/// Tokens (prompt and output) of the longest warm-up request.
pub(super) const WARM_UP_TOKENS: usize = 20;

/// Runs two short greedy requests through `model` before the serving loop starts, on a scratch
/// scheduler: a prefill step of both prompts, decode steps of two sequences, then of one (the
/// single-token path). On a GPU the first launch of each kernel loads it and cuBLAS picks its
/// algorithms on first use; without this the first user request pays for that (its time to
/// first token was 75-107 ms against 40 ms later on an H100, bench/RESULTS.md). Nothing of it
/// is counted in the metrics, and the pools' pages it wrote are overwritten by the requests that
/// get them later. Returns the steps run.
pub fn warm_up(model: &mut dyn Forward, sched: &SchedulerConfig) -> Result<usize, String> {
    let vocab = model.config().vocab as u32;
    let prompt = |seed: u32| -> Vec<u32> { (0..16).map(|i| (seed + 7 * i) % vocab.max(1)).collect() };
    let requests = [(prompt(1), 2), (prompt(2), WARM_UP_TOKENS - 16)];
    run_greedy(model, sched, &requests).map(|(steps, _)| steps)
}

/// Runs `requests` (prompt, output tokens) to completion with greedy sampling on a scratch
/// scheduler over `model`'s pools, outside any serving loop (no metrics, no streaming). Returns
/// the steps run and each request's output tokens.
pub fn run_greedy(
    model: &mut dyn Forward,
    sched: &SchedulerConfig,
    requests: &[(Vec<u32>, usize)],
) -> Result<(usize, Vec<Vec<u32>>), String> {
    let kv = model.kv_config().clone();
    let mut s = Scheduler::new(sched.clone(), &kv.groups);
    let mut tokens: Vec<Vec<u32>> = requests.iter().map(|(p, _)| p.clone()).collect();
    let mut outputs = vec![Vec::new(); requests.len()];
    for (i, (p, n)) in requests.iter().enumerate() {
        s.submit(i as RequestId, p.len(), *n)
            .map_err(|e| format!("request {i}: {e}"))?;
    }
    // Every step computes at least one token of some request, so this bounds the steps.
    let limit = requests.iter().map(|(p, n)| p.len() + n).sum::<usize>() + 1;
    let (mut plan, mut events, mut steps) = (StepPlan::default(), Vec::new(), 0);
    while !s.is_idle() {
        if steps >= limit {
            return Err(format!("the requests did not finish within {limit} steps"));
        }
        if s.schedule(&mut plan, &mut events) == 0 {
            return Err("the scheduler could not place the requests in the KV pools".into());
        }
        let chunks: Vec<_> = s.scheduled().collect();
        let batch: Vec<SeqChunk<'_>> = chunks
            .iter()
            .map(|c| SeqChunk {
                seq: c.id,
                start_pos: c.start,
                tokens: &tokens[c.id as usize][c.start..c.start + c.len],
                logits: usize::from(c.samples),
            })
            .collect();
        let rows: Vec<usize> = chunks
            .iter()
            .filter(|c| c.samples)
            .map(|c| c.id as usize)
            .collect();
        let picked = model
            .forward_rows(&batch, &plan, &vec![RowPick::Greedy; rows.len()])
            .map_err(|e| format!("step {steps}: {e}"))?;
        if picked.len() != rows.len() {
            return Err(format!(
                "step {steps} returned {} tokens for {} rows",
                picked.len(),
                rows.len()
            ));
        }
        for (&id, token) in rows.iter().zip(picked) {
            tokens[id].push(token);
            outputs[id].push(token);
        }
        s.complete(&mut events);
        if let Some(Event::Failed { id, reason }) = events.iter().find(|e| matches!(e, Event::Failed { .. }))
        {
            return Err(format!("request {id} failed: {reason}"));
        }
        events.clear();
        steps += 1;
    }
    Ok((steps, outputs))
}

/// The longest prompt + output one request may have: maxModelLen, or less when a group's
/// pool cannot hold that many pages.
pub(super) fn largest_request(s: &Scheduler) -> usize {
    let (mut lo, mut hi) = (1usize, s.config().max_model_len);
    if s.check(hi - 1, 1).is_ok() {
        return hi;
    }
    // check(n - 1, 1) is monotone in n: find the largest n that passes.
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if mid >= 2 && s.check(mid - 1, 1).is_ok() {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

//! The seam between the serving loop and where the forward pass runs. The engine's
//! [`Scheduler`](crate::engine::scheduler::Scheduler) owns the page tables and writes
//! each step's [`StepPlan`]; a [`Forward`] runs the model's layers for the step's tokens and
//! hands each layer's Q/K/V to the engine backend (append + attention) under that plan: the
//! CPU backend here, the CUDA backend in `model::gpu::GpuLlama`.

mod cpu_drafter;
pub mod proposer;

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

pub use cpu_drafter::{CpuDflash, CpuEagle3};

use super::drafter::Drafter;
use super::kv::KvError;
use super::llama::{AuxHidden, ForwardError, Llama, LlamaConfig, SeqChunk};
use super::paged::Planned;
use super::sampling::{token_logprobs, RowPick, RowSample, TokenLogprobs};
use crate::engine::cpu::CpuBackend;
use crate::engine::direct::DirectPlanner;
use crate::engine::layout::{BackendConfig, KvDtype};
use crate::engine::{Backend, StepPlan};
use proposer::Proposer;

/// A model on a device with the engine's KV pools, stepped by the serving loop.
pub trait Forward: Any + Send {
    /// The model's geometry.
    fn config(&self) -> &LlamaConfig;

    /// The KV pools as allocated (groups, pages, dtype): what the scheduler manages.
    fn kv_config(&self) -> &BackendConfig;

    /// Runs the new tokens of every chunk under `plan` (whose `qo_indptr` lists the chunks in
    /// the same order, and whose slot mappings say where their K/V go) and returns
    /// `[chunks wanting logits, vocab]` f32 logits in chunk order.
    fn forward(&mut self, batch: &[SeqChunk<'_>], plan: &StepPlan) -> Result<Vec<f32>, ForwardError>;

    /// Runs the step like [`Forward::forward`] for a serving loop that samples, and returns
    /// the next token of each row (the `i`-th chunk wanting logits), picked as `picks[i]`
    /// says, with no adjustments: [`Forward::forward_samples`] of plain picks.
    fn forward_rows(
        &mut self,
        batch: &[SeqChunk<'_>],
        plan: &StepPlan,
        picks: &[RowPick],
    ) -> Result<Vec<u32>, ForwardError> {
        let rows: Vec<RowSample> = picks.iter().map(|&p| RowSample::from(p)).collect();
        Ok(self
            .forward_samples(batch, plan, &rows)?
            .into_iter()
            .map(|p| p.token)
            .collect())
    }

    /// Runs the step and returns each row's token, picked as `rows[i]` says (its adjustments
    /// applied first), and the raw logits of the rows that keep them. A device that holds the
    /// logits picks there (the GPU: `kernels/sampling.cu`), so only token ids cross to the host,
    /// and the logits rows asked for; the default picks on the host.
    fn forward_samples(
        &mut self,
        batch: &[SeqChunk<'_>],
        plan: &StepPlan,
        rows: &[RowSample],
    ) -> Result<Vec<Picked>, ForwardError> {
        let logits = self.forward(batch, plan)?;
        let vocab = self.config().vocab;
        let n = logits.len() / vocab.max(1);
        if n != rows.len() {
            return Err(ForwardError::Kv(KvError::Backend(format!(
                "{} picks for {n} rows wanting logits",
                rows.len()
            ))));
        }
        Ok(rows
            .iter()
            .zip(logits.chunks_exact(vocab))
            .map(|(r, row)| Picked {
                token: r.pick(row),
                logits: r.keep_logits.then(|| row.to_vec()),
            })
            .collect())
    }

    /// The log-probability of every prompt token after the first under the model (with `top`
    /// alternatives each), computed over the whole prompt apart from the serving pools (no
    /// prefix cache: every position is computed). `None` where the device does not implement it.
    fn score_prompt(
        &mut self,
        _tokens: &[u32],
        _top: usize,
    ) -> Option<Result<Vec<TokenLogprobs>, ForwardError>> {
        None
    }

    /// Whether [`Forward::score_prompt`] is implemented for this model on this device.
    fn can_score_prompts(&self) -> bool {
        false
    }

    /// Where it runs, for logs and `/v1/capacity` (`cpu`, `cuda`).
    fn device(&self) -> &'static str;

    /// Time the last step spent in the engine's append + attention calls, when the device
    /// can tell without a synchronisation (the CPU).
    fn last_attention_time(&self) -> Option<Duration> {
        None
    }

    /// Mixture of experts: the tokens each expert of each sparse layer took in the last step
    /// (`[sparse layers * experts]`), where the device counts them (the CPU); empty for a
    /// dense model.
    fn last_expert_tokens(&self) -> Option<&[u32]> {
        None
    }

    /// Attaches a drafter (speculative decoding, EAGLE-3 or DFlash): from then on every step
    /// keeps the target's hidden states the drafter reads. Its KV pool is the target's
    /// full-attention pages once more, for the drafter's layers. The drafter, as its method's
    /// proposer, is then [`Forward::take_proposer`]'s.
    fn attach_drafter(&mut self, drafter: Drafter) -> Result<(), ForwardError> {
        Err(ForwardError::Unsupported(format!(
            "{} drafters are not implemented on the {} engine yet (the CPU engine runs them); use method ngram",
            drafter.method(),
            self.device()
        )))
    }

    /// Whether a drafter is attached (its hidden states kept every step).
    fn has_drafter(&self) -> bool {
        false
    }

    /// The attached drafter as its method's proposer, for the serving loop (once). Its passes
    /// run on this device and read this model: the loop hands it back as `&mut dyn Forward`,
    /// which the drafter reads as its device's model (`Forward: Any`).
    fn take_proposer(&mut self) -> Option<Box<dyn Proposer>> {
        None
    }
}

/// One row's result of [`Forward::forward_samples`].
#[derive(Debug, Clone, PartialEq)]
pub struct Picked {
    pub token: u32,
    /// The raw logits row, when the row asked to keep it.
    pub logits: Option<Vec<f32>>,
}

/// Checks that `plan` was written for `batch`: one `qo_indptr` entry per chunk, each the
/// chunk's token count.
pub fn check_plan(batch: &[SeqChunk<'_>], plan: &StepPlan) -> Result<(), ForwardError> {
    let lens = plan.qo_indptr.windows(2).map(|w| (w[1] - w[0]) as usize);
    let ok = plan.qo_indptr.len() == batch.len() + 1 && lens.zip(batch).all(|(n, c)| n == c.tokens.len());
    if ok {
        Ok(())
    } else {
        Err(ForwardError::Kv(KvError::Backend(format!(
            "the step plan lists {} chunks, the batch {}; plan and batch must come from the same schedule",
            plan.qo_indptr.len().saturating_sub(1),
            batch.len()
        ))))
    }
}

/// Plans `batch` on `planner` (the scheduler's page tables, for callers that choose their own
/// batches: tests, benchmarks) and runs it.
pub fn step_direct(
    f: &mut dyn Forward,
    planner: &mut DirectPlanner,
    batch: &[SeqChunk<'_>],
    plan: &mut StepPlan,
) -> Result<Vec<f32>, ForwardError> {
    let seqs: Vec<(u64, usize, usize)> = batch
        .iter()
        .map(|c| (c.seq, c.start_pos, c.tokens.len()))
        .collect();
    planner
        .plan(&seqs, plan)
        .map_err(|e| ForwardError::Kv(KvError::Backend(e.to_string())))?;
    f.forward(batch, plan)
}

/// The CPU forward pass ([`Llama::forward`]) on the engine's CPU backend: K/V in the
/// engine's paged pools, in the resolved KV dtype.
pub struct CpuForward {
    model: Arc<Llama>,
    backend: CpuBackend,
    attention_time: Duration,
    /// The hidden states a drafter reads, kept by every step once one is attached.
    hidden: Option<AuxHidden>,
    /// The experts' load of the last step, without a drafter (no hidden states kept).
    load: AuxHidden,
    /// The attached drafter, until the serving loop takes it.
    proposer: Option<Box<dyn Proposer>>,
}

impl CpuForward {
    /// `backend` must hold the model's layers (checked).
    pub fn new(model: Arc<Llama>, backend: CpuBackend) -> Result<Self, ForwardError> {
        let geo = model.config.attn_geometry();
        let cfg = backend.config();
        let c = &model.config;
        let fits = cfg.layers.len() == geo.n_layers
            && cfg.layers.iter().enumerate().all(|(i, l)| {
                l.attn.q_heads == geo.n_heads
                    && l.attn.kv_heads == geo.n_kv_heads
                    && l.attn.head_dim == geo.head_dim
                    && l.attn.window.map(|w| w as usize) == c.layer_window(i)
            });
        if !fits {
            return Err(ForwardError::Kv(KvError::Backend(format!(
                "the KV pools were laid out for {} layers of another geometry; the model has {} layers of \
                 {} query heads, {} KV heads, head_dim {}, sliding windows {:?} (lay the pools out with \
                 capacity::pool_layout of LlamaConfig::kv_layers, or give the worker the model's own geometry)",
                cfg.layers.len(),
                geo.n_layers,
                geo.n_heads,
                geo.n_kv_heads,
                geo.head_dim,
                (0..geo.n_layers).map(|i| c.layer_window(i)).collect::<Vec<_>>()
            ))));
        }
        Ok(CpuForward {
            model,
            backend,
            attention_time: Duration::ZERO,
            hidden: None,
            load: AuxHidden::default(),
            proposer: None,
        })
    }

    pub fn model(&self) -> &Arc<Llama> {
        &self.model
    }

    /// `target` as the CPU model, for a drafter on the CPU.
    pub(crate) fn of(target: &mut dyn Forward) -> Result<&mut CpuForward, ForwardError> {
        let device = target.device();
        (target as &mut dyn Any)
            .downcast_mut::<CpuForward>()
            .ok_or_else(|| {
                ForwardError::Unsupported(format!(
                    "a CPU drafter beside a {device} model; attach the drafter to the model it drafts for"
                ))
            })
    }

    /// The hidden states the last step kept for the drafter (empty when none is attached).
    pub(crate) fn hidden(&self) -> &[f32] {
        self.hidden.as_ref().map_or(&[], |h| &h.rows)
    }
}

impl Forward for CpuForward {
    fn config(&self) -> &LlamaConfig {
        &self.model.config
    }

    fn kv_config(&self) -> &BackendConfig {
        self.backend.config()
    }

    fn forward(&mut self, batch: &[SeqChunk<'_>], plan: &StepPlan) -> Result<Vec<f32>, ForwardError> {
        check_plan(batch, plan)?;
        let mut planned = Planned::new(&mut self.backend, plan);
        // Without a drafter no hidden state is kept, only the experts' load.
        let aux = self.hidden.as_mut().unwrap_or(&mut self.load);
        let logits = self.model.forward_aux(&mut planned, batch, aux);
        self.attention_time = planned.time;
        logits
    }

    fn attach_drafter(&mut self, drafter: Drafter) -> Result<(), ForwardError> {
        let cfg = self.backend.config();
        let full = cfg.groups.get(cfg.draft_group()).map_or(0, |g| g.num_blocks);
        let dtype = cfg.layers.first().map_or(KvDtype::Bf16, |l| l.dtype);
        let layers = drafter.aux_layers().to_vec();
        self.proposer = Some(drafter.cpu_proposer(dtype, cfg.block_size, full)?);
        self.hidden = Some(AuxHidden {
            layers,
            ..AuxHidden::default()
        });
        Ok(())
    }

    fn has_drafter(&self) -> bool {
        self.hidden.is_some()
    }

    fn take_proposer(&mut self) -> Option<Box<dyn Proposer>> {
        self.proposer.take()
    }

    fn device(&self) -> &'static str {
        "cpu"
    }

    fn score_prompt(
        &mut self,
        tokens: &[u32],
        top: usize,
    ) -> Option<Result<Vec<TokenLogprobs>, ForwardError>> {
        Some(
            self.model
                .prompt_logits(tokens, |i, row| token_logprobs(row, tokens[i + 1], top)),
        )
    }

    fn can_score_prompts(&self) -> bool {
        let c = &self.model.config;
        (0..c.n_layers).all(|i| c.layer_window(i).is_none())
    }

    fn last_attention_time(&self) -> Option<Duration> {
        Some(self.attention_time)
    }

    fn last_expert_tokens(&self) -> Option<&[u32]> {
        Some(&self.hidden.as_ref().unwrap_or(&self.load).expert_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::capacity::{pool_layout, PoolParams, PoolSize};
    use crate::engine::scheduler::{Event, Scheduler, SchedulerConfig};
    use crate::model::kv::{AttnGeometry, ContiguousKv};

    /// `pages` pages of every layer of `geo` in `dtype`, pages of `block_size` tokens.
    fn pools(geo: AttnGeometry, dtype: KvDtype, block_size: usize, pages: usize) -> BackendConfig {
        let p = PoolParams::pages(dtype, block_size);
        pool_layout(&geo.kv_layers(), 0, &p, PoolSize::Pages(pages)).unwrap()
    }

    /// Steps `prompts` through the engine scheduler and the CPU forward pass, feeding back a
    /// fixed token, and compares every logit row with the f32 contiguous reference cache.
    #[test]
    fn scheduled_steps_on_the_engine_match_the_contiguous_reference() {
        let mut cfg = LlamaConfig::llama(2, 64, 96, 4, 2, 40);
        cfg.context_len = 128;
        let m = Arc::new(Llama::dummy(cfg, 11).unwrap());
        let geo = m.config.attn_geometry();
        let backend = CpuBackend::new(pools(geo, KvDtype::F16, 4, 32)).unwrap();
        let mut f = CpuForward::new(m.clone(), backend).unwrap();
        let mut sched = Scheduler::new(
            SchedulerConfig {
                block_size: 4,
                max_num_seqs: 4,
                max_num_batched_tokens: 8,
                max_model_len: 64,
                max_waiting: 16,
                prefix_caching: true,
            },
            &f.kv_config().groups,
        );
        let prompts: [Vec<u32>; 2] = [
            (0..9).map(|i| i * 7 % 40).collect(),
            (0..5).map(|i| i * 3 % 40).collect(),
        ];
        let mut toks: Vec<Vec<u32>> = prompts.to_vec();
        for (i, p) in prompts.iter().enumerate() {
            sched.submit(i as u64, p.len(), 3).unwrap();
        }
        let mut flat = ContiguousKv::new(geo, 1000);
        let mut plan = StepPlan::default();
        let mut events = Vec::new();
        let mut rows_checked = 0;
        while !sched.is_idle() {
            sched.schedule(&mut plan, &mut events);
            let chunks: Vec<_> = sched.scheduled().collect();
            let batch: Vec<SeqChunk<'_>> = chunks
                .iter()
                .map(|c| SeqChunk {
                    seq: c.id,
                    start_pos: c.start,
                    tokens: &toks[c.id as usize][c.start..c.start + c.len],
                    logits: usize::from(c.samples),
                })
                .collect();
            let got = f.forward(&batch, &plan).unwrap();
            let want = m.forward(&mut flat, &batch).unwrap();
            assert_eq!(got.len(), want.len());
            let err = got
                .iter()
                .zip(&want)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            let scale = want.iter().map(|x| x.abs()).fold(0.0, f32::max);
            assert!(
                err <= 0.02 * scale + 1e-3,
                "max |engine - contiguous| = {err} (scale {scale})"
            );
            rows_checked += got.len() / m.config.vocab;
            drop(batch);
            sched.complete(&mut events);
            for e in events.drain(..) {
                if let Event::Token { id, .. } = e {
                    toks[id as usize].push((id as u32 + 1) * 5);
                }
            }
        }
        assert_eq!(rows_checked, 6, "3 tokens for each of 2 requests");
        assert_eq!(sched.kv().used_blocks(), 0, "every page returned");
    }

    #[test]
    fn a_plan_for_another_batch_is_refused() {
        let m = Arc::new(Llama::dummy(LlamaConfig::llama(1, 32, 64, 4, 2, 20), 3).unwrap());
        let backend = CpuBackend::new(pools(m.config.attn_geometry(), KvDtype::Bf16, 4, 8)).unwrap();
        let mut f = CpuForward::new(m, backend).unwrap();
        let toks = [1u32, 2, 3];
        let e = f
            .forward(
                &[SeqChunk {
                    seq: 1,
                    start_pos: 0,
                    tokens: &toks,
                    logits: 1,
                }],
                &StepPlan::default(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("same schedule"), "{e}");
    }

    #[test]
    fn pools_of_another_geometry_are_refused() {
        let m = Arc::new(Llama::dummy(LlamaConfig::llama(2, 32, 64, 4, 2, 20), 3).unwrap());
        let mut geo = m.config.attn_geometry();
        geo.n_layers = 3;
        let backend = CpuBackend::new(pools(geo, KvDtype::Bf16, 4, 8)).unwrap();
        assert!(CpuForward::new(m, backend).is_err());
    }
}

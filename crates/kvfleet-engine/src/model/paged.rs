//! The CPU backend under one step's plan, as a model's layers see it ([`KvAttention`]): what
//! the target's and a drafter's forward passes on the CPU share. Their pools are laid out by
//! `engine::capacity::pool_layout`.

use std::time::{Duration, Instant};

use super::kv::{AttnSeq, KvAttention, KvError, Qkv, SeqId};
use super::llama::ForwardError;
use crate::engine::cpu::CpuBackend;
use crate::engine::{Backend, BackendError, StepPlan};

/// Checks that `plan` was written for `seqs`: one `qo_indptr` entry each, of its length.
pub(crate) fn check_rows(seqs: &[AttnSeq], plan: &StepPlan) -> Result<(), ForwardError> {
    let lens = plan.qo_indptr.windows(2).map(|w| (w[1] - w[0]) as usize);
    if plan.qo_indptr.len() == seqs.len() + 1 && lens.zip(seqs).all(|(n, s)| n == s.len) {
        Ok(())
    } else {
        Err(ForwardError::Kv(KvError::Backend(format!(
            "the drafter's plan lists {} rows, the drafter {}",
            plan.qo_indptr.len().saturating_sub(1),
            seqs.len()
        ))))
    }
}

/// The engine backend seen by [`Llama::forward`] for one planned step.
pub(crate) struct Planned<'a> {
    backend: &'a mut CpuBackend,
    plan: &'a StepPlan,
    prepared: bool,
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    out: Vec<f32>,
    pub(crate) time: Duration,
}

impl<'a> Planned<'a> {
    pub(crate) fn new(backend: &'a mut CpuBackend, plan: &'a StepPlan) -> Self {
        Planned {
            backend,
            plan,
            prepared: false,
            k: Vec::new(),
            v: Vec::new(),
            q: Vec::new(),
            out: Vec::new(),
            time: Duration::ZERO,
        }
    }
}

fn fill(buf: &mut Vec<f32>, src: &[f32]) {
    buf.clear();
    buf.extend_from_slice(src);
}

impl KvAttention for Planned<'_> {
    fn attend(
        &mut self,
        layer: usize,
        _seqs: &[AttnSeq],
        (q, k, v): Qkv<'_>,
        out: &mut [f32],
    ) -> Result<(), KvError> {
        let t0 = Instant::now();
        let device = |e: BackendError| KvError::Backend(e.to_string());
        if !self.prepared {
            self.backend.prepare(self.plan).map_err(device)?;
            self.prepared = true;
        }
        fill(&mut self.k, k);
        fill(&mut self.v, v);
        fill(&mut self.q, q);
        self.out.resize(out.len(), 0.0);
        self.backend.append_kv(layer, &self.k, &self.v).map_err(device)?;
        self.backend
            .attention(layer, &self.q, &mut self.out)
            .map_err(device)?;
        out.copy_from_slice(&self.out[..out.len()]);
        self.time += t0.elapsed();
        Ok(())
    }

    fn cached_len(&self, _seq: SeqId) -> usize {
        0
    }

    fn release(&mut self, _seq: SeqId) {}
}

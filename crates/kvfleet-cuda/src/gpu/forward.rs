//! A step of [`GpuLlama`], all on the one stream of its GPU with no host synchronisation until
//! the results are copied back:
//! 1. check the batch on the host, upload tokens, positions and the rows wanting logits, and
//!    `prepare` the attention backend (its pages from the engine's plan);
//! 2. the family's layers ([`super::step::Family`]): from the token ids to the residual stream;
//! 3. the last row of every chunk that wants logits: `rmsnorm`, `logits = h · headᵀ` (f32),
//!    as one fused GEMV when there is one such row;
//! 4. the logits back to the host, or each row's token picked on the device: the raw logits
//!    rows that ask for them (log-probabilities) copied back first, then the rows' logit
//!    adjustments applied in place (`kvf_adjust_rows`, when any row has some), then the pick.

use kvfleet_engine::engine::layout::{BackendConfig, StepPlan};
use kvfleet_engine::model::drafter::Drafter;
use kvfleet_engine::model::forward::{check_plan, Forward, Picked};
use kvfleet_engine::model::llama::{ForwardError, LlamaConfig, SeqChunk};
use kvfleet_engine::model::proposer::Proposer;
use kvfleet_engine::model::sampling::{RowPick, RowSample};

use kvfleet_engine::engine::Backend;

use super::arena::upload_into;
use super::blas::Gemm;
use super::error::{backend_err, drv, GpuError};
use super::gemv::{Input, Output};
use super::kernels::Norm;
use super::model::GpuLlama;
use super::sampling::adjust_words;
use super::step::{part, Marks, Step};

/// What a step brings back to the host, and where.
enum StepOut<'a> {
    /// `[rows, vocab]` f32.
    Logits(&'a mut Vec<f32>),
    /// A token a row, picked on the device as each row says (and the raw logits of the rows
    /// that keep them).
    Tokens(&'a [RowSample], &'a mut Vec<Picked>),
}

/// A step's tokens and positions, and the rows that want logits, as the kernels read them.
struct HostStep {
    tokens: Vec<i32>,
    positions: Vec<i32>,
    last: Vec<i32>,
}

impl HostStep {
    /// Checks every token against the vocabulary and every position against the context.
    fn of(c: &LlamaConfig, batch: &[SeqChunk<'_>]) -> Result<Self, ForwardError> {
        let t: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut step = HostStep {
            tokens: Vec::with_capacity(t),
            positions: Vec::with_capacity(t),
            last: Vec::new(),
        };
        for s in batch {
            for token in s.checked_tokens(c) {
                let (tok, pos) = token?;
                step.tokens.push(tok as i32);
                step.positions.push(pos as i32);
            }
            let (end, n) = (step.tokens.len() as i32, s.logits.min(s.tokens.len()) as i32);
            step.last.extend(end - n..end);
        }
        Ok(step)
    }
}

impl GpuLlama {
    /// Host checks, uploads and the backend's plan for a step; returns the step's tokens and
    /// the rows wanting logits.
    fn begin(&mut self, batch: &[SeqChunk<'_>], plan: &StepPlan) -> Result<(usize, Vec<i32>), ForwardError> {
        check_plan(batch, plan)?;
        let host = HostStep::of(&self.config, batch)?;
        let t = host.tokens.len();
        if t == 0 {
            return Ok((0, host.last));
        }
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(drv("binding the context"))?;
        let s = self.gpu.stream().clone();
        self.acts.ensure(&s, &self.dims, t, host.last.len())?;
        if let Some(h) = self.hidden.as_mut() {
            h.ensure(&s, t, self.dims.d)?;
        }
        if let Some(p) = self.profile.as_mut() {
            p.start(&s).map_err(drv("recording a profile event"))?;
        }
        self.backend.prepare(plan).map_err(backend_err)?;
        upload_into(&s, &host.tokens, &mut self.acts.tok)?;
        upload_into(&s, &host.positions, &mut self.acts.pos)?;
        upload_into(&s, &host.last, &mut self.acts.last)?;
        if let Some(p) = self.profile.as_mut() {
            p.mark(&s, part::PREPARE)
                .map_err(drv("recording a profile event"))?;
        }
        Ok((t, host.last))
    }

    /// The step on the device; host-side checks were done by the caller. Writes every row's
    /// logits, or with picks only each row's token, into `out`.
    fn run(&mut self, t: usize, last: &[i32], out: StepOut<'_>) -> Result<(), GpuError> {
        let s = self.gpu.stream().clone();
        let mut st = Step {
            c: &self.config,
            dm: &self.dims,
            blas: &self.blas,
            k: &self.kernels,
            w: &self.weights,
            a: &mut self.acts,
            backend: &mut self.backend,
            marks: Marks::new(self.profile.as_mut(), &s),
            t,
            fused: self.single_token_gemv && t == 1 && self.family.single_token_gemv(),
            fused_append: self.single_token_append,
            aux: self.hidden.as_mut(),
        };
        self.family.layers(&mut st)?;
        let n = last.len();
        if n == 0 {
            self.gpu.synchronize()?;
            return Ok(());
        }
        lm_head(&mut st, n, self.single_token_gemv)?;
        st.marks.mark(part::LM_HEAD)?;
        to_host(&mut st, n, out)?;
        self.gpu.synchronize()?;
        st.marks.mark(part::TO_HOST)?;
        st.marks.finish(t, n)
    }
}

/// `logits[r] = rmsnorm(x[last[r]]) · headᵀ` for the `n` rows wanting logits; one row with the
/// GEMV path on is one fused GEMV.
fn lm_head(st: &mut Step<'_>, n: usize, gemv: bool) -> Result<(), GpuError> {
    let (c, dm, w, k) = (st.c, st.dm, st.w, st.k);
    let a = &mut *st.a;
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    if gemv && n == 1 {
        let input = Input::Normed {
            x: &a.x,
            w: &w.out_norm,
            row: Some(&a.last),
            eps: c.rms_eps,
        };
        k.gemv
            .run(head, dm.vocab, dm.d, input, Output::Store(&mut a.logits))
    } else {
        let norm = Norm::new(&w.out_norm, c.rms_eps);
        k.rms_norm_rows(&a.x, &a.last, n, dm.d, norm, &mut a.hl)?;
        st.blas
            .gemm(head, &a.hl, &mut a.logits, Gemm::store(n, dm.vocab, dm.d))
    }
}

/// The step's result to the host: the logits, or each row's token picked on the device (a step
/// of greedy rows only skips the upload of the picks' parameters and runs the argmax, on the
/// adjusted logits when a row has adjustments).
fn to_host(st: &mut Step<'_>, n: usize, out: StepOut<'_>) -> Result<(), GpuError> {
    let (k, vocab) = (st.k, st.dm.vocab);
    let s = k.stream();
    let a = &mut *st.a;
    match out {
        StepOut::Tokens(rows, out) => {
            // Rows that report log-probabilities take their raw logits (before adjustments, as
            // vLLM's default `raw_logprobs`): rare evaluation traffic, a row of vocab floats each.
            let mut kept: Vec<Option<Vec<f32>>> = vec![None; n];
            for (r, row) in rows.iter().enumerate() {
                if row.keep_logits {
                    let mut h = vec![0f32; vocab];
                    s.memcpy_dtoh(&a.logits.slice(r * vocab..(r + 1) * vocab), h.as_mut_slice())
                        .map_err(drv("copying a logits row to the host"))?;
                    kept[r] = Some(h);
                }
            }
            if let Some(words) = adjust_words(rows) {
                a.ensure_adjust(s, words.len())?;
                k.adjust_rows(&mut a.logits, n, vocab, &words, &mut a.adjust)?;
            }
            let picks: Vec<RowPick> = rows.iter().map(|r| r.pick).collect();
            if picks.iter().all(|p| *p == RowPick::Greedy) {
                k.argmax_rows(&a.logits, n, vocab, &mut a.picks)?;
            } else {
                k.pick_rows(&a.logits, vocab, &picks, &mut a.pick_words, &mut a.picks)?;
            }
            st.marks.mark(part::SAMPLE)?;
            let mut ids = vec![0i32; n];
            s.memcpy_dtoh(&a.picks.slice(..n), &mut ids)
                .map_err(drv("copying sampled tokens to the host"))?;
            out.clear();
            out.extend(ids.into_iter().zip(kept).map(|(id, logits)| Picked {
                token: id as u32,
                logits,
            }));
        }
        StepOut::Logits(host) => {
            host.resize(n * vocab, 0.0);
            s.memcpy_dtoh(&a.logits.slice(..n * vocab), host.as_mut_slice())
                .map_err(drv("copying logits to the host"))?;
        }
    }
    Ok(())
}

impl Forward for GpuLlama {
    fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn kv_config(&self) -> &BackendConfig {
        self.backend.config()
    }

    fn forward(&mut self, batch: &[SeqChunk<'_>], plan: &StepPlan) -> Result<Vec<f32>, ForwardError> {
        let (t, last) = self.begin(batch, plan)?;
        if t == 0 {
            return Ok(Vec::new());
        }
        let mut logits = Vec::new();
        self.run(t, &last, StepOut::Logits(&mut logits))?;
        Ok(logits)
    }

    fn forward_samples(
        &mut self,
        batch: &[SeqChunk<'_>],
        plan: &StepPlan,
        rows: &[RowSample],
    ) -> Result<Vec<Picked>, ForwardError> {
        let (t, last) = self.begin(batch, plan)?;
        if t == 0 {
            return Ok(Vec::new());
        }
        if rows.len() != last.len() {
            return Err(GpuError::Invalid(format!(
                "{} picks for {} rows wanting logits",
                rows.len(),
                last.len()
            ))
            .into());
        }
        let mut out = Vec::with_capacity(rows.len());
        self.run(t, &last, StepOut::Tokens(rows, &mut out))?;
        Ok(out)
    }

    fn device(&self) -> &'static str {
        "cuda"
    }

    fn attach_drafter(&mut self, drafter: Drafter) -> Result<(), ForwardError> {
        Ok(self.attach(drafter)?)
    }

    fn has_drafter(&self) -> bool {
        self.hidden.is_some()
    }

    fn take_proposer(&mut self) -> Option<Box<dyn Proposer>> {
        self.proposer.take()
    }
}

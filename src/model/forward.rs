//! The seam between the generation loop and where the forward pass runs: the CPU model with
//! any [`KvAttention`] cache, or the GPU model (`model::gpu::GpuLlama`) with its paged cache.

use std::sync::Arc;

use super::kv::{KvAttention, SeqId};
use super::llama::{ForwardError, Llama, LlamaConfig, SeqChunk};

/// A model plus its KV cache, stepped by the generation loop.
pub trait Forward: Send {
    /// The model's geometry.
    fn config(&self) -> &LlamaConfig;

    /// Runs the new tokens of every chunk (storing their K/V) and returns
    /// `[chunks wanting logits, vocab]` f32 logits in chunk order.
    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<f32>, ForwardError>;

    /// Frees everything cached for `seq`.
    fn release(&mut self, seq: SeqId);

    /// Tokens cached for `seq`, 0 when unknown.
    fn cached_len(&self, seq: SeqId) -> usize;

    /// Where it runs, for logs (`cpu`, `cuda`).
    fn device(&self) -> &'static str;

    /// Hands a logits buffer back once sampled, so the next step can reuse its memory (a GPU
    /// step copies `[rows, vocab]` f32 to the host: 131 MB for 256 rows of a 128k vocabulary,
    /// whose fresh allocation and page faults cost more than the copy).
    fn recycle(&mut self, logits: Vec<f32>) {
        drop(logits);
    }
}

/// The CPU forward pass ([`Llama::forward`]) over a [`KvAttention`] cache.
pub struct CpuForward {
    pub model: Arc<Llama>,
    pub kv: Box<dyn KvAttention>,
}

impl CpuForward {
    pub fn new(model: Arc<Llama>, kv: Box<dyn KvAttention>) -> Self {
        CpuForward { model, kv }
    }
}

impl Forward for CpuForward {
    fn config(&self) -> &LlamaConfig {
        &self.model.config
    }

    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<f32>, ForwardError> {
        self.model.forward(self.kv.as_mut(), batch)
    }

    fn release(&mut self, seq: SeqId) {
        self.kv.release(seq)
    }

    fn cached_len(&self, seq: SeqId) -> usize {
        self.kv.cached_len(seq)
    }

    fn device(&self) -> &'static str {
        "cpu"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kv::ContiguousKv;
    use crate::model::llama::LlamaConfig;

    #[test]
    fn cpu_forward_steps_and_releases_through_the_trait() {
        let m = Arc::new(Llama::dummy(LlamaConfig::llama(1, 32, 64, 4, 2, 20), 3).unwrap());
        let kv = ContiguousKv::new(m.config.attn_geometry(), 100);
        let mut f: Box<dyn Forward> = Box::new(CpuForward::new(m.clone(), Box::new(kv)));
        let toks = [1u32, 2, 3];
        let l = f
            .forward(&[SeqChunk {
                seq: 4,
                start_pos: 0,
                tokens: &toks,
                want_logits: true,
            }])
            .unwrap();
        assert_eq!(l.len(), f.config().vocab);
        assert_eq!(f.cached_len(4), 3);
        f.release(4);
        assert_eq!(f.cached_len(4), 0);
        assert_eq!(f.device(), "cpu");
    }
}

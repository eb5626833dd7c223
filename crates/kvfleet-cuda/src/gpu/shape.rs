//! Which geometries the GPU kernels cover, and the widths a step's buffers are cut to.

use kvfleet_core::plan::{engine_memory, EngineShape};
use kvfleet_engine::model::llama::LlamaConfig;

use crate::spec::{GroupSize, HeadDim};

use super::error::GpuError;

/// How many times each KV head is stored so that the attention kernels' GQA group sizes
/// (1, 2, 4, 8) cover the model: returns `(kv_rep, stored group)`.
/// The planner's rule (`plan::engine_memory::kv_replication`) over the kernels' [`GroupSize`]s.
pub fn kv_replication(n_heads: usize, n_kv_heads: usize) -> Result<(usize, usize), GpuError> {
    debug_assert!(GroupSize::ALL
        .iter()
        .map(|g| g.get() as u64)
        .eq(engine_memory::KERNEL_GQA_GROUPS));
    engine_memory::kv_replication(n_heads as u64, n_kv_heads as u64)
        .map(|(rep, group)| (rep as usize, group as usize))
        .ok_or_else(|| GpuError::Unsupported(format!("{n_heads} query heads over {n_kv_heads} KV heads")))
}

/// Whether the GPU kernels cover `c` (head_dim 64/128/256; any GQA group, by replication).
pub(super) fn check_shapes(c: &LlamaConfig) -> Result<(), GpuError> {
    // No expert kernels yet (issue 55): refused here, before any weight reaches the device,
    // rather than running a sparse layer's empty dense MLP.
    if c.moe.is_some() || c.qk_norm_full {
        return Err(GpuError::Unsupported(format!(
            "architecture `{}` is a mixture-of-experts model, which the CUDA engine does not serve \
             yet (the CPU engine does; on a GPU, serve it with runtime: vllm)",
            c.arch
        )));
    }
    if c.gemma3.is_some() && !c.qk_norm {
        return Err(GpuError::Unsupported(
            "a Gemma 3 geometry without QK norms (the query scale is folded into the Q norm)".into(),
        ));
    }
    if HeadDim::from_usize(c.head_dim).is_none() {
        return Err(GpuError::Unsupported(format!(
            "head_dim {} (the attention kernels build 64, 128, 256)",
            c.head_dim
        )));
    }
    kv_replication(c.n_heads, c.n_kv_heads)?;
    Ok(())
}

/// The model's widths as a step uses them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub d: usize,
    pub hd: usize,
    pub n_heads: usize,
    pub n_kv: usize,
    pub kv_rep: usize,
    pub qw: usize,
    pub kw: usize,
    /// K/V width as stored (replicated heads).
    pub kw_rep: usize,
    pub ff: usize,
    pub vocab: usize,
    /// Gemma 3's block (post-norms, GeGLU, scaled embedding, local RoPE).
    pub gemma: bool,
    /// FP8 linear weights: the step also needs [`super::fp8::Fp8Scratch`] (and `shape` counts
    /// it: `fp8_linear`).
    pub fp8: bool,
    /// What the weights and the activation workspace cost (the planner's terms).
    pub shape: EngineShape,
}

impl Dims {
    pub fn new(c: &LlamaConfig, kv_rep: usize) -> Self {
        let (qw, kw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        Dims {
            d: c.d_model,
            hd: c.head_dim,
            n_heads: c.n_heads,
            n_kv: c.n_kv_heads,
            kv_rep,
            qw,
            kw,
            kw_rep: kw * kv_rep,
            ff: c.d_ff,
            vocab: c.vocab,
            gemma: c.gemma3.is_some(),
            fp8: false,
            shape: c.engine_shape(kv_rep as u64),
        }
    }

    /// With FP8 linear weights or not: the flag, and the planner's terms that follow it.
    pub fn with_fp8(self, fp8: bool) -> Self {
        Dims {
            fp8,
            shape: kvfleet_core::plan::EngineShape {
                fp8_linear: fp8,
                ..self.shape
            },
            ..self
        }
    }

    /// The widest input of an FP8 GEMM.
    pub fn fp8_k(&self) -> usize {
        self.d.max(self.qw).max(self.ff)
    }

    /// Width of the fused Q/K/V projection's output rows.
    pub fn qkv(&self) -> usize {
        self.qw + 2 * self.kw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gqa_groups_outside_the_kernels_store_replicated_kv_heads() {
        assert_eq!(kv_replication(9, 3).unwrap(), (3, 1), "SmolLM2-135M");
        assert_eq!(kv_replication(32, 8).unwrap(), (1, 4), "Llama 3 8B");
        assert_eq!(kv_replication(28, 4).unwrap(), (7, 1), "Qwen2 7B: group 7");
        assert_eq!(kv_replication(48, 4).unwrap(), (3, 4), "group 12");
        assert_eq!(kv_replication(64, 4).unwrap(), (2, 8), "group 16");
        assert!(kv_replication(10, 4).is_err());
    }

    #[test]
    fn head_dims_outside_the_attention_kernels_are_named_errors() {
        let ok = LlamaConfig::llama(2, 4096, 14336, 32, 8, 128256);
        check_shapes(&ok).unwrap();
        let bad = LlamaConfig::llama(2, 96 * 4, 512, 4, 2, 100);
        let e = check_shapes(&bad).unwrap_err().to_string();
        assert!(
            e.contains("head_dim 96") && e.contains("--attention-backend KVFLEET_CPU"),
            "{e}"
        );
    }

    #[test]
    fn a_mixture_of_experts_model_is_refused_naming_its_architecture_and_the_ways_to_serve_it() {
        let mut c = LlamaConfig::llama(2, 1024, 4096, 16, 4, 1000);
        c.arch = "qwen3moe".into();
        c.moe = Some(kvfleet_engine::model::moe::Moe {
            experts: 8,
            top_k: 2,
            rule: kvfleet_engine::model::moe::RouterRule::SoftmaxTopK { renormalize: true },
            expert_ff: 256,
            shared_ff: None,
            sparse_step: 1,
            dense_layers: Vec::new(),
        });
        let e = check_shapes(&c).unwrap_err().to_string();
        for want in [
            "qwen3moe",
            "CUDA engine does not serve",
            "runtime: vllm",
            "KVFLEET_CPU",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}

//! The GPU memory of kvfleet's own engine (`runtime: kvfleet`), term by term, so that the
//! planner predicts the KV pools the worker allocates: the worker sizes its pools with these
//! functions (`kvfleet-cuda` `gpu::pools`), the planner with the same ones.
//!
//! The definition follows vLLM's (`determine_available_memory` in vllm/v1/worker/gpu_worker.py:
//! the requested memory `gpu_memory_utilization x total`, minus the weights, the peak
//! activation memory of a profiling pass of `max_num_batched_tokens` tokens, and the non-torch
//! memory). kvfleet needs no profiling pass: its weights and its activation workspace are
//! allocated to the byte by formulas ([`EngineShape::weight_bytes`],
//! [`EngineShape::activation_bytes`]), and the one term no formula gives, what the CUDA
//! context, cuBLAS and the loaded kernels hold, is a stated constant
//! ([`CONTEXT_RESERVE_BYTES`]):
//!
//! `KV budget = floor(total x gpuMemoryUtilization) - weights - activations - context reserve`
//!
//! The worker gives the pools the budget, or what is measured free less
//! [`MIN_FREE_BYTES`] when that is less (and then says the prediction was not met).

use serde::Serialize;

use super::geometry::Geometry;
use super::PlanError;
use crate::api::ModelGeometry;

/// What the CUDA context, the cuBLAS handle, the model's kernels and the driver hold on the
/// device besides kvfleet's own allocations: 1,152 MiB.
///
/// Measured on an H100 80GB HBM3 (bench/RESULTS.md, "The one per-layer KV list", commit
/// `1b0a400`): dummy Llama-3.1-8B at utilisation 0.92 and 2,048 batched tokens left
/// 29,062 bf16 pages (and 58,125 fp8 pages) after `(1 - 0.92) x total`, which puts
/// `total - free - weights - activations` between 1,049.4 and 1,050.4 MiB. The reserve is that
/// figure plus about 10% for drivers and devices that hold more; where one holds more still,
/// the worker takes what is free and reports the shortfall (`kvBudgetBytes` against
/// `kvBytes` in `/v1/capacity`). An H200 (driver 580) holds more: 1,504 MiB
/// (`tests/cuda_capacity.rs`, bench/RESULTS.md), so this is not yet a per-device figure.
pub const CONTEXT_RESERVE_BYTES: u64 = 1152 << 20;

/// What the worker leaves free in any case for the cuBLAS workspace and per-step buffers.
pub const MIN_FREE_BYTES: u64 = 256 << 20;

/// 32-bit words of one logit row's sampling parameters (`kvf_pick_rows`).
pub const PICK_WORDS: u64 = 6;

/// The query-head groups the attention kernels build: a model whose group is none of them
/// stores each KV head `kv_rep` times (see [`kv_replication`]).
pub const KERNEL_GQA_GROUPS: [u64; 4] = [1, 2, 4, 8];

/// How many times each KV head is stored so that the kernels' group sizes cover the model:
/// `(kv_rep, stored group)`; `None` when the query heads are not a multiple of the KV heads.
pub fn kv_replication(n_heads: u64, n_kv_heads: u64) -> Option<(u64, u64)> {
    if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        return None;
    }
    let group = n_heads / n_kv_heads;
    let stored = KERNEL_GQA_GROUPS
        .iter()
        .copied()
        .filter(|g| group % g == 0)
        .max()
        .unwrap_or(1);
    Some((group / stored, stored))
}

/// A Llama-family decoder as kvfleet's GPU engine lays it out: what its weights and its
/// activation workspace cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct EngineShape {
    pub layers: u64,
    pub d_model: u64,
    pub d_ff: u64,
    pub vocab: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub head_dim: u64,
    /// Copies of each KV head stored ([`kv_replication`]).
    pub kv_rep: u64,
    /// Dimensions of a head that RoPE rotates.
    pub rope_dims: u64,
    pub tied_embeddings: bool,
    /// Biases on Q, K and V (Qwen2).
    pub attn_bias: bool,
    /// RMSNorm on each Q and K head.
    pub qk_norm: bool,
    /// Gemma 3's block: post-norms, a second RoPE table, a sublayer output buffer.
    pub gemma3: bool,
    /// FP8 linear layers (`engine.quantization: fp8`, or an FP8 checkpoint): one e4m3 byte a
    /// weight and an f32 scale a row, and the FP8 GEMMs' buffers beside the activations.
    pub fp8_linear: bool,
}

/// The cuBLASLt workspace the GPU engine allocates for its FP8 GEMMs.
pub const FP8_GEMM_WORKSPACE_BYTES: u64 = 32 << 20;

impl EngineShape {
    /// The shape the worker serves for dummy weights of a CRD geometry: hidden size
    /// `hiddenSize` (else heads x head_dim), MLP `intermediateSize` (else 8/3 x hidden rounded
    /// up to 256), vocabulary `vocabSize` (else 32,000), untied, no biases or QK norms.
    /// `None` for geometries the worker makes no dummy weights of (sliding windows, MLA,
    /// mixture of experts).
    pub fn for_spec(g: &ModelGeometry) -> Option<EngineShape> {
        if g.sliding_window.is_some()
            || g.layer_types.is_some()
            || g.kv_lora_rank.is_some()
            || g.moe.is_some()
        {
            return None;
        }
        let u = |v: i32| u64::try_from(v).ok().filter(|v| *v > 0);
        let (heads, kv, hd) = (u(g.query_heads)?, u(g.kv_heads)?, u(g.head_dim)?);
        let d = match g.hidden_size {
            Some(h) => u(h)?,
            None => heads * hd,
        };
        let ff = match g.intermediate_size {
            Some(f) => u(f)?,
            None => default_d_ff(d),
        };
        let vocab = match g.vocab_size {
            Some(v) => u(v)?,
            None => DEFAULT_VOCAB,
        };
        Some(EngineShape {
            layers: u(g.layers)?,
            d_model: d,
            d_ff: ff,
            vocab,
            n_heads: heads,
            n_kv_heads: kv,
            head_dim: hd,
            kv_rep: kv_replication(heads, kv)?.0,
            rope_dims: hd,
            tied_embeddings: false,
            attn_bias: false,
            qk_norm: false,
            gemma3: false,
            fp8_linear: false,
        })
    }

    /// Q and K/V widths: `n_heads x head_dim`, `n_kv_heads x head_dim`.
    fn widths(&self) -> (u64, u64) {
        (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim)
    }

    /// Bytes of every tensor the GPU loader allocates: bf16 matrices (Q/K/V and gate/up
    /// fused, the embedding and an untied head), f32 norms, biases and RoPE frequencies.
    pub fn weight_bytes(&self) -> u64 {
        let (d, ff, (qw, kw)) = (self.d_model, self.d_ff, self.widths());
        let layer_bf16 = (qw + 2 * kw) * d + d * qw + 2 * ff * d + d * ff;
        let head = if self.tied_embeddings { 1 } else { 2 };
        // FP8: the linear matrices at one byte a weight, and an f32 scale a row of each.
        let (layer_bf16, layer_fp8) = if self.fp8_linear {
            let rows = (qw + 2 * kw) + d + 2 * ff + d;
            (0, layer_bf16 + 4 * rows)
        } else {
            (layer_bf16, 0)
        };
        let bf16 = self.layers * layer_bf16 + head * self.vocab * d;
        let mut layer_f32 = 2 * d;
        if self.attn_bias {
            layer_f32 += qw + 2 * kw;
        }
        if self.qk_norm {
            layer_f32 += 2 * self.head_dim;
        }
        if self.gemma3 {
            layer_f32 += 2 * d;
        }
        let tables = if self.gemma3 { 2 } else { 1 };
        let f32s = self.layers * layer_f32 + d + tables * (self.rope_dims / 2);
        2 * bf16 + 4 * f32s + self.layers * layer_fp8
    }

    /// Bytes of the activation workspace for steps of `tokens` tokens and `rows` logit rows
    /// (both at least 1), as the GPU arena allocates it: f32 residual stream, fused Q/K/V and
    /// gate/up outputs and logits; bf16 normed inputs, Q, stored K and V, attention output,
    /// MLP activation and normed last rows; i32 tokens, positions, rows and picks; the rows'
    /// sampling words; Gemma 3's f32 sublayer output (one element otherwise).
    pub fn activation_bytes(&self, tokens: u64, rows: u64) -> u64 {
        let (t, r) = (tokens.max(1), rows.max(1));
        let (d, ff, (qw, kw)) = (self.d_model, self.d_ff, self.widths());
        let kw_rep = kw * self.kv_rep;
        let proj = if self.gemma3 { t * d } else { 1 };
        let f32s = t * d + t * (qw + 2 * kw) + t * 2 * ff + r * self.vocab + proj;
        let bf16s = t * d + 2 * t * qw + 2 * t * kw_rep + t * ff + r * d;
        let i32s = 2 * t + 2 * r + PICK_WORDS * r;
        4 * f32s + 2 * bf16s + 4 * i32s + self.fp8_activation_bytes(t)
    }

    /// FP8 linear layers: a GEMM's input quantized (the widest: d, the Q width or ff), a scale a
    /// token, an f32 output `[t, d]` the scales are applied to before the residual add, and the
    /// cuBLASLt workspace. 0 otherwise.
    fn fp8_activation_bytes(&self, t: u64) -> u64 {
        if !self.fp8_linear {
            return 0;
        }
        let (d, ff, (qw, _)) = (self.d_model, self.d_ff, self.widths());
        t * d.max(qw).max(ff) + 4 * t + 4 * t * d + FP8_GEMM_WORKSPACE_BYTES
    }
}

/// The vocabulary of dummy weights whose geometry gives none.
pub const DEFAULT_VOCAB: u64 = 32_000;

/// The MLP width of dummy weights whose geometry gives none: 8/3 x hidden, rounded up to 256.
pub fn default_d_ff(d_model: u64) -> u64 {
    (d_model * 8 / 3).div_ceil(256) * 256
}

/// The KV budget of one GPU under kvfleet's engine, term by term.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct EngineMemory {
    pub total_bytes: u64,
    pub gpu_memory_utilization: f64,
    /// floor(total x utilisation).
    pub requested_bytes: u64,
    pub weight_bytes: u64,
    pub activation_bytes: u64,
    pub context_reserve_bytes: u64,
    /// requested - weights - activations - context reserve (0 when negative).
    pub kv_budget_bytes: u64,
}

impl EngineMemory {
    /// The budget of `total` bytes at `util` for weights and activations of these sizes.
    pub fn new(total: u64, util: f64, weight_bytes: u64, activation_bytes: u64) -> EngineMemory {
        let util = util.clamp(0.0, 1.0);
        let requested = (total as f64 * util).floor() as u64;
        EngineMemory {
            total_bytes: total,
            gpu_memory_utilization: util,
            requested_bytes: requested,
            weight_bytes,
            activation_bytes,
            context_reserve_bytes: CONTEXT_RESERVE_BYTES,
            kv_budget_bytes: requested
                .saturating_sub(weight_bytes)
                .saturating_sub(activation_bytes)
                .saturating_sub(CONTEXT_RESERVE_BYTES),
        }
    }

    /// The budget of `shape` with activations for `tokens` batched tokens and `rows` logit
    /// rows (maxNumBatchedTokens, maxNumSeqs).
    pub fn for_shape(total: u64, util: f64, shape: &EngineShape, tokens: u64, rows: u64) -> EngineMemory {
        EngineMemory::new(
            total,
            util,
            shape.weight_bytes(),
            shape.activation_bytes(tokens, rows),
        )
    }

    /// What the pools get when `free` bytes are measured free after weights and activations:
    /// the budget, or `free - MIN_FREE_BYTES` when that is less.
    pub fn kv_bytes(&self, free: u64) -> u64 {
        self.kv_budget_bytes.min(free.saturating_sub(MIN_FREE_BYTES))
    }
}

/// The layers of `geometry` with each KV head stored `kv_rep` times, as the GPU engine's
/// pools hold them.
pub fn stored_geometry(geometry: &Geometry, kv_rep: u64) -> Result<Geometry, PlanError> {
    let rep = u32::try_from(kv_rep)
        .ok()
        .filter(|r| *r > 0)
        .ok_or_else(|| PlanError::InvalidInput(format!("KV head replication {kv_rep}")))?;
    let mut g = geometry.clone();
    if rep > 1 {
        for l in &mut g.layers {
            l.kv_heads = l.kv_heads.saturating_mul(rep);
        }
        g.notes.push(format!(
            "each KV head stored {rep} times (the GPU kernels' GQA groups are 1, 2, 4, 8)"
        ));
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_3_1_8b() -> EngineShape {
        EngineShape {
            layers: 32,
            d_model: 4096,
            d_ff: 14336,
            vocab: 128_256,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            kv_rep: 1,
            rope_dims: 128,
            tied_embeddings: false,
            attn_bias: false,
            qk_norm: false,
            gemma3: false,
            fp8_linear: false,
        }
    }

    #[test]
    fn fp8_linear_layers_take_a_byte_a_weight_and_the_fp8_gemm_buffers() {
        let bf16 = llama_3_1_8b();
        let fp8 = EngineShape {
            fp8_linear: true,
            ..bf16
        };
        let geometry: crate::api::ModelGeometry = serde_json::from_value(serde_json::json!({
            "layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128,
            "hiddenSize": 4096, "intermediateSize": 14336, "vocabSize": 128256
        }))
        .unwrap();
        // The weights the admission planner counts for `engine.quantization: fp8`.
        let linear = super::super::weights::LinearLayers::of(&geometry).unwrap();
        assert_eq!(Some(fp8.weight_bytes()), linear.fp8_bytes(bf16.weight_bytes()));
        // The quantized input (14,336 wide: ff), a scale a token, an f32 [t, 4096] output and
        // cuBLASLt's 32 MiB workspace.
        let t = 2048;
        assert_eq!(
            fp8.activation_bytes(t, 256) - bf16.activation_bytes(t, 256),
            t * 14336 + 4 * t + 4 * t * 4096 + (32 << 20)
        );
    }

    #[test]
    fn llama_3_1_8b_activations_are_the_bytes_the_worker_profiled() {
        // The figure the H100 worker logged for 2,048 tokens and 256 rows (issue 33).
        assert_eq!(llama_3_1_8b().activation_bytes(2048, 256), 569_663_492);
    }

    #[test]
    fn llama_3_1_8b_weights_are_its_parameters_in_bf16_with_f32_norms() {
        // 8,030,261,248 parameters; the 266,240 norm weights are f32, plus 64 RoPE frequencies.
        let bf16_params = 8_030_261_248u64 - 266_240;
        assert_eq!(
            llama_3_1_8b().weight_bytes(),
            2 * bf16_params + 4 * (266_240 + 64)
        );
    }

    #[test]
    fn gemma_and_replicated_heads_add_their_buffers() {
        let base = llama_3_1_8b();
        let gemma = EngineShape { gemma3: true, ..base };
        assert_eq!(
            gemma.activation_bytes(100, 3) - base.activation_bytes(100, 3),
            4 * (100 * 4096 - 1)
        );
        assert_eq!(
            gemma.weight_bytes() - base.weight_bytes(),
            4 * (32 * 2 * 4096 + 64)
        );
        let rep = EngineShape { kv_rep: 3, ..base };
        assert_eq!(
            rep.activation_bytes(10, 1) - base.activation_bytes(10, 1),
            2 * 2 * 10 * 1024 * 2
        );
        assert_eq!(kv_replication(9, 3), Some((3, 1)));
        assert_eq!(kv_replication(32, 8), Some((1, 4)));
        assert_eq!(kv_replication(64, 4), Some((2, 8)));
        assert_eq!(kv_replication(10, 4), None);
    }

    #[test]
    fn the_budget_subtracts_every_term_and_the_pools_take_less_only_when_less_is_free() {
        let m = EngineMemory::new(80 << 30, 0.9, 16 << 30, 1 << 30);
        let requested = ((80u64 << 30) as f64 * 0.9).floor() as u64;
        assert_eq!(m.kv_budget_bytes, requested - (17 << 30) - CONTEXT_RESERVE_BYTES);
        assert_eq!(m.kv_bytes(u64::MAX), m.kv_budget_bytes);
        assert_eq!(m.kv_bytes(1 << 30), (1 << 30) - MIN_FREE_BYTES);
        assert_eq!(EngineMemory::new(1 << 30, 0.9, 1 << 30, 0).kv_budget_bytes, 0);
    }

    #[test]
    fn spec_geometry_defaults_are_those_of_dummy_weights() {
        let g: ModelGeometry =
            serde_json::from_str(r#"{"layers": 2, "queryHeads": 4, "kvHeads": 2, "headDim": 64}"#).unwrap();
        let s = EngineShape::for_spec(&g).unwrap();
        assert_eq!((s.d_model, s.d_ff, s.vocab), (256, 768, 32_000));
        let sliding: ModelGeometry = serde_json::from_str(
            r#"{"layers": 2, "queryHeads": 4, "kvHeads": 2, "headDim": 64, "slidingWindow": 8}"#,
        )
        .unwrap();
        assert!(EngineShape::for_spec(&sliding).is_none());
    }
}

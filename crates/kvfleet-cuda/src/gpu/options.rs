//! What the GPU model is asked for ([`GpuOptions`]) and what it got ([`GpuCapacity`]).

use kvfleet_engine::engine::capacity::ModelLayer;
use kvfleet_engine::engine::layout::KvDtype;

/// Tokens per KV page (the only page size the attention kernels build).
pub const BLOCK_SIZE: usize = 16;

/// What a speculative drafter takes of the memory the KV pools would otherwise get: its weights
/// and buffers, and its K/V per token of the model's pages (its pool has as many pages as the
/// model's draft group, `BackendConfig::draft_group`). `DraftReserve::of` (in `drafter`) works
/// it out for a loaded drafter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftReserve {
    pub fixed_bytes: usize,
    /// K and V of every drafter layer, one token: what [`DraftReserve::kv_layers`] store.
    pub kv_bytes_per_token: usize,
    /// The drafter's K/V layers (full attention) and their shape, K/V heads as the kernels
    /// store them (replicated).
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl DraftReserve {
    /// The drafter's layers as entries of the per-layer KV list, to follow the model's own:
    /// full-attention layers of the drafter's heads and head dim.
    pub fn kv_layers(&self) -> Vec<ModelLayer> {
        let l = ModelLayer {
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: None,
        };
        vec![l; self.layers]
    }
}

/// Options of the GPU model.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuOptions {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// KV-cache dtype (any the attention kernels build: bf16, f16, fp8, nvfp4).
    pub kv_dtype: KvDtype,
    /// Tokens per forward pass the activation buffers are sized for (larger batches grow them).
    pub max_batched_tokens: usize,
    /// Logit rows per forward pass the buffers are sized for.
    pub max_num_seqs: usize,
    /// Cap on KV tokens; `None`: the whole KV budget.
    pub max_kv_tokens: Option<usize>,
    /// Tokens per KV page.
    pub block_size: usize,
    /// Fraction of the device's memory kvfleet may use (vLLM's `gpu_memory_utilization`): the
    /// KV pools get `floor(it x total)` less the weights, the activations and the context
    /// reserve (`plan::engine_memory`), or less when less is free.
    pub gpu_memory_utilization: f64,
    /// Bytes left free after the KV pools instead: the pools get `free - it` (no prediction).
    pub memory_margin_bytes: Option<usize>,
    /// The device's memory as NVML reports it (and GPU Feature Discovery labels it,
    /// `nvidia.com/gpu.memory`): the total the KV budget is a share of, so that `kvfleet check`,
    /// which knows only that figure, predicts the pools. CUDA reports less (an H200: 150,109,880,320
    /// bytes against NVML's 150,754,820,096). `None`: CUDA's total.
    pub reported_total_bytes: Option<usize>,
    /// Run the attention kernels' self-test on the served geometry and dtype before
    /// allocating the pools (the worker's preflight).
    pub self_test: bool,
    /// Tokens of one request at most (the engine's maxModelLen): a model with sliding-window
    /// layers splits the KV memory between its layer groups by what one such request needs
    /// from each. `None`: the model's context length.
    pub max_model_len: Option<usize>,
    /// Steps of one token run their projections as fused GEMVs (`kernels/gemv.cu`) rather
    /// than cuBLAS GEMMs with separate norm and SwiGLU kernels. Off only to compare the two.
    pub single_token_gemv: bool,
    /// With `single_token_gemv`, the Q/K/V GEMV of a one-token step also writes the token's K/V
    /// into the cache (bf16, f16 and fp8 caches; nvfp4 keeps the append kernel), which takes the
    /// append launch off every layer of the step: logits bit-equal to the launch's for every KV
    /// dtype (`gpu_kv_written_by_the_qkv_gemv_equals_the_append_launch`), one stream 1-2%
    /// faster on an H200 (bench/RESULTS.md, 2026-12-01). Off only to compare the two.
    pub single_token_append: bool,
    /// Linear-layer weights in FP8 e4m3 with one scale per output channel (`--quantization
    /// fp8`): GEMVs stream one byte a weight, larger steps run cuBLASLt's FP8 GEMMs on
    /// activations quantized per token. Embeddings, the LM head and norms stay bf16/f32.
    /// Needs compute capability 8.9 or later.
    pub fp8_weights: bool,
    /// A speculative drafter to run beside the model: its weights, buffers and K/V come out
    /// of the KV budget before the pages are counted (its pool has as many pages).
    pub drafter: Option<DraftReserve>,
    /// The lab knobs, each at what the measurements kept unless set (`GpuTuning::from_env`).
    pub tuning: GpuTuning,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            ordinal: 0,
            kv_dtype: KvDtype::Bf16,
            max_batched_tokens: 1024,
            max_num_seqs: 256,
            max_kv_tokens: None,
            block_size: BLOCK_SIZE,
            gpu_memory_utilization: 0.9,
            memory_margin_bytes: None,
            reported_total_bytes: None,
            self_test: false,
            max_model_len: None,
            single_token_gemv: true,
            single_token_append: true,
            fp8_weights: false,
            drafter: None,
            tuning: GpuTuning::default(),
        }
    }
}

/// Where the GPU's memory went; the KV capacity in tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCapacity {
    pub device: String,
    /// The total the KV budget is a share of: NVML's when the worker knows it, else CUDA's.
    pub total_bytes: usize,
    pub weight_bytes: usize,
    pub activation_bytes: usize,
    /// Free bytes after weights and activations, before the KV pools.
    pub free_bytes: usize,
    /// Bytes left free after the KV pools' memory (`free_bytes - kv_bytes`).
    pub margin_bytes: usize,
    /// The KV budget (`plan::engine_memory`: what `kvfleet check` predicts), or `free - margin`
    /// under an explicit `memory_margin_bytes`.
    pub kv_budget_bytes: usize,
    /// Bytes the pools were given: the budget, or less when less was free.
    pub kv_bytes: usize,
    /// KV bytes per token over all layers (K and V, replicated heads included).
    pub kv_bytes_per_token: usize,
    /// KV heads stored per layer (`n_kv_heads * kv_rep`).
    pub kv_heads_stored: usize,
    /// Pages of every layer the KV memory holds. A model with sliding-window layers (Gemma 3)
    /// gets the same bytes split between its layer groups (the model's `kv_config` has each
    /// group's pages), so these are the pages of a full-layer budget of the same memory.
    pub blocks: usize,
    pub block_size: usize,
    /// `blocks * block_size`.
    pub kv_tokens: usize,
    /// Bytes a speculative drafter took out of the KV budget (weights, buffers and its pool).
    pub drafter_bytes: usize,
}

impl GpuCapacity {
    /// Tokens the generation loop may reserve: every running sequence may waste up to a
    /// page minus one token in its last page.
    pub fn admission_tokens(&self, max_num_seqs: usize) -> usize {
        self.kv_tokens
            .saturating_sub(max_num_seqs * (self.block_size - 1))
            .max(self.block_size.min(self.kv_tokens))
    }
}

/// Which neighbours of the FP8 GEMMs take over the input quantization and the unit-scale
/// epilogue at steps of more than one token (bench/RESULTS.md, 2026-11-28, measures each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Fusion {
    /// RMSNorm writes the QKV and gate/up GEMMs' e4m3 rows and scales (`kvf_rms_norm_fp8`).
    pub norm: bool,
    /// The gate/up rows' scales, SwiGLU and the down projection's quantization in one kernel
    /// (`kvf_silu_quantize_fp8`).
    pub glu: bool,
    /// The Q/K/V split applies the QKV GEMM's scales as it reads (`kvf_qkv_post(_wide)_fp8`).
    pub qkv: bool,
    /// The O and down projections' unit-scale residual add is done by the RMSNorm after them
    /// (`kvf_add_rms_norm_fp8`; with `norm` only, and where no layer's features are kept).
    pub add: bool,
}

impl Fp8Fusion {
    pub const ALL: Fp8Fusion = Fp8Fusion {
        norm: true,
        glu: true,
        qkv: true,
        add: true,
    };
    pub const NONE: Fp8Fusion = Fp8Fusion {
        norm: false,
        glu: false,
        qkv: false,
        add: false,
    };
}

/// How cuBLASLt's FP8 GEMMs meet the scales (`super::lt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scales {
    /// Per-row and unit scales timed once a bucket of token counts and `(n, k)` where the
    /// library takes per-row scales, the faster kept for the bucket.
    Timed,
    /// Per-row scales for every shape the library takes them for, unit scales for the others.
    PerRow,
    /// Unit scales everywhere (the path of GPUs and libraries without per-row scales, to test
    /// and time it anywhere).
    Unit,
}

/// The most tokens `kvf_gemm_fp8_skinny` takes: B's 8 columns of `mma.m16n8k32`.
pub(crate) const SKINNY_MAX: usize = 8;
/// Blocks per SM the one-token GEMVs' grid is capped at (warps then stride over the matrix).
const GEMV_BLOCKS_PER_SM: usize = 4;

/// The GPU model's lab knobs. Defaults are what bench/RESULTS.md kept.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuTuning {
    /// FP8 projections whose row pairs do not fill the capped GEMV grid (O and down) take a row
    /// a warp (`kvf_gemv_fp8_row`; `KVFLEET_FP8_GEMV_ROW=0` keeps the pair).
    pub fp8_gemv_row: bool,
    /// The one-token GEMVs' grid cap in blocks per SM (`KVFLEET_GEMV_BLOCKS_PER_SM`; 0: none).
    pub gemv_blocks_per_sm: usize,
    /// The one-token Q/K/V GEMV splits, rotates and appends in its epilogue
    /// (`KVFLEET_GEMV_QKV=0` keeps the separate `kvf_qkv_post`).
    pub gemv_qkv_split: bool,
    /// Steps of 2 to this many tokens run their FP8 GEMMs on `kvf_gemm_fp8_skinny` instead of
    /// cuBLASLt (`KVFLEET_FP8_SKINNY`: a count, `off` or 0 for never; at most [`SKINNY_MAX`]).
    pub fp8_skinny_max: usize,
    /// The skinny GEMM takes units of 16 rows where 32 leave under two blocks an SM
    /// (`KVFLEET_FP8_SKINNY_UNIT=32` keeps 32 everywhere).
    pub fp8_skinny_unit16: bool,
    /// What the FP8 GEMMs' neighbours fuse (`KVFLEET_FP8_FUSE`: `all`, `none` or a list).
    pub fp8_fusion: Fp8Fusion,
    /// The FP8 GEMMs' scale path (`KVFLEET_FP8_UNIT_SCALES`: unset timed, `0` per-row, `1` unit).
    pub fp8_scales: Fp8Scales,
    /// Split decode steps merge in `kvf_decode` rather than a `kvf_merge` launch
    /// (`KVFLEET_FUSED_MERGE=0` keeps the launch).
    pub fused_merge: bool,
    /// CUDA-event timing of each part of a step, and of the serving loop's host parts
    /// (`KVFLEET_PROFILE=1`; [`crate::profile`]).
    pub profile: bool,
}

impl Default for GpuTuning {
    fn default() -> Self {
        GpuTuning {
            fp8_gemv_row: true,
            gemv_blocks_per_sm: GEMV_BLOCKS_PER_SM,
            gemv_qkv_split: true,
            fp8_skinny_max: SKINNY_MAX,
            fp8_skinny_unit16: true,
            fp8_fusion: Fp8Fusion::ALL,
            fp8_scales: Fp8Scales::Timed,
            fused_merge: true,
            profile: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_leaves_one_partial_page_per_sequence() {
        let cap = GpuCapacity {
            device: "x".into(),
            total_bytes: 0,
            weight_bytes: 0,
            activation_bytes: 0,
            free_bytes: 0,
            margin_bytes: 0,
            kv_budget_bytes: 0,
            kv_bytes: 0,
            kv_bytes_per_token: 1,
            kv_heads_stored: 1,
            blocks: 100,
            block_size: 16,
            kv_tokens: 1600,
            drafter_bytes: 0,
        };
        assert_eq!(cap.admission_tokens(10), 1600 - 150);
        assert_eq!(cap.admission_tokens(1000), 16, "never below one page");
    }
}

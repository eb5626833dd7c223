//! Table-driven tests of both rule sets and of `auto` resolution on every architecture.

use std::collections::BTreeSet;

use super::rules::{evaluate, KVFLEET_RULES, VLLM_RULES};
use super::vocab::{
    AttentionBackend as B, KvCacheDtype as D, Quantization as Q, Runtime, SpeculativeMethod as S,
};
use super::{ComputeCapability, ModelFeatures};

fn cc(s: &str) -> ComputeCapability {
    s.parse().unwrap()
}

#[derive(Clone, Copy, Debug)]
enum Model {
    /// Llama-style: head dim 128, all full attention.
    Llama,
    /// Gemma 2/3-style: head dim 256, sliding + full layers.
    Gemma2,
    /// Gemma 4-style: sliding head 256, global head 512, sliding + full layers.
    Gemma4,
    /// Llama with a quantized checkpoint.
    LlamaAwq,
    /// Non-causal drafter, head dim 128.
    Drafter,
    /// DeepSeek-style MLA.
    Mla,
    /// Head dim 128 with 6 query heads per KV head (outside the CUDA kernels' groups).
    Gqa6,
    /// Llama served with 32-token pages.
    Block32,
    /// Llama with GQA 8 and 16-token pages (exactly what the kernels are specialised for).
    Gqa8Block16,
    /// A non-causal model with sliding-window layers.
    SlidingEncoder,
    /// Llama from an FP8 checkpoint (GQA 8, 16-token pages).
    LlamaFp8,
    /// Llama quantized to FP8 at load (`engine.quantization: fp8`).
    LlamaFp8AtLoad,
    /// Llama with n-gram speculative decoding.
    SpecNgram,
    /// Llama with an EAGLE-3 drafter.
    SpecEagle3,
    /// A Gemma 3-style model (sliding-window layers) with an EAGLE-3 drafter.
    SpecEagle3Sliding,
    /// Llama with a DFlash drafter (non-causal drafter attention, as validation sets it).
    SpecDflash,
    /// A Gemma 3-style model with a DFlash drafter.
    SpecDflashSliding,
    /// Qwen3-30B-A3B: mixture of experts, its architecture named.
    Qwen3Moe,
    /// A mixture-of-experts geometry without an architecture.
    AnonymousMoe,
    /// An architecture nobody serves here.
    Gpt2,
    /// Llama in 4-bit formats.
    LlamaAwq4,
    LlamaGptq,
    LlamaW4a16,
    LlamaMxfp4,
    LlamaNvfp4,
}

fn quantized(base: ModelFeatures, q: Q) -> ModelFeatures {
    ModelFeatures {
        quantized_checkpoint: true,
        quantization: q,
        ..base
    }
}

fn features(m: Model) -> ModelFeatures {
    let base = ModelFeatures {
        head_dims: vec![128],
        ..ModelFeatures::default()
    };
    match m {
        Model::Llama => base,
        Model::Gemma2 => ModelFeatures {
            head_dims: vec![256],
            sliding_windows: vec![4096],
            per_layer_windows: true,
            ..base
        },
        Model::Gemma4 => ModelFeatures {
            head_dims: vec![256, 512],
            sliding_windows: vec![1024],
            per_layer_windows: true,
            ..base
        },
        Model::Qwen3Moe => ModelFeatures {
            moe: true,
            architecture: Some("Qwen3MoeForCausalLM".into()),
            ..base
        },
        Model::AnonymousMoe => ModelFeatures { moe: true, ..base },
        Model::Gpt2 => ModelFeatures {
            architecture: Some("GPT2LMHeadModel".into()),
            ..base
        },
        Model::LlamaAwq4 => quantized(base, Q::Awq),
        Model::LlamaGptq => quantized(base, Q::Gptq),
        Model::LlamaW4a16 => quantized(base, Q::W4a16),
        Model::LlamaMxfp4 => quantized(base, Q::Mxfp4),
        Model::LlamaNvfp4 => quantized(base, Q::Nvfp4),
        Model::LlamaAwq => ModelFeatures {
            quantized_checkpoint: true,
            ..base
        },
        Model::Drafter => ModelFeatures {
            non_causal: true,
            ..base
        },
        Model::Mla => ModelFeatures {
            head_dims: vec![576],
            mla: true,
            ..base
        },
        Model::Gqa6 => ModelFeatures {
            gqa_groups: vec![6],
            ..base
        },
        Model::Block32 => ModelFeatures {
            block_size: Some(32),
            ..base
        },
        Model::Gqa8Block16 => ModelFeatures {
            gqa_groups: vec![8],
            block_size: Some(16),
            ..base
        },
        Model::SlidingEncoder => ModelFeatures {
            sliding_windows: vec![512],
            non_causal: true,
            ..base
        },
        Model::LlamaFp8 => ModelFeatures {
            quantized_checkpoint: true,
            fp8_weights: true,
            gqa_groups: vec![8],
            block_size: Some(16),
            ..base
        },
        Model::LlamaFp8AtLoad => ModelFeatures {
            fp8_weights: true,
            fp8_at_load: true,
            gqa_groups: vec![8],
            block_size: Some(16),
            ..base
        },
        Model::SpecNgram => ModelFeatures {
            speculative: Some(S::Ngram),
            ..base
        },
        Model::SpecEagle3 => ModelFeatures {
            speculative: Some(S::Eagle3),
            ..base
        },
        Model::SpecEagle3Sliding => ModelFeatures {
            speculative: Some(S::Eagle3),
            sliding_windows: vec![512],
            per_layer_windows: true,
            ..base
        },
        Model::SpecDflash => ModelFeatures {
            speculative: Some(S::Dflash),
            non_causal: true,
            ..base
        },
        Model::SpecDflashSliding => ModelFeatures {
            speculative: Some(S::Dflash),
            non_causal: true,
            non_causal_drafter_only: true,
            sliding_windows: vec![512],
            per_layer_windows: true,
            ..base
        },
    }
}

enum Want {
    /// Runs, resolved to this dtype and backend.
    Runs(D, B),
    /// Denied; the violations include this rule and the message contains this text.
    Denied(&'static str, &'static str),
}

use Model::*;
use Want::*;

const V: Runtime = Runtime::Vllm;
const K: Runtime = Runtime::Kvfleet;

#[rustfmt::skip]
fn table() -> Vec<(Runtime, &'static str, Model, D, B, Want)> {
    vec![
        // --- vLLM: nvfp4 only on family 100 (vllm#43562, vllm#43669)
        (V, "12.0", Llama, D::Nvfp4, B::Auto, Denied("vllm.nvfp4-kv-needs-sm100", "needs compute capability 10.0 or 10.3 (B200/B300); use fp8")),
        (V, "9.0", Llama, D::Nvfp4, B::Auto, Denied("vllm.nvfp4-kv-needs-sm100", "use fp8")),
        (V, "8.6", Llama, D::Nvfp4, B::Auto, Denied("vllm.nvfp4-kv-needs-sm100", "use fp8_e5m2")),
        (V, "10.0", Llama, D::Nvfp4, B::Auto, Runs(D::Nvfp4, B::FlashInfer)),
        (V, "10.3", Llama, D::Nvfp4, B::Auto, Runs(D::Nvfp4, B::FlashInfer)),
        // --- fp8 e4m3 in Triton below 8.9 (vllm#26431, vllm#7714, vllm#39133)
        (V, "8.6", Llama, D::Fp8E4m3, B::Auto, Denied("vllm.fp8-e4m3-needs-sm89-in-triton", "use fp8_e5m2")),
        (V, "8.0", Llama, D::Fp8, B::Auto, Denied("vllm.fp8-e4m3-needs-sm89-in-triton", "fp8 (fp8_e4m3)")),
        (V, "8.7", Llama, D::Fp8E4m3, B::TritonAttn, Denied("vllm.fp8-e4m3-needs-sm89-in-triton", "below compute capability 8.9")),
        (V, "8.9", Llama, D::Fp8E4m3, B::Auto, Runs(D::Fp8E4m3, B::FlashInfer)),
        (V, "8.9", Llama, D::Fp8E4m3, B::TritonAttn, Runs(D::Fp8E4m3, B::TritonAttn)),
        // --- fp8 with FLASH_ATTN needs FA3 = family 90 (vllm#24577)
        (V, "8.9", Llama, D::Fp8, B::FlashAttn, Denied("vllm.flash-attn-fp8-needs-fa3", "use attentionBackend auto, FLASHINFER or TRITON_ATTN")),
        (V, "10.0", Llama, D::Fp8E5m2, B::FlashAttn, Denied("vllm.flash-attn-fp8-needs-fa3", "FlashAttention 3")),
        (V, "9.0", Llama, D::Fp8, B::Auto, Runs(D::Fp8, B::FlashAttn)),
        (V, "8.6", Llama, D::Fp8E5m2, B::Auto, Runs(D::Fp8E5m2, B::FlashInfer)),
        // --- fp8_e5m2 with a quantized checkpoint (vllm#39133)
        (V, "9.0", LlamaAwq, D::Fp8E5m2, B::Auto, Denied("vllm.fp8-e5m2-with-quantized-checkpoint", "use fp8")),
        (V, "8.6", LlamaAwq, D::Fp8E5m2, B::Auto, Denied("vllm.fp8-e5m2-with-quantized-checkpoint", "use bfloat16")),
        (V, "9.0", LlamaAwq, D::Fp8, B::Auto, Runs(D::Fp8, B::FlashAttn)),
        // --- bfloat16 needs 8.0; auto falls back to float16 (vllm/platforms/cuda.py)
        (V, "7.5", Llama, D::Bfloat16, B::Auto, Denied("vllm.bfloat16-needs-sm80", "use float16")),
        (V, "7.5", Llama, D::Auto, B::Auto, Runs(D::Float16, B::TritonAttn)),
        // --- FA2 and FlashInfer floors at 8.0 (FA README, vllm#47549)
        (V, "7.5", Llama, D::Float16, B::FlashAttn, Denied("vllm.flash-attn-needs-sm80", "TRITON_ATTN")),
        (V, "7.5", Llama, D::Float16, B::FlashInfer, Denied("vllm.flashinfer-needs-sm80", "prefill fails")),
        // --- FlashInfer on sm_120 (vllm#40153, vllm#40677)
        (V, "12.0", Llama, D::Auto, B::FlashInfer, Denied("vllm.flashinfer-sm120-prefill-crash", "use attentionBackend TRITON_ATTN")),
        (V, "12.1", Llama, D::Bfloat16, B::FlashInfer, Denied("vllm.flashinfer-sm120-prefill-crash", "prefill_wrapper.plan()")),
        // --- FlashInfer: one window for all layers (infer_global_hyperparameters, vllm#39995)
        (V, "9.0", Gemma2, D::Auto, B::FlashInfer, Denied("vllm.flashinfer-one-window-for-all-layers", "sliding-window (4096) and full-attention layers")),
        (V, "10.0", Gemma2, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        // --- FlashInfer: non-causal (vllm#39995, fi#3335)
        (V, "9.0", Drafter, D::Auto, B::FlashInfer, Denied("vllm.flashinfer-non-causal", "FLASH_ATTN or TRITON_ATTN")),
        (V, "10.0", Drafter, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        // --- head dims (vllm#40677; FA README)
        (V, "10.0", Gemma4, D::Auto, B::FlashInfer, Denied("vllm.flashinfer-head-dims", "this model has 256, 512")),
        (V, "9.0", Gemma4, D::Auto, B::FlashAttn, Denied("vllm.flash-attn-head-dims", "up to 256")),
        (V, "12.0", Gemma4, D::Auto, B::Auto, Runs(D::Bfloat16, B::TritonAttn)),
        (V, "9.0", Gemma4, D::Fp8, B::Auto, Runs(D::Fp8, B::TritonAttn)),
        // --- MLA (docs/design/attention_backends.md)
        (V, "9.0", Mla, D::Auto, B::TritonAttn, Denied("vllm.mla-model-needs-mla-backend", "TRITON_MLA")),
        (V, "9.0", Llama, D::Auto, B::TritonMla, Denied("vllm.mla-backend-needs-mla-model", "no kvLoraRank")),
        (V, "8.6", Mla, D::Auto, B::FlashMla, Denied("vllm.flashmla-needs-sm90-or-sm100", "9.x or 10.x")),
        (V, "9.0", Mla, D::Auto, B::FlashMla, Runs(D::Bfloat16, B::FlashMla)),
        (V, "9.0", Mla, D::Auto, B::CutlassMla, Denied("vllm.sm100-mla-backends", "10.0 or 10.3")),
        (V, "10.0", Mla, D::Auto, B::FlashInferMla, Runs(D::Bfloat16, B::FlashInferMla)),
        (V, "8.6", Mla, D::Auto, B::Auto, Runs(D::Bfloat16, B::TritonMla)),
        // --- KVFLEET_* with vLLM
        (V, "9.0", Llama, D::Auto, B::KvfleetCuda, Denied("vllm.kvfleet-backend-needs-kvfleet-runtime", "runtime kvfleet")),
        // --- vLLM auto on every architecture
        (V, "8.0", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "8.6", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "8.7", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "8.9", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "9.0", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "10.0", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashInfer)),
        (V, "10.3", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashInfer)),
        (V, "11.0", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "12.0", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::TritonAttn)),
        (V, "12.1", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::TritonAttn)),
        (V, "12.0", Llama, D::Fp8, B::Auto, Runs(D::Fp8, B::TritonAttn)),
        // --- FP8 weights: W8A8 from 8.9, Marlin weight-only on 8.0-8.7 (a warning), none below
        //     8.0 (vllm fp8.py, compressed_tensors.py, w8a8_utils.py cutlass_fp8_supported)
        (V, "8.9", LlamaFp8, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "9.0", LlamaFp8, D::Fp8, B::Auto, Runs(D::Fp8, B::FlashAttn)),
        (V, "9.0", LlamaFp8AtLoad, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "10.0", LlamaFp8, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashInfer)),
        (V, "12.0", LlamaFp8AtLoad, D::Auto, B::Auto, Runs(D::Bfloat16, B::TritonAttn)),
        (V, "8.6", LlamaFp8, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "8.0", LlamaFp8AtLoad, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "7.5", LlamaFp8, D::Auto, B::Auto, Denied("vllm.fp8-weights-need-sm80", "model.quantization fp8")),
        (V, "7.5", LlamaFp8AtLoad, D::Float16, B::TritonAttn, Denied("vllm.fp8-weights-need-sm80", "L4, L40S")),
        (V, "9.0", LlamaFp8, D::Fp8E5m2, B::Auto, Denied("vllm.fp8-e5m2-with-quantized-checkpoint", "use fp8")),
        // --- speculative decoding: every method in every release here but dflash (below, with
        //     a version); DFlash's non-causal drafter keeps auto off FLASHINFER (vllm#39995)
        (V, "9.0", SpecNgram, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "9.0", SpecEagle3, D::Fp8, B::Auto, Runs(D::Fp8, B::FlashAttn)),
        (V, "10.0", SpecDflash, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "10.0", SpecDflash, D::Auto, B::FlashInfer, Denied("vllm.flashinfer-non-causal", "FLASH_ATTN or TRITON_ATTN")),

        // --- 4-bit weights: vLLM's minimum capability per format (awq.py 75, gptq.py 60,
        //     compressed_tensors_wNa16.py 80, mxfp4.py 80; NVFP4 Marlin from 80, W4A4 from 100)
        (V, "7.0", LlamaAwq4, D::Float16, B::TritonAttn, Denied("vllm.awq-needs-sm75", "7.5 or newer")),
        (V, "7.5", LlamaAwq4, D::Float16, B::TritonAttn, Runs(D::Float16, B::TritonAttn)),
        (V, "5.2", LlamaGptq, D::Float16, B::TritonAttn, Denied("vllm.gptq-needs-sm60", "6.0 or newer")),
        (V, "7.5", LlamaW4a16, D::Float16, B::TritonAttn, Denied("vllm.w4a16-needs-sm80", "8.0 or newer")),
        (V, "8.0", LlamaW4a16, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),
        (V, "7.5", LlamaMxfp4, D::Float16, B::TritonAttn, Denied("vllm.mxfp4-needs-sm80", "8.0 or newer")),
        (V, "7.5", LlamaNvfp4, D::Float16, B::TritonAttn, Denied("vllm.nvfp4-weights-need-sm80", "Blackwell")),
        (V, "10.0", LlamaNvfp4, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashInfer)),
        (K, "9.0", LlamaAwq4, D::Auto, B::Auto, Denied("kvfleet.weight-quantization-served", "does not run awq weights")),
        (K, "9.0", LlamaNvfp4, D::Auto, B::KvfleetCuda, Denied("kvfleet.weight-quantization-served", "Blackwell")),
        (K, "9.0", LlamaMxfp4, D::Auto, B::KvfleetCpu, Denied("kvfleet.weight-quantization-served", "CPU engine")),
        (K, "9.0", LlamaGptq, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        // --- model architectures and mixture of experts (compat::engine)
        (K, "9.0", Qwen3Moe, D::Auto, B::Auto, Denied("kvfleet.architecture-served", "CUDA engine does not serve Qwen3MoeForCausalLM yet")),
        (K, "9.0", Qwen3Moe, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        (K, "9.0", Gpt2, D::Auto, B::KvfleetCpu, Denied("kvfleet.architecture-served", "CPU engine serves LlamaForCausalLM")),
        (K, "9.0", AnonymousMoe, D::Auto, B::Auto, Denied("kvfleet.moe-served", "CUDA engine does not run mixture-of-experts")),
        (V, "9.0", Qwen3Moe, D::Auto, B::Auto, Runs(D::Bfloat16, B::FlashAttn)),

        // --- kvfleet: our engine (kernels/)
        (K, "9.0", Llama, D::Auto, B::FlashInfer, Denied("kvfleet.backend-is-ours", "use attentionBackend auto or KVFLEET_CUDA")),
        (K, "7.0", Llama, D::Float16, B::Auto, Denied("kvfleet.cuda-needs-sm80", "not 7.0")),
        (K, "7.5", Llama, D::Float16, B::Auto, Denied("kvfleet.cuda-needs-sm80", "minComputeCapability")),
        (K, "7.5", Llama, D::Nvfp4, B::KvfleetCuda, Denied("kvfleet.cuda-needs-sm80", "8.0, 8.6")),
        (K, "11.0", Llama, D::Auto, B::Auto, Denied("kvfleet.cuda-needs-sm80", "not 11.0")),
        (K, "9.0", Gqa6, D::Auto, B::Auto, Denied("kvfleet.cuda-gqa-groups", "[6]")),
        (K, "9.0", Block32, D::Auto, B::KvfleetCuda, Denied("kvfleet.cuda-block-size-16", "blockSize is 32")),
        (K, "9.0", SlidingEncoder, D::Auto, B::Auto, Denied("kvfleet.cuda-masks", "causal mask")),
        (K, "9.0", Gemma4, D::Auto, B::Auto, Denied("kvfleet.head-dims", "this model has 256, 512")),
        (K, "9.0", Mla, D::Auto, B::Auto, Denied("kvfleet.no-mla", "use runtime vllm")),
        // --- speculative decoding: n-grams, EAGLE-3 and DFlash on both engines, beside
        // sliding-window models too (issue #36)
        (K, "9.0", SpecNgram, D::Auto, B::Auto, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "9.0", SpecNgram, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        (K, "9.0", SpecEagle3, D::Auto, B::Auto, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "8.9", SpecEagle3, D::Fp8, B::KvfleetCuda, Runs(D::Fp8, B::KvfleetCuda)),
        (K, "9.0", SpecEagle3Sliding, D::Auto, B::Auto, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "9.0", SpecDflashSliding, D::Auto, B::KvfleetCuda, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "9.0", SpecEagle3Sliding, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        (K, "8.9", SpecDflash, D::Fp8, B::Auto, Runs(D::Fp8, B::KvfleetCuda)),
        (K, "9.0", SpecEagle3, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        (K, "9.0", SpecDflash, D::Auto, B::KvfleetCuda, Runs(D::Bfloat16, B::KvfleetCuda)),
        // --- FP8 weights: W8A8 from 8.9 on the GPU, no weight-only path below; the CPU
        // dequantizes FP8 checkpoints and runs engine.quantization fp8 as its reference
        (K, "8.6", LlamaFp8, D::Auto, B::Auto, Denied("kvfleet.fp8-weights-need-sm89", "select GPUs that can: L4, L40S, RTX 4090 (8.9), H100, H200 (9.0)")),
        (K, "8.0", LlamaFp8AtLoad, D::Auto, B::Auto, Denied("kvfleet.fp8-weights-need-sm89", "minComputeCapability \"8.9\"")),
        (K, "8.9", LlamaFp8, D::Auto, B::Auto, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "9.0", LlamaFp8AtLoad, D::Fp8E4m3, B::Auto, Runs(D::Fp8E4m3, B::KvfleetCuda)),
        (K, "12.0", LlamaFp8AtLoad, D::Auto, B::Auto, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "9.0", LlamaFp8AtLoad, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        (K, "8.6", LlamaFp8, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        // kvfleet auto on every architecture; software dequant makes fp8/nvfp4 run on sm_80+
        (K, "9.0", Block32, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        (K, "9.0", Gqa6, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
        (K, "9.0", Gqa8Block16, D::Fp8E4m3, B::Auto, Runs(D::Fp8E4m3, B::KvfleetCuda)),
        (K, "12.1", Gqa8Block16, D::Fp8E5m2, B::Auto, Runs(D::Fp8E5m2, B::KvfleetCuda)),
        (K, "8.0", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "8.6", Llama, D::Fp8E4m3, B::Auto, Runs(D::Fp8E4m3, B::KvfleetCuda)),
        (K, "8.6", LlamaAwq, D::Fp8E5m2, B::Auto, Runs(D::Fp8E5m2, B::KvfleetCuda)),
        (K, "8.7", Llama, D::Nvfp4, B::Auto, Runs(D::Nvfp4, B::KvfleetCuda)),
        (K, "8.9", Gemma2, D::Fp8, B::Auto, Runs(D::Fp8, B::KvfleetCuda)),
        (K, "9.0", Drafter, D::Auto, B::Auto, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "10.0", Llama, D::Nvfp4, B::Auto, Runs(D::Nvfp4, B::KvfleetCuda)),
        (K, "10.3", Llama, D::Auto, B::Auto, Runs(D::Bfloat16, B::KvfleetCuda)),
        (K, "12.0", Llama, D::Nvfp4, B::Auto, Runs(D::Nvfp4, B::KvfleetCuda)),
        (K, "12.1", Gemma2, D::Float16, B::Auto, Runs(D::Float16, B::KvfleetCuda)),
        (K, "9.0", Llama, D::Auto, B::KvfleetCpu, Runs(D::Bfloat16, B::KvfleetCpu)),
    ]
}

#[test]
fn every_row_of_the_rule_table_decides_as_documented() {
    for (runtime, arch, model, dtype, backend, want) in table() {
        let ev = evaluate(runtime, cc(arch), &features(model), dtype, backend);
        let ctx = format!("{runtime} {arch} {model:?} {dtype} {backend}: {ev:#?}");
        match want {
            Runs(d, b) => {
                assert_eq!(ev.resolved, Some((d, b)), "{ctx}");
                assert!(ev.violations.is_empty(), "{ctx}");
            }
            Denied(rule, text) => {
                assert_eq!(ev.resolved, None, "{ctx}");
                let v = ev
                    .violations
                    .iter()
                    .find(|v| v.rule == rule)
                    .unwrap_or_else(|| panic!("{rule} missing: {ctx}"));
                assert!(v.message.contains(text), "{text:?} not in {:?}: {ctx}", v.message);
            }
        }
    }
}

#[test]
fn every_deny_rule_of_both_sets_is_exercised_by_the_table() {
    // The release rule is exercised with a version, below.
    let mut fired = BTreeSet::from([
        "vllm.kv-dtype-needs-release",
        "vllm.speculative-method-needs-release",
    ]);
    for (runtime, arch, model, dtype, backend, want) in table() {
        if let Denied(rule, _) = want {
            let ev = evaluate(runtime, cc(arch), &features(model), dtype, backend);
            if ev.violations.iter().any(|v| v.rule == rule) {
                fired.insert(rule);
            }
        }
    }
    for rule in VLLM_RULES.iter().chain(KVFLEET_RULES) {
        if rule.severity == super::Severity::Deny {
            assert!(fired.contains(rule.id), "no table row exercises {}", rule.id);
        }
    }
}

#[test]
fn flashinfer_cubin_download_is_a_warning_on_sm100_only() {
    let ev = evaluate(V, cc("10.0"), &features(Llama), D::Auto, B::Auto);
    assert_eq!(ev.resolved, Some((D::Bfloat16, B::FlashInfer)));
    assert_eq!(ev.warnings.len(), 1);
    assert_eq!(ev.warnings[0].rule, "vllm.flashinfer-cubins-air-gapped");
    assert!(ev.warnings[0].message.contains("flashinfer-cubin"));
    let ev = evaluate(V, cc("9.0"), &features(Llama), D::Auto, B::FlashInfer);
    assert!(ev.runs() && ev.warnings.is_empty(), "{ev:?}");
}

#[test]
fn fp8_weights_below_sm89_warn_of_marlin_in_vllm_and_nowhere_else() {
    for (arch, model) in [("8.0", LlamaFp8), ("8.6", LlamaFp8), ("8.7", LlamaFp8AtLoad)] {
        let ev = evaluate(V, cc(arch), &features(model), D::Auto, B::Auto);
        assert!(ev.runs(), "{arch}: {ev:?}");
        let w: Vec<_> = ev.warnings.iter().map(|w| w.rule).collect();
        assert_eq!(w, ["vllm.fp8-weights-marlin-below-sm89"], "{arch}");
        let m = &ev.warnings[0].message;
        assert!(m.contains("weight-only FP8 through the Marlin kernels"), "{m}");
        assert!(m.contains(&format!("compute capability {arch}")), "{m}");
        assert!(m.contains("H100"), "{m}");
    }
    for arch in ["8.9", "9.0", "10.0", "10.3", "12.0"] {
        let ev = evaluate(V, cc(arch), &features(LlamaFp8), D::Auto, B::Auto);
        assert!(ev.runs(), "{arch}: {ev:?}");
        assert!(
            ev.warnings
                .iter()
                .all(|w| w.rule != "vllm.fp8-weights-marlin-below-sm89"),
            "{arch}: {ev:?}"
        );
    }
    // Unquantized weights never warn about FP8 GEMMs.
    let ev = evaluate(V, cc("8.6"), &features(Llama), D::Auto, B::Auto);
    assert!(ev.runs() && ev.warnings.is_empty(), "{ev:?}");
}

#[test]
fn every_rule_cites_a_source_and_has_a_pascal_case_reason() {
    let mut ids = BTreeSet::new();
    for rule in VLLM_RULES.iter().chain(KVFLEET_RULES) {
        assert!(ids.insert(rule.id), "duplicate id {}", rule.id);
        assert!(rule.source.len() > 5, "{} has no source", rule.id);
        assert!(!rule.summary.is_empty(), "{} has no summary", rule.id);
        assert!(rule.id.starts_with(rule.runtime.as_str()), "{}", rule.id);
        let first = rule.reason.chars().next().unwrap();
        assert!(
            first.is_ascii_uppercase() && rule.reason.chars().all(|c| c.is_ascii_alphanumeric()),
            "{}",
            rule.reason
        );
        assert!(rule.field.starts_with("spec."), "{}", rule.field);
    }
    for rule in KVFLEET_RULES {
        assert!(rule.source == super::rules::KVFLEET_SOURCE, "{}", rule.id);
    }
}

#[test]
fn auto_failure_reports_the_root_cause_not_every_backend() {
    // nvfp4 on sm_120: the dtype is the cause; FlashInfer's sm_120 crash is noise here.
    let ev = evaluate(V, cc("12.0"), &features(Llama), D::Nvfp4, B::Auto);
    let rules: Vec<_> = ev.violations.iter().map(|v| v.rule).collect();
    assert_eq!(rules, vec!["vllm.nvfp4-kv-needs-sm100"]);
}

#[test]
fn kvfleet_auto_never_picks_the_cpu_backend_for_a_gpu() {
    for arch in [
        "7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "10.3", "11.0", "12.0", "12.1",
    ] {
        for dtype in D::ALL {
            let ev = evaluate(K, cc(arch), &features(Llama), dtype, B::Auto);
            if let Some((_, b)) = ev.resolved {
                assert_eq!(b, B::KvfleetCuda, "{arch} {dtype}");
            }
        }
    }
}

#[test]
fn auto_kv_dtype_stays_the_model_dtype() {
    let fp16_model = ModelFeatures {
        model_dtype: D::Float16,
        ..features(Llama)
    };
    for arch in ["8.0", "9.0", "12.0"] {
        let ev = evaluate(V, cc(arch), &fp16_model, D::Auto, B::Auto);
        assert_eq!(ev.resolved.map(|r| r.0), Some(D::Float16), "{arch}");
        let ev = evaluate(V, cc(arch), &features(Llama), D::Auto, B::Auto);
        assert_eq!(ev.resolved.map(|r| r.0), Some(D::Bfloat16), "{arch}");
    }
}

#[test]
fn nvfp4_kv_before_0_21_is_denied_with_the_release_and_the_image_that_has_it() {
    use crate::compat::{evaluate_at, VllmVersion};
    let at = |v: &str, arch: &str| {
        evaluate_at(
            V,
            cc(arch),
            &features(Llama),
            D::Nvfp4,
            B::Auto,
            VllmVersion::parse(v),
        )
    };
    let ev = at("0.20.2", "10.0");
    assert_eq!(ev.resolved, None);
    let v = ev
        .violations
        .iter()
        .find(|v| v.rule == "vllm.kv-dtype-needs-release")
        .unwrap_or_else(|| panic!("{ev:#?}"));
    for text in [
        "needs vLLM >= 0.21.0",
        "runs vLLM 0.20.2",
        "vllm/vllm-openai:v0.29.0",
        "or use fp8",
    ] {
        assert!(v.message.contains(text), "{text:?} not in {:?}", v.message);
    }
    assert_eq!(at("0.21.0", "10.0").resolved, Some((D::Nvfp4, B::FlashInfer)));
    // The sm_100 rule still holds in every release: a newer release does not lift it.
    let sm120 = at("0.29.0", "12.0");
    assert!(
        sm120
            .violations
            .iter()
            .any(|v| v.rule == "vllm.nvfp4-kv-needs-sm100"),
        "{sm120:#?}"
    );
    // float16 KV arrived in 0.19 (vllm#37199); auto exists everywhere.
    let f16 = evaluate_at(
        V,
        cc("9.0"),
        &features(Llama),
        D::Float16,
        B::Auto,
        VllmVersion::parse("0.14.0"),
    );
    assert!(
        f16.violations
            .iter()
            .any(|v| v.rule == "vllm.kv-dtype-needs-release"),
        "{f16:#?}"
    );
    let auto = evaluate_at(
        V,
        cc("9.0"),
        &features(Llama),
        D::Auto,
        B::Auto,
        VllmVersion::parse("0.11.0"),
    );
    assert!(auto.runs(), "{auto:#?}");
    // auto on sm_75 resolves to float16, but reaches vLLM as auto: no release check.
    let t4 = evaluate_at(
        V,
        cc("7.5"),
        &features(Llama),
        D::Auto,
        B::Auto,
        VllmVersion::parse("0.11.0"),
    );
    assert_eq!(t4.resolved.map(|r| r.0), Some(D::Float16), "{t4:#?}");
    // The kvfleet runtime has no vLLM release.
    let k = evaluate_at(
        K,
        cc("10.0"),
        &features(Llama),
        D::Nvfp4,
        B::Auto,
        VllmVersion::parse("0.11.0"),
    );
    assert!(k.runs(), "{k:#?}");
}

#[test]
fn dflash_before_0_20_is_denied_with_the_release_that_has_it_and_other_methods_run_everywhere() {
    use crate::compat::{evaluate_at, VllmVersion};
    let at = |model: Model, v: &str| {
        evaluate_at(
            V,
            cc("9.0"),
            &features(model),
            D::Auto,
            B::Auto,
            VllmVersion::parse(v),
        )
    };
    let ev = at(SpecDflash, "0.19.0");
    assert_eq!(ev.resolved, None);
    let v = ev
        .violations
        .iter()
        .find(|v| v.rule == "vllm.speculative-method-needs-release")
        .unwrap_or_else(|| panic!("{ev:#?}"));
    assert_eq!(v.field, "spec.engine.speculative.method");
    assert_eq!(v.reason, "UnsupportedByVllmVersion");
    for text in [
        "speculative method dflash needs vLLM >= 0.20.0",
        "runs vLLM 0.19.0",
        "use image vllm/vllm-openai:v0.20.0 or newer",
        "or method ngram",
    ] {
        assert!(v.message.contains(text), "{text:?} not in {:?}", v.message);
    }
    assert!(at(SpecDflash, "0.20.0").runs());
    assert!(at(SpecDflash, "0.29.0").runs());
    for model in [SpecNgram, SpecEagle3] {
        assert!(at(model, "0.11.0").runs(), "{model:?}");
    }
    // No release judged (kvfleet check without a version): the method is not denied.
    assert!(evaluate(V, cc("9.0"), &features(SpecDflash), D::Auto, B::Auto).runs());
}

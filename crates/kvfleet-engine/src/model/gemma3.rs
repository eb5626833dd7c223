//! Gemma 3 on the CPU: what its block does differently from a Llama block, read from its GGUF
//! file, and the math of each departure ([`Block`] for [`Gemma3`]). The layer loop, norms,
//! attention and linears are the shared ones of `llama.rs`.

use rayon::prelude::*;

use super::family::Block;
use super::gguf::{Gguf, GgufError};

/// What a Gemma 3 block does differently from a Llama block. From the GGUF file: the window
/// (`gemma3.attention.sliding_window`), the global RoPE base (`gemma3.rope.freq_base`), QK norms
/// and the post-norms (tensors `attn_{q,k}_norm`, `post_attention_norm`, `post_ffw_norm`), the
/// tied head (no `output.weight`). Not in the file, and read here from Hugging Face
/// transformers `src/transformers/models/gemma3/` (`configuration_gemma3.py`,
/// `modeling_gemma3.py`, v5.23) and llama.cpp `src/llama-model.cpp` (`LLM_ARCH_GEMMA3`):
/// - the layer pattern: layer `i` is local (sliding) unless `(i + 1) % 6 == 0`
///   (`sliding_window_pattern = 6` in transformers' config; `set_swa_pattern(6)` in llama.cpp),
///   so 18 layers are 15 local and 3 global (5, 11, 17);
/// - the local layers' RoPE base 10,000 (`rope_local_base_freq`; llama.cpp
///   `rope_freq_base_train_swa = 10000`), the global layers' from the file;
/// - query scaling `query_pre_attn_scalar ** -0.5`, 256 for the 270M model (transformers'
///   default, which its GGUF loader keeps; llama.cpp: `1 / sqrt(n_embd_head_k)` except 27B);
/// - the embedding scaled by `sqrt(hidden_size)` (`Gemma3TextScaledWordEmbedding`);
/// - GeGLU with the tanh GELU (`hidden_activation = gelu_pytorch_tanh`);
/// - RMSNorm `x * (1 + w)`: llama.cpp's converter stores `1 + w` in the GGUF norm tensors
///   (transformers' GGUF loader subtracts the 1 again, `Gemma2TensorProcessor` in
///   `modeling_gguf_pytorch_utils.py`), so the file's weights multiply as they are;
/// - the rotary layout of the halves (NeoX; llama.cpp `LLAMA_ROPE_TYPE_NEOX` for gemma3,
///   transformers' `rotate_half`), without the Q/K row permutation of `llama` files;
/// - no logit soft-capping (`final_logit_softcapping` and `attn_logit_softcapping` are None).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3 {
    /// Tokens a local layer attends to, itself included (`q_pos - key_pos < window`).
    pub sliding_window: usize,
    /// Every `global_every`-th layer (1-based) attends to the full context.
    pub global_every: usize,
    /// RoPE base of the local layers.
    pub rope_theta_local: f32,
    /// Softmax scale of attention (`query_pre_attn_scalar ** -0.5`).
    pub query_scale: f32,
}

/// Gemma 3's published layer pattern: five local layers, then a global one (transformers'
/// `sliding_window_pattern = 6`, llama.cpp's `set_swa_pattern(6)`). GGUF files of Gemma 3 do not
/// carry it; a file that does (`gemma3.attention.sliding_window_pattern`) wins.
pub const GEMMA3_SLIDING_WINDOW_PATTERN: usize = 6;

impl Gemma3 {
    /// Gemma 3's fixed choices around a window read from the file.
    pub fn new(sliding_window: usize) -> Self {
        Gemma3 {
            sliding_window,
            global_every: GEMMA3_SLIDING_WINDOW_PATTERN,
            rope_theta_local: 10_000.0,
            query_scale: 1.0 / 256f32.sqrt(),
        }
    }

    /// The block of a `gemma3` GGUF file: its window, and its layer pattern where the file has
    /// one.
    pub fn from_gguf(g: &Gguf, arch: &str) -> Result<Self, GgufError> {
        let u = |k: &str| g.get_u64(&format!("{arch}.{k}")).map(|v| v as usize);
        Ok(Gemma3 {
            global_every: u("attention.sliding_window_pattern").unwrap_or(GEMMA3_SLIDING_WINDOW_PATTERN),
            ..Gemma3::new(u("attention.sliding_window")?)
        })
    }

    /// Whether layer `i` attends only within the window.
    pub fn is_local(&self, i: usize) -> bool {
        (i + 1) % self.global_every != 0
    }
}

impl Block for Gemma3 {
    /// The embedding times sqrt(hidden_size), rounded to the weights' dtype first as
    /// transformers does (f32 here).
    fn embed(&self, e: &[f32], out: &mut [f32]) {
        let s = (out.len() as f32).sqrt();
        out.iter_mut().zip(e).for_each(|(o, v)| *o = v * s);
    }

    /// Attention backends scale by 1/sqrt(head_dim); the model's own scale is folded into the
    /// queries (a no-op when query_pre_attn_scalar equals head_dim).
    fn scale_queries(&self, head_dim: usize, q: &mut [f32]) {
        let s = self.query_scale * (head_dim as f32).sqrt();
        if s != 1.0 {
            q.par_iter_mut().for_each(|v| *v *= s);
        }
    }

    /// GeGLU: `gelu_tanh(gate) * up`.
    fn glu(&self, gate: &mut [f32], up: &[f32]) {
        gate.par_iter_mut()
            .zip(up.par_iter())
            .for_each(|(g, u)| *g = gelu_tanh(*g) * u);
    }
}

/// GELU with the tanh approximation: `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`.
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

//! The model on the CPU and the Llama family's block (Llama, Mistral, Qwen2, Qwen3 dense,
//! SmolLM): the config read from a file (one row of [`ARCHITECTURES`] per architecture), and
//! the forward pass every family shares: embeddings, RMSNorm, RoPE, GQA attention through a
//! [`KvAttention`], the gated MLP, tied or separate LM head, with the math of a family's own
//! in its [`Block`] (SwiGLU here; Gemma 3's in `gemma3.rs`). Every projection goes through the
//! linear op ([`Linear`], `linear.rs`), which owns the weight's format: f32 as loaded
//! (dequantised at load, `weights.rs`), or the f32 simulation of FP8 W8A8
//! ([`Llama::quantize_fp8`]), the CPU reference of the GPU's FP8 GEMMs. GEMMs run on our own
//! FMA kernel (every row the same bits whatever the batch: [`matmul_t`]), split across rayon
//! threads.
//!
//! GGUF tensor names and the rotary layout per architecture follow llama.cpp: `llama` files
//! have Q/K rows permuted by the converter so RoPE rotates adjacent pairs (`LLAMA_ROPE_TYPE_NORM`),
//! `qwen2`/`qwen3` rotate the two halves of a head (`LLAMA_ROPE_TYPE_NEOX`)
//! (ggml-org/llama.cpp `src/llama-model.cpp`, `llama_model_rope_type`).

use rayon::prelude::*;

use super::family::Block;
use super::gemma3::Gemma3;
use super::gguf::{Gguf, GgufError};
use super::kv::{AttnGeometry, AttnSeq, KvAttention, KvError, SeqId};
use super::linear::{Linear, LinearQuantization};
use super::moe::{Moe, MoeLayer};
pub use kvfleet_gemm::matmul_t;

/// Errors of loading a model.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(
        "architecture `{0}` is not supported; kvfleet runs llama, mistral, qwen2, qwen3 (dense) and gemma3 models, and from Hugging Face checkpoints qwen3moe, qwen2moe, olmoe and mixtral"
    )]
    Architecture(String),
    #[error("RoPE scaling `{0}` is not supported (only none, linear, and llama3-style rope_freqs)")]
    RopeScaling(String),
    #[error("tensor `{name}` has {got} elements, expected {want} from the model's geometry")]
    Shape { name: String, got: usize, want: usize },
    #[error("invalid geometry: {0}")]
    Geometry(String),
}

/// Errors of running the forward pass.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("token id {0} is outside the vocabulary")]
    Token(u32),
    #[error("position {pos} exceeds the model's context length {ctx}")]
    Context { pos: usize, ctx: usize },
    /// The device's own error (the GPU backend converts its errors into this).
    #[error(transparent)]
    Device(Box<dyn std::error::Error + Send + Sync>),
    /// Something this device or model does not implement (the message says what instead).
    #[error("{0}")]
    Unsupported(String),
}

/// Geometry and hyper-parameters of a Llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub arch: String,
    pub n_layers: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_len: usize,
    pub rope_theta: f32,
    /// Dimensions of each head that RoPE rotates (the leading ones).
    pub rope_dims: usize,
    /// Positions are divided by this (linear RoPE scaling); 1.0 for none.
    pub rope_linear_scale: f32,
    /// Rotate the two halves of a head (NeoX) instead of adjacent pairs.
    pub rope_neox: bool,
    pub rms_eps: f32,
    /// Qwen2: biases on Q, K, V.
    pub attn_bias: bool,
    /// Qwen3: RMSNorm on each Q and K head.
    pub qk_norm: bool,
    /// OLMoE: the Q and K norms span the whole projection (every head at once).
    pub qk_norm_full: bool,
    pub tied_embeddings: bool,
    /// Gemma 3's block (`None` for the Llama family).
    pub gemma3: Option<Gemma3>,
    /// The mixture-of-experts MLP of its sparse layers (`moe.rs`; `None` for dense models).
    pub moe: Option<Moe>,
}

/// One architecture kvfleet runs (GGUF `general.architecture`): how its block departs from a
/// Llama block where the file does not say (rotary layout and QKV biases after llama.cpp's
/// `llama_model_rope_type` and tensor lists), and the reader of a family's own block.
pub struct Architecture {
    pub name: &'static str,
    /// Rotate the two halves of a head (`LLAMA_ROPE_TYPE_NEOX`), not adjacent pairs.
    pub rope_neox: bool,
    /// Biases on Q, K, V.
    pub attn_bias: bool,
    /// RMSNorm on each Q and K head.
    pub qk_norm: bool,
    /// Gemma 3's block, read from the file.
    pub gemma3: Option<ReadGemma3>,
}

/// Reads a family's own block from a GGUF file of architecture `arch`.
pub type ReadGemma3 = fn(g: &Gguf, arch: &str) -> Result<Gemma3, GgufError>;

/// The architectures kvfleet runs: a new one is a row here (and, for a family of its own, a
/// file implementing [`Block`]).
pub const ARCHITECTURES: [Architecture; 5] = [
    Architecture {
        name: "llama",
        rope_neox: false,
        attn_bias: false,
        qk_norm: false,
        gemma3: None,
    },
    Architecture {
        name: "mistral",
        rope_neox: false,
        attn_bias: false,
        qk_norm: false,
        gemma3: None,
    },
    Architecture {
        name: "qwen2",
        rope_neox: true,
        attn_bias: true,
        qk_norm: false,
        gemma3: None,
    },
    Architecture {
        name: "qwen3",
        rope_neox: true,
        attn_bias: false,
        qk_norm: true,
        gemma3: None,
    },
    Architecture {
        name: "gemma3",
        rope_neox: true,
        attn_bias: false,
        qk_norm: true,
        gemma3: Some(Gemma3::from_gguf),
    },
];

impl LlamaConfig {
    /// The attention geometry in the CRD's terms: what preflight and the planner check, and
    /// the source of the per-layer KV list ([`LlamaConfig::kv_layers`]).
    /// What the GPU engine's weights and activation workspace cost for this model with each
    /// KV head stored `kv_rep` times (`plan::engine_memory`).
    pub fn engine_shape(&self, kv_rep: u64) -> kvfleet_core::plan::EngineShape {
        let u = |v: usize| v as u64;
        kvfleet_core::plan::EngineShape {
            layers: u(self.n_layers),
            d_model: u(self.d_model),
            d_ff: u(self.d_ff),
            vocab: u(self.vocab),
            n_heads: u(self.n_heads),
            n_kv_heads: u(self.n_kv_heads),
            head_dim: u(self.head_dim),
            kv_rep,
            rope_dims: u(self.rope_dims),
            tied_embeddings: self.tied_embeddings,
            attn_bias: self.attn_bias,
            qk_norm: self.qk_norm,
            gemma3: self.gemma3.is_some(),
            // The GPU sets it when it keeps the linear layers in FP8.
            fp8_linear: false,
        }
    }

    pub fn model_geometry(&self) -> kvfleet_core::api::ModelGeometry {
        use kvfleet_core::api::LayerType;
        let i = |v: usize| i32::try_from(v).unwrap_or(i32::MAX);
        kvfleet_core::api::ModelGeometry {
            layers: i(self.n_layers),
            query_heads: i(self.n_heads),
            kv_heads: i(self.n_kv_heads),
            head_dim: i(self.head_dim),
            sliding_window: self.gemma3.as_ref().map(|g| i(g.sliding_window)),
            layer_types: self.gemma3.as_ref().map(|_| {
                (0..self.n_layers)
                    .map(|l| match self.layer_window(l) {
                        Some(_) => LayerType::SlidingAttention,
                        None => LayerType::FullAttention,
                    })
                    .collect()
            }),
            global_head_dim: None,
            global_kv_heads: None,
            kv_lora_rank: None,
            qk_rope_head_dim: None,
            draft_layers: None,
            hidden_size: Some(i(self.d_model)),
            vocab_size: Some(i(self.vocab)),
            intermediate_size: Some(i(self.d_ff)),
            moe: None,
        }
    }

    /// The per-layer KV list of this model with `kv_heads` KV heads stored a layer (more than
    /// the model's where the GPU replicates heads), through the one producer
    /// ([`crate::engine::capacity::ModelLayer::from_geometry`]).
    pub fn kv_layers(&self, kv_heads: usize) -> Result<Vec<crate::engine::capacity::ModelLayer>, String> {
        let mut g = self.model_geometry();
        g.kv_heads = i32::try_from(kv_heads).unwrap_or(i32::MAX);
        let geometry = kvfleet_core::plan::Geometry::from_spec(&g).map_err(|e| e.to_string())?;
        crate::engine::capacity::ModelLayer::from_geometry(&geometry).map_err(|e| e.to_string())
    }

    /// The sliding window of layer `i`, `None` for full attention.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        self.gemma3
            .as_ref()
            .filter(|g| g.is_local(i))
            .map(|g| g.sliding_window)
    }

    /// A Llama-shaped geometry (no biases, adjacent-pair RoPE, separate head), e.g. for dummy
    /// weights.
    pub fn llama(
        n_layers: usize,
        d_model: usize,
        d_ff: usize,
        n_heads: usize,
        n_kv_heads: usize,
        vocab: usize,
    ) -> Self {
        let head_dim = d_model / n_heads.max(1);
        LlamaConfig {
            arch: "llama".into(),
            n_layers,
            d_model,
            d_ff,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            context_len: 8192,
            rope_theta: 500000.0,
            rope_dims: head_dim,
            rope_linear_scale: 1.0,
            rope_neox: false,
            rms_eps: 1e-5,
            attn_bias: false,
            qk_norm: false,
            qk_norm_full: false,
            tied_embeddings: false,
            gemma3: None,
            moe: None,
        }
    }

    /// A Gemma 3 shaped geometry with 270M's attention (4 query heads over 1 KV head of 256):
    /// QK norms, post-norms, tied head, NeoX RoPE, local layers of `window` tokens; e.g. for
    /// dummy weights (change the head fields for another size).
    pub fn gemma3(n_layers: usize, d_model: usize, d_ff: usize, vocab: usize, window: usize) -> Self {
        let mut c = Self::llama(n_layers, d_model, d_ff, 4, 1, vocab);
        c.arch = "gemma3".into();
        c.head_dim = 256;
        c.rope_dims = 256;
        c.rope_theta = 1_000_000.0;
        c.rope_neox = true;
        c.rms_eps = 1e-6;
        c.qk_norm = true;
        c.tied_embeddings = true;
        c.gemma3 = Some(Gemma3::new(window));
        c
    }

    /// Reads the geometry from GGUF metadata (`{arch}.block_count`, ...).
    pub fn from_gguf(g: &Gguf) -> Result<Self, LoadError> {
        let arch = g.get_str("general.architecture")?.to_string();
        let Some(row) = ARCHITECTURES.iter().find(|a| a.name == arch) else {
            return Err(LoadError::Architecture(arch));
        };
        let u = |k: &str| g.get_u64(&format!("{arch}.{k}")).map(|v| v as usize);
        let d_model = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let head_dim = u("attention.key_length").unwrap_or(d_model / n_heads.max(1));
        let emb = g
            .tensor_info("token_embd.weight")
            .ok_or_else(|| GgufError::MissingTensor("token_embd.weight".into()))?;
        let vocab = emb.dims.get(1).copied().unwrap_or(0) as usize;
        let scaling = g.get_str(&format!("{arch}.rope.scaling.type")).unwrap_or("none");
        let rope_linear_scale = match scaling {
            "none" => 1.0,
            "linear" => g.get_f64(&format!("{arch}.rope.scaling.factor")).unwrap_or(1.0) as f32,
            other => return Err(LoadError::RopeScaling(other.into())),
        };
        let cfg = LlamaConfig {
            n_layers: u("block_count")?,
            d_model,
            d_ff: u("feed_forward_length")?,
            n_heads,
            n_kv_heads: u("attention.head_count_kv").unwrap_or(n_heads),
            head_dim,
            vocab,
            context_len: u("context_length").unwrap_or(4096),
            rope_theta: g.get_f64(&format!("{arch}.rope.freq_base")).unwrap_or(10000.0) as f32,
            rope_dims: u("rope.dimension_count").unwrap_or(head_dim),
            // (gemma3's RMS epsilon is in the file: 1e-6.)
            rope_linear_scale,
            rope_neox: row.rope_neox,
            rms_eps: g
                .get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            attn_bias: row.attn_bias,
            qk_norm: row.qk_norm,
            qk_norm_full: false,
            moe: None,
            tied_embeddings: g.tensor_info("output.weight").is_none(),
            gemma3: row.gemma3.map(|read| read(g, &arch)).transpose()?,
            arch,
        };
        cfg.check()?;
        Ok(cfg)
    }

    /// Checks the geometry is consistent (heads, RoPE dimensions).
    pub fn check(&self) -> Result<(), LoadError> {
        let bad = |m: String| Err(LoadError::Geometry(m));
        if self.n_layers == 0 || self.d_model == 0 || self.vocab == 0 || self.head_dim == 0 {
            return bad(format!("empty dimension in {self:?}"));
        }
        if self.n_kv_heads == 0 || self.n_heads % self.n_kv_heads != 0 {
            return bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.rope_dims > self.head_dim || self.rope_dims % 2 != 0 {
            return bad(format!(
                "RoPE dimensions {} must be even and at most head_dim {}",
                self.rope_dims, self.head_dim
            ));
        }
        if let Some(g) = &self.gemma3 {
            if g.sliding_window == 0 || g.global_every == 0 || !self.qk_norm || !self.tied_embeddings {
                return bad(format!(
                    "a Gemma 3 geometry needs a window, QK norms and a tied head: {self:?}"
                ));
            }
        }
        Ok(())
    }

    pub fn attn_geometry(&self) -> AttnGeometry {
        AttnGeometry {
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Parameter count (embeddings counted once when tied).
    pub fn parameters(&self) -> usize {
        let (d, hd) = (self.d_model, self.head_dim);
        let attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2;
        let norms = if self.gemma3.is_some() {
            4 * d + 2 * hd
        } else {
            2 * d
        };
        let mlp = |i| match self.moe.as_ref().filter(|m| m.is_sparse(i)) {
            Some(m) => m.layer_parameters(d),
            None => 3 * d * self.d_ff,
        };
        let mlps: usize = (0..self.n_layers).map(mlp).sum();
        let layer = attn + norms;
        let head = if self.tied_embeddings { 0 } else { self.vocab * d };
        self.n_layers * layer + mlps + self.vocab * d + head + d
    }
}

/// One decoder block's weights (the loader, `weights.rs`, fills them).
#[derive(Clone)]
pub(super) struct Layer {
    pub(super) attn_norm: Vec<f32>,
    pub(super) wq: Linear,
    pub(super) wk: Linear,
    pub(super) wv: Linear,
    pub(super) wo: Linear,
    pub(super) bq: Option<Vec<f32>>,
    pub(super) bk: Option<Vec<f32>>,
    pub(super) bv: Option<Vec<f32>>,
    pub(super) q_norm: Option<Vec<f32>>,
    pub(super) k_norm: Option<Vec<f32>>,
    pub(super) ffn_norm: Vec<f32>,
    pub(super) w_gate: Linear,
    pub(super) w_up: Linear,
    pub(super) w_down: Linear,
    /// Gemma 3: RMSNorm of the attention output and of the MLP output, before each residual add.
    pub(super) post_attn_norm: Option<Vec<f32>>,
    pub(super) post_ffn_norm: Option<Vec<f32>>,
    /// A sparse layer's MLP, which replaces the dense one (whose weights are then empty).
    pub(super) moe: Option<MoeLayer>,
}

impl Layer {
    /// The seven projections, for what changes every linear weight of a layer alike (FP8 at
    /// load, dequantizing a packed model).
    pub(super) fn linears_mut(&mut self) -> [&mut Linear; 7] {
        [
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.w_gate,
            &mut self.w_up,
            &mut self.w_down,
        ]
    }
}

/// A loaded model of any family (f32 weights, matrices `[out, in]` row-major).
#[derive(Clone)]
pub struct Llama {
    pub config: LlamaConfig,
    pub(super) embed: Vec<f32>,
    pub(super) layers: Vec<Layer>,
    pub(super) out_norm: Vec<f32>,
    pub(super) lm_head: Option<Vec<f32>>,
    /// Per rotated pair: the inverse frequency, already divided by any rope_freqs factor.
    pub(super) inv_freq: Vec<f32>,
    /// Gemma 3: the inverse frequencies of the local layers (their own RoPE base).
    pub(super) inv_freq_local: Vec<f32>,
    /// How the linear layers compute ([`Llama::quantize_fp8`] switches to FP8).
    pub(super) quantization: LinearQuantization,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama").field("config", &self.config).finish()
    }
}

/// One sequence's new tokens in a forward batch.
#[derive(Debug, Clone)]
pub struct SeqChunk<'a> {
    pub seq: SeqId,
    /// Position of `tokens[0]`; equals the tokens the KV cache already holds for `seq`.
    pub start_pos: usize,
    pub tokens: &'a [u32],
    /// Return the logits of the chunk's last `logits` tokens (0: none; 1: the next token's;
    /// more: a speculative step's verification rows, one a proposed token and the bonus).
    pub logits: usize,
}

impl SeqChunk<'_> {
    /// Each new token with its position; an error for a token outside `c`'s vocabulary or a
    /// position past its context (the CPU and GPU forward passes check alike).
    pub fn checked_tokens<'s>(
        &'s self,
        c: &LlamaConfig,
    ) -> impl Iterator<Item = Result<(u32, usize), ForwardError>> + 's {
        let (vocab, ctx) = (c.vocab, c.context_len);
        self.tokens.iter().enumerate().map(move |(i, &tok)| {
            let pos = self.start_pos + i;
            if tok as usize >= vocab {
                Err(ForwardError::Token(tok))
            } else if pos >= ctx {
                Err(ForwardError::Context { pos, ctx })
            } else {
                Ok((tok, pos))
            }
        })
    }
}

/// The residual stream entering each of `layers` (`n_layers`: the last layer's output) for
/// every new token of a step, `rows` `[tokens, layers.len() * d_model]`: the target features a
/// drafter reads. Empty `layers` keep nothing.
#[derive(Debug, Default)]
pub struct AuxHidden {
    pub layers: Vec<usize>,
    pub rows: Vec<f32>,
    /// Mixture of experts: the tokens each expert of each sparse layer took in the step, in
    /// layer then expert order (`[sparse layers * experts]`; empty for a dense model).
    pub expert_tokens: Vec<u32>,
}

impl Llama {
    /// The math of this model's family where its block departs from a Llama block.
    fn block(&self) -> &dyn Block {
        match &self.config.gemma3 {
            Some(g) => g,
            None => &LlamaBlock,
        }
    }

    /// Runs the new tokens of every chunk through the model, storing their K/V in `kv`, and
    /// returns `[chunks wanting logits, vocab]` logits in chunk order.
    pub fn forward(
        &self,
        kv: &mut dyn KvAttention,
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward_aux(kv, batch, &mut AuxHidden::default())
    }

    /// [`Llama::forward`] that also writes into `aux.rows` the residual stream entering each
    /// layer of `aux.layers`, for every new token: the target features an EAGLE-3 drafter reads
    /// (vLLM takes `hidden_states + residual` before those layers).
    pub fn forward_aux(
        &self,
        kv: &mut dyn KvAttention,
        batch: &[SeqChunk<'_>],
        aux: &mut AuxHidden,
    ) -> Result<Vec<f32>, ForwardError> {
        let d = self.config.d_model;
        let x = self.hidden_aux(kv, batch, aux)?;
        // Only the last row of chunks that want logits goes through the LM head.
        let mut last = Vec::new();
        let mut row = 0;
        for s in batch {
            row += s.tokens.len();
            let n = s.logits.min(s.tokens.len());
            last.extend_from_slice(&x[(row - n) * d..row * d]);
        }
        Ok(self.head(&last))
    }

    /// The embedding table's rows of `tokens` (`[tokens, d_model]`), as stored: without
    /// Gemma 3's `sqrt(hidden_size)` scale. `None` for a token outside the vocabulary.
    pub fn embedding_rows(&self, tokens: &[u32]) -> Option<Vec<f32>> {
        let d = self.config.d_model;
        let mut out = Vec::with_capacity(tokens.len() * d);
        for &t in tokens {
            out.extend_from_slice(self.embed.get(t as usize * d..(t as usize + 1) * d)?);
        }
        Some(out)
    }

    /// The LM head `[vocab, d_model]` (the embedding table when tied).
    pub fn lm_head_matrix(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }

    /// `[rows, vocab]` logits of `[rows, d_model]` final hidden states.
    fn head(&self, x: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let d = c.d_model;
        let n = x.len() / d;
        let mut normed = vec![0f32; n * d];
        rms_norm(x, &self.out_norm, c.rms_eps, &mut normed);
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        let mut logits = vec![0f32; n * c.vocab];
        matmul_t(&normed, n, d, head, c.vocab, &mut logits);
        logits
    }

    /// Runs a whole prompt on a scratch f32 cache of its own (no pages, nothing cached or kept)
    /// and calls `f(i, logits of position i)` for every position `i` but the last, in order:
    /// what scoring a prompt needs (the logits at `i` give token `i + 1`'s log-probability).
    /// The LM head runs 64 positions at a time, so memory stays `64 x vocab` floats. On a model
    /// with sliding-window layers, a prompt longer than the smallest window is refused (the
    /// scratch cache attends to every position; within a window that is the same).
    pub fn prompt_logits<T>(
        &self,
        tokens: &[u32],
        mut f: impl FnMut(usize, &[f32]) -> T,
    ) -> Result<Vec<T>, ForwardError> {
        let c = &self.config;
        if let Some(w) = (0..c.n_layers).filter_map(|i| c.layer_window(i)).min() {
            if tokens.len() > w {
                return Err(ForwardError::Kv(KvError::Backend(format!(
                    "prompt scoring of {} tokens is not implemented for a model with {w}-token \
                     sliding-window layers; score at most {w} tokens",
                    tokens.len()
                ))));
            }
        }
        let mut kv = super::kv::ContiguousKv::new(c.attn_geometry(), tokens.len().max(1));
        let chunk = SeqChunk {
            seq: 0,
            start_pos: 0,
            tokens,
            logits: 0,
        };
        let x = self.hidden_aux(&mut kv, &[chunk], &mut AuxHidden::default())?;
        let d = c.d_model;
        let scored = tokens.len().saturating_sub(1);
        let mut out = Vec::with_capacity(scored);
        for start in (0..scored).step_by(64) {
            let end = (start + 64).min(scored);
            let logits = self.head(&x[start * d..end * d]);
            for (j, row) in logits.chunks_exact(c.vocab).enumerate() {
                out.push(f(start + j, row));
            }
        }
        Ok(out)
    }

    /// The final hidden states `[tokens, d_model]` of every chunk's new tokens (before the
    /// output norm), their K/V stored in `kv`; the residual stream entering each layer of
    /// `aux.layers` (`n_layers`: the last layer's output) copied into `aux.rows`.
    fn hidden_aux(
        &self,
        kv: &mut dyn KvAttention,
        batch: &[SeqChunk<'_>],
        aux: &mut AuxHidden,
    ) -> Result<Vec<f32>, ForwardError> {
        let (aux_layers, aux, load) = (&aux.layers[..], &mut aux.rows, &mut aux.expert_tokens);
        load.clear();
        let c = &self.config;
        let block = self.block();
        let (d, hd, ff) = (c.d_model, c.head_dim, c.d_ff);
        let (qw, kw) = (c.n_heads * hd, c.n_kv_heads * hd);
        let t: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut positions = Vec::with_capacity(t);
        let mut x = vec![0f32; t * d];
        let mut row = 0;
        for s in batch {
            for token in s.checked_tokens(c) {
                let (tok, pos) = token?;
                positions.push(pos);
                let e = &self.embed[tok as usize * d..(tok as usize + 1) * d];
                block.embed(e, &mut x[row * d..(row + 1) * d]);
                row += 1;
            }
        }
        let seqs: Vec<AttnSeq> = batch
            .iter()
            .map(|s| AttnSeq {
                seq: s.seq,
                start_pos: s.start_pos,
                len: s.tokens.len(),
            })
            .collect();
        let mut h = vec![0f32; t * d];
        let mut q = vec![0f32; t * qw];
        let mut k = vec![0f32; t * kw];
        let mut v = vec![0f32; t * kw];
        let mut attn = vec![0f32; t * qw];
        let mut proj = vec![0f32; t * d];
        let mut gate = vec![0f32; t * ff];
        let mut up = vec![0f32; t * ff];
        let na = aux_layers.len();
        aux.clear();
        aux.resize(t * na * d, 0.0);
        for (li, l) in self.layers.iter().enumerate() {
            keep_features(&x, d, aux_layers, li, aux);
            rms_norm(&x, &l.attn_norm, c.rms_eps, &mut h);
            l.wq.project(&h, t, &mut q);
            l.wk.project(&h, t, &mut k);
            l.wv.project(&h, t, &mut v);
            for (buf, b) in [(&mut q, &l.bq), (&mut k, &l.bk), (&mut v, &l.bv)] {
                if let Some(b) = b {
                    buf.par_chunks_mut(b.len())
                        .for_each(|r| r.iter_mut().zip(b).for_each(|(x, b)| *x += b));
                }
            }
            if let Some(n) = &l.q_norm {
                let src = q.clone();
                rms_norm(&src, n, c.rms_eps, &mut q);
            }
            if let Some(n) = &l.k_norm {
                let src = k.clone();
                rms_norm(&src, n, c.rms_eps, &mut k);
            }
            let freqs = match c.layer_window(li) {
                Some(_) => &self.inv_freq_local,
                None => &self.inv_freq,
            };
            self.rope_with(freqs, &mut q, &positions, c.n_heads);
            self.rope_with(freqs, &mut k, &positions, c.n_kv_heads);
            block.scale_queries(hd, &mut q);
            kv.attend(li, &seqs, (&q, &k, &v), &mut attn)?;
            l.wo.project(&attn, t, &mut proj);
            if let Some(n) = &l.post_attn_norm {
                let src = proj.clone();
                rms_norm(&src, n, c.rms_eps, &mut proj);
            }
            add_in_place(&mut x, &proj);
            rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut h);
            if let (Some(moe), Some(m)) = (&c.moe, &l.moe) {
                m.forward(moe, block, &h, t, &mut proj, load);
            } else {
                l.w_gate.project(&h, t, &mut gate);
                l.w_up.project(&h, t, &mut up);
                block.glu(&mut gate, &up);
                l.w_down.project(&gate, t, &mut proj);
            }
            if let Some(n) = &l.post_ffn_norm {
                let src = proj.clone();
                rms_norm(&src, n, c.rms_eps, &mut proj);
            }
            add_in_place(&mut x, &proj);
        }
        // A feature "entering" layer n_layers is the last layer's output.
        keep_features(&x, d, aux_layers, c.n_layers, aux);
        Ok(x)
    }

    /// How the linear layers compute.
    pub fn quantization(&self) -> LinearQuantization {
        self.quantization
    }

    /// Switches the model to FP8 W8A8 ([`LinearQuantization::Fp8`]): every linear layer's
    /// weight becomes its per-output-channel e4m3 quantization, dequantized to f32, and from
    /// now on each linear layer's input is quantized per token ([`Linear::quantize_fp8`]).
    /// Embeddings, norms, biases and the LM head stay as loaded. A second call does nothing,
    /// and so does a call on a model whose linear layers are packed 4-bit weights.
    pub fn quantize_fp8(&mut self) {
        if matches!(
            self.quantization,
            LinearQuantization::Fp8 | LinearQuantization::W4A16(_)
        ) {
            return;
        }
        self.layers.par_iter_mut().for_each(|l| {
            for w in l.linears_mut() {
                w.quantize_fp8();
            }
            if let Some(m) = &mut l.moe {
                m.quantize_fp8();
            }
        });
        self.quantization = LinearQuantization::Fp8;
    }

    #[cfg(test)]
    fn rope(&self, x: &mut [f32], positions: &[usize], heads: usize) {
        self.rope_with(&self.inv_freq, x, positions, heads)
    }

    fn rope_with(&self, inv_freq: &[f32], x: &mut [f32], positions: &[usize], heads: usize) {
        rope(&self.config, inv_freq, x, positions, heads)
    }
}

/// Copies the residual stream `x` (`[tokens, d]`) entering layer `layer` into the column block
/// of each entry of `aux_layers` that names it, in `aux` (`[tokens, aux_layers.len() * d]`).
fn keep_features(x: &[f32], d: usize, aux_layers: &[usize], layer: usize, aux: &mut [f32]) {
    let na = aux_layers.len();
    for (j, _) in aux_layers.iter().enumerate().filter(|(_, &a)| a == layer) {
        for (r, xr) in x.chunks_exact(d).enumerate() {
            aux[(r * na + j) * d..(r * na + j + 1) * d].copy_from_slice(xr);
        }
    }
}

/// Rotates each head of each row of `x` (`[positions, heads * head_dim]`) by its position, as
/// `cfg` says (rotated dims, linear scale, NeoX halves or adjacent pairs).
pub(crate) fn rope(cfg: &LlamaConfig, inv_freq: &[f32], x: &mut [f32], positions: &[usize], heads: usize) {
    {
        let hd = cfg.head_dim;
        let half = cfg.rope_dims / 2;
        let scale = cfg.rope_linear_scale;
        let neox = cfg.rope_neox;
        x.par_chunks_mut(heads * hd)
            .zip(positions.par_iter())
            .for_each(|(row, &pos)| {
                let p = pos as f32 / scale;
                for head in row.chunks_mut(hd) {
                    for (i, f) in inv_freq.iter().enumerate() {
                        let (sin, cos) = (p * f).sin_cos();
                        let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
                        let (x0, x1) = (head[a], head[b]);
                        head[a] = x0 * cos - x1 * sin;
                        head[b] = x0 * sin + x1 * cos;
                    }
                }
            });
    }
}

pub fn inv_freq(cfg: &LlamaConfig, factors: Option<&[f32]>) -> Vec<f32> {
    let half = cfg.rope_dims / 2;
    (0..half)
        .map(|i| {
            let f = cfg.rope_theta.powf(-2.0 * i as f32 / cfg.rope_dims as f32);
            f / factors.and_then(|fs| fs.get(i)).copied().unwrap_or(1.0)
        })
        .collect()
}

/// Gemma 3: the local layers' inverse frequencies (empty for other models).
pub(super) fn inv_freq_local(cfg: &LlamaConfig) -> Vec<f32> {
    match &cfg.gemma3 {
        Some(g) => {
            let mut local = cfg.clone();
            local.rope_theta = g.rope_theta_local;
            inv_freq(&local, None)
        }
        None => Vec::new(),
    }
}

/// The Llama family's block: the embedding as stored, the queries as the backends scale
/// them, SwiGLU (`silu(gate) * up`).
struct LlamaBlock;

impl Block for LlamaBlock {
    fn embed(&self, e: &[f32], out: &mut [f32]) {
        out.copy_from_slice(e);
    }

    fn scale_queries(&self, _head_dim: usize, _q: &mut [f32]) {}

    fn glu(&self, gate: &mut [f32], up: &[f32]) {
        gate.par_iter_mut().zip(up.par_iter()).for_each(|(g, u)| {
            *g = *g / (1.0 + (-*g).exp()) * u;
        });
    }
}

/// RMSNorm of each row of `x` (row length `w.len()`), scaled by `w`.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    out.par_chunks_mut(n).zip(x.par_chunks(n)).for_each(|(o, r)| {
        let ms = r.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(r).zip(w) {
            *o = v * inv * w;
        }
    });
}

pub(crate) fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.par_iter_mut().zip(y.par_iter()).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests;

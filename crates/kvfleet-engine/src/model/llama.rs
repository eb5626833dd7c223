//! The Llama-family forward pass on the CPU (Llama, Mistral, Qwen2, Qwen3 dense, SmolLM):
//! embeddings, RMSNorm, RoPE, GQA attention through a [`KvAttention`], SwiGLU MLP, tied or
//! separate LM head. Weights are f32 (dequantised at load); GEMMs run on our own FMA kernel
//! (every row the same bits whatever the batch: [`matmul_t`]),
//! split across rayon threads. [`Llama::quantize_fp8`] turns the linear layers into the f32
//! simulation of FP8 W8A8 (issue 32), the CPU reference of the GPU's FP8 GEMMs.
//!
//! Gemma 3 (`gemma3` GGUF files) runs on the same pass with its departures switched on by
//! [`Gemma3`]: see that type for each one and where the facts come from.
//!
//! GGUF tensor names and the rotary layout per architecture follow llama.cpp: `llama` files
//! have Q/K rows permuted by the converter so RoPE rotates adjacent pairs (`LLAMA_ROPE_TYPE_NORM`),
//! `qwen2`/`qwen3` rotate the two halves of a head (`LLAMA_ROPE_TYPE_NEOX`)
//! (ggml-org/llama.cpp `src/llama-model.cpp`, `llama_model_rope_type`).

use std::borrow::Cow;

use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use super::fp8::{fake_quantize_rows, quantize_rows};
use super::gguf::{Gguf, GgufError};
use super::kv::{AttnGeometry, AttnSeq, KvAttention, KvError, SeqId};
pub use kvfleet_gemm::matmul_t;

/// Errors of loading a model.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(
        "architecture `{0}` is not supported; kvfleet runs llama, mistral, qwen2, qwen3 (dense) and gemma3 models"
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
    pub tied_embeddings: bool,
    /// Gemma 3's block (`None` for the Llama family).
    pub gemma3: Option<Gemma3>,
}

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

    /// Whether layer `i` attends only within the window.
    pub fn is_local(&self, i: usize) -> bool {
        (i + 1) % self.global_every != 0
    }
}

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
            tied_embeddings: false,
            gemma3: None,
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
        let (rope_neox, attn_bias, qk_norm) = match arch.as_str() {
            "llama" | "mistral" => (false, false, false),
            "qwen2" => (true, true, false),
            "qwen3" | "gemma3" => (true, false, true),
            _ => return Err(LoadError::Architecture(arch)),
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
            rope_neox,
            rms_eps: g
                .get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            attn_bias,
            qk_norm,
            tied_embeddings: g.tensor_info("output.weight").is_none(),
            gemma3: match arch.as_str() {
                "gemma3" => Some(Gemma3 {
                    global_every: u("attention.sliding_window_pattern")
                        .unwrap_or(GEMMA3_SLIDING_WINDOW_PATTERN),
                    ..Gemma3::new(u("attention.sliding_window")?)
                }),
                _ => None,
            },
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
        let layer = attn + 3 * d * self.d_ff + norms;
        let head = if self.tied_embeddings { 0 } else { self.vocab * d };
        self.n_layers * layer + self.vocab * d + head + d
    }
}

#[derive(Clone)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
    /// Gemma 3: RMSNorm of the attention output and of the MLP output, before each residual add.
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
}

/// How the linear layers (Q, K, V, O, gate, up, down) compute. Embeddings, norms and the
/// LM head are never quantized (as in vLLM's `fp8` method, whose quantized layers are the
/// transformer blocks' linears: a low-precision head costs the most accuracy for the least
/// memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinearQuantization {
    /// f32 weights and activations as loaded.
    #[default]
    None,
    /// FP8 W8A8, simulated in f32: each weight row (output channel) quantized to e4m3 with
    /// its own scale at load, each linear layer's input quantized per token (row) before the
    /// GEMM, both with `scale = amax / 448` ([`super::fp8::fake_quantize_rows`]). The GEMM then
    /// computes what an FP8 GEMM with per-channel and per-token scales does, up to the f32
    /// summation order; this is the reference of the GPU's FP8 path.
    Fp8,
}

/// A loaded Llama-family model (f32 weights, matrices `[out, in]` row-major).
#[derive(Clone)]
pub struct Llama {
    pub config: LlamaConfig,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    lm_head: Option<Vec<f32>>,
    /// Per rotated pair: the inverse frequency, already divided by any rope_freqs factor.
    inv_freq: Vec<f32>,
    /// Gemma 3: the inverse frequencies of the local layers (their own RoPE base).
    inv_freq_local: Vec<f32>,
    /// How the linear layers compute ([`Llama::quantize_fp8`] switches to FP8).
    quantization: LinearQuantization,
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

impl Llama {
    /// Loads and dequantises every tensor of a GGUF model.
    pub fn from_gguf(g: &Gguf) -> Result<Self, LoadError> {
        let cfg = LlamaConfig::from_gguf(g)?;
        let load = |name: &str, want: usize| -> Result<Vec<f32>, LoadError> {
            let w = g.dequantize(name)?;
            if w.len() != want {
                return Err(LoadError::Shape {
                    name: name.into(),
                    got: w.len(),
                    want,
                });
            }
            Ok(w)
        };
        let opt = |name: &str, want: usize| -> Result<Option<Vec<f32>>, LoadError> {
            match g.tensor_info(name) {
                Some(_) => load(name, want).map(Some),
                None => Ok(None),
            }
        };
        let (d, hd, ff) = (cfg.d_model, cfg.head_dim, cfg.d_ff);
        let (qw, kw) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            layers.push(Layer {
                attn_norm: load(&n("attn_norm.weight"), d)?,
                wq: load(&n("attn_q.weight"), qw * d)?,
                wk: load(&n("attn_k.weight"), kw * d)?,
                wv: load(&n("attn_v.weight"), kw * d)?,
                wo: load(&n("attn_output.weight"), d * qw)?,
                bq: opt(&n("attn_q.bias"), qw)?,
                bk: opt(&n("attn_k.bias"), kw)?,
                bv: opt(&n("attn_v.bias"), kw)?,
                q_norm: opt(&n("attn_q_norm.weight"), hd)?,
                k_norm: opt(&n("attn_k_norm.weight"), hd)?,
                ffn_norm: load(&n("ffn_norm.weight"), d)?,
                w_gate: load(&n("ffn_gate.weight"), ff * d)?,
                w_up: load(&n("ffn_up.weight"), ff * d)?,
                w_down: load(&n("ffn_down.weight"), d * ff)?,
                post_attn_norm: match cfg.gemma3 {
                    Some(_) => Some(load(&n("post_attention_norm.weight"), d)?),
                    None => None,
                },
                post_ffn_norm: match cfg.gemma3 {
                    Some(_) => Some(load(&n("post_ffw_norm.weight"), d)?),
                    None => None,
                },
            });
        }
        let freq_factors = opt("rope_freqs.weight", cfg.rope_dims / 2)?;
        Ok(Llama {
            embed: load("token_embd.weight", cfg.vocab * d)?,
            out_norm: load("output_norm.weight", d)?,
            lm_head: opt("output.weight", cfg.vocab * d)?,
            inv_freq: inv_freq(&cfg, freq_factors.as_deref()),
            inv_freq_local: inv_freq_local(&cfg),
            layers,
            config: cfg,
            quantization: LinearQuantization::None,
        })
    }

    /// Builds the model from tensors a checkpoint reader supplies. `get(name, shape)` is asked
    /// for each tensor under its GGUF name (`blk.N.attn_q.weight`, ...) with the logical shape
    /// `[out, in]` (or `[n]`), and only for the tensors `cfg` says exist (biases with
    /// `attn_bias`, QK norms with `qk_norm`, `output.weight` unless `tied_embeddings`). Q/K rows
    /// must already be in the layout `cfg.rope_neox` rotates. `freq_factors` divide RoPE's
    /// inverse frequencies (llama3 scaling), one per rotated pair.
    pub fn from_tensors<E: From<LoadError>>(
        cfg: LlamaConfig,
        freq_factors: Option<&[f32]>,
        mut source: impl FnMut(&str, &[usize]) -> Result<Vec<f32>, E>,
    ) -> Result<Self, E> {
        cfg.check()?;
        if cfg.gemma3.is_some() {
            let what = "gemma3 from a Hugging Face checkpoint (load its GGUF file instead)";
            return Err(LoadError::Architecture(what.into()).into());
        }
        let mut get = |name: &str, shape: &[usize]| -> Result<Vec<f32>, E> {
            let w = source(name, shape)?;
            let want = shape.iter().product();
            if w.len() != want {
                return Err(LoadError::Shape {
                    name: name.into(),
                    got: w.len(),
                    want,
                }
                .into());
            }
            Ok(w)
        };
        if let Some(f) = freq_factors {
            if f.len() != cfg.rope_dims / 2 {
                return Err(LoadError::Geometry(format!(
                    "{} RoPE frequency factors for {} rotated pairs",
                    f.len(),
                    cfg.rope_dims / 2
                ))
                .into());
            }
        }
        let (d, hd, ff) = (cfg.d_model, cfg.head_dim, cfg.d_ff);
        let (qw, kw) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let mut opt = |on: bool, name: &str, shape: &[usize]| -> Result<Option<Vec<f32>>, E> {
                if on {
                    get(&n(name), shape).map(Some)
                } else {
                    Ok(None)
                }
            };
            let bq = opt(cfg.attn_bias, "attn_q.bias", &[qw])?;
            let bk = opt(cfg.attn_bias, "attn_k.bias", &[kw])?;
            let bv = opt(cfg.attn_bias, "attn_v.bias", &[kw])?;
            let q_norm = opt(cfg.qk_norm, "attn_q_norm.weight", &[hd])?;
            let k_norm = opt(cfg.qk_norm, "attn_k_norm.weight", &[hd])?;
            layers.push(Layer {
                attn_norm: get(&n("attn_norm.weight"), &[d])?,
                wq: get(&n("attn_q.weight"), &[qw, d])?,
                wk: get(&n("attn_k.weight"), &[kw, d])?,
                wv: get(&n("attn_v.weight"), &[kw, d])?,
                wo: get(&n("attn_output.weight"), &[d, qw])?,
                bq,
                bk,
                bv,
                q_norm,
                k_norm,
                ffn_norm: get(&n("ffn_norm.weight"), &[d])?,
                w_gate: get(&n("ffn_gate.weight"), &[ff, d])?,
                w_up: get(&n("ffn_up.weight"), &[ff, d])?,
                w_down: get(&n("ffn_down.weight"), &[d, ff])?,
                post_attn_norm: None,
                post_ffn_norm: None,
            });
        }
        let embed = get("token_embd.weight", &[cfg.vocab, d])?;
        let out_norm = get("output_norm.weight", &[d])?;
        let lm_head = if cfg.tied_embeddings {
            None
        } else {
            Some(get("output.weight", &[cfg.vocab, d])?)
        };
        Ok(Llama {
            embed,
            layers,
            out_norm,
            lm_head,
            inv_freq: inv_freq(&cfg, freq_factors),
            inv_freq_local: Vec::new(),
            config: cfg,
            quantization: LinearQuantization::None,
        })
    }

    /// Random weights of any geometry (vLLM's `--load-format dummy`): for capacity and
    /// throughput measurements, not for text.
    pub fn dummy(cfg: LlamaConfig, seed: u64) -> Result<Self, LoadError> {
        cfg.check()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (d, hd, ff) = (cfg.d_model, cfg.head_dim, cfg.d_ff);
        let (qw, kw) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let mut rand_mat = |rows: usize, cols: usize| -> Vec<f32> {
            let a = 1.0 / (cols as f32).sqrt();
            (0..rows * cols).map(|_| rng.random_range(-a..a)).collect()
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for _ in 0..cfg.n_layers {
            layers.push(Layer {
                attn_norm: vec![1.0; d],
                wq: rand_mat(qw, d),
                wk: rand_mat(kw, d),
                wv: rand_mat(kw, d),
                wo: rand_mat(d, qw),
                bq: cfg.attn_bias.then(|| vec![0.0; qw]),
                bk: cfg.attn_bias.then(|| vec![0.0; kw]),
                bv: cfg.attn_bias.then(|| vec![0.0; kw]),
                q_norm: cfg.qk_norm.then(|| vec![1.0; hd]),
                k_norm: cfg.qk_norm.then(|| vec![1.0; hd]),
                ffn_norm: vec![1.0; d],
                w_gate: rand_mat(ff, d),
                w_up: rand_mat(ff, d),
                w_down: rand_mat(d, ff),
                post_attn_norm: cfg.gemma3.as_ref().map(|_| vec![1.0; d]),
                post_ffn_norm: cfg.gemma3.as_ref().map(|_| vec![1.0; d]),
            });
        }
        let embed = rand_mat(cfg.vocab, d);
        let lm_head = (!cfg.tied_embeddings).then(|| rand_mat(cfg.vocab, d));
        Ok(Llama {
            embed,
            layers,
            out_norm: vec![1.0; d],
            lm_head,
            inv_freq: inv_freq(&cfg, None),
            inv_freq_local: inv_freq_local(&cfg),
            config: cfg,
            quantization: LinearQuantization::None,
        })
    }

    /// Runs the new tokens of every chunk through the model, storing their K/V in `kv`, and
    /// returns `[chunks wanting logits, vocab]` logits in chunk order.
    pub fn forward(
        &self,
        kv: &mut dyn KvAttention,
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward_aux(kv, batch, &[], &mut Vec::new())
    }

    /// [`Llama::forward`] that also writes into `aux` (`[tokens, aux_layers.len() * d_model]`)
    /// the residual stream entering each layer of `aux_layers`, for every new token: the target
    /// features an EAGLE-3 drafter reads (vLLM takes `hidden_states + residual` before those
    /// layers).
    pub fn forward_aux(
        &self,
        kv: &mut dyn KvAttention,
        batch: &[SeqChunk<'_>],
        aux_layers: &[usize],
        aux: &mut Vec<f32>,
    ) -> Result<Vec<f32>, ForwardError> {
        let d = self.config.d_model;
        let x = self.hidden_aux(kv, batch, aux_layers, aux)?;
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
        let x = self.hidden_aux(&mut kv, &[chunk], &[], &mut Vec::new())?;
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
    /// `aux_layers` (`n_layers`: the last layer's output) copied into `aux`.
    fn hidden_aux(
        &self,
        kv: &mut dyn KvAttention,
        batch: &[SeqChunk<'_>],
        aux_layers: &[usize],
        aux: &mut Vec<f32>,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
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
                let xr = &mut x[row * d..(row + 1) * d];
                match &c.gemma3 {
                    // The embedding times sqrt(hidden_size), rounded to the weights' dtype
                    // first as transformers does (f32 here).
                    Some(_) => {
                        let s = (d as f32).sqrt();
                        xr.iter_mut().zip(e).for_each(|(o, v)| *o = v * s);
                    }
                    None => xr.copy_from_slice(e),
                }
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
            let hq = self.linear_input(&h, d);
            matmul_t(&hq, t, d, &l.wq, qw, &mut q);
            matmul_t(&hq, t, d, &l.wk, kw, &mut k);
            matmul_t(&hq, t, d, &l.wv, kw, &mut v);
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
            if let Some(g) = &c.gemma3 {
                // Attention backends scale by 1/sqrt(head_dim); fold the model's own scale
                // into the queries (a no-op when query_pre_attn_scalar equals head_dim).
                let s = g.query_scale * (hd as f32).sqrt();
                if s != 1.0 {
                    q.par_iter_mut().for_each(|v| *v *= s);
                }
            }
            kv.attend(li, &seqs, &q, &k, &v, &mut attn)?;
            matmul_t(&self.linear_input(&attn, qw), t, qw, &l.wo, d, &mut proj);
            if let Some(n) = &l.post_attn_norm {
                let src = proj.clone();
                rms_norm(&src, n, c.rms_eps, &mut proj);
            }
            add_in_place(&mut x, &proj);
            rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut h);
            let hq = self.linear_input(&h, d);
            matmul_t(&hq, t, d, &l.w_gate, ff, &mut gate);
            matmul_t(&hq, t, d, &l.w_up, ff, &mut up);
            if c.gemma3.is_some() {
                gate.par_iter_mut()
                    .zip(up.par_iter())
                    .for_each(|(g, u)| *g = gelu_tanh(*g) * u);
            } else {
                gate.par_iter_mut().zip(up.par_iter()).for_each(|(g, u)| {
                    *g = *g / (1.0 + (-*g).exp()) * u;
                });
            }
            matmul_t(&self.linear_input(&gate, ff), t, ff, &l.w_down, d, &mut proj);
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

    /// What a linear layer multiplies: `x` itself (rows of `cols`), or with FP8 each row
    /// quantized per token and dequantized (a copy; the unquantized path copies nothing).
    fn linear_input<'a>(&self, x: &'a [f32], cols: usize) -> Cow<'a, [f32]> {
        match self.quantization {
            LinearQuantization::None => Cow::Borrowed(x),
            LinearQuantization::Fp8 => {
                let mut q = x.to_vec();
                fake_quantize_rows(&mut q, cols);
                Cow::Owned(q)
            }
        }
    }

    /// How the linear layers compute.
    pub fn quantization(&self) -> LinearQuantization {
        self.quantization
    }

    /// Switches the model to FP8 W8A8 ([`LinearQuantization::Fp8`]): every linear layer's
    /// weight becomes its per-output-channel e4m3 quantization, dequantized to f32
    /// ([`super::fp8::quantize_rows`]), and from now on each linear layer's input is quantized
    /// per token. Embeddings, norms, biases and the LM head stay as loaded. A second call does
    /// nothing.
    pub fn quantize_fp8(&mut self) {
        if self.quantization == LinearQuantization::Fp8 {
            return;
        }
        let c = &self.config;
        let (d, ff, qw) = (c.d_model, c.d_ff, c.n_heads * c.head_dim);
        self.layers.par_iter_mut().for_each(|l| {
            for (w, cols) in [
                (&mut l.wq, d),
                (&mut l.wk, d),
                (&mut l.wv, d),
                (&mut l.wo, qw),
                (&mut l.w_gate, d),
                (&mut l.w_up, d),
                (&mut l.w_down, ff),
            ] {
                *w = quantize_rows(w, w.len() / cols, cols).dequantize();
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

/// Borrowed f32 weights of one layer (matrices `[out, in]` row-major), for other backends.
pub struct LayerTensors<'a> {
    pub attn_norm: &'a [f32],
    pub wq: &'a [f32],
    pub wk: &'a [f32],
    pub wv: &'a [f32],
    pub wo: &'a [f32],
    pub bq: Option<&'a [f32]>,
    pub bk: Option<&'a [f32]>,
    pub bv: Option<&'a [f32]>,
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub ffn_norm: &'a [f32],
    pub w_gate: &'a [f32],
    pub w_up: &'a [f32],
    pub w_down: &'a [f32],
    /// Gemma 3: RMSNorm weights of the attention and MLP outputs (`None` for the Llama family).
    pub post_attn_norm: Option<&'a [f32]>,
    pub post_ffn_norm: Option<&'a [f32]>,
}

/// Borrowed f32 weights of the whole model (see [`Llama::tensors`]).
pub struct LlamaTensors<'a> {
    /// `[vocab, d_model]`.
    pub embed: &'a [f32],
    pub layers: Vec<LayerTensors<'a>>,
    pub out_norm: &'a [f32],
    /// `[vocab, d_model]`; `None` when tied to `embed`.
    pub lm_head: Option<&'a [f32]>,
    /// Per rotated pair: the inverse frequency, already divided by any rope_freqs factor.
    pub inv_freq: &'a [f32],
}

impl Llama {
    /// The model's weights, e.g. to upload them to a GPU (`model::gpu`).
    pub fn tensors(&self) -> LlamaTensors<'_> {
        LlamaTensors {
            embed: &self.embed,
            layers: self
                .layers
                .iter()
                .map(|l| LayerTensors {
                    attn_norm: &l.attn_norm,
                    wq: &l.wq,
                    wk: &l.wk,
                    wv: &l.wv,
                    wo: &l.wo,
                    bq: l.bq.as_deref(),
                    bk: l.bk.as_deref(),
                    bv: l.bv.as_deref(),
                    q_norm: l.q_norm.as_deref(),
                    k_norm: l.k_norm.as_deref(),
                    ffn_norm: &l.ffn_norm,
                    w_gate: &l.w_gate,
                    w_up: &l.w_up,
                    w_down: &l.w_down,
                    post_attn_norm: l.post_attn_norm.as_deref(),
                    post_ffn_norm: l.post_ffn_norm.as_deref(),
                })
                .collect(),
            out_norm: &self.out_norm,
            lm_head: self.lm_head.as_deref(),
            inv_freq: &self.inv_freq,
        }
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
fn inv_freq_local(cfg: &LlamaConfig) -> Vec<f32> {
    match &cfg.gemma3 {
        Some(g) => {
            let mut local = cfg.clone();
            local.rope_theta = g.rope_theta_local;
            inv_freq(&local, None)
        }
        None => Vec::new(),
    }
}

/// GELU with the tanh approximation: `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`.
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
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
mod tests {

    #[test]
    fn the_kv_list_of_gemma3_reads_its_window_pattern_and_matches_the_planner() {
        let c = LlamaConfig::gemma3(18, 640, 2048, 1000, 512);
        let layers = c.kv_layers(1).unwrap();
        assert_eq!(layers.len(), 18);
        for (i, l) in layers.iter().enumerate() {
            let global = (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0;
            assert_eq!(l.window, (!global).then_some(512), "layer {i}");
            assert_eq!((l.q_heads, l.kv_heads, l.head_dim), (4, 1, 256));
        }
        // The planner reads the same layers from the same geometry.
        let g = kvfleet_core::plan::Geometry::from_spec(&c.model_geometry()).unwrap();
        let planned: Vec<Option<u32>> = g
            .layers
            .iter()
            .map(|l| match l.kind {
                kvfleet_core::plan::LayerKind::Sliding { window } => Some(window),
                _ => None,
            })
            .collect();
        assert_eq!(planned, layers.iter().map(|l| l.window).collect::<Vec<_>>());
        // Stored heads (the GPU may replicate KV heads) change the list, not the pattern.
        assert!(c.kv_layers(4).unwrap().iter().all(|l| l.kv_heads == 4));
        assert!(c.kv_layers(3).is_err(), "4 query heads over 3 KV heads");
    }

    use super::*;
    use crate::model::kv::{ContiguousKv, KvAttention};

    #[test]
    fn matmul_t_matches_naive_on_odd_shapes() {
        for (t, k, n) in [(3, 5, 131), (1, 37, 70), (9, 21, 200)] {
            matmul_case(t, k, n);
        }
    }

    fn matmul_case(t: usize, k: usize, n: usize) {
        let x: Vec<f32> = (0..t * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = vec![0.0; t * n];
        matmul_t(&x, t, k, &w, n, &mut out);
        for i in 0..t {
            for j in 0..n {
                let want: f32 = (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum();
                assert!((out[i * n + j] - want).abs() < 1e-4);
            }
        }
    }

    fn tiny() -> Llama {
        let mut cfg = LlamaConfig::llama(2, 32, 64, 4, 2, 50);
        cfg.context_len = 64;
        Llama::dummy(cfg, 7).unwrap()
    }

    #[test]
    fn incremental_decode_matches_full_prefill_logits() {
        let m = tiny();
        let toks = [3u32, 14, 15, 9, 26, 5];
        let geo = m.config.attn_geometry();
        let mut kv = ContiguousKv::new(geo, 1000);
        let full = m
            .forward(
                &mut kv,
                &[SeqChunk {
                    seq: 1,
                    start_pos: 0,
                    tokens: &toks,
                    logits: 1,
                }],
            )
            .unwrap();
        let mut kv2 = ContiguousKv::new(geo, 1000);
        let mut last = Vec::new();
        // Chunk of 4, then two single tokens, batched together with an unrelated sequence.
        let plan: [&[u32]; 3] = [&toks[..4], &toks[4..5], &toks[5..]];
        let mut pos = 0;
        for p in plan {
            let other = [7u32];
            let other_pos = kv2.cached_len(2);
            last = m
                .forward(
                    &mut kv2,
                    &[
                        SeqChunk {
                            seq: 2,
                            start_pos: other_pos,
                            tokens: &other,
                            logits: 1,
                        },
                        SeqChunk {
                            seq: 1,
                            start_pos: pos,
                            tokens: p,
                            logits: 1,
                        },
                    ],
                )
                .unwrap();
            pos += p.len();
        }
        let v = m.config.vocab;
        for (a, b) in full.iter().zip(&last[v..]) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    #[test]
    fn neox_and_pair_rope_rotate_different_dimensions() {
        let mut m = tiny();
        let mut a = vec![1.0f32; 8];
        let mut b = a.clone();
        m.config.head_dim = 8;
        m.config.rope_dims = 8;
        m.inv_freq = inv_freq(&m.config, None);
        m.rope(&mut a, &[3], 1);
        m.config.rope_neox = true;
        m.rope(&mut b, &[3], 1);
        assert_ne!(a, b);
        // Rotations keep each rotated pair's norm.
        let n = |x: &[f32], i: usize, j: usize| x[i] * x[i] + x[j] * x[j];
        assert!((n(&a, 0, 1) - 2.0).abs() < 1e-5);
        assert!((n(&b, 0, 4) - 2.0).abs() < 1e-5);
    }

    #[test]
    fn fp8_linear_equals_the_hand_computed_per_row_and_per_token_dequantized_product() {
        // Weight rows (output channels) with amax 2 and 6: scales 2/448 and 6/448. Row 0 maps to
        // 224, -448, 112 (all e4m3 codes, so exact); in row 1, 0.3 maps to 22.4, whose nearest
        // code is 22 (step 2 between 16 and 32). One scale for the whole matrix (6/448) would
        // round row 0 too (2 -> 149.3 -> 144), so the test tells per-row scales apart.
        let w = [1.0f32, -2.0, 0.5, 3.0, 0.3, -6.0];
        let wq = quantize_rows(&w, 2, 3).dequantize();
        let want_w = [1.0, -2.0, 0.5, 3.0, 22.0 * 6.0 / 448.0, -6.0];
        for (a, b) in wq.iter().zip(&want_w) {
            assert!((a - b).abs() < 1e-6, "{wq:?}");
        }
        // Token rows with amax 1 and 0.7 (scales 1/448 and 0.7/448): -0.13 maps to -58.24, nearest
        // code -60 (step 4 between 32 and 64); row 1 maps to 64, 128, -448 exactly.
        let x = [1.0f32, 0.5, -0.13, 0.1, 0.2, -0.7];
        let mut m = tiny();
        m.quantize_fp8();
        let xq = m.linear_input(&x, 3);
        let want_x = [1.0, 0.5, -60.0 / 448.0, 0.1, 0.2, -0.7];
        for (a, b) in xq.iter().zip(&want_x) {
            assert!((a - b).abs() < 1e-6, "{xq:?}");
        }
        let mut out = [0f32; 4];
        matmul_t(&xq, 2, 3, &wq, 2, &mut out);
        for i in 0..2 {
            for j in 0..2 {
                let want: f32 = (0..3).map(|p| want_x[i * 3 + p] * want_w[j * 3 + p]).sum();
                assert!(
                    (out[i * 2 + j] - want).abs() < 1e-5,
                    "({i}, {j}): {} vs {want}",
                    out[i * 2 + j]
                );
            }
        }
        // Unquantized, the input is passed through, not copied.
        assert!(matches!(tiny().linear_input(&x, 3), Cow::Borrowed(_)));
    }

    #[test]
    fn quantize_fp8_replaces_exactly_the_linear_weights_and_changes_the_logits() {
        let plain = tiny();
        let mut m = plain.clone();
        m.quantize_fp8();
        assert_eq!(m.quantization(), LinearQuantization::Fp8);
        let (d, ff, qw) = (32, 64, 32);
        for (p, q) in plain.layers.iter().zip(&m.layers) {
            for (a, b, cols) in [
                (&p.wq, &q.wq, d),
                (&p.wk, &q.wk, d),
                (&p.wv, &q.wv, d),
                (&p.wo, &q.wo, qw),
                (&p.w_gate, &q.w_gate, d),
                (&p.w_up, &q.w_up, d),
                (&p.w_down, &q.w_down, ff),
            ] {
                assert_eq!(*b, quantize_rows(a, a.len() / cols, cols).dequantize());
                assert_ne!(a, b);
            }
            assert_eq!((&p.attn_norm, &p.ffn_norm), (&q.attn_norm, &q.ffn_norm));
        }
        assert_eq!(plain.embed, m.embed);
        assert_eq!(plain.lm_head, m.lm_head);
        assert_eq!(plain.out_norm, m.out_norm);
        let again = {
            let mut a = m.clone();
            a.quantize_fp8();
            a
        };
        assert_eq!(again.layers[0].wq, m.layers[0].wq, "a second call does nothing");
        let logits = |m: &Llama| {
            let mut kv = ContiguousKv::new(m.config.attn_geometry(), 64);
            let chunk = SeqChunk {
                seq: 1,
                start_pos: 0,
                tokens: &[3, 14, 15, 9],
                logits: 1,
            };
            m.forward(&mut kv, &[chunk]).unwrap()
        };
        let (a, b) = (logits(&plain), logits(&m));
        let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let span = a.iter().fold(0f32, |s, v| s.max(v.abs()));
        assert!(
            err > 0.0 && err < 0.1 * span,
            "max error {err} of logits up to {span}"
        );
    }

    #[test]
    fn bad_geometry_and_token_are_errors() {
        let cfg = LlamaConfig::llama(1, 32, 64, 4, 3, 10);
        assert!(matches!(Llama::dummy(cfg, 0), Err(LoadError::Geometry(_))));
        let m = tiny();
        let mut kv = ContiguousKv::new(m.config.attn_geometry(), 10);
        let e = m
            .forward(
                &mut kv,
                &[SeqChunk {
                    seq: 1,
                    start_pos: 0,
                    tokens: &[999],
                    logits: 1,
                }],
            )
            .unwrap_err();
        assert!(matches!(e, ForwardError::Token(999)));
    }
}

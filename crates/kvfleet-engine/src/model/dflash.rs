//! DFlash drafters (block diffusion, arXiv 2602.06036): a few Qwen3-style decoder layers that
//! draft a whole block in one pass. The target's features of every computed position become
//! the drafter's *context* K/V (projected once, when the target computes them); a block of the
//! newest token followed by `k` mask tokens attends over that context and over itself, without
//! a causal mask, and the outputs at the mask positions are the `k` proposals.
//!
//! The checkpoint is the one the DFlash authors (z-lab) and vLLM use: `config.json` with
//! `architectures: ["DFlashDraftModel"]`, the Qwen3 keys, `block_size` and `dflash_config:
//! {mask_token_id, target_layer_ids}` (or `eagle_aux_hidden_state_layer_ids`), and
//! `model.safetensors` with `fc` `[hidden, n x target hidden]`, `hidden_norm`, `layers.{i}.*`
//! (Qwen3 layers with `q_norm` / `k_norm`), `norm`, and optionally `lm_head`, `embed_tokens`
//! and `d2t` (without them the target's LM head and embeddings are used).
//!
//! Facts from vllm-project/vllm `vllm/model_executor/models/qwen3_dflash.py` (the context
//! K/V: `k_norm(W_k · hidden_norm(fc(features)))` with RoPE at the context positions, `W_v ·`
//! the same, written to every layer's cache; the query layers; non-causal unless the config
//! says `is_causal` / `dflash_config.causal`), `vllm/v1/spec_decode/dflash.py` (the query
//! block: the next token then `k` mask tokens at the positions after the context, drafts taken
//! at the mask positions) and `eagle3_utils.py` (`target_layer_ids` name layer *outputs*: the
//! feature of id `i` is the residual stream entering layer `i + 1`). Sliding-window DFlash
//! layers are refused.

use std::path::Path;

use rayon::prelude::*;
use serde::Deserialize;

use super::eagle3::fits_target;
use super::hf::{self, HfConfig, HfError, Safetensors};
use super::kv::{AttnGeometry, AttnSeq, KvAttention};
use super::llama::{add_in_place, inv_freq, matmul_t, rms_norm, rope, ForwardError, Llama, LlamaConfig};

#[derive(Deserialize)]
struct DflashJson {
    architectures: Option<Vec<String>>,
    draft_vocab_size: Option<usize>,
    target_hidden_size: Option<usize>,
    block_size: Option<usize>,
    is_causal: Option<bool>,
    eagle_aux_hidden_state_layer_ids: Option<Vec<usize>>,
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    dflash_config: DflashConfigJson,
}

#[derive(Deserialize, Default)]
struct DflashConfigJson {
    mask_token_id: Option<u32>,
    target_layer_ids: Option<Vec<usize>>,
    causal: Option<bool>,
    use_swa: Option<bool>,
}

const DFLASH_ARCHITECTURES: &[&str] = &["DFlashDraftModel", "DFlashQwen3ForCausalLM"];

/// A DFlash drafter's geometry and where it reads the target.
#[derive(Debug, Clone, PartialEq)]
pub struct DflashConfig {
    /// The decoder layers' geometry (`n_layers` of them, Qwen3: Q/K norms).
    pub layer: LlamaConfig,
    pub draft_vocab: usize,
    /// The target layers whose input features `fc` fuses, in `fc`'s column order.
    pub aux_layers: Vec<usize>,
    pub target_hidden: usize,
    pub mask_token: u32,
    /// The block the drafter was trained on (at most `block_size - 1` proposals a step).
    pub block_size: usize,
    pub causal: bool,
}

fn config_error(path: &Path, msg: String) -> HfError {
    HfError::Config {
        path: path.into(),
        msg,
    }
}

impl DflashConfig {
    pub fn load(dir: &Path, target: &LlamaConfig) -> Result<Self, HfError> {
        let path = hf::config_path(dir);
        let text = hf::read(&path)?;
        Self::parse(&path, &text, target)
    }

    pub fn parse(path: &Path, text: &str, target: &LlamaConfig) -> Result<Self, HfError> {
        let raw: DflashJson = hf::parse_json(path, text)?;
        let arch = raw.architectures.as_deref().and_then(|a| a.first()).cloned();
        if !arch.as_deref().is_some_and(|a| DFLASH_ARCHITECTURES.contains(&a)) {
            return Err(config_error(
                path,
                format!(
                    "architectures {:?} is not a DFlash drafter; expected {DFLASH_ARCHITECTURES:?}",
                    arch.unwrap_or_default()
                ),
            ));
        }
        if raw.dflash_config.use_swa == Some(true)
            || raw.layer_types.iter().flatten().any(|t| t == "sliding_attention")
        {
            return Err(config_error(
                path,
                "sliding-window DFlash layers (dflash_config.use_swa, layer_types) are not supported; kvfleet runs full-attention DFlash drafters".into(),
            ));
        }
        let mut json: serde_json::Value = hf::parse_json(path, text)?;
        json["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
        let mut layer = HfConfig::parse(path, &json.to_string())?.llama;
        let (target_hidden, draft_vocab) =
            fits_target(path, &layer, raw.target_hidden_size, raw.draft_vocab_size, target)?;
        let mask_token = raw.dflash_config.mask_token_id.ok_or_else(|| {
            config_error(
                path,
                "dflash_config.mask_token_id is missing: the block's mask token".into(),
            )
        })?;
        if mask_token as usize >= layer.vocab {
            return Err(config_error(
                path,
                format!(
                    "dflash_config.mask_token_id {mask_token} is outside the vocabulary of {}",
                    layer.vocab
                ),
            ));
        }
        let n = target.n_layers;
        // `eagle_aux_hidden_state_layer_ids` name layer inputs; DFlash's own ids name outputs.
        let aux_layers = match (
            raw.eagle_aux_hidden_state_layer_ids,
            raw.dflash_config.target_layer_ids,
        ) {
            (Some(ids), _) => ids,
            (None, Some(ids)) => ids.iter().map(|i| i + 1).collect(),
            (None, None) => {
                return Err(config_error(
                    path,
                    "dflash_config.target_layer_ids is missing: the target layers the drafter reads".into(),
                ))
            }
        };
        if aux_layers.is_empty() || aux_layers.iter().any(|&l| l > n) {
            return Err(config_error(
                path,
                format!(
                    "the feature layers {aux_layers:?} (dflash_config.target_layer_ids + 1) must be in 1..={n} for the served model's {n} layers"
                ),
            ));
        }
        let block_size = raw.block_size.unwrap_or(16);
        if block_size < 2 {
            return Err(config_error(
                path,
                format!("block_size {block_size} must be at least 2"),
            ));
        }
        layer.context_len = target.context_len;
        Ok(DflashConfig {
            layer,
            draft_vocab,
            aux_layers,
            target_hidden,
            mask_token,
            block_size,
            causal: raw.is_causal.or(raw.dflash_config.causal).unwrap_or(false),
        })
    }

    pub fn attn_geometry(&self) -> AttnGeometry {
        self.layer.attn_geometry()
    }
}

/// One decoder layer's tensors (public for the GPU engine, which uploads them).
pub struct DLayer {
    pub input_norm: Vec<f32>,
    pub wq: Vec<f32>,
    pub wk: Vec<f32>,
    pub wv: Vec<f32>,
    pub wo: Vec<f32>,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub w_gate: Vec<f32>,
    pub w_up: Vec<f32>,
    pub w_down: Vec<f32>,
}

/// A loaded DFlash drafter (f32 weights; public for the GPU engine, which uploads them).
pub struct Dflash {
    pub config: DflashConfig,
    pub inv_freq: Vec<f32>,
    pub fc: Vec<f32>,
    pub hidden_norm: Vec<f32>,
    pub layers: Vec<DLayer>,
    pub out_norm: Vec<f32>,
    pub lm_head: Option<Vec<f32>>,
    pub d2t: Vec<u32>,
    pub embed: Option<Vec<f32>>,
}

impl std::fmt::Debug for Dflash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dflash").field("config", &self.config).finish()
    }
}

impl Dflash {
    pub fn load(dir: &Path, target: &LlamaConfig) -> Result<Self, HfError> {
        let config = DflashConfig::load(dir, target)?;
        let st = Safetensors::open(dir)?;
        let c = &config.layer;
        let (d, ff, hd) = (c.d_model, c.d_ff, c.head_dim);
        let (qw, kw, dv) = (c.n_heads * hd, c.n_kv_heads * hd, config.draft_vocab);
        let pre = if st.contains("fc.weight") { "" } else { "model." };
        let w = |name: &str, shape: &[usize]| st.tensor_f32(&format!("{pre}{name}"), shape);
        let any = |names: [&str; 2], shape: &[usize]| {
            names
                .into_iter()
                .find(|n| st.contains(n))
                .map(|n| st.tensor_f32(n, shape))
                .transpose()
        };
        let layers = (0..c.n_layers)
            .map(|i| {
                let l = |name: &str, shape: &[usize]| w(&format!("layers.{i}.{name}"), shape);
                Ok(DLayer {
                    input_norm: l("input_layernorm.weight", &[d])?,
                    wq: l("self_attn.q_proj.weight", &[qw, d])?,
                    wk: l("self_attn.k_proj.weight", &[kw, d])?,
                    wv: l("self_attn.v_proj.weight", &[kw, d])?,
                    wo: l("self_attn.o_proj.weight", &[d, qw])?,
                    q_norm: l("self_attn.q_norm.weight", &[hd])?,
                    k_norm: l("self_attn.k_norm.weight", &[hd])?,
                    post_norm: l("post_attention_layernorm.weight", &[d])?,
                    w_gate: l("mlp.gate_proj.weight", &[ff, d])?,
                    w_up: l("mlp.up_proj.weight", &[ff, d])?,
                    w_down: l("mlp.down_proj.weight", &[d, ff])?,
                })
            })
            .collect::<Result<Vec<_>, HfError>>()?;
        let lm_head = any(["lm_head.weight", "model.lm_head.weight"], &[dv, d])?;
        if lm_head.is_none() && dv != c.vocab {
            return Err(HfError::MissingTensor {
                dir: dir.into(),
                tensor: "lm_head.weight (draft_vocab_size differs from the vocabulary)".into(),
            });
        }
        let d2t = super::eagle3::draft_to_target(&st, dir, dv, c.vocab)?;
        Ok(Dflash {
            inv_freq: inv_freq(c, None),
            fc: w("fc.weight", &[d, config.aux_layers.len() * config.target_hidden])?,
            hidden_norm: w("hidden_norm.weight", &[d])?,
            layers,
            out_norm: w("norm.weight", &[d])?,
            lm_head,
            d2t,
            embed: any(
                ["embed_tokens.weight", "model.embed_tokens.weight"],
                &[c.vocab, d],
            )?,
            config,
        })
    }

    fn qk(&self, l: &DLayer, x: &[f32], t: usize, positions: &[usize]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.config.layer;
        let (d, hd) = (c.d_model, c.head_dim);
        let (qw, kw) = (c.n_heads * hd, c.n_kv_heads * hd);
        let (mut q, mut k, mut v) = (vec![0f32; t * qw], vec![0f32; t * kw], vec![0f32; t * kw]);
        matmul_t(x, t, d, &l.wq, qw, &mut q);
        matmul_t(x, t, d, &l.wk, kw, &mut k);
        matmul_t(x, t, d, &l.wv, kw, &mut v);
        let src = q.clone();
        rms_norm(&src, &l.q_norm, c.rms_eps, &mut q);
        let src = k.clone();
        rms_norm(&src, &l.k_norm, c.rms_eps, &mut k);
        rope(c, &self.inv_freq, &mut q, positions, c.n_heads);
        rope(c, &self.inv_freq, &mut k, positions, c.n_kv_heads);
        (q, k, v)
    }

    /// The context K and V of each layer for `[rows, n x target hidden]` target features at
    /// `positions`: `(k, v)` per layer, `[rows, kv_heads x head_dim]` each.
    pub fn context_kv(&self, aux: &[f32], positions: &[usize]) -> Vec<(Vec<f32>, Vec<f32>)> {
        let c = &self.config.layer;
        let (d, k_in) = (
            c.d_model,
            self.config.aux_layers.len() * self.config.target_hidden,
        );
        let t = positions.len();
        let mut fused = vec![0f32; t * d];
        matmul_t(aux, t, k_in, &self.fc, d, &mut fused);
        let mut h = vec![0f32; t * d];
        rms_norm(&fused, &self.hidden_norm, c.rms_eps, &mut h);
        self.layers
            .iter()
            .map(|l| {
                let (_, k, v) = self.qk(l, &h, t, positions);
                (k, v)
            })
            .collect()
    }

    /// The query blocks through every layer (`embeds` `[t, d]` at `positions`; attention
    /// through `kv`, whose layers hold the context): the final-normed outputs `[t, d]`.
    pub fn blocks(
        &self,
        kv: &mut dyn KvAttention,
        seqs: &[AttnSeq],
        positions: &[usize],
        embeds: &[f32],
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config.layer;
        let (d, ff, hd) = (c.d_model, c.d_ff, c.head_dim);
        let qw = c.n_heads * hd;
        let t = positions.len();
        let mut x = embeds.to_vec();
        let mut h = vec![0f32; t * d];
        let mut attn = vec![0f32; t * qw];
        let mut proj = vec![0f32; t * d];
        let (mut gate, mut up) = (vec![0f32; t * ff], vec![0f32; t * ff]);
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&x, &l.input_norm, c.rms_eps, &mut h);
            let (q, k, v) = self.qk(l, &h, t, positions);
            kv.attend(li, seqs, (&q, &k, &v), &mut attn)?;
            matmul_t(&attn, t, qw, &l.wo, d, &mut proj);
            add_in_place(&mut x, &proj);
            rms_norm(&x, &l.post_norm, c.rms_eps, &mut h);
            matmul_t(&h, t, d, &l.w_gate, ff, &mut gate);
            matmul_t(&h, t, d, &l.w_up, ff, &mut up);
            gate.par_iter_mut()
                .zip(up.par_iter())
                .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
            matmul_t(&gate, t, ff, &l.w_down, d, &mut proj);
            add_in_place(&mut x, &proj);
        }
        rms_norm(&x.clone(), &self.out_norm, c.rms_eps, &mut x);
        Ok(x)
    }

    /// The drafted target token of each `[rows, d]` normed output (greedy; the drafter's LM
    /// head, else the target's).
    pub fn tokens(&self, target: &Llama, normed: &[f32]) -> Vec<u32> {
        let d = self.config.layer.d_model;
        let rows = normed.len() / d;
        let (head, dv) = match &self.lm_head {
            Some(h) => (h.as_slice(), self.config.draft_vocab),
            None => (target.lm_head_matrix(), target.config.vocab),
        };
        let mut logits = vec![0f32; rows * dv];
        matmul_t(normed, rows, d, head, dv, &mut logits);
        logits
            .chunks_exact(dv)
            .map(|row| self.d2t[super::eagle3::argmax(row)])
            .collect()
    }

    /// Embedding rows of `tokens`: the drafter's own table, else the target's.
    pub fn embeddings(&self, target: &Llama, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        super::eagle3::embedding_rows(self.embed.as_deref(), target, self.config.layer.d_model, tokens)
    }
}

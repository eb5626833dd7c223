//! EAGLE-3 drafters (arXiv 2503.01840): one Llama decoder layer that reads the target model's
//! own features and proposes the next tokens, which the target then verifies in its batched
//! step (`engine::speculative`).
//!
//! The checkpoint is the one the EAGLE-3 authors and vLLM use: a directory with `config.json`
//! (`architectures: ["LlamaForCausalLMEagle3"]`, the Llama keys, `draft_vocab_size`, and
//! optionally `target_hidden_size`, `norm_before_residual` and
//! `eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors` holding
//! - `fc.weight` `[hidden, 3 x target hidden]`: the three target features to one;
//! - `midlayer.*` (or `layers.0.*`): `input_layernorm` (on the token's embedding),
//!   `hidden_norm` (on the feature), `self_attn.{q,k,v}_proj` reading both side by side
//!   (`[*, 2 x hidden]`), `o_proj`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`;
//! - `norm.weight`, `lm_head.weight` `[draft_vocab, hidden]`, and `d2t` `[draft_vocab]` (the
//!   target id of draft token `i` is `i + d2t[i]`); `t2d` is not needed;
//! - `embed_tokens.weight` when the drafter has its own, else the target's table is used.
//!
//! (vllm-project/vllm `vllm/model_executor/models/llama_eagle3.py`: the tensor names, the
//! concatenation order `[embedding, feature]`, the residual, and that the pre-norm output is
//! the next step's feature; `llama.py` `get_eagle3_aux_hidden_state_layers`: the default
//! feature layers `(2, L / 2, L - 3)` of an `L`-layer target, each the residual stream
//! entering that layer.) Only safetensors are read: a `pytorch_model.bin` checkpoint is
//! converted first (e.g. `safetensors`' `convert.py`).
//!
//! Drafting position `i` pairs the feature of position `i` (the target's, fused by `fc`, or
//! the drafter's own pre-norm output while it chains ahead) with the embedding of token
//! `i + 1`, and predicts token `i + 2`; its K/V go to the drafter's own pool, paged by the
//! target's full-attention page table (one more layer of the same pages).

use std::path::Path;

use rayon::prelude::*;
use serde::Deserialize;

use super::hf::{self, HfConfig, HfError, Safetensors};
use super::kv::{AttnGeometry, AttnSeq, KvAttention};
use super::llama::{add_in_place, inv_freq, matmul_t, rms_norm, rope, ForwardError, Llama, LlamaConfig};

/// The `config.json` keys of an EAGLE-3 drafter beyond the Llama ones.
#[derive(Deserialize)]
struct Eagle3Json {
    architectures: Option<Vec<String>>,
    draft_vocab_size: Option<usize>,
    target_hidden_size: Option<usize>,
    #[serde(default)]
    norm_before_residual: bool,
    eagle_config: Option<EagleConfigJson>,
}

#[derive(Deserialize)]
struct EagleConfigJson {
    eagle_aux_hidden_state_layer_ids: Option<Vec<usize>>,
    use_aux_hidden_state: Option<bool>,
}

/// Architecture names of EAGLE-3 Llama drafters (`architectures[0]`).
const EAGLE3_ARCHITECTURES: &[&str] = &["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"];

/// An EAGLE-3 drafter's geometry and where it reads the target.
#[derive(Debug, Clone, PartialEq)]
pub struct Eagle3Config {
    /// The decoder layer's geometry (one layer; `d_model` is the drafter's hidden size).
    pub layer: LlamaConfig,
    pub draft_vocab: usize,
    /// The target layers whose input features `fc` fuses, in `fc`'s column order.
    pub aux_layers: Vec<usize>,
    pub target_hidden: usize,
    pub norm_before_residual: bool,
}

/// A loaded EAGLE-3 drafter (f32 weights, matrices `[out, in]` row-major; public for the GPU
/// engine, which uploads them).
pub struct Eagle3 {
    pub config: Eagle3Config,
    pub inv_freq: Vec<f32>,
    pub fc: Vec<f32>,
    pub input_norm: Vec<f32>,
    pub hidden_norm: Vec<f32>,
    pub wq: Vec<f32>,
    pub wk: Vec<f32>,
    pub wv: Vec<f32>,
    pub wo: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub w_gate: Vec<f32>,
    pub w_up: Vec<f32>,
    pub w_down: Vec<f32>,
    pub out_norm: Vec<f32>,
    pub lm_head: Vec<f32>,
    /// Target token id of each draft token.
    pub d2t: Vec<u32>,
    pub embed: Option<Vec<f32>>,
}

impl std::fmt::Debug for Eagle3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eagle3").field("config", &self.config).finish()
    }
}

fn config_error(path: &Path, msg: String) -> HfError {
    HfError::Config {
        path: path.into(),
        msg,
    }
}

impl Eagle3Config {
    /// Reads a drafter's `config.json` and checks it against the target it drafts for.
    pub fn load(dir: &Path, target: &LlamaConfig) -> Result<Self, HfError> {
        let path = hf::config_path(dir);
        let text = hf::read(&path)?;
        Self::parse(&path, &text, target)
    }

    /// Parses the text of a drafter's `config.json` (`path` names it in errors).
    pub fn parse(path: &Path, text: &str, target: &LlamaConfig) -> Result<Self, HfError> {
        let raw: Eagle3Json = hf::parse_json(path, text)?;
        let arch = raw.architectures.as_deref().and_then(|a| a.first()).cloned();
        if !arch.as_deref().is_some_and(|a| EAGLE3_ARCHITECTURES.contains(&a)) {
            return Err(config_error(
                path,
                format!(
                    "architectures {:?} is not an EAGLE-3 drafter; expected {EAGLE3_ARCHITECTURES:?} (an EAGLE-3 checkpoint for this model, e.g. from the EAGLE authors or RedHatAI's speculators)",
                    arch.unwrap_or_default()
                ),
            ));
        }
        // The decoder layer is a Llama layer: read its geometry and RoPE as one.
        let mut json: serde_json::Value = hf::parse_json(path, text)?;
        json["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        let layer_cfg = HfConfig::parse(path, &json.to_string())?;
        let mut layer = layer_cfg.llama;
        if layer.n_layers != 1 {
            return Err(config_error(
                path,
                format!(
                    "num_hidden_layers {} : kvfleet runs EAGLE-3 drafters of one decoder layer",
                    layer.n_layers
                ),
            ));
        }
        if raw.eagle_config.as_ref().and_then(|e| e.use_aux_hidden_state) == Some(false) {
            return Err(config_error(
                path,
                "eagle_config.use_aux_hidden_state false (an EAGLE-1/2 style drafter) is not supported; kvfleet runs EAGLE-3 drafters".into(),
            ));
        }
        let (target_hidden, draft_vocab) =
            fits_target(path, &layer, raw.target_hidden_size, raw.draft_vocab_size, target)?;
        let n = target.n_layers;
        let aux_layers = match raw
            .eagle_config
            .and_then(|e| e.eagle_aux_hidden_state_layer_ids)
        {
            Some(ids) => ids,
            None if n >= 4 => vec![2, n / 2, n - 3],
            None => {
                return Err(config_error(
                    path,
                    format!(
                        "the served model has {n} layers, too few for the default feature layers (2, L/2, L-3); set eagle_config.eagle_aux_hidden_state_layer_ids"
                    ),
                ))
            }
        };
        if aux_layers.len() != 3 || aux_layers.iter().any(|&l| l >= n) {
            return Err(config_error(
                path,
                format!(
                    "eagle_config.eagle_aux_hidden_state_layer_ids {aux_layers:?} must name 3 layers of the served model's {n}"
                ),
            ));
        }
        // The drafter's positions are the target's.
        layer.context_len = target.context_len;
        Ok(Eagle3Config {
            layer,
            draft_vocab,
            aux_layers,
            target_hidden,
            norm_before_residual: raw.norm_before_residual,
        })
    }

    /// The drafter's attention: one layer.
    pub fn attn_geometry(&self) -> AttnGeometry {
        self.layer.attn_geometry()
    }
}

impl Eagle3 {
    /// Loads a drafter checkpoint directory for a target of geometry `target`.
    pub fn load(dir: &Path, target: &LlamaConfig) -> Result<Self, HfError> {
        let config = Eagle3Config::load(dir, target)?;
        let st = Safetensors::open(dir)?;
        let c = &config.layer;
        let (d, ff, hd) = (c.d_model, c.d_ff, c.head_dim);
        let (qw, kw, dv) = (c.n_heads * hd, c.n_kv_heads * hd, config.draft_vocab);
        let mid = ["midlayer.", "layers.0.", "model.layers.0."]
            .into_iter()
            .find(|p| st.contains(&format!("{p}input_layernorm.weight")))
            .unwrap_or("midlayer.");
        let top = if st.contains("fc.weight") { "" } else { "model." };
        let w = |name: &str, shape: &[usize]| st.tensor_f32(name, shape);
        let m = |name: &str, shape: &[usize]| st.tensor_f32(&format!("{mid}{name}"), shape);
        let lm_head = if st.contains("lm_head.weight") {
            w("lm_head.weight", &[dv, d])?
        } else {
            w("model.lm_head.weight", &[dv, d])?
        };
        let d2t = draft_to_target(&st, dir, dv, c.vocab)?;
        let embed = ["embed_tokens.weight", "model.embed_tokens.weight"]
            .into_iter()
            .find(|n| st.contains(n))
            .map(|n| w(n, &[c.vocab, d]))
            .transpose()?;
        Ok(Eagle3 {
            inv_freq: inv_freq(c, None),
            fc: w(&format!("{top}fc.weight"), &[d, 3 * config.target_hidden])?,
            input_norm: m("input_layernorm.weight", &[d])?,
            hidden_norm: m("hidden_norm.weight", &[d])?,
            wq: m("self_attn.q_proj.weight", &[qw, 2 * d])?,
            wk: m("self_attn.k_proj.weight", &[kw, 2 * d])?,
            wv: m("self_attn.v_proj.weight", &[kw, 2 * d])?,
            wo: m("self_attn.o_proj.weight", &[d, qw])?,
            post_norm: m("post_attention_layernorm.weight", &[d])?,
            w_gate: m("mlp.gate_proj.weight", &[ff, d])?,
            w_up: m("mlp.up_proj.weight", &[ff, d])?,
            w_down: m("mlp.down_proj.weight", &[d, ff])?,
            out_norm: w(&format!("{top}norm.weight"), &[d])?,
            lm_head,
            d2t,
            embed,
            config,
        })
    }

    /// `[rows, d]` features from `[rows, 3 x target hidden]` target features (`fc`).
    pub fn fuse(&self, aux: &[f32]) -> Vec<f32> {
        let (d, k) = (self.config.layer.d_model, 3 * self.config.target_hidden);
        let rows = aux.len() / k;
        let mut out = vec![0f32; rows * d];
        matmul_t(aux, rows, k, &self.fc, d, &mut out);
        out
    }

    /// The decoder layer over `[t, d]` token embeddings and features at `positions`, its K/V
    /// stored through `kv` (layer 0); returns the pre-norm outputs `[t, d]` (the next features).
    pub fn layer(
        &self,
        kv: &mut dyn KvAttention,
        seqs: &[AttnSeq],
        positions: &[usize],
        embeds: &[f32],
        features: &[f32],
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config.layer;
        let (d, ff, hd) = (c.d_model, c.d_ff, c.head_dim);
        let (qw, kw) = (c.n_heads * hd, c.n_kv_heads * hd);
        let t = positions.len();
        let mut e = vec![0f32; t * d];
        rms_norm(embeds, &self.input_norm, c.rms_eps, &mut e);
        let mut h = vec![0f32; t * d];
        rms_norm(features, &self.hidden_norm, c.rms_eps, &mut h);
        let mut x = if self.config.norm_before_residual {
            h.clone()
        } else {
            features.to_vec()
        };
        let mut cat = vec![0f32; t * 2 * d];
        cat.par_chunks_mut(2 * d)
            .zip(e.par_chunks(d).zip(h.par_chunks(d)))
            .for_each(|(o, (e, h))| {
                o[..d].copy_from_slice(e);
                o[d..].copy_from_slice(h);
            });
        let (mut q, mut k, mut v) = (vec![0f32; t * qw], vec![0f32; t * kw], vec![0f32; t * kw]);
        matmul_t(&cat, t, 2 * d, &self.wq, qw, &mut q);
        matmul_t(&cat, t, 2 * d, &self.wk, kw, &mut k);
        matmul_t(&cat, t, 2 * d, &self.wv, kw, &mut v);
        rope(c, &self.inv_freq, &mut q, positions, c.n_heads);
        rope(c, &self.inv_freq, &mut k, positions, c.n_kv_heads);
        let mut attn = vec![0f32; t * qw];
        kv.attend(0, seqs, (&q, &k, &v), &mut attn)?;
        let mut proj = vec![0f32; t * d];
        matmul_t(&attn, t, qw, &self.wo, d, &mut proj);
        add_in_place(&mut x, &proj);
        rms_norm(&x, &self.post_norm, c.rms_eps, &mut h);
        let (mut gate, mut up) = (vec![0f32; t * ff], vec![0f32; t * ff]);
        matmul_t(&h, t, d, &self.w_gate, ff, &mut gate);
        matmul_t(&h, t, d, &self.w_up, ff, &mut up);
        gate.par_iter_mut()
            .zip(up.par_iter())
            .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
        matmul_t(&gate, t, ff, &self.w_down, d, &mut proj);
        add_in_place(&mut x, &proj);
        Ok(x)
    }

    /// The drafted target token of each `[rows, d]` pre-norm output: the most likely draft
    /// token (drafting is greedy, as in vLLM; verification keeps the output exact), mapped
    /// through `d2t`.
    pub fn tokens(&self, prenorm: &[f32]) -> Vec<u32> {
        let c = &self.config.layer;
        let (d, dv) = (c.d_model, self.config.draft_vocab);
        let rows = prenorm.len() / d;
        let mut normed = vec![0f32; rows * d];
        rms_norm(prenorm, &self.out_norm, c.rms_eps, &mut normed);
        let mut logits = vec![0f32; rows * dv];
        matmul_t(&normed, rows, d, &self.lm_head, dv, &mut logits);
        logits.chunks_exact(dv).map(|row| self.d2t[argmax(row)]).collect()
    }

    /// Embedding rows of `tokens`: the drafter's own table, else the target's.
    pub fn embeddings(&self, target: &Llama, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        embedding_rows(self.embed.as_deref(), target, self.config.layer.d_model, tokens)
    }
}

/// Checks a drafter's geometry against the served model's: the hidden size it reads and
/// writes, the vocabulary, and a draft vocabulary within it. Returns `(target hidden, draft
/// vocabulary)`.
pub(crate) fn fits_target(
    path: &Path,
    layer: &LlamaConfig,
    target_hidden_size: Option<usize>,
    draft_vocab_size: Option<usize>,
    target: &LlamaConfig,
) -> Result<(usize, usize), HfError> {
    let target_hidden = target_hidden_size.unwrap_or(layer.d_model);
    if target_hidden != target.d_model || layer.d_model != target.d_model {
        return Err(config_error(
            path,
            format!(
                "hidden_size {} / target_hidden_size {target_hidden} do not match the served model's hidden size {}: this drafter was trained for another model",
                layer.d_model, target.d_model
            ),
        ));
    }
    if layer.vocab != target.vocab {
        return Err(config_error(
            path,
            format!(
                "vocab_size {} differs from the served model's {}: this drafter was trained for another model",
                layer.vocab, target.vocab
            ),
        ));
    }
    let draft_vocab = draft_vocab_size.unwrap_or(layer.vocab);
    if draft_vocab == 0 || draft_vocab > layer.vocab {
        return Err(config_error(
            path,
            format!(
                "draft_vocab_size {draft_vocab} must be in [1, vocab_size {}]",
                layer.vocab
            ),
        ));
    }
    Ok((target_hidden, draft_vocab))
}

/// The target id of each draft token: `i + d2t[i]` from the checkpoint's `d2t`, else the
/// identity when the draft vocabulary is the target's.
pub(crate) fn draft_to_target(
    st: &Safetensors,
    dir: &Path,
    dv: usize,
    vocab: usize,
) -> Result<Vec<u32>, HfError> {
    if !st.contains("d2t") {
        if dv == vocab {
            return Ok((0..dv as u32).collect());
        }
        return Err(HfError::MissingTensor {
            dir: dir.into(),
            tensor: "d2t".into(),
        });
    }
    st.tensor_i64("d2t", &[dv])?
        .iter()
        .enumerate()
        .map(|(i, &o)| {
            u32::try_from(i as i64 + o)
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    config_error(
                        dir,
                        format!("d2t[{i}] = {o} maps draft token {i} outside the vocabulary of {vocab}"),
                    )
                })
        })
        .collect()
}

/// Index of the largest value (the first of ties).
pub(crate) fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0
}

/// Embedding rows of `tokens` (`[tokens, d]`): `own` when the drafter has a table, else the
/// target's (as stored, unscaled).
pub(crate) fn embedding_rows(
    own: Option<&[f32]>,
    target: &Llama,
    d: usize,
    tokens: &[u32],
) -> Result<Vec<f32>, ForwardError> {
    let bad = || ForwardError::Token(tokens.iter().copied().max().unwrap_or(0));
    match own {
        Some(e) => {
            let mut out = Vec::with_capacity(tokens.len() * d);
            for &t in tokens {
                out.extend_from_slice(e.get(t as usize * d..(t as usize + 1) * d).ok_or_else(bad)?);
            }
            Ok(out)
        }
        None => target.embedding_rows(tokens).ok_or_else(bad),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::engine::block::BlockTable;
    use crate::engine::layout::KvDtype;
    use crate::engine::scheduler::write_plan;
    use crate::engine::StepPlan;
    use crate::model::forward::CpuEagle3;
    use crate::model::proposer::CatchUp;

    fn tiny_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/eagle3/tiny")
    }

    /// The served model the tiny drafter was made for: hidden 8, vocabulary 16, 4 layers.
    fn target() -> Llama {
        Llama::dummy(LlamaConfig::llama(4, 8, 16, 2, 1, 16), 1).unwrap()
    }

    #[derive(serde::Deserialize)]
    struct Expected {
        aux: Vec<Vec<f32>>,
        tokens: Vec<u32>,
        prenorm: Vec<Vec<f64>>,
        drafted: Vec<u32>,
    }

    fn expected() -> Expected {
        serde_json::from_str(&std::fs::read_to_string(tiny_dir().join("expected.json")).unwrap()).unwrap()
    }

    fn plan(pages: &[u32], start: usize, len: usize) -> StepPlan {
        let mut p = StepPlan::default();
        let t = [BlockTable {
            blocks: pages.to_vec(),
            freed: 0,
        }];
        write_plan(&mut p, 4, 1, [(&t[..], start, len)]);
        p
    }

    /// Catches up on positions `ranges` of sequence 1 in turn; returns each call's drafted token
    /// and the feature kept after the last.
    fn catch_up_in(ranges: &[(usize, usize)]) -> (Vec<u32>, Vec<f32>) {
        let t = target();
        let e = expected();
        let model = Eagle3::load(&tiny_dir(), &t.config).unwrap();
        let mut d = CpuEagle3::new(model, KvDtype::F16, 4, 4).unwrap();
        let mut got = Vec::new();
        for &(a, b) in ranges {
            let aux = e.aux[a..b].concat();
            let rows = [CatchUp {
                seq: 1,
                start_pos: a,
                next: &e.tokens[a..b],
                row: 0,
                draft: true,
            }];
            got.extend(d.catch_up_on(&t, &aux, &rows, &plan(&[2, 0], a, b - a)).unwrap());
        }
        (got, d.feature(1).unwrap().to_vec())
    }

    fn assert_close(got: &[f32], want: &[f64]) {
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (g, w) in got.iter().zip(want) {
            assert!(
                (*g as f64 - w).abs() <= 5e-3 * scale,
                "pre-norm output {got:?}, float64 reference {want:?}"
            );
        }
    }

    #[test]
    fn the_tiny_drafter_matches_its_float64_reference_in_one_pass_and_in_pieces() {
        let e = expected();
        let c = Eagle3Config::load(&tiny_dir(), &target().config).unwrap();
        assert_eq!(
            (c.draft_vocab, c.aux_layers.clone(), c.layer.d_model),
            (6, vec![2, 2, 1], 8)
        );
        // All five positions in one pass: the last drafts the reference's token.
        let (tokens, feature) = catch_up_in(&[(0, 5)]);
        assert_eq!(tokens, vec![e.drafted[4]]);
        assert_close(&feature, &e.prenorm[4]);
        // Two passes over the same pages (a prefill chunk, then the rest): the second reads the
        // first's K/V from the pool and ends where one pass does.
        let (tokens, feature) = catch_up_in(&[(0, 2), (2, 5)]);
        assert_eq!(tokens, vec![e.drafted[1], e.drafted[4]]);
        assert_close(&feature, &e.prenorm[4]);
        // One position at a time, across a page boundary.
        let (tokens, _) = catch_up_in(&[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]);
        assert_eq!(tokens, e.drafted);
    }

    #[test]
    fn drafters_for_another_model_or_of_another_kind_are_refused_naming_the_key() {
        let p = Path::new("config.json");
        let good = std::fs::read_to_string(tiny_dir().join("config.json")).unwrap();
        let t = target().config;
        let with = |k: &str, v: serde_json::Value| {
            let mut j: serde_json::Value = serde_json::from_str(&good).unwrap();
            j[k] = v;
            Eagle3Config::parse(p, &j.to_string(), &t)
                .unwrap_err()
                .to_string()
        };
        let e = with("architectures", serde_json::json!(["LlamaForCausalLM"]));
        assert!(e.contains("not an EAGLE-3 drafter"), "{e}");
        let e = with("hidden_size", serde_json::json!(16));
        assert!(e.contains("hidden_size 16") && e.contains("another model"), "{e}");
        let e = with("vocab_size", serde_json::json!(32));
        assert!(e.contains("vocab_size 32"), "{e}");
        let e = with("draft_vocab_size", serde_json::json!(17));
        assert!(e.contains("draft_vocab_size 17"), "{e}");
        let e = with("num_hidden_layers", serde_json::json!(2));
        assert!(e.contains("num_hidden_layers 2"), "{e}");
        let e = with(
            "eagle_config",
            serde_json::json!({"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}),
        );
        assert!(e.contains("eagle_aux_hidden_state_layer_ids"), "{e}");
    }
}

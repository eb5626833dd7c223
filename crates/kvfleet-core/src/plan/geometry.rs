//! Model geometry: which layers hold a KV cache and how large one token's entry is.
//!
//! Read from an HF `config.json` ([`Geometry::from_hf_config`], through
//! [`super::hf_config`]) or from the CRD's inline geometry ([`Geometry::from_spec`]). Key names
//! are the public `transformers` config keys.

use serde::Serialize;
use serde_json::Value;

use super::hf_config::{self, ConfigView, HEADS_KEYS, HEAD_DIM_KEYS, HIDDEN_KEYS, LAYERS_KEYS};
use super::PlanError;
use crate::api::{LayerType, ModelGeometry};

/// Most layers (model plus draft) a geometry may hold: checked before any per-layer
/// allocation, so a hostile config or spec cannot make the planner allocate gigabytes.
pub const MAX_LAYERS: u32 = 4096;
/// Largest KV heads or head dimension of one layer.
pub const MAX_LAYER_DIM: u32 = 16_384;

fn too_many_layers(key: &str, n: u64) -> PlanError {
    PlanError::InvalidConfig {
        key: key.into(),
        message: format!("{n} layers is more than the maximum {MAX_LAYERS}; check the value (real models have at most a few hundred)"),
    }
}

/// How a layer attends, which decides how much of the context its KV cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LayerKind {
    /// Attends to the whole context: K and V for every token.
    Full,
    /// Attends to the last `window` tokens (HF `sliding_window`): K and V for those.
    Sliding { window: u32 },
    /// DeepSeek-style multi-head latent attention: one latent vector of
    /// `kv_lora_rank + qk_rope_head_dim` values per token, shared by all heads and
    /// replicated on every tensor-parallel rank (vLLM `MLAAttentionSpec`, num_kv_heads 1).
    Mla,
}

impl LayerKind {
    pub fn label(self) -> String {
        match self {
            LayerKind::Full => "full".to_string(),
            LayerKind::Sliding { window } => format!("sliding({window})"),
            LayerKind::Mla => "mla".to_string(),
        }
    }
}

/// The KV-cache shape of one layer, as the planner sizes it (the engine's
/// `layout::LayerSpec` is another thing: where a layer's pages live and how it attends).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct LayerGeometry {
    #[serde(flatten)]
    pub kind: LayerKind,
    /// KV heads of the whole layer (before tensor parallelism); 1 for MLA.
    pub kv_heads: u32,
    /// Values per head vector; for MLA `kv_lora_rank + qk_rope_head_dim`.
    pub head_dim: u32,
}

/// The attention geometry of a model: one [`LayerGeometry`] per layer that holds a KV cache.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Geometry {
    /// `model_type` or `architectures[0]` of the config, or `spec` for CRD geometry.
    pub architecture: String,
    /// Query heads per layer (tensor parallelism must divide them).
    pub query_heads: u32,
    /// Layers holding a KV cache, in model order (draft layers last).
    pub layers: Vec<LayerGeometry>,
    /// How many of `layers` (at the end) belong to a speculative draft model.
    pub draft_layers: u32,
    /// Hidden size when the config gives it.
    pub hidden_size: Option<u32>,
    /// How the geometry was derived, one sentence per decision (printed by `kvfleet plan`).
    pub notes: Vec<String>,
}

impl Geometry {
    /// Reads an HF `config.json`. A multimodal config's nested `text_config` describes
    /// the decoder and is used when present.
    pub fn from_hf_config(config: &Value) -> Result<Geometry, PlanError> {
        let decoder = hf_config::decoder(config)?;
        let mut notes = Vec::new();
        if decoder.nested {
            notes.push("decoder geometry read from the nested text_config (multimodal model)".into());
        }
        let architecture = decoder.architecture.to_string();
        let model_type = decoder.model_type.to_string();
        let c = decoder.keys;

        let n_layers = c.first_u32(LAYERS_KEYS)?;
        let query_heads = c.first_u32(HEADS_KEYS)?;
        let (n_layers, query_heads) = match (n_layers, query_heads) {
            (Some(l), Some(h)) => (l, h),
            (l, h) => {
                let mut keys = Vec::new();
                if l.is_none() {
                    keys.push(LAYERS_KEYS.join(" | "));
                }
                if h.is_none() {
                    keys.push(HEADS_KEYS.join(" | "));
                }
                return Err(PlanError::MissingKeys { architecture, keys });
            }
        };
        if n_layers == 0 || query_heads == 0 {
            return Err(PlanError::InvalidConfig {
                key: "num_hidden_layers / num_attention_heads".into(),
                message: "must be at least 1".into(),
            });
        }
        if n_layers > MAX_LAYERS {
            return Err(too_many_layers("num_hidden_layers", n_layers.into()));
        }
        let hidden_size = c.first_u32(HIDDEN_KEYS)?;

        // MLA (DeepSeek V2/V3, Kimi K2, GLM-4.5-style MLA variants).
        if let (Some(rank), Some(rope)) = (c.u32("kv_lora_rank")?, c.u32("qk_rope_head_dim")?) {
            if rank > MAX_LAYER_DIM || rope > MAX_LAYER_DIM {
                return Err(PlanError::InvalidConfig {
                    key: "kv_lora_rank / qk_rope_head_dim".into(),
                    message: format!("{rank} and {rope} must each be at most {MAX_LAYER_DIM}"),
                });
            }
            notes.push(format!(
                "MLA: every layer caches one latent of kv_lora_rank {rank} + qk_rope_head_dim {rope} = {} values per token",
                rank + rope
            ));
            let spec = LayerGeometry {
                kind: LayerKind::Mla,
                kv_heads: 1,
                head_dim: rank + rope,
            };
            return Ok(Geometry {
                architecture,
                query_heads,
                layers: vec![spec; n_layers as usize],
                draft_layers: 0,
                hidden_size,
                notes,
            });
        } else if c.has("kv_lora_rank") && !c.is_null("kv_lora_rank") {
            return Err(PlanError::MissingKeys {
                architecture,
                keys: vec!["qk_rope_head_dim".into()],
            });
        }

        // KV heads: GQA key, ChatGLM's multi_query_group_num, else MHA.
        let kv_heads = if let Some(k) = c.u32("num_key_value_heads")? {
            k
        } else if c.bool("multi_query_attention") == Some(true) {
            c.u32("multi_query_group_num")?
                .ok_or_else(|| PlanError::MissingKeys {
                    architecture: architecture.clone(),
                    keys: vec!["multi_query_group_num".into()],
                })?
        } else {
            notes.push(format!(
                "no num_key_value_heads: multi-head attention, {query_heads} KV heads"
            ));
            query_heads
        };
        let head_dim = match c.first_u32(HEAD_DIM_KEYS)? {
            Some(d) => d,
            None => match hidden_size {
                Some(h) if h % query_heads == 0 => {
                    notes.push(format!(
                        "head_dim = hidden_size {h} / num_attention_heads {query_heads}"
                    ));
                    h / query_heads
                }
                _ => {
                    return Err(PlanError::MissingKeys {
                        architecture,
                        keys: vec!["head_dim (or hidden_size divisible by num_attention_heads)".into()],
                    })
                }
            },
        };
        if kv_heads == 0 || head_dim == 0 {
            return Err(PlanError::InvalidConfig {
                key: "num_key_value_heads / head_dim".into(),
                message: "must be at least 1".into(),
            });
        }
        // Gemma 4: full-attention layers have their own head size and KV heads.
        let global_head_dim = c.u32("global_head_dim")?.unwrap_or(head_dim);
        let global_kv_heads = c.u32("num_global_key_value_heads")?.unwrap_or(kv_heads);
        if global_head_dim != head_dim || global_kv_heads != kv_heads {
            notes.push(format!(
                "full-attention layers: {global_kv_heads} KV heads x {global_head_dim} (global_head_dim, num_global_key_value_heads); sliding layers: {kv_heads} x {head_dim}"
            ));
        }
        if c.bool("attention_k_eq_v") == Some(true) {
            notes.push(
                "attention_k_eq_v: vLLM still allocates separate K and V pages, so both are counted".into(),
            );
        }

        let window = c.u32("sliding_window")?;
        if window == Some(0) {
            return Err(PlanError::InvalidConfig {
                key: "sliding_window".into(),
                message: "must be at least 1".into(),
            });
        }
        let kinds = layer_kinds(&c, &model_type, n_layers, window, &mut notes)?;
        let full = LayerGeometry {
            kind: LayerKind::Full,
            kv_heads: global_kv_heads,
            head_dim: global_head_dim,
        };
        let mut layers: Vec<LayerGeometry> = kinds
            .into_iter()
            .map(|k| match k {
                LayerKind::Sliding { .. } => LayerGeometry {
                    kind: k,
                    kv_heads,
                    head_dim,
                },
                _ => full,
            })
            .collect();
        // Gemma 3n / Gemma 4 small models: the last layers reuse earlier layers' KV
        // (vLLM gives layers with a kv_sharing_target_layer_name no cache of their own).
        if let Some(shared) = c.u32("num_kv_shared_layers")? {
            if shared > 0 {
                if shared >= n_layers {
                    return Err(PlanError::InvalidConfig {
                        key: "num_kv_shared_layers".into(),
                        message: format!("{shared} is not less than num_hidden_layers {n_layers}"),
                    });
                }
                layers.truncate((n_layers - shared) as usize);
                notes.push(format!(
                    "num_kv_shared_layers {shared}: the last {shared} layers reuse earlier KV and hold none"
                ));
            }
        }
        Ok(Geometry {
            architecture,
            query_heads,
            layers,
            draft_layers: 0,
            hidden_size,
            notes,
        })
    }

    /// Converts the CRD's inline geometry.
    pub fn from_spec(spec: &ModelGeometry) -> Result<Geometry, PlanError> {
        let pos = |name: &str, v: i32| -> Result<u32, PlanError> {
            u32::try_from(v)
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| PlanError::InvalidConfig {
                    key: format!("model.geometry.{name}"),
                    message: format!("must be at least 1, got {v}"),
                })
        };
        let opt = |name: &str, v: Option<i32>| -> Result<Option<u32>, PlanError> {
            v.map(|v| pos(name, v)).transpose()
        };
        let n_layers = pos("layers", spec.layers)?;
        if n_layers > MAX_LAYERS {
            return Err(too_many_layers("model.geometry.layers", n_layers.into()));
        }
        let query_heads = pos("queryHeads", spec.query_heads)?;
        let kv_heads = pos("kvHeads", spec.kv_heads)?;
        let head_dim = pos("headDim", spec.head_dim)?;
        let window = opt("slidingWindow", spec.sliding_window)?;
        let mut notes = Vec::new();
        let draft = match spec.draft_layers {
            Some(d) if d < 0 => {
                return Err(PlanError::InvalidConfig {
                    key: "model.geometry.draftLayers".into(),
                    message: format!("must not be negative, got {d}"),
                })
            }
            Some(d) if d as u32 > MAX_LAYERS => {
                return Err(too_many_layers("model.geometry.draftLayers", d as u64));
            }
            Some(d) => d as u32,
            None => 0,
        };
        let layers = match (
            opt("kvLoraRank", spec.kv_lora_rank)?,
            opt("qkRopeHeadDim", spec.qk_rope_head_dim)?,
        ) {
            (Some(rank), Some(rope)) => {
                notes.push(format!("MLA: latent {rank} + rope {rope} values per token"));
                vec![
                    LayerGeometry {
                        kind: LayerKind::Mla,
                        kv_heads: 1,
                        head_dim: rank + rope
                    };
                    n_layers as usize
                ]
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(PlanError::InvalidConfig {
                    key: "model.geometry.kvLoraRank".into(),
                    message: "set kvLoraRank and qkRopeHeadDim together (MLA)".into(),
                })
            }
            (None, None) => {
                let full = LayerGeometry {
                    kind: LayerKind::Full,
                    kv_heads: opt("globalKvHeads", spec.global_kv_heads)?.unwrap_or(kv_heads),
                    head_dim: opt("globalHeadDim", spec.global_head_dim)?.unwrap_or(head_dim),
                };
                let sliding = |w| LayerGeometry {
                    kind: LayerKind::Sliding { window: w },
                    kv_heads,
                    head_dim,
                };
                match (&spec.layer_types, window) {
                    (Some(types), _) => {
                        if types.len() != n_layers as usize {
                            return Err(PlanError::InvalidConfig {
                                key: "model.geometry.layerTypes".into(),
                                message: format!("has {} entries for {n_layers} layers", types.len()),
                            });
                        }
                        let mut out = Vec::with_capacity(types.len());
                        for t in types {
                            out.push(match (t, window) {
                                (LayerType::FullAttention, _) => full,
                                (LayerType::SlidingAttention, Some(w)) => sliding(w),
                                (LayerType::SlidingAttention, None) => {
                                    return Err(PlanError::InvalidConfig {
                                        key: "model.geometry.slidingWindow".into(),
                                        message: "sliding_attention layers need slidingWindow".into(),
                                    })
                                }
                            });
                        }
                        out
                    }
                    (None, Some(w)) => {
                        notes.push(format!("slidingWindow {w} without layerTypes: every layer slides (Mistral 7B v0.1 style)"));
                        vec![sliding(w); n_layers as usize]
                    }
                    (None, None) => vec![full; n_layers as usize],
                }
            }
        };
        let geometry = Geometry {
            architecture: "spec".into(),
            query_heads,
            layers,
            draft_layers: 0,
            hidden_size: opt("hiddenSize", spec.hidden_size)?,
            notes,
        };
        geometry.with_draft_layers(draft)
    }

    /// Adds `n` layers of a speculative draft model. They take the spec of the model's
    /// full-attention (or MLA) layers, or of its first layer when every layer slides.
    /// More than [`MAX_LAYERS`] in all is an error (nothing is allocated for them).
    pub fn with_draft_layers(mut self, n: u32) -> Result<Geometry, PlanError> {
        if n == 0 {
            return Ok(self);
        }
        let total = self.layers.len() as u64 + u64::from(n);
        if total > u64::from(MAX_LAYERS) {
            return Err(too_many_layers("draft layers", total));
        }
        let template = self
            .layers
            .iter()
            .copied()
            .find(|l| !matches!(l.kind, LayerKind::Sliding { .. }))
            .or_else(|| self.layers.first().copied());
        if let Some(t) = template {
            self.layers.extend(std::iter::repeat_n(t, n as usize));
            self.draft_layers += n;
            self.notes
                .push(format!("{n} draft-model layers of spec {} added", t.kind.label()));
        }
        Ok(self)
    }

    /// Rejects sizes no real model has, so that byte counts cannot overflow.
    pub fn check_limits(&self) -> Result<(), PlanError> {
        if self.layers.is_empty() {
            return Err(PlanError::InvalidInput(
                "the model has no layers with a KV cache".into(),
            ));
        }
        if self.layers.len() > MAX_LAYERS as usize {
            return Err(PlanError::InvalidInput(format!(
                "{} layers is more than {MAX_LAYERS}",
                self.layers.len()
            )));
        }
        for l in &self.layers {
            if l.kv_heads > MAX_LAYER_DIM || l.head_dim > MAX_LAYER_DIM || l.kv_heads == 0 || l.head_dim == 0
            {
                return Err(PlanError::InvalidInput(format!(
                    "KV heads {} and head_dim {} must be in 1..={MAX_LAYER_DIM}",
                    l.kv_heads, l.head_dim
                )));
            }
        }
        Ok(())
    }

    /// Counts of each distinct layer spec, in first-seen order.
    pub fn distinct_specs(&self) -> Vec<(LayerGeometry, usize)> {
        let mut out: Vec<(LayerGeometry, usize)> = Vec::new();
        for l in &self.layers {
            match out.iter_mut().find(|(s, _)| s == l) {
                Some((_, n)) => *n += 1,
                None => out.push((*l, 1)),
            }
        }
        out
    }

    pub fn is_mla(&self) -> bool {
        self.layers.iter().any(|l| l.kind == LayerKind::Mla)
    }
}

/// Per-layer attention kinds from `layer_types` or the model family's fixed pattern.
fn layer_kinds(
    c: &ConfigView<'_>,
    model_type: &str,
    n_layers: u32,
    window: Option<u32>,
    notes: &mut Vec<String>,
) -> Result<Vec<LayerKind>, PlanError> {
    let n = n_layers as usize;
    let sliding = |key: &str| -> Result<LayerKind, PlanError> {
        window
            .map(|w| LayerKind::Sliding { window: w })
            .ok_or_else(|| PlanError::InvalidConfig {
                key: "sliding_window".into(),
                message: format!("{key} names sliding layers but sliding_window is missing or null"),
            })
    };
    if let Some(types) = c.get("layer_types").filter(|v| !v.is_null()) {
        let types = types.as_array().ok_or_else(|| PlanError::InvalidConfig {
            key: "layer_types".into(),
            message: "must be a list of strings".into(),
        })?;
        if types.len() < n {
            return Err(PlanError::InvalidConfig {
                key: "layer_types".into(),
                message: format!("has {} entries for num_hidden_layers {n_layers}", types.len()),
            });
        }
        let mut out = Vec::with_capacity(n);
        for t in types.iter().take(n) {
            out.push(match t.as_str() {
                Some("full_attention") => LayerKind::Full,
                Some("sliding_attention") => sliding("layer_types")?,
                Some(other) => {
                    return Err(PlanError::InvalidConfig {
                        key: "layer_types".into(),
                        message: format!(
                            "layer type {other:?} is not supported; kvfleet plans full_attention and sliding_attention layers"
                        ),
                    })
                }
                None => {
                    return Err(PlanError::InvalidConfig {
                        key: "layer_types".into(),
                        message: "entries must be strings".into(),
                    })
                }
            });
        }
        let n_sliding = out
            .iter()
            .filter(|k| matches!(k, LayerKind::Sliding { .. }))
            .count();
        notes.push(format!(
            "layer_types: {n_sliding} sliding + {} full layers",
            n - n_sliding
        ));
        return Ok(out);
    }
    let Some(w) = window else {
        return Ok(vec![LayerKind::Full; n]);
    };
    // Families whose pattern is fixed in the modelling code rather than the config.
    let pattern = c.u32("sliding_window_pattern")?;
    if model_type.starts_with("gemma2") || (model_type.starts_with("gemma") && pattern.is_none()) {
        // transformers Gemma2: even layers slide, odd layers are global.
        notes.push("Gemma 2 pattern: layers 0, 2, 4, ... slide, odd layers are full".into());
        return Ok((0..n)
            .map(|i| {
                if i % 2 == 0 {
                    LayerKind::Sliding { window: w }
                } else {
                    LayerKind::Full
                }
            })
            .collect());
    }
    if let Some(p) = pattern.filter(|p| *p > 0) {
        // transformers Gemma3: layer i is full when (i + 1) % sliding_window_pattern == 0.
        notes.push(format!(
            "sliding_window_pattern {p}: every {p}th layer is full, the rest slide"
        ));
        return Ok((0..n)
            .map(|i| {
                if (i + 1) % p as usize == 0 {
                    LayerKind::Full
                } else {
                    LayerKind::Sliding { window: w }
                }
            })
            .collect());
    }
    if let Some(use_sw) = c.bool("use_sliding_window") {
        // Qwen2/Qwen3: sliding only when enabled, and then only from max_window_layers on.
        if !use_sw {
            notes.push(format!(
                "use_sliding_window false: sliding_window {w} unused, all layers full"
            ));
            return Ok(vec![LayerKind::Full; n]);
        }
        let from = c.u32("max_window_layers")?.unwrap_or(0) as usize;
        notes.push(format!("use_sliding_window: layers {from}.. slide"));
        return Ok((0..n)
            .map(|i| {
                if i >= from {
                    LayerKind::Sliding { window: w }
                } else {
                    LayerKind::Full
                }
            })
            .collect());
    }
    notes.push(format!(
        "sliding_window {w} without layer_types: every layer slides (Mistral 7B v0.1 style)"
    ));
    Ok(vec![LayerKind::Sliding { window: w }; n])
}

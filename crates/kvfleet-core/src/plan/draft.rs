//! A speculative drafter beside the model on kvfleet's GPU engine (EAGLE-3 or DFlash): what
//! its weights, buffers and K/V take of the KV budget.
//!
//! The worker reserves exactly [`DraftShape::fixed_bytes`] before it counts pages, and the
//! drafter's K/V then shares every page of the model's full-attention group (its pool has as
//! many pages). The planner counts the same two terms, so `kvfleet check`, the webhook and the
//! controller's status predict the pools of a worker that serves with a drafter.

use serde::Serialize;

use super::engine_memory::kv_replication;
use super::geometry::{Geometry, LayerGeometry, LayerKind};
use super::PlanError;
use crate::api::DraftGeometry;

/// Which drafter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DraftKind {
    /// One Llama decoder layer over `[embedding, fc(features)]` (Q/K/V read both halves).
    Eagle3,
    /// Qwen3 decoder layers (Q/K norms) reading context K/V from `fc(features)`.
    Dflash,
}

/// A drafter as the GPU engine lays it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DraftShape {
    pub kind: DraftKind,
    /// Decoder layers (EAGLE-3: 1).
    pub layers: u64,
    pub d_model: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub head_dim: u64,
    pub d_ff: u64,
    /// The served model's hidden size (the width of each feature row).
    pub target_hidden: u64,
    /// Target layers whose features `fc` fuses (EAGLE-3: 3).
    pub feature_layers: u64,
    /// Rows of the drafter's own LM head (EAGLE-3: its draft vocabulary; DFlash: 0 when it
    /// uses the model's head).
    pub lm_head_rows: u64,
    /// Rows of the drafter's own embedding table (0 when it uses the model's).
    pub embed_rows: u64,
}

impl DraftShape {
    /// The drafter a deployment declares (`draftModel.geometry`, the drafter's config.json) beside
    /// a model of hidden size `target_hidden` and vocabulary `target_vocab`. `None` when a field
    /// is not positive, or a DFlash geometry lacks `featureLayers` (admission denies both).
    pub fn declared(
        kind: DraftKind,
        g: &DraftGeometry,
        target_hidden: u64,
        target_vocab: u64,
    ) -> Option<DraftShape> {
        let u = |v: i32| u64::try_from(v).ok().filter(|v| *v > 0);
        let vocab = g.vocab_size.and_then(u);
        Some(DraftShape {
            kind,
            layers: u(g.layers)?,
            d_model: u(g.hidden_size)?,
            n_heads: u(g.query_heads)?,
            n_kv_heads: u(g.kv_heads)?,
            head_dim: u(g.head_dim)?,
            d_ff: u(g.intermediate_size)?,
            target_hidden,
            feature_layers: match (kind, g.feature_layers) {
                (_, Some(n)) => u(n)?,
                (DraftKind::Eagle3, None) => 3,
                (DraftKind::Dflash, None) => return None,
            },
            // EAGLE-3 always drafts with a head of its own (its draft vocabulary, else the
            // model's); DFlash has one only when the checkpoint holds it.
            lm_head_rows: match kind {
                DraftKind::Eagle3 => vocab.unwrap_or(target_vocab),
                DraftKind::Dflash => vocab.unwrap_or(0),
            },
            embed_rows: if g.own_embeddings { target_vocab } else { 0 },
        })
    }

    /// Where `loaded` (a checkpoint's shape) differs from this declared one, in
    /// `draftModel.geometry`'s field names: `headDim 64 (the drafter has 128)`.
    pub fn differences(&self, loaded: &DraftShape) -> Vec<String> {
        let fields = [
            ("layers", self.layers, loaded.layers),
            ("hiddenSize", self.d_model, loaded.d_model),
            ("queryHeads", self.n_heads, loaded.n_heads),
            ("kvHeads", self.n_kv_heads, loaded.n_kv_heads),
            ("headDim", self.head_dim, loaded.head_dim),
            ("intermediateSize", self.d_ff, loaded.d_ff),
            ("vocabSize", self.lm_head_rows, loaded.lm_head_rows),
            ("featureLayers", self.feature_layers, loaded.feature_layers),
        ];
        let mut out: Vec<String> = fields
            .iter()
            .filter(|(_, a, b)| a != b)
            .map(|(n, a, b)| format!("{n} {a} (the drafter has {b})"))
            .collect();
        if (self.embed_rows > 0) != (loaded.embed_rows > 0) {
            out.push(format!(
                "ownEmbeddings {} (the drafter {} embed_tokens)",
                self.embed_rows > 0,
                if loaded.embed_rows > 0 {
                    "has its own"
                } else {
                    "has no"
                }
            ));
        }
        out
    }

    /// Parameters of its matrices.
    pub fn weight_params(&self) -> u64 {
        let (d, dt, hd) = (self.d_model, self.target_hidden, self.head_dim);
        let (qw, kw) = (self.n_heads * hd, self.n_kv_heads * hd);
        let own = (self.lm_head_rows + self.embed_rows) * d;
        let fc = d * self.feature_layers * dt;
        let mlp_o = qw * d + 3 * self.d_ff * d;
        match self.kind {
            // Q/K/V read the concatenation [embedding, fused feature]: 2d columns.
            DraftKind::Eagle3 => fc + (qw + 2 * kw) * 2 * d + mlp_o + own,
            DraftKind::Dflash => fc + self.layers * ((qw + 2 * kw) * d + mlp_o) + own,
        }
    }

    /// Bytes on the device besides its K/V, for steps of up to `tokens` tokens and `seqs`
    /// requests: bf16 matrices, f32 norms and rotary frequencies, the kept feature rows (f32)
    /// and `fc`'s gathered input (bf16), and for EAGLE-3 each request's latest output (f32).
    pub fn fixed_bytes(&self, tokens: u64, seqs: u64) -> u64 {
        let (d, dt, n) = (self.d_model, self.target_hidden, self.feature_layers);
        let features = 4 * n * tokens * dt + 2 * tokens * n * dt;
        let small = match self.kind {
            DraftKind::Eagle3 => 4 * 5 * d + 4 * seqs * d,
            DraftKind::Dflash => 4 * (3 + 4 * self.layers) * d.max(self.head_dim),
        };
        2 * self.weight_params() + features + small
    }

    /// Copies of each KV head its pool stores (the kernels' query-head groups, as the model's).
    pub fn kv_rep(&self) -> u64 {
        kv_replication(self.n_heads, self.n_kv_heads).map_or(1, |(r, _)| r)
    }

    /// One of its layers as its pool stores it: full attention, KV heads replicated.
    pub fn stored_layer(&self) -> Result<LayerGeometry, PlanError> {
        let int = |what: &str, v: u64| {
            u32::try_from(v).map_err(|_| PlanError::InvalidInput(format!("drafter {what} {v} is too large")))
        };
        Ok(LayerGeometry {
            kind: LayerKind::Full,
            kv_heads: int("KV heads", self.n_kv_heads * self.kv_rep())?,
            head_dim: int("head dimension", self.head_dim)?,
        })
    }

    /// `stored` (the model's layers as the pools store them) with the drafter's layers after
    /// them: full-attention layers, so they join the full group's pages.
    pub fn beside(&self, stored: &Geometry) -> Result<Geometry, PlanError> {
        let layer = self.stored_layer()?;
        let n = usize::try_from(self.layers).unwrap_or(usize::MAX);
        if stored.layers.len().saturating_add(n) > super::geometry::MAX_LAYERS as usize {
            return Err(PlanError::InvalidInput(format!(
                "the model's {} layers and the drafter's {n} are more than any model has",
                stored.layers.len()
            )));
        }
        let mut g = stored.clone();
        g.layers.extend(std::iter::repeat_n(layer, n));
        g.notes.push(format!(
            "{} drafter: {n} layer(s) of {} KV heads x {} on the full-attention pages",
            match self.kind {
                DraftKind::Eagle3 => "EAGLE-3",
                DraftKind::Dflash => "DFlash",
            },
            layer.kv_heads,
            layer.head_dim
        ));
        Ok(g)
    }
}

/// The EAGLE-3 drafter of Llama-3.1-8B (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config.json:
/// one layer, hidden 4096, 32/8 heads of 128, MLP 14336, draft vocabulary 32000): the
/// reference drafter the planner's and the GPU pools' tests size.
pub const EAGLE3_LLAMA_3_1_8B: DraftShape = DraftShape {
    kind: DraftKind::Eagle3,
    layers: 1,
    d_model: 4096,
    n_heads: 32,
    n_kv_heads: 8,
    head_dim: 128,
    d_ff: 14336,
    target_hidden: 4096,
    feature_layers: 3,
    lm_head_rows: 32_000,
    embed_rows: 0,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eagle3_8b_drafter_has_the_parameters_of_its_checkpoint() {
        // fc 4096 x 12288, Q/K/V over 8192 columns (6144 rows), O, gate/up/down, head.
        let want = 4096 * 12288 + 6144 * 8192 + 4096 * 4096 + 3 * 14336 * 4096 + 32_000 * 4096;
        assert_eq!(EAGLE3_LLAMA_3_1_8B.weight_params(), want);
        // About 0.85 GB in bf16, what the published checkpoint holds.
        let gb = 2.0 * want as f64 / 1e9;
        assert!((0.8..0.9).contains(&gb), "{gb}");
    }

    #[test]
    fn its_buffers_grow_with_the_step_and_its_own_embeddings_count() {
        let d = EAGLE3_LLAMA_3_1_8B;
        let (a, b) = (d.fixed_bytes(1024, 256), d.fixed_bytes(2048, 256));
        // 3 feature rows of 4096 a token: f32 kept, bf16 gathered.
        assert_eq!(b - a, 1024 * 3 * 4096 * (4 + 2));
        let own = DraftShape {
            embed_rows: 128_256,
            ..d
        };
        assert_eq!(own.fixed_bytes(1024, 256) - a, 2 * 128_256 * 4096);
    }

    #[test]
    fn dflash_layers_count_each_and_its_kv_joins_the_full_pages() {
        let d = DraftShape {
            kind: DraftKind::Dflash,
            layers: 5,
            feature_layers: 5,
            lm_head_rows: 0,
            ..EAGLE3_LLAMA_3_1_8B
        };
        let one = DraftShape { layers: 1, ..d };
        let layer = (6144 + 4096) * 4096 + 3 * 14336 * 4096;
        assert_eq!(d.weight_params() - one.weight_params(), 4 * layer);
        let types: Vec<&str> = (0..32)
            .map(|i| {
                if i % 2 == 0 {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        let spec: crate::api::ModelGeometry = serde_json::from_value(serde_json::json!({
            "layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128,
            "slidingWindow": 4096, "layerTypes": types
        }))
        .unwrap();
        let model = Geometry::from_spec(&spec).unwrap();
        let g = d.beside(&model).unwrap();
        assert_eq!(g.layers.len(), 37);
        assert!(g.layers[32..]
            .iter()
            .all(|l| l.kind == LayerKind::Full && l.kv_heads == 8));
    }

    #[test]
    fn a_drafter_whose_heads_the_kernels_do_not_group_stores_them_replicated() {
        // 12 query heads on 1 KV head: groups of 4, each KV head stored 3 times.
        let d = DraftShape {
            n_heads: 12,
            n_kv_heads: 1,
            ..EAGLE3_LLAMA_3_1_8B
        };
        assert_eq!(d.kv_rep(), 3);
        assert_eq!(d.stored_layer().unwrap().kv_heads, 3);
    }
}

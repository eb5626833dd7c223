//! Mixture-of-experts MLPs on the CPU: a family's router rule and expert layout read from its
//! `config.json` ([`Moe`]), one sparse layer's weights ([`MoeLayer`]), the router
//! ([`route`]: top-k per token) and the dispatch (tokens grouped by expert so each expert runs
//! one GEMM over its rows, then weighted and added back, as vLLM's `fused_moe` sorts tokens by
//! expert before its grouped GEMM). A sparse layer replaces the dense MLP of the shared layer
//! loop (`llama.rs`); attention, norms and the rest of the block are the family's as usual.
//!
//! The rules, from huggingface/transformers (v5.25) `src/transformers/models/`:
//! - `qwen3_moe/modeling_qwen3_moe.py` (`Qwen3MoeTopKRouter`, `Qwen3MoeExperts`,
//!   `Qwen3MoeDecoderLayer`): softmax over every expert in f32, the k largest probabilities,
//!   divided by their sum when `norm_topk_prob`; layer `i` is sparse unless it is in
//!   `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0` (then a dense MLP of
//!   `intermediate_size`); experts are SwiGLU MLPs of `moe_intermediate_size`.
//! - `qwen2_moe/modeling_qwen2_moe.py` (`Qwen2MoeSparseMoeBlock`): the same router and layer
//!   rule, plus a shared expert (an MLP of `shared_expert_intermediate_size`) every token goes
//!   through, scaled by `sigmoid(shared_expert_gate(x))` and added to the experts' sum.
//! - `olmoe/modeling_olmoe.py` (`OlmoeTopKRouter`): the same router on every layer, experts of
//!   `intermediate_size`; its attention's q/k RMSNorm spans the whole projection (`llama.rs`).
//! - `mixtral/modeling_mixtral.py` (`MixtralTopKRouter`): the k largest, renormalised, on
//!   every layer (`num_local_experts` experts of `intermediate_size`, `block_sparse_moe.w1/w3/w2`
//!   tensors). Softmax over all then renormalising the k equals a softmax over the k largest
//!   logits (vLLM's `fused_topk` with `renormalize`); the engine computes the latter.
//!
//! Ties: of experts with equal scores the lower index is chosen ([`route`]), the order a stable
//! descending sort gives. `torch.topk` documents no order for ties, so a checkpoint whose
//! router ties exactly may route differently in transformers; the fixtures
//! (`tests/fixtures/moe/generate.py`) keep every k-th and (k+1)-th probability apart.

use rayon::prelude::*;
use serde_json::Value;

use super::family::Block;
use super::linear::Linear;

/// How a router turns a token's expert logits into its experts and their weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterRule {
    /// Softmax over every expert, the k largest probabilities, divided by their sum when
    /// `renormalize` (Qwen2-MoE, Qwen3-MoE, OLMoE).
    SoftmaxTopK { renormalize: bool },
    /// The k largest logits, then a softmax over those k (Mixtral).
    TopKSoftmax,
}

/// A family's mixture-of-experts MLP, from its `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    /// Routed experts of a sparse layer.
    pub experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    pub rule: RouterRule,
    /// Intermediate size of one routed expert.
    pub expert_ff: usize,
    /// Qwen2-MoE: the shared expert's intermediate size (its output scaled by a sigmoid gate).
    pub shared_ff: Option<usize>,
    /// Every `sparse_step`-th layer (1-based) is sparse (`decoder_sparse_step`)...
    pub sparse_step: usize,
    /// ...unless listed here (`mlp_only_layers`): those keep a dense MLP.
    pub dense_layers: Vec<usize>,
}

/// The Hugging Face architectures whose MLP is a mixture of experts: the CPU engine serves
/// them (`hf.rs` maps each to kvfleet's name); the CUDA engine does not yet.
pub const MOE_ARCHITECTURES: [&str; 4] = [
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "OlmoeForCausalLM",
    "MixtralForCausalLM",
];

impl Moe {
    /// The MoE MLP of a `config.json` of kvfleet's architecture `arch`: `None` for a dense
    /// family (or a Qwen MoE config with `num_experts` 0, which transformers builds dense); an
    /// error naming the key for a value kvfleet cannot run.
    pub fn from_config_json(arch: &str, c: &Value) -> Result<Option<Moe>, String> {
        let uint = |key: &str| -> Result<Option<usize>, String> {
            match c.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| format!("`{key}` is {v}; it must be a non-negative integer")),
            }
        };
        let need = |key: &str| uint(key)?.ok_or_else(|| format!("`{key}` is missing ({arch} MoE)"));
        let flag = |key: &str| c.get(key).and_then(Value::as_bool).unwrap_or(false);
        // transformers v5 writes `num_local_experts` for Qwen3-MoE (an attribute alias); the
        // published checkpoints say `num_experts`.
        let experts =
            |keys: [&str; 2]| -> Result<usize, String> { Ok(uint(keys[0])?.or(uint(keys[1])?).unwrap_or(0)) };
        let moe = match arch {
            "qwen3moe" | "qwen2moe" => {
                let experts = experts(["num_experts", "num_local_experts"])?;
                if experts == 0 {
                    return Ok(None);
                }
                let dense_layers = match c.get("mlp_only_layers") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|v| v.as_u64().map(|n| n as usize))
                        .collect::<Option<_>>()
                        .ok_or("`mlp_only_layers` must list layer indices")?,
                    Some(v) => return Err(format!("`mlp_only_layers` is {v}; it must be a list")),
                };
                Moe {
                    experts,
                    top_k: need("num_experts_per_tok")?,
                    rule: RouterRule::SoftmaxTopK {
                        renormalize: flag("norm_topk_prob"),
                    },
                    expert_ff: need("moe_intermediate_size")?,
                    shared_ff: match arch {
                        "qwen2moe" => Some(need("shared_expert_intermediate_size")?),
                        _ => None,
                    },
                    sparse_step: uint("decoder_sparse_step")?.unwrap_or(1),
                    dense_layers,
                }
            }
            "olmoe" => {
                if c.get("clip_qkv").is_some_and(|v| !v.is_null()) {
                    return Err("`clip_qkv` is set; kvfleet runs OLMoE without clipping only".into());
                }
                Moe {
                    experts: experts(["num_experts", "num_local_experts"])?,
                    top_k: need("num_experts_per_tok")?,
                    rule: RouterRule::SoftmaxTopK {
                        renormalize: flag("norm_topk_prob"),
                    },
                    expert_ff: need("intermediate_size")?,
                    shared_ff: None,
                    sparse_step: 1,
                    dense_layers: Vec::new(),
                }
            }
            "mixtral" => Moe {
                experts: experts(["num_local_experts", "num_experts"])?,
                top_k: need("num_experts_per_tok")?,
                rule: RouterRule::TopKSoftmax,
                expert_ff: need("intermediate_size")?,
                shared_ff: None,
                sparse_step: 1,
                dense_layers: Vec::new(),
            },
            _ => return Ok(None),
        };
        moe.check()?;
        Ok(Some(moe))
    }

    /// Bounds before anything is sized from them.
    pub fn check(&self) -> Result<(), String> {
        if self.experts == 0 || self.experts > 4096 {
            return Err(format!("{} experts; kvfleet runs 1 to 4096", self.experts));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(format!(
                "num_experts_per_tok {} must be 1 to the {} experts",
                self.top_k, self.experts
            ));
        }
        if self.expert_ff == 0 || self.expert_ff > 1 << 20 || self.shared_ff.is_some_and(|f| f > 1 << 20) {
            return Err(format!(
                "expert intermediate size {} (shared {:?}) must be 1 to 2^20",
                self.expert_ff, self.shared_ff
            ));
        }
        if self.sparse_step == 0 {
            return Err("decoder_sparse_step is 0; it must be at least 1".into());
        }
        Ok(())
    }

    /// Whether layer `i` is sparse (else it keeps the dense MLP).
    pub fn is_sparse(&self, i: usize) -> bool {
        !self.dense_layers.contains(&i) && (i + 1) % self.sparse_step == 0
    }

    /// Parameters of one sparse layer's MLP: router, experts, shared expert and its gate.
    pub fn layer_parameters(&self, d_model: usize) -> usize {
        let mlp = |ff: usize| 3 * d_model * ff;
        self.experts * d_model
            + self.experts * mlp(self.expert_ff)
            + self.shared_ff.map_or(0, |f| mlp(f) + d_model)
    }
}

// === impl routing ===

/// One of a token's experts and the weight of its output.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Route {
    pub expert: usize,
    pub weight: f32,
}

/// Each token's `k` experts and weights (`[tokens * k]`, a token's in descending order of
/// score) from the router's logits `[tokens, experts]`, by `rule`. Of equal scores the lower
/// expert index wins.
pub fn route(rule: RouterRule, logits: &[f32], experts: usize, k: usize) -> Vec<Route> {
    let mut routes = vec![
        Route {
            expert: 0,
            weight: 0.0
        };
        logits.len() / experts.max(1) * k
    ];
    routes
        .par_chunks_mut(k.max(1))
        .zip(logits.par_chunks(experts.max(1)))
        .for_each(|(out, row)| route_token(rule, row, out));
    routes
}

fn route_token(rule: RouterRule, logits: &[f32], out: &mut [Route]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Softmax is monotonic, so both rules pick the k largest logits.
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let top = &order[..out.len()];
    match rule {
        RouterRule::SoftmaxTopK { renormalize } => {
            let total: f32 = logits.iter().map(|l| (l - max).exp()).sum();
            for (o, &e) in out.iter_mut().zip(top) {
                *o = Route {
                    expert: e,
                    weight: (logits[e] - max).exp() / total,
                };
            }
            if renormalize {
                let sum: f32 = out.iter().map(|r| r.weight).sum();
                out.iter_mut().for_each(|r| r.weight /= sum);
            }
        }
        RouterRule::TopKSoftmax => {
            let top_max = logits[top[0]];
            let total: f32 = top.iter().map(|&e| (logits[e] - top_max).exp()).sum();
            for (o, &e) in out.iter_mut().zip(top) {
                *o = Route {
                    expert: e,
                    weight: (logits[e] - top_max).exp() / total,
                };
            }
        }
    }
}

/// For each expert, the `(token, weight)` pairs routed to it, tokens ascending: the rows each
/// expert's GEMM reads (vLLM's `moe_align_block_size` sorts token ids by expert the same way).
pub fn group_by_expert(routes: &[Route], k: usize, experts: usize) -> Vec<Vec<(usize, f32)>> {
    let mut groups = vec![Vec::new(); experts];
    for (i, r) in routes.iter().enumerate() {
        groups[r.expert].push((i / k.max(1), r.weight));
    }
    groups
}

// === impl weights and forward ===

/// A gated MLP: `down(act(gate(x)) * up(x))`, the family's activation ([`Block::glu`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertMlp {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

impl ExpertMlp {
    /// `[rows, d]` of `[rows, d]`.
    fn forward(&self, block: &dyn Block, x: &[f32], rows: usize, out: &mut [f32]) {
        let ff = self.gate.rows();
        let (mut g, mut u) = (vec![0f32; rows * ff], vec![0f32; rows * ff]);
        self.gate.project(x, rows, &mut g);
        self.up.project(x, rows, &mut u);
        block.glu(&mut g, &u);
        self.down.project(&g, rows, out);
    }

    fn quantize_fp8(&mut self) {
        for w in [&mut self.gate, &mut self.up, &mut self.down] {
            w.quantize_fp8();
        }
    }
}

/// One sparse layer's MLP: the router `[experts, d]`, the experts, and Qwen2-MoE's shared
/// expert with its gate `[1, d]`.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeLayer {
    pub(crate) router: Linear,
    pub(crate) experts: Vec<ExpertMlp>,
    pub(crate) shared: Option<(ExpertMlp, Linear)>,
}

/// One sparse layer's tensors as the loader reads them (GGUF's layout, llama.cpp
/// `ffn_{gate,up,down}_exps`): every expert stacked, `[experts, ff, d]` for gate and up,
/// `[experts, d, ff]` for down; the shared expert's `[ff, d]`, `[ff, d]`, `[d, ff]` and gate
/// `[1, d]`.
#[derive(Clone, Debug)]
pub struct MoeTensors {
    pub router: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    pub shared: Option<[Vec<f32>; 4]>,
}

/// The shapes of a sparse layer's [`MoeTensors`]: the router; gate, up and down of the
/// stacked experts; the shared expert's gate, up, down and sigmoid gate.
pub struct MoeShapes {
    pub router: [usize; 2],
    pub experts: [[usize; 3]; 3],
    pub shared: Option<[[usize; 2]; 4]>,
}

impl MoeLayer {
    /// The layer of `moe` (model width `d`) from its stacked tensors.
    pub fn new(moe: &Moe, d: usize, t: MoeTensors) -> Self {
        let ff = moe.expert_ff;
        let mat = |all: &[f32], e: usize, cols: usize| {
            let n = ff * d;
            Linear::new(all[e * n..(e + 1) * n].to_vec(), cols)
        };
        let experts = (0..moe.experts)
            .map(|e| ExpertMlp {
                gate: mat(&t.gate, e, d),
                up: mat(&t.up, e, d),
                down: mat(&t.down, e, ff),
            })
            .collect();
        let shared = t.shared.map(|[gate, up, down, g]| {
            let sff = gate.len() / d.max(1);
            let mlp = ExpertMlp {
                gate: Linear::new(gate, d),
                up: Linear::new(up, d),
                down: Linear::new(down, sff),
            };
            (mlp, Linear::new(g, d))
        });
        MoeLayer {
            router: Linear::new(t.router, d),
            experts,
            shared,
        }
    }

    /// The shapes of [`MoeTensors`] for `moe` at width `d`.
    pub fn shapes(moe: &Moe, d: usize) -> MoeShapes {
        let (e, ff) = (moe.experts, moe.expert_ff);
        MoeShapes {
            router: [e, d],
            experts: [[e, ff, d], [e, ff, d], [e, d, ff]],
            shared: moe.shared_ff.map(|s| [[s, d], [s, d], [d, s], [1, d]]),
        }
    }

    /// The MLP output `[t, d]` of the normed hidden states `x` (`[t, d]`): each token through
    /// its experts, weighted, summed in ascending expert order (as transformers' loop over the
    /// experts hit adds them), then the shared expert's gated output added. Appends to `load`
    /// the tokens each expert took.
    pub fn forward(
        &self,
        moe: &Moe,
        block: &dyn Block,
        x: &[f32],
        t: usize,
        out: &mut [f32],
        load: &mut Vec<u32>,
    ) {
        let d = x.len() / t.max(1);
        let mut logits = vec![0f32; t * moe.experts];
        self.router.project(x, t, &mut logits);
        let routes = route(moe.rule, &logits, moe.experts, moe.top_k);
        let groups = group_by_expert(&routes, moe.top_k, moe.experts);
        load.extend(groups.iter().map(|g| g.len() as u32));
        out.fill(0.0);
        let mut rows = Vec::new();
        let mut y = Vec::new();
        for (expert, group) in self.experts.iter().zip(&groups) {
            if group.is_empty() {
                continue;
            }
            rows.clear();
            for &(tok, _) in group {
                rows.extend_from_slice(&x[tok * d..(tok + 1) * d]);
            }
            y.clear();
            y.resize(group.len() * d, 0.0);
            expert.forward(block, &rows, group.len(), &mut y);
            for (&(tok, w), yr) in group.iter().zip(y.chunks_exact(d)) {
                for (o, v) in out[tok * d..(tok + 1) * d].iter_mut().zip(yr) {
                    *o += w * v;
                }
            }
        }
        if let Some((mlp, gate)) = &self.shared {
            let mut s = vec![0f32; t * d];
            mlp.forward(block, x, t, &mut s);
            let mut g = vec![0f32; t];
            gate.project(x, t, &mut g);
            out.par_chunks_mut(d)
                .zip(s.par_chunks(d))
                .zip(g.par_iter())
                .for_each(|((o, s), g)| {
                    let w = 1.0 / (1.0 + (-g).exp());
                    o.iter_mut().zip(s).for_each(|(o, s)| *o += w * s);
                });
        }
    }

    /// FP8 W8A8 for the experts and the shared expert; the router and the shared expert's gate
    /// stay as loaded (vLLM builds both without the quantization config, `qwen2_moe.py`,
    /// `qwen3_moe.py`).
    pub fn quantize_fp8(&mut self) {
        self.experts.par_iter_mut().for_each(ExpertMlp::quantize_fp8);
        if let Some((mlp, _)) = &mut self.shared {
            mlp.quantize_fp8();
        }
    }
}

// === impl checkpoint names ===

/// The Hugging Face tensors that hold the MoE tensor the loader asks for by its GGUF name
/// (`blk.N.ffn_gate_inp.weight`, `blk.N.ffn_{gate,up,down}_exps.weight`,
/// `blk.N.ffn_{gate,up,down}_shexp.weight`, `blk.N.ffn_gate_inp_shexp.weight`), in `arch`'s
/// checkpoint naming: one name, or one per expert to stack. `None` for a name that is not an
/// MoE tensor.
pub fn hf_tensor_names(arch: &str, gguf: &str, experts: usize) -> Option<Vec<String>> {
    let (layer, rest) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let stem = rest.strip_suffix(".weight")?;
    // Mixtral keeps the original release's names (`block_sparse_moe`, `w1` gate, `w3` up,
    // `w2` down); the others transformers' (`mlp`, `gate_proj`, `up_proj`, `down_proj`).
    let (block, [g, u, dn]) = match arch {
        "mixtral" => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    let p = format!("model.layers.{layer}.{block}");
    let per_expert = |proj: &str| {
        Some(
            (0..experts)
                .map(|e| format!("{p}.experts.{e}.{proj}.weight"))
                .collect(),
        )
    };
    match stem {
        "ffn_gate_inp" => Some(vec![format!("{p}.gate.weight")]),
        "ffn_gate_exps" => per_expert(g),
        "ffn_up_exps" => per_expert(u),
        "ffn_down_exps" => per_expert(dn),
        "ffn_gate_shexp" => Some(vec![format!("{p}.shared_expert.gate_proj.weight")]),
        "ffn_up_shexp" => Some(vec![format!("{p}.shared_expert.up_proj.weight")]),
        "ffn_down_shexp" => Some(vec![format!("{p}.shared_expert.down_proj.weight")]),
        "ffn_gate_inp_shexp" => Some(vec![format!("{p}.shared_expert_gate.weight")]),
        _ => None,
    }
}

#[cfg(test)]
mod tests;

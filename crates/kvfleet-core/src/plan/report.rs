//! A [`Plan`]: every number of a capacity estimate, with the arithmetic that produced it.

use std::fmt::Write as _;

use serde::Serialize;

use super::bytes::{
    check_tensor_parallel, dtype_label, head_vector_bytes, kv_bytes_per_token, kv_heads_per_rank,
};
use super::draft::DraftShape;
use super::engine_memory::{stored_geometry, EngineMemory, EngineShape};
use super::geometry::{Geometry, LayerGeometry, LayerKind};
use super::kvfleet::{blocks_per_request, pool_layout, KvfleetPlan};
use super::memory::{fmt_gib, MemoryBudget};
use super::vllm::{
    sliding_admission_blocks, vllm_plan, EngineParams, Layout, ReportingEra, SlidingAdmission, VllmPlan,
};
use super::{cdiv, PlanError};

/// Most KV memory per GPU accepted: 1 PiB.
pub const MAX_KV_BYTES: u64 = 1 << 50;

/// Where the KV memory comes from.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryInput {
    /// "Available KV cache memory" from a vLLM log, in bytes per GPU.
    AvailableKv { bytes: u64 },
    /// Predict it from the GPU, utilization, weights and reserve.
    Predict {
        gpu_memory_bytes: u64,
        gpu_memory_utilization: f64,
        /// All ranks together; `None` assumes 0.
        weight_bytes_total: Option<u64>,
        activation_reserve_bytes: u64,
    },
    /// kvfleet's own engine on one GPU (`engine_memory`): weights and the activation workspace
    /// of maxNumBatchedTokens tokens and `max_num_seqs` rows from the model's shape, and the
    /// context reserve; what its worker gives the KV pools.
    KvfleetEngine {
        gpu_memory_bytes: u64,
        gpu_memory_utilization: f64,
        shape: EngineShape,
        max_num_seqs: u64,
        /// A speculative drafter served beside the model: its weights and buffers come off the
        /// budget first, and its layers join the full-attention pages ([`DraftShape`]).
        drafter: Option<DraftShape>,
    },
}

/// Everything a plan depends on besides the geometry.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanInputs {
    pub engine: EngineParams,
    pub era: ReportingEra,
    pub memory: MemoryInput,
    /// Also report concurrency for requests of this many tokens.
    pub request_len: Option<u64>,
}

/// KV bytes of one distinct layer spec.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerBytes {
    pub spec: LayerGeometry,
    pub layers: usize,
    pub kv_heads_per_rank: u32,
    pub head_vector_bytes: u64,
    pub bytes_per_token: u64,
    pub page_bytes: u64,
}

/// Concurrency for requests of a given length.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AtLength {
    pub tokens: u64,
    /// vLLM's blocks per request at this length since PR #40946 (window-capped admission).
    pub vllm_blocks_per_request: u64,
    pub vllm_concurrency: f64,
    /// Before vllm PR #40946 sliding groups were admitted for every prompt token.
    pub vllm_uncapped_blocks_per_request: u64,
    pub vllm_uncapped_concurrency: f64,
    /// kvfleet with pools sized for max_model_len requests.
    pub kvfleet_concurrency: f64,
    /// kvfleet with pools sized for requests of this length.
    pub kvfleet_concurrency_sized_for_length: f64,
}

/// kvfleet against vLLM at max_model_len.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Saving {
    pub vllm_bytes_per_request: u64,
    pub kvfleet_bytes_per_request: u64,
    /// kvfleet max concurrency / vLLM max concurrency.
    pub concurrency_ratio: f64,
}

/// A complete capacity plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub inputs: PlanInputs,
    pub geometry: Geometry,
    pub layer_bytes: Vec<LayerBytes>,
    /// Sum over all layers of bytes_per_token (what one token costs with no window).
    pub bytes_per_token_all_layers: u64,
    pub memory: MemoryBudget,
    pub vllm: VllmPlan,
    pub kvfleet: KvfleetPlan,
    pub at_request_len: Option<AtLength>,
    pub saving: Saving,
}

/// The layers kvfleet's GPU engine pools for `memory`: each KV head stored as the kernels need
/// it, and a drafter's layers after the model's. `None`: `geometry` as it is.
pub fn kvfleet_geometry(geometry: &Geometry, memory: &MemoryInput) -> Result<Option<Geometry>, PlanError> {
    let MemoryInput::KvfleetEngine { shape, drafter, .. } = memory else {
        return Ok(None);
    };
    let stored = stored_geometry(geometry, shape.kv_rep)?;
    Ok(Some(match drafter {
        Some(d) => d.beside(&stored)?,
        None => stored,
    }))
}

/// Checks the inputs against the geometry and computes every number.
pub fn plan(geometry: &Geometry, inputs: &PlanInputs) -> Result<Plan, PlanError> {
    let p = &inputs.engine;
    p.check()?;
    check_tensor_parallel(geometry, p.tp)?;
    let mut layer_bytes = Vec::new();
    let mut all = 0;
    for (spec, n) in geometry.distinct_specs() {
        let bpt = kv_bytes_per_token(&spec, p.dtype, p.tp)?;
        all += bpt * n as u64;
        layer_bytes.push(LayerBytes {
            spec,
            layers: n,
            kv_heads_per_rank: kv_heads_per_rank(&spec, p.tp),
            head_vector_bytes: head_vector_bytes(spec.head_dim, p.dtype)?,
            bytes_per_token: bpt,
            page_bytes: bpt * u64::from(p.block_size),
        });
    }
    let memory = match &inputs.memory {
        MemoryInput::AvailableKv { bytes } => {
            if *bytes == 0 {
                return Err(PlanError::InvalidInput(
                    "available KV memory is zero: pass the \"Available KV cache memory\" GiB of a vLLM log"
                        .into(),
                ));
            }
            MemoryBudget::given(*bytes)
        }
        MemoryInput::Predict {
            gpu_memory_bytes,
            gpu_memory_utilization,
            weight_bytes_total,
            activation_reserve_bytes,
        } => MemoryBudget::predict(
            *gpu_memory_bytes,
            *gpu_memory_utilization,
            *weight_bytes_total,
            p.tp,
            *activation_reserve_bytes,
        )?,
        MemoryInput::KvfleetEngine {
            gpu_memory_bytes,
            gpu_memory_utilization,
            shape,
            max_num_seqs,
            drafter,
        } => {
            if !(*gpu_memory_utilization > 0.0 && *gpu_memory_utilization <= 1.0) {
                return Err(PlanError::InvalidInput(format!(
                    "gpu memory utilization {gpu_memory_utilization} must be in (0, 1], e.g. 0.9"
                )));
            }
            if p.tp != 1 {
                return Err(PlanError::InvalidInput(
                    "kvfleet's engine runs one GPU per replica: tensor parallel size 1".into(),
                ));
            }
            let mut m = MemoryBudget::engine(&EngineMemory::for_shape(
                *gpu_memory_bytes,
                *gpu_memory_utilization,
                shape,
                p.max_num_batched_tokens,
                *max_num_seqs,
            ))?;
            if let Some(d) = drafter {
                m.reserve_drafter(d.fixed_bytes(p.max_num_batched_tokens, *max_num_seqs));
            }
            m
        }
    };
    let avail = memory.available_kv_bytes;
    if avail > MAX_KV_BYTES {
        return Err(PlanError::InvalidInput(format!(
            "{} GiB of KV memory per GPU is more than any GPU has; pass the memory of one GPU",
            fmt_gib(avail)
        )));
    }
    let vllm = vllm_plan(geometry, p, avail, inputs.era)?;
    let stored = kvfleet_geometry(geometry, &inputs.memory)?;
    let kv_geometry = stored.as_ref().unwrap_or(geometry);
    let kvfleet = pool_layout(kv_geometry, p, avail)?;
    let at_request_len = match inputs.request_len {
        None => None,
        Some(0) => {
            return Err(PlanError::InvalidInput(
                "request length must be at least 1 token".into(),
            ))
        }
        Some(r) => {
            let r = r.min(p.max_model_len);
            let blocks = |rule: SlidingAdmission| -> u64 {
                vllm.groups
                    .iter()
                    .map(|g| match g.kind {
                        LayerKind::Sliding { window } => sliding_admission_blocks(
                            rule,
                            window,
                            r,
                            p.max_num_batched_tokens,
                            p.max_model_len,
                            g.block_size,
                        ),
                        _ => cdiv(r, u64::from(g.block_size)),
                    })
                    .sum()
            };
            let capped = blocks(SlidingAdmission::StartupBound);
            let uncapped = blocks(SlidingAdmission::Uncapped);
            let sized = pool_layout(
                kv_geometry,
                &EngineParams {
                    max_model_len: r,
                    ..*p
                },
                avail,
            )?;
            Some(AtLength {
                tokens: r,
                vllm_blocks_per_request: capped,
                vllm_concurrency: vllm.num_blocks as f64 / capped as f64,
                vllm_uncapped_blocks_per_request: uncapped,
                vllm_uncapped_concurrency: vllm.num_blocks as f64 / uncapped as f64,
                kvfleet_concurrency: kvfleet.concurrency_at(r),
                kvfleet_concurrency_sized_for_length: sized.max_concurrency,
            })
        }
    };
    let saving = Saving {
        vllm_bytes_per_request: vllm.bytes_per_request(),
        kvfleet_bytes_per_request: kvfleet.bytes_per_request,
        concurrency_ratio: if vllm.max_concurrency > 0.0 {
            kvfleet.max_concurrency / vllm.max_concurrency
        } else {
            0.0
        },
    };
    Ok(Plan {
        inputs: inputs.clone(),
        geometry: geometry.clone(),
        layer_bytes,
        bytes_per_token_all_layers: all,
        memory,
        vllm,
        kvfleet,
        at_request_len,
        saving,
    })
}

/// `1234567` as `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The `per request:` line of a plan: each layer group's term, summed.
fn write_per_request(o: &mut String, terms: &[String], total: String, unit: &str) {
    let _ = writeln!(o, "   per request: {} = {total} {unit}", terms.join(" + "));
}

fn spec_name(s: &LayerGeometry) -> String {
    match s.kind {
        LayerKind::Mla => format!("mla latent {}", s.head_dim),
        k => format!("{} {}x{}", k.label(), s.kv_heads, s.head_dim),
    }
}

impl Plan {
    /// The arithmetic, line by line, the way an engineer checks it by hand.
    pub fn explain(&self) -> String {
        let mut o = String::new();
        let p = &self.inputs.engine;
        let t = thousands;
        let _ = writeln!(
            o,
            "kvfleet plan: {} | tp {} | kv-cache-dtype {} | block {} | max-model-len {} | max-num-batched-tokens {}",
            self.geometry.architecture,
            p.tp,
            dtype_label(p.dtype),
            p.block_size,
            t(p.max_model_len),
            t(p.max_num_batched_tokens)
        );

        let _ = writeln!(
            o,
            "\n1. Geometry: {} layers hold a KV cache",
            self.geometry.layers.len()
        );
        for n in &self.geometry.notes {
            let _ = writeln!(o, "   - {n}");
        }
        for lb in &self.layer_bytes {
            let s = &lb.spec;
            let heads = match s.kind {
                LayerKind::Mla => "1 latent (replicated on every rank)".to_string(),
                _ => format!(
                    "max(1, {} / {}) = {} KV heads per rank",
                    s.kv_heads, p.tp, lb.kv_heads_per_rank
                ),
            };
            let per_token = match s.kind {
                LayerKind::Mla => format!(
                    "{} x {} = {}",
                    lb.kv_heads_per_rank,
                    t(lb.head_vector_bytes),
                    t(lb.bytes_per_token)
                ),
                _ => format!(
                    "2 (K,V) x {} x {} = {}",
                    lb.kv_heads_per_rank,
                    t(lb.head_vector_bytes),
                    t(lb.bytes_per_token)
                ),
            };
            let _ = writeln!(
                o,
                "   {:>3} x {}: {heads}; head vector {} bytes; per token per layer {per_token} bytes; page of {} tokens {} bytes",
                lb.layers,
                spec_name(s),
                t(lb.head_vector_bytes),
                p.block_size,
                t(lb.page_bytes)
            );
        }
        let sum: Vec<String> = self
            .layer_bytes
            .iter()
            .map(|lb| format!("{} x {}", lb.layers, t(lb.bytes_per_token)))
            .collect();
        let _ = writeln!(
            o,
            "   one token in every layer: {} = {} bytes per rank",
            sum.join(" + "),
            t(self.bytes_per_token_all_layers)
        );

        let m = &self.memory;
        let _ = writeln!(o, "\n2. KV memory per GPU ({})", m.source);
        if let (Some(g), Some(u), Some(b), Some(w), Some(wg), Some(r)) = (
            m.gpu_memory_bytes,
            m.gpu_memory_utilization,
            m.engine_budget_bytes,
            m.weight_bytes_total,
            m.weight_bytes_per_gpu,
            m.activation_reserve_bytes,
        ) {
            let _ = writeln!(
                o,
                "   engine budget = {} x {u} = {} bytes ({} GiB)",
                t(g),
                t(b),
                fmt_gib(b)
            );
            let _ = writeln!(
                o,
                "   weights per GPU = {} / {} = {} bytes ({} GiB)",
                t(w),
                p.tp,
                t(wg),
                fmt_gib(wg)
            );
            match (m.activation_bytes, m.context_reserve_bytes) {
                (Some(a), Some(c)) => {
                    let _ = writeln!(
                        o,
                        "   activation workspace ({} tokens, as kvfleet's engine allocates it) + context reserve = {} + {} = {} bytes ({} GiB)",
                        t(p.max_num_batched_tokens),
                        t(a),
                        t(c),
                        t(r),
                        fmt_gib(r)
                    );
                }
                _ => {
                    let _ = writeln!(
                        o,
                        "   activation + non-torch reserve = {} bytes ({} GiB)",
                        t(r),
                        fmt_gib(r)
                    );
                }
            }
            let _ = writeln!(
                o,
                "   available = {} - {} - {} = {} bytes ({} GiB)",
                t(b),
                t(wg),
                t(r),
                t(m.available_kv_bytes),
                fmt_gib(m.available_kv_bytes)
            );
        } else {
            let _ = writeln!(
                o,
                "   available = {} GiB = {} bytes",
                fmt_gib(m.available_kv_bytes),
                t(m.available_kv_bytes)
            );
        }
        for n in &m.notes {
            let _ = writeln!(o, "   - {n}");
        }

        let v = &self.vllm;
        let _ = writeln!(
            o,
            "\n3. vLLM: KV-cache groups (vllm/v1/core/kv_cache_utils.py get_kv_cache_groups)"
        );
        match v.layout {
            Layout::UniformSpec => {
                let _ = writeln!(
                    o,
                    "   every layer has the same spec: 1 group of {} layers, page {} bytes",
                    v.group_size,
                    t(v.groups[0].page_bytes)
                );
                let _ = writeln!(
                    o,
                    "   bytes per block = {} x {} layers = {}",
                    t(v.groups[0].page_bytes),
                    v.group_size,
                    t(v.bytes_per_block)
                );
            }
            Layout::UniformType => {
                let _ = writeln!(
                    o,
                    "   one attention type, different page sizes: 1 group, block = sum of the {} layers' pages = {} bytes",
                    v.groups[0].layers.len(),
                    t(v.bytes_per_block)
                );
            }
            Layout::Hybrid => {
                let pages: Vec<u64> = self.layer_bytes.iter().map(|lb| lb.page_bytes).collect();
                let max_page = v.groups.first().map(|g| g.page_bytes).unwrap_or(0);
                if pages.iter().any(|pg| *pg != max_page) {
                    for lb in &self.layer_bytes {
                        if lb.page_bytes != max_page {
                            let ratio = max_page / lb.page_bytes.max(1);
                            let _ = writeln!(
                                o,
                                "   unify pages: {} page {} < {}: block_size {} x {ratio} = {} tokens",
                                spec_name(&lb.spec),
                                t(lb.page_bytes),
                                t(max_page),
                                p.block_size,
                                u64::from(p.block_size) * ratio
                            );
                        }
                    }
                }
                let counts: Vec<String> = self.layer_bytes.iter().map(|lb| lb.layers.to_string()).collect();
                let _ = writeln!(
                    o,
                    "   group_size = {} layers (layers per spec: {}; the fewest, or the most when most < 1.5 x fewest)",
                    v.group_size,
                    counts.join(", ")
                );
                let _ = writeln!(
                    o,
                    "   bytes per block = page {} x group_size {} = {}",
                    t(max_page),
                    v.group_size,
                    t(v.bytes_per_block)
                );
            }
        }
        let _ = writeln!(
            o,
            "   num_blocks = {} // {} = {}",
            t(v.available_kv_bytes),
            t(v.bytes_per_block),
            t(v.num_blocks)
        );

        let _ = writeln!(
            o,
            "\n4. vLLM: blocks per request of {} tokens",
            t(p.max_model_len)
        );
        let mut terms = Vec::new();
        for (i, g) in v.groups.iter().enumerate() {
            let how = match g.kind {
                LayerKind::Sliding { window } => format!(
                    "cdiv(min({window} - 1 + {}, {}), {}) + 1",
                    p.max_num_batched_tokens, p.max_model_len, g.block_size
                ),
                _ => format!("cdiv({}, {})", p.max_model_len, g.block_size),
            };
            let pad = if g.padding_layers > 0 {
                format!(" + {} padding", g.padding_layers)
            } else {
                String::new()
            };
            let _ = writeln!(
                o,
                "   group {i}: {} x {}{pad}, block {} tokens, page {} bytes: {how} = {}",
                g.layers.len(),
                g.kind.label(),
                g.block_size,
                t(g.page_bytes),
                t(g.blocks_per_request)
            );
            terms.push(t(g.blocks_per_request));
        }
        write_per_request(&mut o, &terms, t(v.blocks_per_request), "blocks");
        let c = v.max_concurrency;
        let _ = writeln!(
            o,
            "   max concurrency = {} / {} = {c:.4} -> \"{c:.2}x\"",
            t(v.num_blocks),
            t(v.blocks_per_request),
        );
        if !v.fits_one_request {
            let _ = writeln!(
                o,
                "   ! one request needs {} x {} = {} bytes > {} available: vLLM refuses to start",
                t(v.blocks_per_request),
                t(v.bytes_per_block),
                t(v.bytes_per_request()),
                t(v.available_kv_bytes)
            );
        }

        let _ = writeln!(o, "\n5. vLLM: logged \"GPU KV cache size: N tokens\"");
        let min_block = v
            .groups
            .iter()
            .map(|g| g.block_size)
            .min()
            .unwrap_or(p.block_size);
        for (era, tokens) in &v.tokens_by_era {
            let how = match era {
                ReportingEra::UpToV0_9 => {
                    format!("num_blocks x block_size = {} x {}", t(v.num_blocks), p.block_size)
                }
                ReportingEra::V0_10ToV0_20 => format!(
                    "num_blocks // groups x min block = {} // {} x {}",
                    t(v.num_blocks),
                    v.groups.len(),
                    min_block
                ),
                ReportingEra::V0_21On => {
                    format!(
                        "int(max_concurrency x max_model_len) = int({:.4} x {})",
                        v.max_concurrency,
                        t(p.max_model_len)
                    )
                }
            };
            let mark = if *era == v.era { "   <- selected" } else { "" };
            let _ = writeln!(o, "   {:<18} {how} = {}{mark}", era.label(), t(*tokens));
        }

        let k = &self.kvfleet;
        let _ = writeln!(
            o,
            "\n6. kvfleet: one pool per layer spec; sliding layers hold window - 1 + chunk ({}) tokens",
            t(k.chunk)
        );
        let mut terms = Vec::new();
        for g in &k.groups {
            let how = match g.kind {
                LayerKind::Sliding { window } => format!(
                    "min(cdiv({}, {b}), cdiv({window} - 1, {b}) + cdiv({}, {b}))",
                    k.max_model_len,
                    k.chunk,
                    b = g.block_size
                ),
                _ => format!("cdiv({}, {})", k.max_model_len, g.block_size),
            };
            let _ = writeln!(
                o,
                "   {} x {}: block = {} layers x {} = {} bytes; per request {how} = {} blocks = {} bytes",
                g.layers.len(),
                g.kind.label(),
                g.layers.len(),
                t(g.page_bytes),
                t(g.block_bytes),
                t(g.blocks_per_request),
                t(g.blocks_per_request.saturating_mul(g.block_bytes))
            );
            terms.push(t(g.blocks_per_request.saturating_mul(g.block_bytes)));
        }
        write_per_request(&mut o, &terms, t(k.bytes_per_request), "bytes");
        let _ = writeln!(
            o,
            "   pools: the largest c with sum(ceil(c x blocks per request) x block bytes) <= {} (at most {} / {} = {:.4}), remainder to the limiting pool",
            t(k.available_kv_bytes),
            t(k.available_kv_bytes),
            t(k.bytes_per_request),
            k.available_kv_bytes as f64 / k.bytes_per_request.max(1) as f64
        );
        for g in &k.groups {
            let _ = writeln!(
                o,
                "   pool {}: {} blocks x {} = {} bytes -> {} / {} = {:.4} requests",
                g.kind.label(),
                t(g.num_blocks),
                t(g.block_bytes),
                t(g.num_blocks.saturating_mul(g.block_bytes)),
                t(g.num_blocks),
                t(g.blocks_per_request),
                g.num_blocks as f64 / g.blocks_per_request as f64
            );
        }
        let _ = writeln!(
            o,
            "   max concurrency = {:.4} -> {:.2}x",
            k.max_concurrency, k.max_concurrency
        );
        let _ = writeln!(
            o,
            "   capacity = int({:.4} x {}) = {} tokens",
            k.max_concurrency,
            t(k.max_model_len),
            t(k.capacity_tokens)
        );
        let _ = writeln!(
            o,
            "   full-layer budget of the same pools (every layer holds {} tokens): {:.4} -> {:.2}x; window-aware / full-layer = {:.3}",
            t(k.max_model_len),
            k.full_layer_max_concurrency,
            k.full_layer_max_concurrency,
            if k.full_layer_max_concurrency > 0.0 { k.max_concurrency / k.full_layer_max_concurrency } else { 0.0 }
        );

        let s = &self.saving;
        let _ = writeln!(o, "\n7. kvfleet against vLLM");
        let _ = writeln!(
            o,
            "   bytes per max-length request: vLLM {} ({} GiB), kvfleet {} ({} GiB)",
            t(s.vllm_bytes_per_request),
            fmt_gib(s.vllm_bytes_per_request),
            t(s.kvfleet_bytes_per_request),
            fmt_gib(s.kvfleet_bytes_per_request)
        );
        let _ = writeln!(
            o,
            "   concurrency: kvfleet {:.2}x / vLLM {:.2}x = {:.3}",
            k.max_concurrency, v.max_concurrency, s.concurrency_ratio
        );
        if let Some(a) = &self.at_request_len {
            let _ = writeln!(o, "   requests of {} tokens:", t(a.tokens));
            let _ = writeln!(
                o,
                "     vLLM, window-capped admission (PR #40946): {} / {} = {:.2}",
                t(v.num_blocks),
                t(a.vllm_blocks_per_request),
                a.vllm_concurrency
            );
            let _ = writeln!(
                o,
                "     vLLM before PR #40946 (sliding groups admit every token): {} / {} = {:.2}",
                t(v.num_blocks),
                t(a.vllm_uncapped_blocks_per_request),
                a.vllm_uncapped_concurrency
            );
            let _ = writeln!(
                o,
                "     kvfleet, pools sized for max-model-len: {:.2}",
                a.kvfleet_concurrency
            );
            let _ = writeln!(
                o,
                "     kvfleet, pools sized for {} tokens: {:.2}",
                t(a.tokens),
                a.kvfleet_concurrency_sized_for_length
            );
            for g in k
                .groups
                .iter()
                .filter(|g| matches!(g.kind, LayerKind::Sliding { .. }))
            {
                if let LayerKind::Sliding { window } = g.kind {
                    let _ = writeln!(
                        o,
                        "     sliding({window}) blocks for one request: vLLM uncapped {}, vLLM #40946 {}, kvfleet {}",
                        t(sliding_admission_blocks(SlidingAdmission::Uncapped, window, a.tokens, k.chunk, k.max_model_len, g.block_size)),
                        t(sliding_admission_blocks(
                            SlidingAdmission::StartupBound,
                            window,
                            a.tokens,
                            k.chunk,
                            k.max_model_len,
                            g.block_size
                        )),
                        t(blocks_per_request(g.kind, a.tokens, k.chunk, g.block_size))
                    );
                }
            }
        }
        o
    }
}

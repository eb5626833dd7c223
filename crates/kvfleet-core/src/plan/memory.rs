//! How much of a GPU's memory is left for the KV cache.
//!
//! vLLM's model (vllm/v1/worker/gpu_worker.py `determine_available_memory` with
//! vllm/utils/mem_utils.py `memory_profiling`): the engine may use
//! `total x gpu_memory_utilization`; from that it subtracts the weights, the peak
//! activation memory of a profiling forward pass of max_num_batched_tokens tokens, and
//! non-torch memory (CUDA context, NCCL buffers, CUDA graphs). The remainder is the KV
//! cache ("Available KV cache memory: X GiB" in the log).
//!
//! kvfleet cannot profile vLLM offline, so for `runtime: vllm` activations plus non-torch
//! memory are one parameter, the activation reserve, defaulting to
//! [`DEFAULT_ACTIVATION_RESERVE_BYTES`]. kvfleet's own engine needs no such guess: its terms
//! are in [`super::engine_memory`] ([`MemoryBudget::engine`]).

use serde::Serialize;

use super::engine_memory::EngineMemory;
use super::PlanError;
use crate::compat::products::{Product, PRODUCTS};

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

/// Default per-GPU reserve for activations, CUDA context and CUDA graphs under vLLM (and
/// under kvfleet's engine when the geometry lacks the sizes its terms need): 1 GiB.
///
/// Derived from the Gemma 4 31B AWQ case on 2 x 24 GiB GPUs (tests/fixtures/plan/
/// kv_capacity_public.json): 24 GiB x 0.90 - 9.5 GiB weights per GPU - 11.54 GiB KV =
/// 1.06 GiB for everything else. Models with large vocabularies or large
/// max_num_batched_tokens need more: read "non_torch memory" and "PyTorch activation peak
/// memory" from a vLLM startup log and pass their sum as the reserve.
pub const DEFAULT_ACTIVATION_RESERVE_BYTES: u64 = GIB;

/// Memory of a GPU product in bytes as NVML reports it ([`Product::reported_mib`]; products
/// without a reported total are unknown here). Matches the GFD label case-insensitively, with
/// spaces or dashes, with or without the `NVIDIA-` prefix.
pub fn gpu_memory_bytes(product: &str) -> Option<u64> {
    let norm = |s: &str| {
        let s = s.trim().to_ascii_lowercase().replace([' ', '_'], "-");
        s.strip_prefix("nvidia-").map(str::to_string).unwrap_or(s)
    };
    let want = norm(product);
    gpu_products()
        .find(|p| norm(p.label) == want)
        .and_then(|p| p.reported_mib)
        .map(|mib| mib * MIB)
}

/// The products [`gpu_memory_bytes`] knows.
pub fn gpu_products() -> impl Iterator<Item = &'static Product> {
    PRODUCTS.iter().filter(|p| p.reported_mib.is_some())
}

/// Parses a Kubernetes quantity (`19Gi`, `16G`, `1.5Ti`, `2e9`, `512Mi`, `1024`) as bytes,
/// rounding a fractional byte count up.
pub fn parse_quantity_bytes(q: &str) -> Result<u64, PlanError> {
    let s = q.trim();
    let bad = |why: &str| PlanError::InvalidQuantity {
        value: q.to_string(),
        message: why.to_string(),
    };
    if s.is_empty() {
        return Err(bad("empty"));
    }
    const SUFFIXES: &[(&str, f64)] = &[
        ("Ki", 1024.0),
        ("Mi", 1_048_576.0),
        ("Gi", 1_073_741_824.0),
        ("Ti", 1_099_511_627_776.0),
        ("Pi", 1_125_899_906_842_624.0),
        ("Ei", 1_152_921_504_606_846_976.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
        ("m", 1e-3),
    ];
    let (num, mult) = SUFFIXES
        .iter()
        .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n, *m)))
        .unwrap_or((s, 1.0));
    if num.is_empty()
        || !num
            .chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'))
    {
        return Err(bad(
            "expected a number with an optional suffix such as Gi, Mi, G or M",
        ));
    }
    let v: f64 = num.parse().map_err(|_| bad("not a number"))?;
    let bytes = v * mult;
    if !bytes.is_finite() || bytes < 0.0 {
        return Err(bad("must be a non-negative number of bytes"));
    }
    if bytes >= u64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(bytes.ceil() as u64)
}

/// Converts GiB as vLLM logs it (two decimals) to bytes.
pub fn gib_to_bytes(gib: f64) -> u64 {
    (gib * GIB as f64).round().max(0.0) as u64
}

/// The KV budget of one GPU, derived step by step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryBudget {
    /// Either `given` (available KV memory from a log) or `predicted`.
    pub source: &'static str,
    pub gpu_memory_bytes: Option<u64>,
    pub gpu_memory_utilization: Option<f64>,
    /// floor(gpu_memory_bytes x gpu_memory_utilization).
    pub engine_budget_bytes: Option<u64>,
    /// Total weight bytes of the model (all ranks).
    pub weight_bytes_total: Option<u64>,
    /// weight_bytes_total / tp.
    pub weight_bytes_per_gpu: Option<u64>,
    pub activation_reserve_bytes: Option<u64>,
    /// kvfleet's engine: the activation workspace, part of `activation_reserve_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_bytes: Option<u64>,
    /// kvfleet's engine: the CUDA context reserve, the rest of `activation_reserve_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_reserve_bytes: Option<u64>,
    /// kvfleet's engine with a speculative drafter: its weights and buffers, taken off the
    /// budget before the pages (its K/V is in the pages).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drafter_bytes: Option<u64>,
    pub available_kv_bytes: u64,
    pub notes: Vec<String>,
}

impl MemoryBudget {
    /// The available KV memory read from a log line.
    pub fn given(available_kv_bytes: u64) -> MemoryBudget {
        MemoryBudget {
            source: "given",
            gpu_memory_bytes: None,
            gpu_memory_utilization: None,
            engine_budget_bytes: None,
            weight_bytes_total: None,
            weight_bytes_per_gpu: None,
            activation_reserve_bytes: None,
            activation_bytes: None,
            context_reserve_bytes: None,
            drafter_bytes: None,
            available_kv_bytes,
            notes: Vec::new(),
        }
    }

    /// kvfleet's engine on one GPU ([`EngineMemory`]): its weights and activation workspace
    /// to the byte, and the context reserve.
    pub fn engine(m: &EngineMemory) -> Result<MemoryBudget, PlanError> {
        if m.total_bytes == 0 {
            return Err(PlanError::InvalidInput(
                "GPU memory is zero: pass --gpu PRODUCT or --gpu-memory-gib with the memory of one GPU"
                    .into(),
            ));
        }
        let mut notes = Vec::new();
        if m.kv_budget_bytes == 0 {
            notes.push(format!(
                "nothing is left for the KV cache: {} GiB budget - {} GiB weights - {} GiB activations - {} GiB context reserve",
                fmt_gib(m.requested_bytes),
                fmt_gib(m.weight_bytes),
                fmt_gib(m.activation_bytes),
                fmt_gib(m.context_reserve_bytes)
            ));
        }
        Ok(MemoryBudget {
            source: "predicted",
            gpu_memory_bytes: Some(m.total_bytes),
            gpu_memory_utilization: Some(m.gpu_memory_utilization),
            engine_budget_bytes: Some(m.requested_bytes),
            weight_bytes_total: Some(m.weight_bytes),
            weight_bytes_per_gpu: Some(m.weight_bytes),
            activation_reserve_bytes: Some(m.activation_bytes + m.context_reserve_bytes),
            activation_bytes: Some(m.activation_bytes),
            context_reserve_bytes: Some(m.context_reserve_bytes),
            drafter_bytes: None,
            available_kv_bytes: m.kv_budget_bytes,
            notes,
        })
    }

    /// Takes a speculative drafter's weights and buffers (`bytes`) off the KV memory, as the
    /// worker does before it counts pages.
    pub fn reserve_drafter(&mut self, bytes: u64) {
        if bytes > self.available_kv_bytes {
            self.notes.push(format!(
                "the drafter's weights and buffers ({} GiB) are more than the {} GiB left for the KV cache",
                fmt_gib(bytes),
                fmt_gib(self.available_kv_bytes)
            ));
        }
        self.available_kv_bytes = self.available_kv_bytes.saturating_sub(bytes);
        self.drafter_bytes = Some(bytes);
    }

    /// Predicts available KV memory on one of `tp` GPUs. `weight_bytes_total = None`
    /// assumes weights of 0 bytes and says so in `notes`.
    pub fn predict(
        gpu_memory_bytes: u64,
        gpu_memory_utilization: f64,
        weight_bytes_total: Option<u64>,
        tp: u32,
        activation_reserve_bytes: u64,
    ) -> Result<MemoryBudget, PlanError> {
        if gpu_memory_bytes == 0 {
            return Err(PlanError::InvalidInput(
                "GPU memory is zero: pass --gpu PRODUCT or --gpu-memory-gib with the memory of one GPU"
                    .into(),
            ));
        }
        if !(gpu_memory_utilization > 0.0 && gpu_memory_utilization <= 1.0) {
            return Err(PlanError::InvalidInput(format!(
                "gpu memory utilization {gpu_memory_utilization} must be in (0, 1], e.g. 0.9"
            )));
        }
        if tp == 0 {
            return Err(PlanError::InvalidInput(
                "tensor parallel size must be at least 1".into(),
            ));
        }
        let mut notes = Vec::new();
        let engine_budget = (gpu_memory_bytes as f64 * gpu_memory_utilization).floor() as u64;
        let weights_total = match weight_bytes_total {
            Some(w) => w,
            None => {
                notes.push(
                    "weight bytes not given: assumed 0, so the KV budget is an upper bound; set model.weightBytes (or --weight-gib)".into(),
                );
                0
            }
        };
        let per_gpu = weights_total.div_ceil(u64::from(tp));
        let available = engine_budget
            .saturating_sub(per_gpu)
            .saturating_sub(activation_reserve_bytes);
        if available == 0 {
            notes.push(format!(
                "nothing is left for the KV cache: {} GiB budget - {} GiB weights - {} GiB reserve",
                fmt_gib(engine_budget),
                fmt_gib(per_gpu),
                fmt_gib(activation_reserve_bytes)
            ));
        }
        Ok(MemoryBudget {
            source: "predicted",
            gpu_memory_bytes: Some(gpu_memory_bytes),
            gpu_memory_utilization: Some(gpu_memory_utilization),
            engine_budget_bytes: Some(engine_budget),
            weight_bytes_total: Some(weights_total),
            weight_bytes_per_gpu: Some(per_gpu),
            activation_reserve_bytes: Some(activation_reserve_bytes),
            activation_bytes: None,
            context_reserve_bytes: None,
            drafter_bytes: None,
            available_kv_bytes: available,
            notes,
        })
    }
}

/// Bytes as GiB with two decimals, the way vLLM logs them.
pub fn fmt_gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / GIB as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_binary_decimal_and_exponent_forms() {
        assert_eq!(parse_quantity_bytes("19Gi").unwrap(), 19 * GIB);
        assert_eq!(parse_quantity_bytes("16G").unwrap(), 16_000_000_000);
        assert_eq!(parse_quantity_bytes("1.5Ki").unwrap(), 1536);
        assert_eq!(parse_quantity_bytes("2e9").unwrap(), 2_000_000_000);
        assert_eq!(parse_quantity_bytes("1024").unwrap(), 1024);
        assert!(parse_quantity_bytes("19 GB").is_err());
        assert!(parse_quantity_bytes("Gi").is_err());
        assert!(parse_quantity_bytes("-1Gi").is_err());
    }

    #[test]
    fn gpu_products_match_labels_loosely() {
        assert_eq!(gpu_memory_bytes("NVIDIA-H100-80GB-HBM3"), Some(81_559 * MIB));
        assert_eq!(gpu_memory_bytes("geforce rtx 3090"), Some(24 * GIB));
        assert_eq!(gpu_memory_bytes("Tesla-T4"), Some(15 * GIB));
        assert_eq!(gpu_memory_bytes("NVIDIA-Imaginary-9000"), None);
    }

    #[test]
    fn prediction_subtracts_weights_per_rank_and_reserve() {
        let m = MemoryBudget::predict(24 * GIB, 0.9, Some(19 * GIB), 2, GIB).unwrap();
        assert_eq!(
            m.engine_budget_bytes,
            Some((24.0 * 0.9 * GIB as f64).floor() as u64)
        );
        assert_eq!(m.weight_bytes_per_gpu, Some(19 * GIB / 2));
        assert_eq!(
            m.available_kv_bytes,
            m.engine_budget_bytes.unwrap() - 19 * GIB / 2 - GIB
        );
        let none = MemoryBudget::predict(24 * GIB, 0.9, None, 2, GIB).unwrap();
        assert!(none.notes[0].contains("assumed 0"), "{:?}", none.notes);
        assert!(MemoryBudget::predict(0, 0.9, None, 1, GIB).is_err());
        assert!(MemoryBudget::predict(GIB, 1.5, None, 1, GIB).is_err());
    }
}

//! A plain snapshot of the node's NVIDIA GPUs through NVML, or why there is none.

use serde::Serialize;

/// One GPU as NVML reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    pub index: u32,
    /// NVML name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// The name as GPU Feature Discovery labels it (`NVIDIA-H100-80GB-HBM3`).
    pub product: String,
    pub compute_capability: (u32, u32),
    pub memory_total_bytes: u64,
    pub memory_free_bytes: u64,
    pub driver_version: String,
}

impl GpuInfo {
    pub fn compute_capability_label(&self) -> String {
        format!("{}.{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// The outcome of probing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    Gpus(Vec<GpuInfo>),
    /// No driver, no library or no device; the reason is NVML's.
    NoGpu {
        reason: String,
    },
}

/// Probes every GPU. Never panics: a missing driver or library is "no GPU".
pub fn probe() -> Probe {
    match std::panic::catch_unwind(probe_inner) {
        Ok(Ok(gpus)) if gpus.is_empty() => Probe::NoGpu {
            reason: "NVML reports 0 devices".into(),
        },
        Ok(Ok(gpus)) => Probe::Gpus(gpus),
        Ok(Err(reason)) => Probe::NoGpu { reason },
        Err(_) => Probe::NoGpu {
            reason: "NVML panicked while loading".into(),
        },
    }
}

fn probe_inner() -> Result<Vec<GpuInfo>, String> {
    use nvml_wrapper::Nvml;
    let nvml = Nvml::init().map_err(|e| format!("NVML init failed: {e}"))?;
    let driver_version = nvml.sys_driver_version().unwrap_or_default();
    let count = nvml
        .device_count()
        .map_err(|e| format!("NVML device count: {e}"))?;
    let mut gpus = Vec::new();
    for index in 0..count {
        let dev = nvml
            .device_by_index(index)
            .map_err(|e| format!("NVML device {index}: {e}"))?;
        let name = dev.name().map_err(|e| format!("NVML device {index} name: {e}"))?;
        let cc = dev
            .cuda_compute_capability()
            .map_err(|e| format!("NVML device {index} compute capability: {e}"))?;
        let mem = dev
            .memory_info()
            .map_err(|e| format!("NVML device {index} memory: {e}"))?;
        gpus.push(GpuInfo {
            index,
            product: name.trim().replace(' ', "-"),
            name,
            compute_capability: (cc.major.max(0) as u32, cc.minor.max(0) as u32),
            memory_total_bytes: mem.total,
            memory_free_bytes: mem.free,
            driver_version: driver_version.clone(),
        });
    }
    Ok(gpus)
}

//! GPU products as GPU Feature Discovery labels them (`nvidia.com/gpu.product`), with their
//! compute capability and nominal memory.
//!
//! GFD writes the NVML device name with spaces replaced by `-` (gfd: NVIDIA/k8s-device-plugin
//! `docs/gpu-feature-discovery/README.md`), so the values are not marketing names:
//! `NVIDIA-H100-80GB-HBM3`, `Tesla-T4`, `NVIDIA-L4`. Under time-slicing/MPS sharing the value
//! may end in `-SHARED`, under the MIG single strategy in `-MIG-1g.5gb` (or similar).
//! Capabilities: CUDA C Programming Guide, "Compute Capabilities" table, and COMPAT.md.
//! Memory is nominal (marketing GiB x 1024 MiB) unless noted; where known, the total NVML
//! (nvidia-smi) reports is kept beside it (`reported_mib`). A node's own
//! `nvidia.com/gpu.memory` label wins over this table.

use super::cc::ComputeCapability;

/// One GPU product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Product {
    /// The GFD `nvidia.com/gpu.product` value (without sharing or MIG suffixes).
    pub label: &'static str,
    /// The name people use.
    pub name: &'static str,
    pub cc: ComputeCapability,
    /// Memory per GPU in MiB (nominal).
    pub memory_mib: u64,
    /// Memory per GPU in MiB as NVML (nvidia-smi) reports it and GFD labels it
    /// (`nvidia.com/gpu.memory`), where known. (I): typical nvidia-smi totals.
    pub reported_mib: Option<u64>,
}

const fn p(label: &'static str, name: &'static str, major: u32, minor: u32, gib: u64) -> Product {
    Product {
        label,
        name,
        cc: ComputeCapability::new(major, minor),
        memory_mib: gib * 1024,
        reported_mib: None,
    }
}

impl Product {
    /// The same product with the total NVML reports.
    const fn reported(self, mib: u64) -> Product {
        Product {
            reported_mib: Some(mib),
            ..self
        }
    }
}

/// Every product kvfleet knows, ordered by compute capability.
pub static PRODUCTS: &[Product] = &[
    // 7.5 Turing
    p("Tesla-T4", "T4 16 GB", 7, 5, 16).reported(15_360),
    p("NVIDIA-GeForce-RTX-2080-Ti", "RTX 2080 Ti 11 GB", 7, 5, 11),
    p(
        "GeForce-RTX-2080-Ti",
        "RTX 2080 Ti 11 GB (older drivers)",
        7,
        5,
        11,
    ),
    p("Quadro-RTX-8000", "Quadro RTX 8000 48 GB", 7, 5, 48),
    // 8.0 Ampere data center
    p("NVIDIA-A100-SXM4-40GB", "A100 SXM4 40 GB", 8, 0, 40).reported(40_960),
    p("NVIDIA-A100-SXM4-80GB", "A100 SXM4 80 GB", 8, 0, 80).reported(81_920),
    p("NVIDIA-A100-PCIE-40GB", "A100 PCIe 40 GB", 8, 0, 40).reported(40_960),
    p("NVIDIA-A100-80GB-PCIe", "A100 PCIe 80 GB", 8, 0, 80).reported(81_920),
    p("NVIDIA-A30", "A30 24 GB", 8, 0, 24),
    // 8.6 Ampere
    p("NVIDIA-A10", "A10 24 GB", 8, 6, 24).reported(23_028),
    p("NVIDIA-A40", "A40 48 GB", 8, 6, 48).reported(46_068),
    p("NVIDIA-GeForce-RTX-3090", "RTX 3090 24 GB", 8, 6, 24).reported(24_576),
    p("NVIDIA-RTX-A6000", "RTX A6000 48 GB", 8, 6, 48).reported(49_140),
    // 8.7 Jetson Orin (unified memory; 64 GB is the AGX Orin 64 GB module)
    p("NVIDIA-Jetson-AGX-Orin", "Jetson AGX Orin 64 GB", 8, 7, 64),
    p("Orin", "Jetson Orin (nvgpu)", 8, 7, 64),
    // 8.9 Ada
    p("NVIDIA-L4", "L4 24 GB", 8, 9, 24).reported(23_034),
    p("NVIDIA-L40", "L40 48 GB", 8, 9, 48).reported(46_068),
    p("NVIDIA-L40S", "L40S 48 GB", 8, 9, 48).reported(46_068),
    p("NVIDIA-GeForce-RTX-4090", "RTX 4090 24 GB", 8, 9, 24).reported(24_564),
    p("NVIDIA-RTX-6000-Ada-Generation", "RTX 6000 Ada 48 GB", 8, 9, 48).reported(49_140),
    // 9.0 Hopper
    p("NVIDIA-H100-80GB-HBM3", "H100 SXM 80 GB", 9, 0, 80).reported(81_559),
    p("NVIDIA-H100-PCIe", "H100 PCIe 80 GB", 9, 0, 80).reported(81_559),
    p("NVIDIA-H100-NVL", "H100 NVL 94 GB", 9, 0, 94).reported(95_830),
    p("NVIDIA-H200", "H200 141 GB", 9, 0, 141).reported(143_771),
    p("NVIDIA-H200-NVL", "H200 NVL 141 GB", 9, 0, 141),
    p("NVIDIA-GH200-480GB", "GH200 96 GB HBM3", 9, 0, 96),
    p("NVIDIA-GH200-144G-HBM3e", "GH200 144 GB HBM3e", 9, 0, 144),
    p("NVIDIA-H20", "H20 96 GB", 9, 0, 96),
    // 10.0 Blackwell data center
    p("NVIDIA-B200", "B200 180 GB", 10, 0, 180).reported(183_359),
    p("NVIDIA-GB200", "GB200 186 GB", 10, 0, 186),
    // 10.3 Blackwell Ultra
    p("NVIDIA-B300-SXM6-AC", "B300 288 GB", 10, 3, 288),
    p("NVIDIA-B300", "B300 288 GB", 10, 3, 288),
    p("NVIDIA-GB300", "GB300 288 GB", 10, 3, 288),
    // 11.0 Jetson Thor (sm_101 before CUDA 13; not family 100)
    p("NVIDIA-Jetson-AGX-Thor", "Jetson AGX Thor 128 GB", 11, 0, 128),
    p("NVIDIA-Thor", "Jetson Thor 128 GB", 11, 0, 128),
    // 12.0 Blackwell workstation / consumer
    p("NVIDIA-GeForce-RTX-5090", "RTX 5090 32 GB", 12, 0, 32).reported(32_607),
    p(
        "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
        "RTX PRO 6000 Blackwell Server Edition 96 GB",
        12,
        0,
        96,
    )
    .reported(97_887),
    p(
        "NVIDIA-RTX-PRO-6000-Blackwell-Workstation-Edition",
        "RTX PRO 6000 Blackwell Workstation Edition 96 GB",
        12,
        0,
        96,
    ),
    p(
        "NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edition",
        "RTX PRO 6000 Blackwell Max-Q 96 GB",
        12,
        0,
        96,
    ),
    p(
        "NVIDIA-RTX-PRO-6000-Blackwell",
        "RTX PRO 6000 Blackwell 96 GB (short form)",
        12,
        0,
        96,
    ),
    // 12.1 DGX Spark (unified memory)
    p("NVIDIA-GB10", "DGX Spark GB10 128 GB unified", 12, 1, 128),
];

/// Strips the GFD sharing (`-SHARED`) and MIG (`-MIG-...`) suffixes.
pub fn base_label(label: &str) -> &str {
    let label = label.trim();
    let label = label.strip_suffix("-SHARED").unwrap_or(label);
    match label.find("-MIG-") {
        Some(i) => &label[..i],
        None => label,
    }
}

/// Finds a product by its GFD label, tolerating `-SHARED` / `-MIG-...` suffixes, case and
/// a missing or extra `NVIDIA-` prefix (older drivers name GeForce boards without it).
pub fn lookup(label: &str) -> Option<&'static Product> {
    let base = base_label(label);
    if base.is_empty() {
        return None;
    }
    let find = |l: &str| PRODUCTS.iter().find(|p| p.label.eq_ignore_ascii_case(l));
    find(base)
        .or_else(|| {
            let stripped = base
                .strip_prefix("NVIDIA-")
                .or_else(|| base.strip_prefix("nvidia-"))?;
            find(stripped)
        })
        .or_else(|| find(&format!("NVIDIA-{base}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cc_of(label: &str) -> Option<String> {
        lookup(label).map(|p| p.cc.to_string())
    }

    #[test]
    fn every_compat_md_architecture_row_has_products() {
        let table = [
            ("Tesla-T4", "7.5"),
            ("NVIDIA-GeForce-RTX-2080-Ti", "7.5"),
            ("Quadro-RTX-8000", "7.5"),
            ("NVIDIA-A100-SXM4-80GB", "8.0"),
            ("NVIDIA-A100-SXM4-40GB", "8.0"),
            ("NVIDIA-A30", "8.0"),
            ("NVIDIA-A10", "8.6"),
            ("NVIDIA-A40", "8.6"),
            ("NVIDIA-GeForce-RTX-3090", "8.6"),
            ("NVIDIA-RTX-A6000", "8.6"),
            ("NVIDIA-Jetson-AGX-Orin", "8.7"),
            ("NVIDIA-L4", "8.9"),
            ("NVIDIA-L40", "8.9"),
            ("NVIDIA-L40S", "8.9"),
            ("NVIDIA-GeForce-RTX-4090", "8.9"),
            ("NVIDIA-RTX-6000-Ada-Generation", "8.9"),
            ("NVIDIA-H100-80GB-HBM3", "9.0"),
            ("NVIDIA-H100-NVL", "9.0"),
            ("NVIDIA-H200", "9.0"),
            ("NVIDIA-GH200-480GB", "9.0"),
            ("NVIDIA-H20", "9.0"),
            ("NVIDIA-B200", "10.0"),
            ("NVIDIA-GB200", "10.0"),
            ("NVIDIA-B300-SXM6-AC", "10.3"),
            ("NVIDIA-GB300", "10.3"),
            ("NVIDIA-Jetson-AGX-Thor", "11.0"),
            ("NVIDIA-GeForce-RTX-5090", "12.0"),
            ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", "12.0"),
            ("NVIDIA-RTX-PRO-6000-Blackwell-Workstation-Edition", "12.0"),
            ("NVIDIA-GB10", "12.1"),
        ];
        for (label, cc) in table {
            assert_eq!(cc_of(label).as_deref(), Some(cc), "{label}");
        }
    }

    #[test]
    fn sharing_and_mig_suffixes_are_tolerated() {
        assert_eq!(cc_of("NVIDIA-H100-80GB-HBM3-SHARED").as_deref(), Some("9.0"));
        assert_eq!(cc_of("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb").as_deref(), Some("8.0"));
        assert_eq!(
            cc_of("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED").as_deref(),
            Some("8.0")
        );
        assert_eq!(base_label("NVIDIA-H200-MIG-3g.71gb"), "NVIDIA-H200");
    }

    #[test]
    fn prefix_and_case_variants_resolve() {
        assert_eq!(cc_of("GeForce-RTX-3090").as_deref(), Some("8.6"));
        assert_eq!(cc_of("nvidia-l4").as_deref(), Some("8.9"));
        assert_eq!(cc_of("NVIDIA-Tesla-T4").as_deref(), Some("7.5"));
        assert!(lookup("").is_none());
        assert!(lookup("NVIDIA-Imaginary-9000").is_none());
    }

    #[test]
    fn memory_is_nominal_mib() {
        assert_eq!(lookup("NVIDIA-H100-80GB-HBM3").unwrap().memory_mib, 80 * 1024);
        assert_eq!(
            lookup("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition")
                .unwrap()
                .memory_mib,
            96 * 1024
        );
        assert_eq!(lookup("NVIDIA-GeForce-RTX-3090").unwrap().memory_mib, 24 * 1024);
    }

    #[test]
    fn labels_are_unique() {
        for (i, a) in PRODUCTS.iter().enumerate() {
            for b in &PRODUCTS[i + 1..] {
                assert!(!a.label.eq_ignore_ascii_case(b.label), "{}", a.label);
            }
        }
    }
}

//! Kernel specialisations: one closed enum per axis, a key string per specialisation and the
//! generated prelude of constexprs that the attention kernels (`kernels/attention/`) are compiled
//! with.
//!
//! Pure: no CUDA calls here, so the planner, the key and the tiling can be tested anywhere.

use std::fmt;

/// The CUDA source, embedded at build time so a worker image needs no kernel files: the files of
/// `kernels/attention/` in dependency order (each may use what the ones before it define).
pub const ATTENTION_SOURCE: &str = concat!(
    include_str!("../../../kernels/attention/common.cuh"),
    include_str!("../../../kernels/attention/quant.cuh"),
    include_str!("../../../kernels/attention/pipeline.cuh"),
    include_str!("../../../kernels/attention/prefill.cu"),
    include_str!("../../../kernels/attention/prefill_wgmma.cu"),
    include_str!("../../../kernels/attention/decode.cu"),
    include_str!("../../../kernels/attention/entry.cu"),
    include_str!("../../../kernels/attention/append.cu"),
);

/// The KV-cache storage dtype is the engine's: one enum for the layout, the CPU backend and
/// the kernels.
pub use kvfleet_engine::engine::layout::KvDtype;

/// What the kernels call a [`KvDtype`]. Both names are frozen: the code is compiled into every
/// prelude and the key names the PTX caches.
pub trait KernelDtype {
    /// The `KV_DTYPE` constant of the kernel source (`DT_BF16` .. `DT_NVFP4`).
    fn kernel_code(self) -> u32;
    /// The dtype's segment of [`KernelSpec::key`].
    fn key_name(self) -> &'static str;
}

impl KernelDtype for KvDtype {
    fn kernel_code(self) -> u32 {
        match self {
            Self::Bf16 => 0,
            Self::F16 => 1,
            Self::Fp8E4m3 => 2,
            Self::Fp8E5m2 => 3,
            Self::Nvfp4 => 4,
        }
    }

    fn key_name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Fp8E4m3 => "e4m3",
            Self::Fp8E5m2 => "e5m2",
            Self::Nvfp4 => "nvfp4",
        }
    }
}

/// Head dimensions the kernels are built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HeadDim {
    D64,
    D128,
    D256,
}

impl HeadDim {
    pub const ALL: [HeadDim; 3] = [Self::D64, Self::D128, Self::D256];

    pub fn get(self) -> usize {
        match self {
            Self::D64 => 64,
            Self::D128 => 128,
            Self::D256 => 256,
        }
    }

    pub fn from_usize(d: usize) -> Option<Self> {
        Self::ALL.into_iter().find(|h| h.get() == d)
    }
}

/// Tokens per KV page (block_size). Only 16 (the engine's and vLLM's default) is built: every
/// extra value multiplies the specialisations the PTX test compiles for six targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PageSize {
    P16,
}

impl PageSize {
    pub const ALL: [PageSize; 1] = [Self::P16];

    pub fn get(self) -> usize {
        match self {
            Self::P16 => 16,
        }
    }

    pub fn from_usize(p: usize) -> Option<Self> {
        Self::ALL.into_iter().find(|x| x.get() == p)
    }
}

/// Query heads per KV head (GQA group); 1 is multi-head attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupSize {
    G1,
    G2,
    G4,
    G8,
}

impl GroupSize {
    pub const ALL: [GroupSize; 4] = [Self::G1, Self::G2, Self::G4, Self::G8];

    pub fn get(self) -> usize {
        match self {
            Self::G1 => 1,
            Self::G2 => 2,
            Self::G4 => 4,
            Self::G8 => 8,
        }
    }

    pub fn from_usize(g: usize) -> Option<Self> {
        Self::ALL.into_iter().find(|x| x.get() == g)
    }
}

/// Which keys a query sees: all held keys, causal, or causal within a sliding window
/// (the window length itself is a launch argument; only the flag is compiled in).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mask {
    Full,
    Causal,
    CausalSliding,
}

impl Mask {
    pub const ALL: [Mask; 3] = [Self::Full, Self::Causal, Self::CausalSliding];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Causal => "causal",
            Self::CausalSliding => "swa",
        }
    }

    pub fn causal(self) -> bool {
        !matches!(self, Self::Full)
    }

    pub fn sliding(self) -> bool {
        matches!(self, Self::CausalSliding)
    }
}

/// The kernel targets live with the compute capabilities (the compat rules deny what has none).
pub use kvfleet_core::compat::cc::Arch;

/// One compiled program: all kernels (attention, merge, append) for one point of every axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelSpec {
    pub dtype: KvDtype,
    pub head_dim: HeadDim,
    pub page: PageSize,
    pub group: GroupSize,
    pub mask: Mask,
}

/// Threads per CTA of every kernel.
pub const THREADS: u32 = 128;

impl KernelSpec {
    /// Every specialisation we build and claim; the PTX test compiles each for every [`Arch`].
    pub fn all() -> Vec<KernelSpec> {
        let mut v = Vec::new();
        for dtype in KvDtype::ALL {
            for head_dim in HeadDim::ALL {
                for page in PageSize::ALL {
                    for group in GroupSize::ALL {
                        for mask in Mask::ALL {
                            v.push(KernelSpec {
                                dtype,
                                head_dim,
                                page,
                                group,
                                mask,
                            });
                        }
                    }
                }
            }
        }
        v
    }

    /// The cache key, URI-like: `attn/<dtype>/d<head_dim>/p<page>/g<group>/<mask>`.
    pub fn key(&self) -> String {
        format!(
            "attn/{}/d{}/p{}/g{}/{}",
            self.dtype.key_name(),
            self.head_dim.get(),
            self.page.get(),
            self.group.get(),
            self.mask.as_str()
        )
    }

    /// Keys per pipeline tile: 64 up to head_dim 128 (128 for nvfp4, whose tiles are small and
    /// whose warps then get more independent work), 32 at 256 (shared memory).
    pub fn tile_keys(&self) -> usize {
        if self.head_dim.get() <= 128 && self.dtype == KvDtype::Nvfp4 {
            128
        } else if self.head_dim.get() <= 128 {
            64
        } else {
            32
        }
    }

    /// Pipeline depth (cp.async stages). Quantized caches move fewer bytes per tile, so they
    /// keep more tiles in flight.
    pub fn stages(&self) -> usize {
        match self.dtype {
            KvDtype::Bf16 | KvDtype::F16 => 2,
            _ => 4,
        }
    }

    /// Warps that split one key tile in a decode CTA (each takes 16 keys).
    pub fn decode_warps_kv(&self) -> usize {
        (self.tile_keys() / 16).min(4)
    }

    /// Resident CTAs per SM that `kvf_decode`'s register budget must allow: the minimum CTAs
    /// per SM of its `__launch_bounds__` (a register cap of 64K / (128 x n)). 3 helps fp8 and
    /// costs bf16 nothing; nvfp4 dequantizes in more registers and is faster unconstrained
    /// (bench/RESULTS.md).
    pub fn decode_min_ctas(&self) -> usize {
        match self.dtype {
            KvDtype::Bf16 | KvDtype::F16 => 3,
            _ if self.head_dim.get() <= 128 => 4,
            KvDtype::Nvfp4 => 1,
            _ => 3,
        }
    }

    /// 16-row m-tiles per warp in a prefill CTA: 2 up to head_dim 128, so every K/V fragment
    /// read from shared memory feeds two `mma` (the prefill kernel is bound by shared-memory
    /// bandwidth otherwise); 1 at head_dim 256, whose accumulators would not fit the registers.
    /// Pipeline stages of the decode-only kernel (`kvf_decode`). The transposed decode CTA
    /// (head_dim <= 128) needs few registers, so shared memory sets its occupancy: three stages
    /// of 64 fp8 keys or two of 128 nvfp4 keys let four CTAs share an SM (bf16 tiles are twice
    /// the bytes: two stages, three CTAs).
    pub fn decode_stages(&self) -> usize {
        match self.dtype {
            _ if self.head_dim.get() > 128 => self.stages(),
            KvDtype::Fp8E4m3 | KvDtype::Fp8E5m2 => 3,
            KvDtype::Bf16 | KvDtype::F16 | KvDtype::Nvfp4 => 2,
        }
    }

    /// Dynamic shared memory of the decode-only kernel: its pipeline, or the row-major CTA's
    /// whole footprint for head_dim 256.
    pub fn decode_smem_bytes(&self) -> usize {
        let d = self.head_dim.get();
        if d > 128 {
            return self.smem_bytes();
        }
        // four warps' (m, l, O) for 8 rows alias the pipeline after the key loop
        let dump = 4 * 8 * (d + 4) * 4 + 2 * 4 * 8 * 4;
        (self.decode_stages() * self.stage_bytes()).max(dump)
    }

    fn stage_bytes(&self) -> usize {
        let d = self.head_dim.get();
        let tk = self.tile_keys();
        if matches!(self.dtype, KvDtype::Bf16 | KvDtype::F16) {
            2 * tk * (d + 8) * 2
        } else {
            2 * tk * (self.dtype.data_bytes(d) + 16 + self.dtype.scale_bytes(d))
        }
    }

    pub fn prefill_mt(&self) -> usize {
        if self.head_dim.get() <= 128 {
            2
        } else {
            1
        }
    }

    /// Rows (token x head-in-group) of one prefill CTA: 4 warps x 16 x [`Self::prefill_mt`].
    pub fn prefill_rows(&self) -> usize {
        64 * self.prefill_mt()
    }

    /// Whether the prefill CTA runs on `wgmma` on `arch`: sm_90a with a 16-bit cache and
    /// head_dim <= 128 (`WGMMA_PREFILL` in kernels/attention/common.cuh); elsewhere `mma.sync`.
    pub fn wgmma_prefill(&self, arch: Arch) -> bool {
        arch == Arch::Sm90a
            && matches!(self.dtype, KvDtype::Bf16 | KvDtype::F16)
            && self.head_dim.get() <= 128
    }

    /// Query rows of one prefill item on `arch`: the wgmma CTA is one m64 slab.
    pub fn prefill_rows_on(&self, arch: Arch) -> usize {
        if self.wgmma_prefill(arch) {
            64
        } else {
            self.prefill_rows()
        }
    }

    /// Rows (token x head-in-group) one decode CTA holds; requests with more rows run as prefill.
    /// Query rows of one decode item (tokens x GQA group). Head dims up to 128 run the transposed
    /// decode CTA, whose rows are the mma's 8-wide N side; 256 runs the row-major CTA, 16 rows per
    /// warp along rows.
    pub fn decode_rows(&self) -> usize {
        if self.head_dim.get() <= 128 {
            8
        } else {
            16 * (4 / self.decode_warps_kv())
        }
    }

    /// Dynamic shared memory of `kvf_attention`, mirrored by a static_assert in the kernel.
    pub fn smem_bytes(&self) -> usize {
        let d = self.head_dim.get();
        let pipe = self.stages() * self.stage_bytes();
        let groups = 4 * self.prefill_mt();
        let dump = groups * 16 * (d + 4) * 4 + 2 * groups * 16 * 4;
        pipe.max(dump)
    }

    pub fn prelude(&self) -> String {
        format!(
            "// generated by kvfleet for {key}\n\
             constexpr int KV_DTYPE = {dt};\n\
             constexpr int HEAD_DIM = {d};\n\
             constexpr int PAGE_SIZE = {p};\n\
             constexpr int GROUP = {g};\n\
             constexpr bool CAUSAL = {c};\n\
             constexpr bool SLIDING = {s};\n\
             constexpr int TILE_KEYS = {tk};\n\
             constexpr int STAGES = {st};\n\
             constexpr int DECODE_WARPS_KV = {dw};\n\
             constexpr int DECODE_ROWS = {dr};\n\
             constexpr int DECODE_MIN_CTAS = {dm};\n\
             constexpr int DECODE_STAGES = {ds};\n\
             constexpr int DECODE_SMEM_BYTES_HOST = {dsm};\n\
             constexpr int PREFILL_MT = {pm};\n\
             constexpr int SMEM_BYTES_HOST = {sm};\n",
            key = self.key(),
            dt = self.dtype.kernel_code(),
            d = self.head_dim.get(),
            p = self.page.get(),
            g = self.group.get(),
            c = self.mask.causal(),
            s = self.mask.sliding(),
            tk = self.tile_keys(),
            st = self.stages(),
            dw = self.decode_warps_kv(),
            dr = self.decode_rows(),
            dm = self.decode_min_ctas(),
            ds = self.decode_stages(),
            dsm = self.decode_smem_bytes(),
            pm = self.prefill_mt(),
            sm = self.smem_bytes(),
        )
    }

    /// Prelude plus kernel source: what NVRTC compiles.
    pub fn source(&self) -> String {
        let mut s = self.prelude();
        s.push_str(ATTENTION_SOURCE);
        s
    }
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_unique_across_all_specialisations() {
        let all = KernelSpec::all();
        let keys: std::collections::HashSet<_> = all.iter().map(|s| s.key()).collect();
        assert_eq!(keys.len(), all.len());
    }

    #[test]
    fn prelude_names_every_axis() {
        let s = KernelSpec {
            dtype: KvDtype::Nvfp4,
            head_dim: HeadDim::D128,
            page: PageSize::P16,
            group: GroupSize::G4,
            mask: Mask::CausalSliding,
        };
        let p = s.prelude();
        for want in [
            "KV_DTYPE = 4;",
            "HEAD_DIM = 128;",
            "PAGE_SIZE = 16;",
            "GROUP = 4;",
            "CAUSAL = true;",
            "SLIDING = true;",
        ] {
            assert!(p.contains(want), "{want} missing from {p}");
        }
        assert_eq!(s.key(), "attn/nvfp4/d128/p16/g4/swa");
    }

    #[test]
    fn dtype_codes_and_key_names_stay_what_the_caches_were_built_with() {
        let names: Vec<_> = KvDtype::ALL
            .iter()
            .map(|d| (d.kernel_code(), d.key_name()))
            .collect();
        assert_eq!(
            names,
            [(0, "bf16"), (1, "f16"), (2, "e4m3"), (3, "e5m2"), (4, "nvfp4")]
        );
        for (code, dt) in ["DT_BF16", "DT_F16", "DT_E4M3", "DT_E5M2", "DT_NVFP4"]
            .iter()
            .zip(KvDtype::ALL)
        {
            let want = format!("constexpr int {code} = {};", dt.kernel_code());
            assert!(
                ATTENTION_SOURCE.contains(&want),
                "{want} missing from the kernel source"
            );
        }
    }

    #[test]
    fn shared_memory_fits_hopper_and_ampere_limits() {
        for s in KernelSpec::all() {
            // sm_80's opt-in maximum is 163 KiB per block; sm_86/89/120 allow 99 KiB.
            assert!(s.smem_bytes() <= 99 * 1024, "{s}: {} bytes", s.smem_bytes());
        }
    }

    #[test]
    fn decode_kernel_footprint_allows_its_occupancy() {
        // Hopper: 228 KiB of shared memory per SM, 1 KiB reserved per CTA; 64K registers.
        for s in KernelSpec::all() {
            // the decode kernel never needs more than the mixed kernel it is split from
            assert!(s.decode_smem_bytes() <= s.smem_bytes(), "{s}");
            let per_cta = s.decode_smem_bytes() + 1024;
            let want = s.decode_min_ctas();
            if s.head_dim.get() <= 128 {
                assert!(
                    want * per_cta <= 228 * 1024,
                    "{s}: {want} CTAs of {per_cta} bytes do not fit one SM"
                );
            }
        }
    }

    #[test]
    fn one_token_of_any_group_is_a_decode_item() {
        for s in KernelSpec::all() {
            assert!(s.decode_rows() >= s.group.get(), "{s}");
            if s.head_dim.get() <= 128 {
                // the transposed decode CTA's rows are the mma's 8-wide N side
                assert_eq!(s.decode_rows(), 8, "{s}");
            }
        }
    }

    #[test]
    fn capability_mapping_rejects_pre_ampere() {
        assert_eq!(Arch::for_capability(7, 5), None);
        assert_eq!(Arch::for_capability(9, 0), Some(Arch::Sm90a));
        assert_eq!(Arch::for_capability(12, 1), Some(Arch::Sm120a));
    }
}

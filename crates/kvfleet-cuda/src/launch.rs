//! Kernel launches through `cuLaunchKernelEx`, with programmatic dependent launch (PDL) where
//! the device has it (sm_90 and later).
//!
//! A kernel launched with PDL may be started by the driver while the kernel before it in the
//! stream is still draining its last blocks, which takes the launch latency off every kernel
//! boundary of a step (bench/RESULTS.md). The contract, kept by every kernel launched here:
//! its first statement is `kvf_wait_prior_grid()` (`griddepcontrol.wait`; in `kernels/model.cu`
//! and `kernels/attention/common.cuh`), which returns once the previous kernel has completed and
//! its writes are visible, so nothing is read or written early. Launched without the attribute
//! (before sm_90) the wait is a no-op. No kernel here triggers its dependents early
//! (`griddepcontrol.launch_dependents`): measured slower (bench/RESULTS.md).
//!
//! The exceptions, each a word of `KVFLEET_EARLY_LAUNCH` ([`EarlyLaunch`]), to time them: the
//! decode kernel triggers once it has waited, so the next kernel's blocks (the O projection's
//! GEMV in a one-token step) are resident while attention runs; the single-token GEMVs trigger
//! when a warp starts its last unit of work, and fetch their first rows into L2 before their
//! wait. A kernel still reads nothing a previous kernel writes before its wait, and it triggers
//! only after it, so at most one kernel waits early behind the one that runs.
//!
//! cudarc's launch builder has no launch attributes, hence [`Launch`]: it collects the arguments
//! the same way (device addresses of borrowed buffers, scalars) and launches raw.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::spec::Arch;
use cudarc::driver::sys;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError, LaunchConfig, SyncOnDrop,
};

// Scalars sit in the low bytes of their 8-byte slot, where the driver reads them.
const _: () = assert!(cfg!(target_endian = "little"));

/// Whether kernels for `arch` are launched with PDL (sm_90 and later).
pub fn pdl(arch: Arch) -> bool {
    matches!(arch, Arch::Sm90a | Arch::Sm100a | Arch::Sm120a)
}

/// The arguments of one launch, in the kernel's parameter order. Each argument takes an 8-byte
/// slot (a device address, or a 4-byte scalar in its low bytes); the borrows of the buffers last
/// until [`Launch::launch`] has queued the kernel.
pub struct Launch<'a> {
    stream: &'a CudaStream,
    slots: Vec<u64>,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Launch<'a> {
    pub fn new(stream: &'a CudaStream) -> Self {
        Launch {
            stream,
            slots: Vec::with_capacity(24),
            guards: Vec::with_capacity(24),
        }
    }

    /// A buffer the kernel reads.
    pub fn ptr<T>(&mut self, buf: &'a CudaSlice<T>) -> &mut Self {
        let (p, g) = buf.device_ptr(self.stream);
        self.guards.push(g);
        self.slots.push(p);
        self
    }

    /// Borrows `buf` for this launch and returns its device address, for arguments that point
    /// inside it (passed with [`Self::addr`]).
    pub fn hold<T>(&mut self, buf: &'a CudaSlice<T>) -> u64 {
        let (p, g) = buf.device_ptr(self.stream);
        self.guards.push(g);
        p
    }

    /// A buffer the kernel writes.
    pub fn ptr_mut<T>(&mut self, buf: &'a mut CudaSlice<T>) -> &mut Self {
        let (p, g) = buf.device_ptr_mut(self.stream);
        self.guards.push(g);
        self.slots.push(p);
        self
    }

    /// A raw device address: 0 for an optional buffer the kernel is told is absent, or an
    /// address inside a buffer borrowed by an earlier argument of this launch.
    pub fn addr(&mut self, p: u64) -> &mut Self {
        self.slots.push(p);
        self
    }

    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.slots.push(u64::from(v as u32));
        self
    }

    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.slots.push(u64::from(v.to_bits()));
        self
    }

    /// Queues `f` on the stream, with PDL when `pdl` (see the module docs for the kernel's side).
    ///
    /// # Safety
    /// The arguments must match `f`'s parameters in order and type (pointers for [`Self::ptr`],
    /// [`Self::ptr_mut`] and [`Self::addr`]; `int` and `float` for the scalars),
    /// the kernel must stay inside the buffers it is given, and with `pdl` it must call
    /// `kvf_wait_prior_grid()` before touching memory.
    pub unsafe fn launch(self, f: &CudaFunction, cfg: LaunchConfig, pdl: bool) -> Result<(), DriverError> {
        // cudarc's launches bind the context to the thread; the raw one does too.
        self.stream.context().bind_to_thread()?;
        let mut args: Vec<*mut std::ffi::c_void> = self
            .slots
            .iter()
            .map(|s| s as *const u64 as *mut std::ffi::c_void)
            .collect();
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let (gx, gy, gz) = cfg.grid_dim;
        let (bx, by, bz) = cfg.block_dim;
        let c = sys::CUlaunchConfig {
            gridDimX: gx,
            gridDimY: gy,
            gridDimZ: gz,
            blockDimX: bx,
            blockDimY: by,
            blockDimZ: bz,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        // SAFETY: `args` points at one 8-byte slot per kernel parameter, alive until the call
        // returns (the driver copies the values at launch), as does `attr`; the caller vouches
        // for the match with the kernel's signature and its memory accesses.
        let r =
            unsafe { sys::cuLaunchKernelEx(&c, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) };
        drop(self.guards);
        r.result()
    }
}

/// Which kernels let the next kernel start before they end (`KVFLEET_EARLY_LAUNCH`: words
/// `decode`, `gemv`, `prefetch`, `evict`, or `all` / `none`; see the module docs). One setting
/// for the process, read at the first launch that asks; [`set_early_launch`] changes it for
/// the launches after, to compare settings in one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EarlyLaunch {
    /// `kvf_decode` triggers its dependents right after its wait.
    pub decode: bool,
    /// A single-token GEMV triggers its dependents when one of its warps starts its last unit.
    pub gemv: bool,
    /// A single-token GEMV fetches the first 4 KiB of each row of its warps' first units into
    /// L2 before it waits (the weights never depend on the kernel before).
    pub prefetch: bool,
    /// A single-token GEMV streams its weights with L2's evict-first policy, so that the rows
    /// the next GEMV fetched early stay cached.
    pub evict: bool,
}

/// `KVFLEET_EARLY_LAUNCH`, the switch of [`EarlyLaunch`].
pub const EARLY_LAUNCH_ENV: &str = "KVFLEET_EARLY_LAUNCH";

/// The GEMV kernels' `flow` bits (kernels/gemv.cu `FLOW_*`).
const FLOW_TRIGGER: i32 = 1;
const FLOW_PREFETCH: i32 = 2;
const FLOW_EVICT: i32 = 4;
/// The stored setting's bits; `UNREAD` until the environment has been read.
const UNREAD: u8 = 0x80;
static EARLY: AtomicU8 = AtomicU8::new(UNREAD);

impl EarlyLaunch {
    pub const ALL: EarlyLaunch = EarlyLaunch {
        decode: true,
        gemv: true,
        prefetch: true,
        evict: true,
    };
    pub const NONE: EarlyLaunch = EarlyLaunch {
        decode: false,
        gemv: false,
        prefetch: false,
        evict: false,
    };
    /// What runs when `KVFLEET_EARLY_LAUNCH` is unset.
    pub const DEFAULT: EarlyLaunch = EarlyLaunch::NONE;

    /// Parses the switch's words, comma-separated; an unknown word is an error naming it.
    pub fn parse(v: &str) -> Result<Self, String> {
        match v.trim() {
            "" => return Ok(Self::DEFAULT),
            "all" => return Ok(Self::ALL),
            "none" => return Ok(Self::NONE),
            _ => {}
        }
        let mut e = Self::NONE;
        for w in v.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            match w {
                "decode" => e.decode = true,
                "gemv" => e.gemv = true,
                "prefetch" => e.prefetch = true,
                "evict" => e.evict = true,
                other => {
                    return Err(format!(
                        "{EARLY_LAUNCH_ENV}: unknown word {other:?} (words: decode, gemv, prefetch, evict; or all, none)"
                    ))
                }
            }
        }
        Ok(e)
    }

    /// The `flow` argument of the GEMV kernels for this setting.
    pub fn gemv_flow(self) -> i32 {
        (if self.gemv { FLOW_TRIGGER } else { 0 })
            | (if self.prefetch { FLOW_PREFETCH } else { 0 })
            | (if self.evict { FLOW_EVICT } else { 0 })
    }

    fn bits(self) -> u8 {
        u8::from(self.decode)
            | u8::from(self.gemv) << 1
            | u8::from(self.prefetch) << 2
            | u8::from(self.evict) << 3
    }

    fn from_bits(b: u8) -> Self {
        EarlyLaunch {
            decode: b & 1 != 0,
            gemv: b & 2 != 0,
            prefetch: b & 4 != 0,
            evict: b & 8 != 0,
        }
    }
}

/// The process's setting: `KVFLEET_EARLY_LAUNCH` when first asked (an unknown word is logged
/// and the default kept), or what [`set_early_launch`] stored since.
pub fn early_launch() -> EarlyLaunch {
    let b = EARLY.load(Ordering::Relaxed);
    if b != UNREAD {
        return EarlyLaunch::from_bits(b);
    }
    let e = match std::env::var(EARLY_LAUNCH_ENV) {
        Ok(v) => EarlyLaunch::parse(&v).unwrap_or_else(|error| {
            tracing::warn!(%error, "keeping the default early launches");
            EarlyLaunch::DEFAULT
        }),
        Err(_) => EarlyLaunch::DEFAULT,
    };
    // A set_early_launch racing this first read wins.
    let _ = EARLY.compare_exchange(UNREAD, e.bits(), Ordering::Relaxed, Ordering::Relaxed);
    EarlyLaunch::from_bits(EARLY.load(Ordering::Relaxed))
}

/// Sets the early launches of the kernels launched from now on (tests and benchmarks that
/// compare settings in one process).
pub fn set_early_launch(e: EarlyLaunch) {
    EARLY.store(e.bits(), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_launch_words_set_their_switches_and_unknown_words_are_named() {
        assert_eq!(EarlyLaunch::parse("all"), Ok(EarlyLaunch::ALL));
        assert_eq!(EarlyLaunch::parse(" none "), Ok(EarlyLaunch::NONE));
        assert_eq!(EarlyLaunch::parse(""), Ok(EarlyLaunch::DEFAULT));
        let e = EarlyLaunch::parse("decode, prefetch").unwrap();
        assert!(e.decode && e.prefetch && !e.gemv && !e.evict);
        assert_eq!(e.gemv_flow(), FLOW_PREFETCH);
        assert_eq!(
            EarlyLaunch::ALL.gemv_flow(),
            FLOW_TRIGGER | FLOW_PREFETCH | FLOW_EVICT
        );
        let err = EarlyLaunch::parse("decode,graph").unwrap_err();
        assert!(
            err.contains("\"graph\"") && err.contains(EARLY_LAUNCH_ENV),
            "{err}"
        );
        for b in 0..16u8 {
            assert_eq!(EarlyLaunch::from_bits(b).bits(), b);
        }
    }
}

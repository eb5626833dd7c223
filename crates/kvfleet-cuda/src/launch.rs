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
//! cudarc's launch builder has no launch attributes, hence [`Launch`]: it collects the arguments
//! the same way (device addresses of borrowed buffers, scalars) and launches raw.

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

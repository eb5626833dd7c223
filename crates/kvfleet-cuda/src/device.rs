//! Device side: the context, loaded modules per specialisation, KV pools, step buffers and the
//! launches. A step is one launch sequence (attention, then merge when any request was split and
//! the attention launch did not merge it itself), all on one stream with no host
//! synchronisation, so it can be captured in a CUDA graph.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig};

use super::launch::{self, Launch};
use super::nvrtc::{self, PtxCache};
use super::plan::{CsrBatch, LaunchPlan};
use super::scenarios::Scenario;
use super::spec::{Arch, KernelSpec, KvDtype, THREADS};
use super::{driver_err, CudaError};

/// Whether the CUDA driver library can be loaded (cudarc panics on first use otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only tries `dlopen` on libcuda candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// One GPU: context, stream, target architecture and compiled kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub arch: Arch,
    pub name: String,
    pub num_sms: usize,
    pub capability: (i32, i32),
    ptx: PtxCache,
    loaded: Mutex<HashMap<KernelSpec, Arc<Kernels>>>,
    /// What [`Kernels::fused_merge`] starts at for specialisations loaded from now on
    /// ([`Gpu::set_fused_merge`]).
    fused_merge: AtomicBool,
}

/// The kernels of one specialisation, loaded on a device.
pub struct Kernels {
    pub spec: KernelSpec,
    attention: CudaFunction,
    /// The decode-only entry (steps without prefill items): fewer registers, more CTAs per SM.
    decode: CudaFunction,
    merge: CudaFunction,
    append: CudaFunction,
    /// Whether decode-only steps merge split-KV partials in `kvf_decode`'s last CTA of each job
    /// rather than in a `kvf_merge` launch (`GpuTuning::fused_merge`; [`Gpu::set_fused_merge`]).
    fused_merge: AtomicBool,
    /// Launch with programmatic dependent launch (sm_90 and later, [`launch`]).
    pdl: bool,
    /// Seconds NVRTC took for this specialisation.
    pub compile_seconds: f64,
}

impl Gpu {
    /// Opens device `ordinal`. Fails with a clear error without a driver, NVRTC, or on a GPU
    /// older than sm_80.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::DriverMissing);
        }
        nvrtc::toolchain()?;
        let ctx = CudaContext::new(ordinal).map_err(driver_err("creating the context"))?;
        let capability = ctx
            .compute_capability()
            .map_err(driver_err("reading the compute capability"))?;
        let arch = Arch::for_capability(capability.0, capability.1).ok_or(CudaError::UnsupportedDevice {
            major: capability.0,
            minor: capability.1,
        })?;
        let name = ctx.name().map_err(driver_err("reading the device name"))?;
        let num_sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_err("reading the SM count"))? as usize;
        let stream = ctx.default_stream();
        Ok(Self {
            ctx,
            stream,
            arch,
            name,
            num_sms,
            capability,
            ptx: PtxCache::new(),
            loaded: Mutex::new(HashMap::new()),
            fused_merge: AtomicBool::new(true),
        })
    }

    /// Whether split decode steps merge in `kvf_decode` (the default) or in a `kvf_merge`
    /// launch, for every specialisation loaded and to be loaded (`GpuTuning::fused_merge`).
    pub fn set_fused_merge(&self, on: bool) -> Result<(), CudaError> {
        self.fused_merge.store(on, Ordering::Relaxed);
        for k in self.loaded.lock().map_err(|_| CudaError::Poisoned)?.values() {
            k.set_fused_merge(on);
        }
        Ok(())
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Compiles (once) and loads the kernels of `spec` for this device.
    pub fn kernels(&self, spec: &KernelSpec) -> Result<Arc<Kernels>, CudaError> {
        if let Some(k) = self.loaded.lock().map_err(|_| CudaError::Poisoned)?.get(spec) {
            return Ok(k.clone());
        }
        let compiled = self.ptx.get_or_compile(spec, self.arch)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(compiled.ptx.to_string()))
            .map_err(driver_err("loading the PTX module"))?;
        let f = |name: &'static str| module.load_function(name).map_err(driver_err("finding a kernel"));
        let attention = f("kvf_attention")?;
        let decode = f("kvf_decode")?;
        for (k, bytes) in [
            (&attention, spec.smem_bytes()),
            (&decode, spec.decode_smem_bytes()),
        ] {
            k.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(driver_err("raising the shared-memory limit"))?;
        }
        let k = Arc::new(Kernels {
            spec: *spec,
            attention,
            decode,
            merge: f("kvf_merge")?,
            append: f("kvf_append")?,
            fused_merge: AtomicBool::new(self.fused_merge.load(Ordering::Relaxed)),
            pdl: launch::pdl(self.arch),
            compile_seconds: compiled.compile_time.as_secs_f64(),
        });
        self.loaded
            .lock()
            .map_err(|_| CudaError::Poisoned)?
            .insert(*spec, k.clone());
        Ok(k)
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        if host.is_empty() {
            // zero-length allocations are not allowed; kernels never read these
            // SAFETY: a one-element buffer the kernels never read before writing.
            return unsafe { self.stream.alloc::<T>(1) }.map_err(driver_err("allocating"));
        }
        self.stream
            .clone_htod(host)
            .map_err(driver_err("copying to the device"))
    }

    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.stream
            .clone_dtoh(dev)
            .map_err(driver_err("copying to the host"))
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(driver_err("synchronising the stream"))
    }
}

/// One layer's KV pools on the device, in the layout of the contract (see `kernels/attention/common.cuh`).
pub struct KvLayer {
    pub dtype: KvDtype,
    pub num_blocks: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub page: usize,
    pub k: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
    /// nvfp4 block scales (one-byte placeholders for other dtypes).
    pub k_block_scales: CudaSlice<u8>,
    pub v_block_scales: CudaSlice<u8>,
    /// fp8 per-tensor scale or nvfp4 global scale (1.0 for 16-bit dtypes).
    pub k_scale: f32,
    pub v_scale: f32,
}

impl KvLayer {
    /// Bytes of one pool (K or V) without block scales.
    pub fn pool_bytes(
        dtype: KvDtype,
        num_blocks: usize,
        kv_heads: usize,
        page: usize,
        head_dim: usize,
    ) -> usize {
        num_blocks * kv_heads * page * dtype.data_bytes(head_dim)
    }

    /// Allocates zeroed pools.
    pub fn zeroed(
        gpu: &Gpu,
        dtype: KvDtype,
        num_blocks: usize,
        kv_heads: usize,
        page: usize,
        head_dim: usize,
    ) -> Result<Self, CudaError> {
        let bytes = Self::pool_bytes(dtype, num_blocks, kv_heads, page, head_dim);
        let sbytes = (num_blocks * kv_heads * page * dtype.scale_bytes(head_dim)).max(1);
        let z = |n| {
            gpu.stream
                .alloc_zeros::<u8>(n)
                .map_err(driver_err("allocating the KV pool"))
        };
        Ok(Self {
            dtype,
            num_blocks,
            kv_heads,
            head_dim,
            page,
            k: z(bytes)?,
            v: z(bytes)?,
            k_block_scales: z(sbytes)?,
            v_block_scales: z(sbytes)?,
            k_scale: 1.0,
            v_scale: 1.0,
        })
    }

    /// Builds pools from host bytes laid out as the contract says.
    #[allow(clippy::too_many_arguments)]
    pub fn from_host(
        gpu: &Gpu,
        dtype: KvDtype,
        num_blocks: usize,
        kv_heads: usize,
        page: usize,
        head_dim: usize,
        k: &[u8],
        v: &[u8],
        k_block_scales: &[u8],
        v_block_scales: &[u8],
        k_scale: f32,
        v_scale: f32,
    ) -> Result<Self, CudaError> {
        let bytes = Self::pool_bytes(dtype, num_blocks, kv_heads, page, head_dim);
        let sbytes = num_blocks * kv_heads * page * dtype.scale_bytes(head_dim);
        if k.len() != bytes
            || v.len() != bytes
            || k_block_scales.len() != sbytes
            || v_block_scales.len() != sbytes
        {
            return Err(CudaError::InvalidBatch(format!(
                "KV pool sizes: want {bytes} bytes per pool and {sbytes} scale bytes, got {} / {} / {} / {}",
                k.len(),
                v.len(),
                k_block_scales.len(),
                v_block_scales.len()
            )));
        }
        Ok(Self {
            dtype,
            num_blocks,
            kv_heads,
            head_dim,
            page,
            k: gpu.upload(k)?,
            v: gpu.upload(v)?,
            k_block_scales: gpu.upload(k_block_scales)?,
            v_block_scales: gpu.upload(v_block_scales)?,
            k_scale,
            v_scale,
        })
    }

    /// The pools of a random [`Scenario`] (its spec's dtype, page and head size), scales and all.
    pub fn from_scenario(gpu: &Gpu, sc: &Scenario) -> Result<Self, CudaError> {
        Self::from_host(
            gpu,
            sc.spec.dtype,
            sc.num_blocks,
            sc.kv_heads,
            sc.spec.page.get(),
            sc.spec.head_dim.get(),
            &sc.k,
            &sc.v,
            &sc.k_block_scales,
            &sc.v_block_scales,
            sc.k_scale,
            sc.v_scale,
        )
    }
}

/// A planned step uploaded: CSR arrays, work items, merge jobs and split-KV scratch.
/// The device side of one step's batch and plan. The index arrays (the CSR batch, the work
/// items, the merge jobs) sit in one buffer and go up in one copy; [`StepBuffers::refill`]
/// reuses the buffers of the previous step, so a decode step allocates nothing.
pub struct StepBuffers {
    /// qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_first_pos, items, merges; each
    /// section starts at a multiple of [`SECTION_ALIGN`] values.
    index: CudaSlice<i32>,
    /// Where each section starts in `index` (i32 elements).
    off: [usize; SECTIONS],
    /// The host staging of `index`, kept to reuse its allocation.
    host: Vec<i32>,
    partial_o: CudaSlice<f32>,
    partial_lse: CudaSlice<f32>,
    /// One counter per (merge job, KV head) for the merge in `kvf_decode`: zeroed when
    /// allocated and never again from the host. The kernel keeps them zero between launches (the
    /// last CTA of a job resets its counter), so the launches of every layer and step that use
    /// these buffers, one after the other on the stream, find them zero.
    merge_counters: CudaSlice<i32>,
    pub n_items: usize,
    pub n_prefill: usize,
    pub n_merges: usize,
    pub total_q: usize,
}

const SECTIONS: usize = 7;
// The sections of `StepBuffers::index`, in order.
const QO: usize = 0;
const KV_PTR: usize = 1;
const KV_IDX: usize = 2;
const KV_LAST: usize = 3;
const KV_FIRST: usize = 4;
const ITEMS: usize = 5;
const MERGES: usize = 6;
/// 64 bytes: the work items and merge jobs are read as 32- and 16-byte structs.
const SECTION_ALIGN: usize = 16;

impl StepBuffers {
    /// Validates the batch, then uploads it with its plan into new buffers.
    pub fn upload(
        gpu: &Gpu,
        spec: &KernelSpec,
        kv: &KvLayer,
        batch: &CsrBatch,
        plan: &LaunchPlan,
    ) -> Result<Self, CudaError> {
        let one = || {
            gpu.stream
                .alloc_zeros::<f32>(1)
                .map_err(driver_err("allocating step buffers"))
        };
        let mut sb = Self {
            index: gpu
                .stream
                .alloc_zeros::<i32>(1)
                .map_err(driver_err("allocating step buffers"))?,
            off: [0; SECTIONS],
            host: Vec::new(),
            partial_o: one()?,
            partial_lse: one()?,
            merge_counters: gpu
                .stream
                .alloc_zeros::<i32>(1)
                .map_err(driver_err("allocating step buffers"))?,
            n_items: 0,
            n_prefill: 0,
            n_merges: 0,
            total_q: 0,
        };
        sb.refill(gpu, spec, kv, batch, plan)?;
        Ok(sb)
    }

    /// Validates the batch, then uploads it with its plan, reusing these buffers where they are
    /// large enough (growing them otherwise): one host-to-device copy.
    pub fn refill(
        &mut self,
        gpu: &Gpu,
        spec: &KernelSpec,
        kv: &KvLayer,
        batch: &CsrBatch,
        plan: &LaunchPlan,
    ) -> Result<(), CudaError> {
        batch.validate(spec.page.get(), kv.num_blocks)?;
        let d = spec.head_dim.get();
        let items = plan.items_as_i32();
        let merges = plan.merges_as_i32();
        let csr: [&[u32]; 5] = [
            &batch.qo_indptr,
            &batch.kv_indptr,
            &batch.kv_indices,
            &batch.kv_last_page_len,
            &batch.kv_first_pos,
        ];
        self.host.clear();
        for i in 0..SECTIONS {
            self.off[i] = self.host.len();
            // The CSR arrays are `u32`, validated to fit the kernels' `int`.
            match (csr.get(i), i) {
                (Some(sec), _) => self.host.extend(sec.iter().map(|&x| x as i32)),
                (None, ITEMS) => self.host.extend_from_slice(&items),
                (None, _) => self.host.extend_from_slice(&merges),
            }
            let padded = self.host.len().next_multiple_of(SECTION_ALIGN);
            self.host.resize(padded, 0);
        }
        let n = self.host.len().max(1);
        if self.index.len() < n {
            // Room for growth: a decode batch's page list grows a page at a time.
            self.index = gpu
                .stream
                .alloc_zeros::<i32>(n + n / 2)
                .map_err(driver_err("allocating step indices"))?;
        }
        if !self.host.is_empty() {
            gpu.stream
                .memcpy_htod(&self.host, &mut self.index.slice_mut(..self.host.len()))
                .map_err(driver_err("copying step indices to the device"))?;
        }
        let slots = plan.n_slots.max(1);
        let (po, pl) = (
            slots * kv.kv_heads * spec.decode_rows() * d,
            slots * kv.kv_heads * spec.decode_rows(),
        );
        // Every slot a merge reads is written first by its item in the same step, so the
        // scratch is zeroed only when (re)allocated.
        if self.partial_o.len() < po {
            self.partial_o = gpu
                .stream
                .alloc_zeros::<f32>(po)
                .map_err(driver_err("allocating split-KV scratch"))?;
        }
        if self.partial_lse.len() < pl {
            self.partial_lse = gpu
                .stream
                .alloc_zeros::<f32>(pl)
                .map_err(driver_err("allocating split-KV scratch"))?;
        }
        // Grown only: a new buffer is zero, and the kernel leaves an old one zero.
        let counters = plan.merges.len() * kv.kv_heads;
        if self.merge_counters.len() < counters {
            self.merge_counters = gpu
                .stream
                .alloc_zeros::<i32>(counters)
                .map_err(driver_err("allocating split-KV merge counters"))?;
        }
        self.n_items = plan.items.len();
        self.n_prefill = plan.n_prefill;
        self.n_merges = plan.merges.len();
        self.total_q = batch.total_q();
        Ok(())
    }
}

fn check_layer(spec: &KernelSpec, kv: &KvLayer) -> Result<(), CudaError> {
    if kv.dtype != spec.dtype || kv.head_dim != spec.head_dim.get() || kv.page != spec.page.get() {
        return Err(CudaError::InvalidBatch(format!(
            "KV layer ({:?}, head_dim {}, page {}) does not match kernels {}",
            kv.dtype,
            kv.head_dim,
            kv.page,
            spec.key()
        )));
    }
    Ok(())
}

impl Kernels {
    /// Registers per thread, spilled (local) bytes per thread and resident CTAs per SM of the
    /// attention kernel at its shared-memory size (for benchmarks and tuning).
    pub fn attention_resources(&self, decode_only: bool) -> Result<(i32, i32, u32), CudaError> {
        let (f, smem) = if decode_only {
            (&self.decode, self.spec.decode_smem_bytes())
        } else {
            (&self.attention, self.spec.smem_bytes())
        };
        let regs = f.num_regs().map_err(driver_err("reading kernel attributes"))?;
        let local = f
            .local_size_bytes()
            .map_err(driver_err("reading kernel attributes"))?;
        let ctas = f
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)
            .map_err(driver_err("reading kernel occupancy"))?;
        Ok((regs, local, ctas))
    }

    /// Decode CTAs the device holds at once: `num_sms` x the decode kernel's occupancy (one per
    /// SM when the driver cannot say). [`super::plan::plan_step`] sizes its chunks by it.
    pub fn decode_slots(&self, num_sms: usize) -> usize {
        let per_sm = self
            .attention_resources(true)
            .map_or(1, |(_, _, ctas)| ctas as usize)
            .max(1);
        num_sms.max(1) * per_sm
    }

    /// Whether split decode steps merge in `kvf_decode` (the default; [`Gpu::set_fused_merge`]).
    pub fn fused_merge(&self) -> bool {
        self.fused_merge.load(Ordering::Relaxed)
    }

    /// Switches the merge of later decode-only steps between `kvf_decode` (`true`) and a
    /// `kvf_merge` launch, for tests and benchmarks that compare the two in one process.
    pub fn set_fused_merge(&self, on: bool) {
        self.fused_merge.store(on, Ordering::Relaxed);
    }

    /// One step of attention for every request of `step`: `q` and `o` are bf16 (as u16)
    /// `[total_q, kv_heads * group, head_dim]`. Launches attention, then merge when needed:
    /// a step without prefill items merges in `kvf_decode` unless [`Self::fused_merge`] is off.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        stream: &CudaStream,
        kv: &KvLayer,
        q: &CudaSlice<u16>,
        o: &mut CudaSlice<u16>,
        step: &mut StepBuffers,
        sm_scale: f32,
        window: i32,
    ) -> Result<(), CudaError> {
        check_layer(&self.spec, kv)?;
        let d = self.spec.head_dim.get();
        let q_heads = kv.kv_heads * self.spec.group.get();
        let need = step.total_q * q_heads * d;
        if q.len() < need || o.len() < need {
            return Err(CudaError::InvalidBatch(format!(
                "Q/O hold {} / {} values, step needs {need}",
                q.len(),
                o.len()
            )));
        }
        if self.spec.mask.sliding() && window <= 0 {
            return Err(CudaError::InvalidBatch(
                "sliding-window kernels need a window of at least 1".into(),
            ));
        }
        if step.n_items == 0 {
            return Ok(());
        }
        let n_prefill = step.n_prefill as i32;
        let decode_only = n_prefill == 0;
        let (kernel, smem) = if decode_only {
            (&self.decode, self.spec.decode_smem_bytes())
        } else {
            (&self.attention, self.spec.smem_bytes())
        };
        // The merge runs in `kvf_decode` only: prefill items are never split (plan_step), but
        // kvf_attention's register budget is the prefill path's, so mixed steps keep kvf_merge.
        let fuse = decode_only && step.n_merges > 0 && self.fused_merge();
        if fuse && step.merge_counters.len() < step.n_merges * kv.kv_heads {
            return Err(CudaError::InvalidBatch(format!(
                "{} merge counters for {} merge jobs x {} KV heads: plan the step for this layer's KV heads",
                step.merge_counters.len(),
                step.n_merges,
                kv.kv_heads
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (step.n_items as u32, kv.kv_heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut l = Launch::new(stream);
        let idx = l.hold(&step.index);
        let at = |sec: usize| idx + 4 * step.off[sec] as u64;
        l.addr(at(ITEMS))
            .i32(n_prefill)
            .ptr(q)
            .ptr_mut(&mut *o)
            .ptr(&kv.k)
            .ptr(&kv.v)
            .ptr(&kv.k_block_scales)
            .ptr(&kv.v_block_scales)
            .addr(at(QO))
            .addr(at(KV_PTR))
            .addr(at(KV_IDX))
            .addr(at(KV_LAST))
            .addr(at(KV_FIRST))
            .ptr_mut(&mut step.partial_o)
            .ptr_mut(&mut step.partial_lse)
            .f32(sm_scale)
            .f32(kv.k_scale)
            .f32(kv.v_scale)
            .i32(window);
        if decode_only {
            l.addr(at(MERGES));
            if fuse {
                l.ptr_mut(&mut step.merge_counters);
            } else {
                l.addr(0);
            }
        }
        // SAFETY: the argument list matches `kvf_attention`'s signature in
        // kernels/attention/entry.cu (pointers, then i32/f32 scalars, in order), and for
        // `kvf_decode` the same list plus its merge jobs and counters (null: no merge here).
        // Every pointer is a live device allocation of this context or a section of the step's
        // index buffer (borrowed by `hold`); the batch was validated (page ids < num_blocks,
        // lengths consistent), Q/O sizes were checked above, and partial buffers were sized
        // from the same plan. With counters, every split item names a merge job of the plan and
        // the counters cover jobs x KV heads (checked above); they are zero, as `refill`
        // allocates them and every launch that counts leaves them (its last CTA of each job
        // resets the job's counter), and no two launches count at once: they are passed as a
        // written buffer, which orders launches on one stream and cudarc's events across
        // streams. Both entries wait for the previous kernel first (PDL).
        unsafe { l.launch(kernel, cfg, self.pdl) }.map_err(driver_err("launching kvf_attention"))?;
        if step.n_merges > 0 && !fuse {
            let cfg = LaunchConfig {
                grid_dim: (step.n_merges as u32, kv.kv_heads as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut l = Launch::new(stream);
            let idx = l.hold(&step.index);
            let at = |sec: usize| idx + 4 * step.off[sec] as u64;
            l.addr(at(MERGES))
                .addr(at(QO))
                .ptr(&step.partial_o)
                .ptr(&step.partial_lse)
                .ptr_mut(&mut *o);
            // SAFETY: matches `kvf_merge`; merge jobs only name slots the plan allocated; it
            // waits for the attention kernel first (PDL).
            unsafe { l.launch(&self.merge, cfg, self.pdl) }.map_err(driver_err("launching kvf_merge"))?;
        }
        Ok(())
    }

    /// Appends `n_tokens` new K/V rows (bf16 `[n_tokens, kv_heads, head_dim]`) at cache slots
    /// `slots[i] = page * page_size + offset` (-1 skips a token), quantizing on write.
    #[allow(clippy::too_many_arguments)]
    pub fn append(
        &self,
        stream: &CudaStream,
        kv: &mut KvLayer,
        new_k: &CudaSlice<u16>,
        new_v: &CudaSlice<u16>,
        slots: &CudaSlice<i64>,
        n_tokens: usize,
        host_slots: &[i64],
    ) -> Result<(), CudaError> {
        check_layer(&self.spec, kv)?;
        let d = self.spec.head_dim.get();
        let need = n_tokens * kv.kv_heads * d;
        if new_k.len() < need || new_v.len() < need || slots.len() < n_tokens || host_slots.len() != n_tokens
        {
            return Err(CudaError::InvalidBatch(
                "append buffers are smaller than n_tokens".into(),
            ));
        }
        let cap = (kv.num_blocks * kv.page) as i64;
        if let Some(s) = host_slots.iter().find(|s| **s >= cap || **s < -1) {
            return Err(CudaError::InvalidBatch(format!(
                "slot {s} outside the pool of {cap} slots"
            )));
        }
        let total = n_tokens * kv.kv_heads * 2 * (d / 16);
        if total == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(THREADS as usize) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = n_tokens as i32;
        let heads = kv.kv_heads as i32;
        let mut l = Launch::new(stream);
        l.ptr(new_k)
            .ptr(new_v)
            .ptr(slots)
            .i32(n)
            .i32(heads)
            .ptr_mut(&mut kv.k)
            .ptr_mut(&mut kv.v)
            .ptr_mut(&mut kv.k_block_scales)
            .ptr_mut(&mut kv.v_block_scales)
            .f32(kv.k_scale)
            .f32(kv.v_scale);
        // SAFETY: matches `kvf_append`; slots were checked against the pool size above (the
        // device copy is the same array), buffer sizes were checked against n_tokens; it waits
        // for the previous kernel first (PDL).
        unsafe { l.launch(&self.append, cfg, self.pdl) }.map_err(driver_err("launching kvf_append"))?;
        Ok(())
    }
}

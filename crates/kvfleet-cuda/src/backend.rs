//! The engine's [`Backend`] on a GPU: KV pools of every layer on the device, activations in
//! bf16 device buffers, and per layer one append launch and one attention launch sequence
//! (attention, merge when split) of the kernels in `kernels/attention/`.
//!
//! `prepare` turns the engine's step plan into each layer group's CSR batch, plans the work
//! items once per (group, specialisation) and uploads them; every layer of the step reuses
//! them. Nothing synchronises the host until [`Backend::synchronize`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;

use super::device::{Gpu, Kernels, KvLayer, StepBuffers};
use super::plan::{plan_step, CsrBatch};
use super::spec::{GroupSize, HeadDim, KernelDtype, KernelSpec, KvDtype, Mask, PageSize};
use super::{driver_err, CudaError};
use kvfleet_engine::engine::backend::{Backend, BackendError};
use kvfleet_engine::engine::layout::{BackendConfig, LayerSpec, StepPlan};

fn dev(e: CudaError) -> BackendError {
    BackendError::Device(e.to_string())
}

/// The specialisation that runs `layer` with pages of `block_size` tokens.
pub fn spec_for(layer: &LayerSpec, block_size: usize) -> Result<KernelSpec, CudaError> {
    let a = &layer.attn;
    let unsupported = |what: String, supported: &'static str| CudaError::UnsupportedShape { what, supported };
    let head_dim = HeadDim::from_usize(a.head_dim)
        .ok_or_else(|| unsupported(format!("head_dim {}", a.head_dim), "64, 128, 256"))?;
    let page = PageSize::from_usize(block_size)
        .ok_or_else(|| unsupported(format!("blockSize {block_size}"), "16"))?;
    if a.kv_heads == 0 || a.q_heads % a.kv_heads != 0 {
        return Err(unsupported(
            format!("{} query heads over {} KV heads", a.q_heads, a.kv_heads),
            "query heads a multiple of KV heads",
        ));
    }
    let group = GroupSize::from_usize(a.group_size())
        .ok_or_else(|| unsupported(format!("GQA group size {}", a.group_size()), "1, 2, 4, 8"))?;
    let mask = match (a.causal, a.window) {
        (false, None) => Mask::Full,
        (true, None) => Mask::Causal,
        (true, Some(_)) => Mask::CausalSliding,
        (false, Some(_)) => {
            return Err(unsupported(
                "a sliding window without a causal mask".into(),
                "full, causal, causal + sliding window",
            ))
        }
    };
    Ok(KernelSpec {
        dtype: layer.dtype,
        head_dim,
        page,
        group,
        mask,
    })
}

/// The distinct specialisations `cfg` needs (what preflight compiles and self-tests).
pub fn specs_for(cfg: &BackendConfig) -> Result<Vec<(KernelSpec, usize)>, CudaError> {
    let mut v: Vec<(KernelSpec, usize)> = Vec::new();
    for l in &cfg.layers {
        let s = (spec_for(l, cfg.block_size)?, l.attn.kv_heads);
        if !v.contains(&s) {
            v.push(s);
        }
    }
    Ok(v)
}

struct Layer {
    kernels: Arc<Kernels>,
    kv: KvLayer,
    sm_scale: f32,
    window: i32,
    /// Decode CTAs resident at once on this device ([`Kernels::decode_slots`]).
    slots: usize,
}

/// One group's uploaded batch, per (specialisation, KV heads) that reads it.
struct GroupStep {
    slots: CudaSlice<i64>,
    host_slots: Vec<i64>,
    steps: HashMap<(KernelSpec, usize), StepBuffers>,
}

/// One layer's K/V cache as a kernel other than `kvf_append` writes a step's one token into it
/// ([`CudaBackend::single_token_append`]): row `(page * kv_heads + head) * page + offset` of
/// `head_dim` values, encoded as `kvf_append` encodes them (`dtype_code`: the kernels' `DT_*`).
pub struct AppendTarget<'a> {
    pub k: &'a mut CudaSlice<u8>,
    pub v: &'a mut CudaSlice<u8>,
    /// The step's slot (`page * page + offset`; -1: padding, nothing written), on the device.
    pub slot: &'a CudaSlice<i64>,
    pub dtype_code: i32,
    /// K/V heads stored (replicated ones included).
    pub kv_heads: usize,
    pub head_dim: usize,
    pub page: usize,
    /// Bytes of each pool (K or V), every page of it.
    pub pool_bytes: usize,
    pub k_scale: f32,
    pub v_scale: f32,
}

/// Attention on an NVIDIA GPU (sm_80 or newer) with kvfleet's kernels.
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    cfg: BackendConfig,
    layers: Vec<Layer>,
    groups: Vec<GroupStep>,
    prepared: bool,
}

impl CudaBackend {
    /// Copies `layer`'s pools back to the host in the engine's layout (tests compare them
    /// with the CPU backend's byte for byte; synchronises the stream).
    pub fn download_pools(
        &self,
        layer: usize,
    ) -> Result<kvfleet_engine::engine::cpu::LayerPools, BackendError> {
        let l = self.layers.get(layer).ok_or(BackendError::NoLayer {
            layer,
            layers: self.layers.len(),
        })?;
        let shape = self.cfg.pool_shape(layer)?;
        let dl = |s: &CudaSlice<u8>, len: usize| -> Result<Vec<u8>, BackendError> {
            let mut v = self.gpu.download(s).map_err(dev)?;
            v.truncate(len);
            Ok(v)
        };
        Ok(kvfleet_engine::engine::cpu::LayerPools {
            shape,
            k: dl(&l.kv.k, shape.data_len())?,
            v: dl(&l.kv.v, shape.data_len())?,
            k_scales: dl(&l.kv.k_block_scales, shape.scale_len())?,
            v_scales: dl(&l.kv.v_block_scales, shape.scale_len())?,
        })
    }

    /// Compiles the kernels `cfg` needs for this device (cached) and allocates zeroed pools.
    pub fn new(gpu: Arc<Gpu>, cfg: BackendConfig) -> Result<Self, BackendError> {
        cfg.check()?;
        let mut layers = Vec::with_capacity(cfg.layers.len());
        for (i, l) in cfg.layers.iter().enumerate() {
            let spec = spec_for(l, cfg.block_size).map_err(|e| BackendError::Unsupported(e.to_string()))?;
            let kernels = gpu.kernels(&spec).map_err(dev)?;
            let shape = cfg.pool_shape(i)?;
            let mut kv = KvLayer::zeroed(
                &gpu,
                spec.dtype,
                shape.num_blocks,
                shape.kv_heads,
                shape.block_size,
                shape.head_dim,
            )
            .map_err(dev)?;
            kv.k_scale = l.scales.k;
            kv.v_scale = l.scales.v;
            let slots = kernels.decode_slots(gpu.num_sms);
            layers.push(Layer {
                slots,
                kernels,
                kv,
                sm_scale: l.attn.scale(),
                window: l.attn.window.map_or(0, |w| w.min(i32::MAX as u32) as i32),
            });
        }
        Ok(Self {
            gpu,
            cfg,
            layers,
            groups: Vec::new(),
            prepared: false,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// For a prepared step of one token: where `layer`'s K/V for it go, for a kernel that
    /// writes them itself instead of the append launch (the one-token Q/K/V GEMV). `None` for a
    /// step of more tokens, or a cache whose encoding needs the append kernel (nvfp4's block
    /// scales span 16 values, more than the GEMV's warp owns).
    pub fn single_token_append(&mut self, layer: usize) -> Result<Option<AppendTarget<'_>>, BackendError> {
        self.layer_check(layer)?;
        let CudaBackend {
            cfg, layers, groups, ..
        } = self;
        let g = &groups[cfg.layers[layer].group];
        let [slot] = g.host_slots[..] else {
            return Ok(None);
        };
        let kv = &mut layers[layer].kv;
        let cap = (kv.num_blocks * kv.page) as i64;
        if !(-1..cap).contains(&slot) {
            return Err(BackendError::Plan(format!(
                "slot {slot} outside the pool of {cap} slots"
            )));
        }
        let code = match kv.dtype {
            KvDtype::Nvfp4 => return Ok(None),
            d @ (KvDtype::Bf16 | KvDtype::F16 | KvDtype::Fp8E4m3 | KvDtype::Fp8E5m2) => {
                d.kernel_code() as i32
            }
        };
        Ok(Some(AppendTarget {
            slot: &g.slots,
            dtype_code: code,
            kv_heads: kv.kv_heads,
            head_dim: kv.head_dim,
            page: kv.page,
            pool_bytes: KvLayer::pool_bytes(kv.dtype, kv.num_blocks, kv.kv_heads, kv.page, kv.head_dim),
            k_scale: kv.k_scale,
            v_scale: kv.v_scale,
            k: &mut kv.k,
            v: &mut kv.v,
        }))
    }

    fn layer_check(&self, layer: usize) -> Result<(), BackendError> {
        if !self.prepared {
            return Err(BackendError::NotPrepared);
        }
        if layer >= self.layers.len() {
            return Err(BackendError::NoLayer {
                layer,
                layers: self.layers.len(),
            });
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<u16>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn config(&self) -> &BackendConfig {
        &self.cfg
    }

    fn alloc(&mut self, elems: usize) -> Result<CudaSlice<u16>, BackendError> {
        self.gpu
            .stream()
            .alloc_zeros::<u16>(elems.max(1))
            .map_err(driver_err("allocating an activation buffer"))
            .map_err(dev)
    }

    fn upload(&mut self, src: &[f32], dst: &mut CudaSlice<u16>) -> Result<(), BackendError> {
        if dst.len() < src.len() {
            return Err(BackendError::BufferTooSmall {
                what: "destination",
                have: dst.len(),
                need: src.len(),
            });
        }
        if src.is_empty() {
            return Ok(());
        }
        let host: Vec<u16> = src.iter().map(|x| bf16::from_f32(*x).to_bits()).collect();
        let mut view = dst.slice_mut(..src.len());
        self.gpu
            .stream()
            .memcpy_htod(&host, &mut view)
            .map_err(driver_err("copying activations to the device"))
            .map_err(dev)
    }

    fn download(&mut self, src: &CudaSlice<u16>, dst: &mut [f32]) -> Result<(), BackendError> {
        if src.len() < dst.len() {
            return Err(BackendError::BufferTooSmall {
                what: "source",
                have: src.len(),
                need: dst.len(),
            });
        }
        if dst.is_empty() {
            return Ok(());
        }
        let mut host = vec![0u16; dst.len()];
        self.gpu
            .stream()
            .memcpy_dtoh(&src.slice(..dst.len()), &mut host)
            .map_err(driver_err("copying activations to the host"))
            .map_err(dev)?;
        self.gpu.synchronize().map_err(dev)?;
        for (d, h) in dst.iter_mut().zip(host) {
            *d = bf16::from_bits(h).to_f32();
        }
        Ok(())
    }

    fn prepare(&mut self, plan: &StepPlan) -> Result<(), BackendError> {
        plan.check(&self.cfg).map_err(BackendError::Plan)?;
        self.prepared = false;
        // The groups of the last step keep their device buffers: this step refills them (one
        // copy each for the slot mapping and for the step's indices), allocating only to grow.
        let mut old = std::mem::take(&mut self.groups).into_iter();
        let mut groups = Vec::with_capacity(plan.groups.len());
        for (g, t) in plan.groups.iter().enumerate() {
            // The engine's tables are the kernels' batch as they are (`CsrBatch`: u32 end to end).
            let batch = CsrBatch {
                qo_indptr: plan.qo_indptr.clone(),
                kv_indptr: t.kv_indptr.clone(),
                kv_indices: t.kv_indices.clone(),
                kv_last_page_len: t.kv_last_page_len.clone(),
                kv_first_pos: t.kv_first_pos.clone(),
            };
            let mut step = match old.next() {
                Some(s) => s,
                None => GroupStep {
                    slots: self.gpu.upload(&[0i64]).map_err(dev)?,
                    host_slots: Vec::new(),
                    steps: HashMap::new(),
                },
            };
            step.host_slots.clear();
            step.host_slots.extend(t.slot_mapping.iter().map(|&s| s as i64));
            let n = step.host_slots.len();
            if step.slots.len() < n {
                step.slots = self
                    .gpu
                    .stream()
                    .alloc_zeros::<i64>(n + n / 2)
                    .map_err(driver_err("allocating the slot mapping"))
                    .map_err(dev)?;
            }
            if n > 0 {
                self.gpu
                    .stream()
                    .memcpy_htod(&step.host_slots, &mut step.slots.slice_mut(..n))
                    .map_err(driver_err("copying the slot mapping"))
                    .map_err(dev)?;
            }
            // Several layers share a key; the first of them fills its buffers.
            let mut filled = HashSet::new();
            for (i, l) in self.cfg.layers.iter().enumerate() {
                let layer = &self.layers[i];
                let key = (layer.kernels.spec, layer.kv.kv_heads);
                if l.group != g || !filled.insert(key) {
                    continue;
                }
                let wp = plan_step(&batch, &key.0, self.gpu.arch, key.1, layer.slots);
                match step.steps.get_mut(&key) {
                    Some(sb) => sb
                        .refill(&self.gpu, &key.0, &layer.kv, &batch, &wp)
                        .map_err(dev)?,
                    None => {
                        let sb =
                            StepBuffers::upload(&self.gpu, &key.0, &layer.kv, &batch, &wp).map_err(dev)?;
                        step.steps.insert(key, sb);
                    }
                }
            }
            groups.push(step);
        }
        self.groups = groups;
        self.prepared = true;
        Ok(())
    }

    fn append_kv(
        &mut self,
        layer: usize,
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
    ) -> Result<(), BackendError> {
        self.layer_check(layer)?;
        let g = &self.groups[self.cfg.layers[layer].group];
        let l = &mut self.layers[layer];
        l.kernels
            .append(
                self.gpu.stream(),
                &mut l.kv,
                k,
                v,
                &g.slots,
                g.host_slots.len(),
                &g.host_slots,
            )
            .map_err(dev)
    }

    fn attention(
        &mut self,
        layer: usize,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), BackendError> {
        self.layer_check(layer)?;
        let g = &mut self.groups[self.cfg.layers[layer].group];
        let l = &self.layers[layer];
        let step = g
            .steps
            .get_mut(&(l.kernels.spec, l.kv.kv_heads))
            .ok_or_else(|| BackendError::Plan("no uploaded batch for this layer".into()))?;
        l.kernels
            .attention(self.gpu.stream(), &l.kv, q, out, step, l.sm_scale, l.window)
            .map_err(dev)
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.gpu.synchronize().map_err(dev)
    }
}

/// Compiles the specialisations `cfg` needs for `gpu`'s architecture and runs
/// [`super::selftest::run`] on each against the CPU reference (the worker's preflight on the
/// served geometry). Returns one summary line per specialisation, or what failed and where.
pub fn self_test(gpu: &Gpu, cfg: &BackendConfig, seed: u64) -> Result<Vec<String>, CudaError> {
    let specs = specs_for(cfg)?;
    let mut lines = Vec::new();
    for (i, (spec, kv_heads)) in specs.iter().enumerate() {
        let k = gpu.kernels(spec)?;
        let c = super::selftest::run(gpu, spec, *kv_heads, seed.wrapping_add(i as u64)).map_err(|error| {
            CudaError::SpecFailed {
                key: spec.key(),
                gpu: gpu.name.clone(),
                arch: gpu.arch.to_string(),
                error: Box::new(error),
            }
        })?;
        lines.push(format!(
            "{} for {}: compiled in {:.2} s, self-test max error {:.2e} (bound {:.2e})",
            spec.key(),
            gpu.arch,
            k.compile_seconds,
            c.max_gpu_err,
            c.bound
        ));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_engine::engine::layout::{KvDtype, KvScales, LayerAttn};

    fn layer(q: usize, kv: usize, d: usize, causal: bool, window: Option<u32>) -> LayerSpec {
        LayerSpec {
            group: 0,
            attn: LayerAttn {
                q_heads: q,
                kv_heads: kv,
                head_dim: d,
                causal,
                window,
                sm_scale: None,
            },
            dtype: KvDtype::Fp8E4m3,
            scales: KvScales::default(),
        }
    }

    #[test]
    fn engine_layers_map_to_their_kernel_specialisation() {
        let s = spec_for(&layer(32, 8, 128, true, Some(4096)), 16).unwrap();
        assert_eq!(s.key(), "attn/e4m3/d128/p16/g4/swa");
        assert_eq!(
            spec_for(&layer(8, 8, 64, false, None), 16).unwrap().key(),
            "attn/e4m3/d64/p16/g1/full"
        );
        assert_eq!(
            spec_for(&layer(16, 2, 256, true, None), 16).unwrap().key(),
            "attn/e4m3/d256/p16/g8/causal"
        );
    }

    #[test]
    fn shapes_outside_the_kernels_are_errors_that_name_what_is_supported() {
        for (l, bs, want) in [
            (layer(32, 8, 96, true, None), 16, "64, 128, 256"),
            (layer(32, 8, 128, true, None), 32, "16"),
            (layer(48, 8, 128, true, None), 16, "1, 2, 4, 8"),
            (layer(32, 8, 128, false, Some(128)), 16, "causal + sliding window"),
        ] {
            let e = spec_for(&l, bs).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn a_config_needs_each_distinct_specialisation_once() {
        let cfg = BackendConfig {
            block_size: 16,
            groups: vec![],
            layers: vec![
                layer(8, 2, 64, true, Some(256)),
                layer(8, 2, 64, true, None),
                layer(8, 2, 64, true, Some(256)),
                layer(8, 2, 64, true, None),
            ],
        };
        let keys: Vec<String> = specs_for(&cfg).unwrap().iter().map(|(s, _)| s.key()).collect();
        assert_eq!(keys, ["attn/e4m3/d64/p16/g4/swa", "attn/e4m3/d64/p16/g4/causal"]);
    }
}

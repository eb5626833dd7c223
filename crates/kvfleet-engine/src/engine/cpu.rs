//! The CPU backend: the layout contract on host memory, f32 arithmetic, online gather of
//! each request's KV head into a dequantized scratch and a two-pass softmax per row.

use super::backend::{Backend, BackendError};
use super::layout::{BackendConfig, PoolShape, StepPlan};
use super::quant;

/// K and V pools of one layer, byte-exact to the layout contract.
pub struct LayerPools {
    pub shape: PoolShape,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
    /// nvfp4 block scales (empty otherwise).
    pub k_scales: Vec<u8>,
    pub v_scales: Vec<u8>,
}

/// Attention on the host.
pub struct CpuBackend {
    cfg: BackendConfig,
    pools: Vec<LayerPools>,
    plan: StepPlan,
    prepared: bool,
    // Scratch: dequantized K and V of one (request, kv head), and scores of one row.
    ks: Vec<f32>,
    vs: Vec<f32>,
    scores: Vec<f32>,
}

impl CpuBackend {
    /// Allocates every layer's pools (zeroed).
    pub fn new(cfg: BackendConfig) -> Result<Self, BackendError> {
        cfg.check()?;
        let mut pools = Vec::with_capacity(cfg.layers.len());
        for layer in 0..cfg.layers.len() {
            let shape = cfg.pool_shape(layer)?;
            pools.push(LayerPools {
                shape,
                k: vec![0; shape.data_len()],
                v: vec![0; shape.data_len()],
                k_scales: vec![0; shape.scale_len()],
                v_scales: vec![0; shape.scale_len()],
            });
        }
        Ok(Self {
            cfg,
            pools,
            plan: StepPlan::default(),
            prepared: false,
            ks: Vec::new(),
            vs: Vec::new(),
            scores: Vec::new(),
        })
    }

    /// The pools of `layer` (tests and device self-tests compare them byte for byte).
    pub fn pools(&self, layer: usize) -> &LayerPools {
        &self.pools[layer]
    }

    fn layer_check(&self, layer: usize) -> Result<(), BackendError> {
        if !self.prepared {
            return Err(BackendError::NotPrepared);
        }
        if layer >= self.cfg.layers.len() {
            return Err(BackendError::NoLayer {
                layer,
                layers: self.cfg.layers.len(),
            });
        }
        Ok(())
    }
}

fn need(what: &'static str, have: usize, need: usize) -> Result<(), BackendError> {
    if have < need {
        return Err(BackendError::BufferTooSmall { what, have, need });
    }
    Ok(())
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn config(&self) -> &BackendConfig {
        &self.cfg
    }

    fn alloc(&mut self, elems: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; elems])
    }

    fn upload(&mut self, src: &[f32], dst: &mut Vec<f32>) -> Result<(), BackendError> {
        need("destination", dst.len(), src.len())?;
        dst[..src.len()].copy_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: &Vec<f32>, dst: &mut [f32]) -> Result<(), BackendError> {
        need("source", src.len(), dst.len())?;
        dst.copy_from_slice(&src[..dst.len()]);
        Ok(())
    }

    fn prepare(&mut self, plan: &StepPlan) -> Result<(), BackendError> {
        if cfg!(debug_assertions) {
            plan.check(&self.cfg).map_err(BackendError::Plan)?;
        }
        self.plan.clone_from(plan);
        self.prepared = true;
        Ok(())
    }

    fn append_kv(&mut self, layer: usize, k: &Vec<f32>, v: &Vec<f32>) -> Result<(), BackendError> {
        self.layer_check(layer)?;
        let spec = self.cfg.layers[layer];
        let table = &self.plan.groups[spec.group];
        let pools = &mut self.pools[layer];
        let sh = pools.shape;
        let (kvh, d, bs) = (sh.kv_heads, sh.head_dim, sh.block_size);
        let total_q = self.plan.total_q();
        need("k", k.len(), total_q * kvh * d)?;
        need("v", v.len(), total_q * kvh * d)?;
        let db = sh.dtype.data_bytes(d);
        let sb = sh.dtype.scale_bytes(d);
        for (t, &slot) in table.slot_mapping.iter().enumerate() {
            let (page, off) = (slot as usize / bs, slot as usize % bs);
            if page >= sh.num_blocks {
                return Err(BackendError::Plan(format!("slot {slot} outside the pool")));
            }
            for h in 0..kvh {
                let vi = sh.vector_index(page, h, off);
                let src = (t * kvh + h) * d;
                quant::encode_vector(
                    sh.dtype,
                    &k[src..src + d],
                    spec.scales.k,
                    &mut pools.k[vi * db..(vi + 1) * db],
                    &mut pools.k_scales[vi * sb..(vi + 1) * sb],
                );
                quant::encode_vector(
                    sh.dtype,
                    &v[src..src + d],
                    spec.scales.v,
                    &mut pools.v[vi * db..(vi + 1) * db],
                    &mut pools.v_scales[vi * sb..(vi + 1) * sb],
                );
            }
        }
        Ok(())
    }

    fn attention(&mut self, layer: usize, q: &Vec<f32>, out: &mut Vec<f32>) -> Result<(), BackendError> {
        self.layer_check(layer)?;
        let spec = self.cfg.layers[layer];
        let attn = spec.attn;
        let table = &self.plan.groups[spec.group];
        let pools = &self.pools[layer];
        let sh = pools.shape;
        let (qh, kvh, d, bs) = (attn.q_heads, attn.kv_heads, attn.head_dim, sh.block_size);
        let group = attn.group_size();
        let scale = attn.scale();
        let total_q = self.plan.total_q();
        need("q", q.len(), total_q * qh * d)?;
        need("out", out.len(), total_q * qh * d)?;
        let db = sh.dtype.data_bytes(d);
        let sb = sh.dtype.scale_bytes(d);
        for r in 0..self.plan.num_requests() {
            let q0 = self.plan.qo_indptr[r] as usize;
            let q_len = self.plan.qo_indptr[r + 1] as usize - q0;
            let pages = &table.kv_indices[table.kv_indptr[r] as usize..table.kv_indptr[r + 1] as usize];
            let first = table.kv_first_pos[r] as usize;
            let kv_len = table.kv_len(r, bs);
            let n = kv_len - first;
            self.ks.resize(n * d, 0.0);
            self.vs.resize(n * d, 0.0);
            for kh in 0..kvh {
                // Gather and dequantize this request's KV head once for all its query rows.
                for i in 0..n {
                    let page = pages[i / bs] as usize;
                    let vi = sh.vector_index(page, kh, i % bs);
                    quant::decode_vector(
                        sh.dtype,
                        &pools.k[vi * db..(vi + 1) * db],
                        &pools.k_scales[vi * sb..(vi + 1) * sb],
                        spec.scales.k,
                        &mut self.ks[i * d..(i + 1) * d],
                    );
                    quant::decode_vector(
                        sh.dtype,
                        &pools.v[vi * db..(vi + 1) * db],
                        &pools.v_scales[vi * sb..(vi + 1) * sb],
                        spec.scales.v,
                        &mut self.vs[i * d..(i + 1) * d],
                    );
                }
                for j in 0..q_len {
                    let q_pos = kv_len - q_len + j;
                    // Visible keys form one range of positions.
                    let hi = if attn.causal { q_pos + 1 } else { kv_len };
                    let lo = match attn.window {
                        Some(w) => first.max((q_pos + 1).saturating_sub(w as usize)),
                        None => first,
                    };
                    for h in kh * group..(kh + 1) * group {
                        let row = ((q0 + j) * qh + h) * d;
                        let qv = &q[row..row + d];
                        let o = &mut out[row..row + d];
                        o.fill(0.0);
                        if lo >= hi {
                            continue;
                        }
                        self.scores.clear();
                        let mut m = f32::NEG_INFINITY;
                        for i in lo - first..hi - first {
                            let kv = &self.ks[i * d..(i + 1) * d];
                            let s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                            m = m.max(s);
                            self.scores.push(s);
                        }
                        let mut z = 0f32;
                        for s in self.scores.iter_mut() {
                            *s = (*s - m).exp();
                            z += *s;
                        }
                        let inv = 1.0 / z;
                        for (idx, &p) in self.scores.iter().enumerate() {
                            let i = lo - first + idx;
                            let vv = &self.vs[i * d..(i + 1) * d];
                            let p = p * inv;
                            for (o, v) in o.iter_mut().zip(vv) {
                                *o += p * v;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::engine::backend::StepBuffers;
    use crate::engine::layout::{GroupSpec, GroupTable, KvDtype, KvScales, LayerAttn, LayerSpec};
    use crate::engine::{backend, oracle, quant};

    /// One request of a test batch: positions `first_pos .. kv_before` already cached,
    /// `q_len` new tokens.
    #[derive(Clone, Copy, Debug)]
    struct Req {
        first_pos: usize,
        kv_before: usize,
        q_len: usize,
    }

    struct Case {
        dtype: KvDtype,
        head_dim: usize,
        block_size: usize,
        gqa: usize,
        causal: bool,
        window: Option<u32>,
        seed: u64,
    }

    fn uniform(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-amp..amp)).collect()
    }

    /// Builds the plan of a step for `reqs` where new tokens are `pos_lo .. pos_hi` of each
    /// request, with pages from `page_of` (request, page index from position 0).
    fn plan_for(
        spans: &[(usize, usize, usize, usize)], // (request, first_pos, pos_lo, pos_hi)
        pages: &[Vec<u32>],
        bs: usize,
    ) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut t = GroupTable::default();
        plan.qo_indptr.push(0);
        t.kv_indptr.push(0);
        for (i, &(r, first, lo, hi)) in spans.iter().enumerate() {
            plan.qo_indptr.push(plan.qo_indptr[i] + (hi - lo) as u32);
            let first_page = first / bs;
            let last_page = (hi - 1) / bs;
            t.kv_indices.extend_from_slice(&pages[r][first_page..=last_page]);
            t.kv_indptr.push(t.kv_indices.len() as u32);
            t.kv_last_page_len.push((hi - last_page * bs) as u32);
            t.kv_first_pos.push(first as u32);
            for p in lo..hi {
                t.slot_mapping
                    .push(pages[r][p / bs] * bs as u32 + (p % bs) as u32);
            }
        }
        plan.groups.push(t);
        plan
    }

    /// Runs `reqs` through the CPU backend in two steps (history, then the new tokens) and
    /// checks both steps against the f64 oracle on dequantized K/V, and the quantization
    /// error against a bound derived from the data.
    fn check_case(case: &Case, reqs: &[Req]) {
        let mut rng = StdRng::seed_from_u64(case.seed);
        let kv_heads = 2;
        let q_heads = kv_heads * case.gqa;
        let d = case.head_dim;
        let bs = case.block_size;
        let total_pages: usize = reqs.iter().map(|r| (r.kv_before + r.q_len).div_ceil(bs)).sum();
        let num_blocks = total_pages + 3;
        // Scales that are not 1 exercise the scale path; nvfp4's global scale keeps the
        // block scales inside e4m3's normal range.
        let scales = match case.dtype {
            KvDtype::Fp8E4m3 | KvDtype::Fp8E5m2 => KvScales { k: 0.02, v: 0.015 },
            KvDtype::Nvfp4 => KvScales { k: 0.01, v: 0.005 },
            _ => KvScales::default(),
        };
        let attn = LayerAttn {
            q_heads,
            kv_heads,
            head_dim: d,
            causal: case.causal,
            window: case.window,
            sm_scale: None,
        };
        let cfg = BackendConfig {
            block_size: bs,
            groups: vec![GroupSpec {
                window: case.window,
                num_blocks,
            }],
            layers: vec![LayerSpec {
                group: 0,
                attn,
                dtype: case.dtype,
                scales,
            }],
        };
        let mut be = CpuBackend::new(cfg.clone()).unwrap();
        // Scattered, shuffled pages: position order is only in kv_indices.
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        ids.shuffle(&mut rng);
        let mut pages = Vec::new();
        let mut next = 0;
        for r in reqs {
            let n = (r.kv_before + r.q_len).div_ceil(bs);
            pages.push(ids[next..next + n].to_vec());
            next += n;
        }
        // Original K/V and Q for every position of every request.
        let per_tok_kv = kv_heads * d;
        let ks: Vec<Vec<f32>> = reqs
            .iter()
            .map(|r| uniform(&mut rng, (r.kv_before + r.q_len) * per_tok_kv, 2.0))
            .collect();
        let vs: Vec<Vec<f32>> = reqs
            .iter()
            .map(|r| uniform(&mut rng, (r.kv_before + r.q_len) * per_tok_kv, 2.0))
            .collect();
        let qs: Vec<Vec<f32>> = reqs
            .iter()
            .map(|r| uniform(&mut rng, (r.kv_before + r.q_len) * q_heads * d, 1.0))
            .collect();
        let roundtrip = |x: &[f32], scale: f32| -> Vec<f32> {
            let mut y = x.to_vec();
            for hv in y.chunks_mut(d) {
                quant::round_trip(case.dtype, hv, scale);
            }
            y
        };
        let kq: Vec<Vec<f32>> = ks.iter().map(|k| roundtrip(k, scales.k)).collect();
        let vq: Vec<Vec<f32>> = vs.iter().map(|v| roundtrip(v, scales.v)).collect();

        // Step 1 writes each request's history (requests without one sit out), step 2 the
        // new tokens.
        let steps: [Vec<(usize, usize, usize, usize)>; 2] = [
            reqs.iter()
                .enumerate()
                .filter(|(_, r)| r.kv_before > r.first_pos)
                .map(|(i, r)| (i, r.first_pos, r.first_pos, r.kv_before))
                .collect(),
            reqs.iter()
                .enumerate()
                .map(|(i, r)| (i, r.first_pos, r.kv_before, r.kv_before + r.q_len))
                .collect(),
        ];
        for spans in steps {
            if spans.is_empty() {
                continue;
            }
            let plan = plan_for(&spans, &pages, bs);
            plan.check(&cfg).unwrap();
            let gather = |src: &[Vec<f32>], width: usize| -> Vec<f32> {
                spans
                    .iter()
                    .flat_map(|&(r, _, lo, hi)| src[r][lo * width..hi * width].to_vec())
                    .collect()
            };
            let total_q = plan.total_q();
            let mut bufs = StepBuffers {
                q: gather(&qs, q_heads * d),
                k: gather(&ks, per_tok_kv),
                v: gather(&vs, per_tok_kv),
                out: vec![f32::NAN; total_q * q_heads * d],
            };
            backend::run_step(&mut be, &plan, &mut bufs).unwrap();

            let to64 = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let expected = |k: &[Vec<f32>], v: &[Vec<f32>]| {
                let parts: Vec<_> = spans
                    .iter()
                    .map(|&(r, first, lo, hi)| {
                        (
                            to64(&qs[r][lo * q_heads * d..hi * q_heads * d]),
                            to64(&k[r][first * per_tok_kv..hi * per_tok_kv]),
                            to64(&v[r][first * per_tok_kv..hi * per_tok_kv]),
                            lo,
                            first,
                        )
                    })
                    .collect();
                let refs: Vec<_> = parts
                    .iter()
                    .map(|(q, k, v, lo, first)| oracle::RefRequest {
                        q,
                        q_pos0: *lo,
                        k,
                        v,
                        first_pos: *first,
                    })
                    .collect();
                oracle::attention(&attn, &refs)
            };
            let ref_deq = expected(&kq, &vq);
            // f32 dot products of <= 256 terms and sums of <= ~100 weighted values of
            // magnitude <= 2: rounding stays near 1e-6; 1e-4 leaves a wide margin.
            let atol = 1e-4;
            let max_err = bufs
                .out
                .iter()
                .zip(&ref_deq)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0f64, f64::max);
            assert!(
                max_err <= atol,
                "{:?} {} d{} bs{} gqa{} causal {} window {:?}: max |cpu - ref| = {max_err}",
                reqs,
                case.dtype,
                d,
                bs,
                case.gqa,
                case.causal,
                case.window
            );

            // Quantization error: the oracle on original K/V differs from the oracle on
            // stored K/V by at most (e^{2 delta} - 1) max|v_q| + max|v - v_q|, where delta
            // bounds the score change (softmax weights move by a factor within e^{+-2 delta}).
            let ref_orig = expected(&ks, &vs);
            let scale = attn.scale() as f64;
            let mut delta = 0f64;
            let (mut vmax, mut dv) = (0f64, 0f64);
            for &(r, first, lo, hi) in &spans {
                for j in lo..hi {
                    for h in 0..q_heads {
                        let kh = h / case.gqa;
                        let qv = &qs[r][(j * q_heads + h) * d..][..d];
                        for p in first..hi {
                            let o = (p * kv_heads + kh) * d;
                            let s: f64 = (0..d)
                                .map(|e| (qv[e] as f64).abs() * (ks[r][o + e] - kq[r][o + e]).abs() as f64)
                                .sum();
                            delta = delta.max(s * scale);
                        }
                    }
                }
                for p in first..hi {
                    for e in 0..per_tok_kv {
                        let o = p * per_tok_kv + e;
                        vmax = vmax.max((vq[r][o] as f64).abs());
                        dv = dv.max((vs[r][o] - vq[r][o]).abs() as f64);
                    }
                }
            }
            let bound = ((2.0 * delta).exp() - 1.0) * vmax + dv + 1e-9;
            let qerr = ref_orig
                .iter()
                .zip(&ref_deq)
                .map(|(a, b)| (a - b).abs())
                .fold(0f64, f64::max);
            assert!(
                qerr <= bound,
                "{}: quantization error {qerr} over bound {bound}",
                case.dtype
            );
            // And the bound itself is what the dtype promises: per-element error within
            // the unit round-off (nvfp4: a sixth of the block max, see quant tests).
            let u = match case.dtype {
                KvDtype::Nvfp4 => 1.0 / 6.0 * (1.0 + 2f64.powi(-4)),
                dt => quant::unit_roundoff(dt) * 1.0001,
            };
            assert!(dv <= u * 2.0 + 1e-6, "{}: max |v - v_q| = {dv}", case.dtype);
        }
    }

    fn random_reqs(rng: &mut StdRng, bs: usize, window: Option<u32>) -> Vec<Req> {
        let b = rng.random_range(1..=4);
        (0..b)
            .map(|_| {
                let kv_before = rng.random_range(0..40usize);
                let q_len = if rng.random_bool(0.5) {
                    1
                } else {
                    rng.random_range(1..12)
                };
                // A sliding group may have freed the pages wholly out of the window.
                let first_pos = match window {
                    Some(w) if kv_before > 0 => {
                        let keep_from = (kv_before + 1).saturating_sub(w as usize);
                        (keep_from / bs) * bs
                    }
                    _ => 0,
                };
                Req {
                    first_pos,
                    kv_before,
                    q_len,
                }
            })
            .collect()
    }

    #[test]
    fn cpu_backend_matches_the_f64_reference_across_the_sweep() {
        let mut n = 0u64;
        for dtype in KvDtype::ALL {
            for head_dim in [64, 128, 256] {
                for block_size in [1, 16] {
                    n += 1;
                    let gqa = [1, 4, 8][(n % 3) as usize];
                    let causal = n % 4 != 0;
                    let window = if n % 2 == 0 {
                        Some(7 + (n % 5) as u32 * 4)
                    } else {
                        None
                    };
                    let case = Case {
                        dtype,
                        head_dim,
                        block_size,
                        gqa,
                        causal,
                        window,
                        seed: 0x5eed_0000 + n,
                    };
                    let mut rng = StdRng::seed_from_u64(case.seed ^ 0xa5a5);
                    let reqs = random_reqs(&mut rng, block_size, window);
                    check_case(&case, &reqs);
                }
            }
        }
    }

    #[test]
    fn every_gqa_ratio_and_mask_is_exact_on_bf16() {
        let mut seed = 1;
        for gqa in [1, 4, 8] {
            for causal in [true, false] {
                for window in [None, Some(5)] {
                    seed += 1;
                    let case = Case {
                        dtype: KvDtype::Bf16,
                        head_dim: 64,
                        block_size: 16,
                        gqa,
                        causal,
                        window,
                        seed,
                    };
                    let mut rng = StdRng::seed_from_u64(seed);
                    let reqs = random_reqs(&mut rng, 16, window);
                    check_case(&case, &reqs);
                }
            }
        }
    }

    #[test]
    fn kv_lengths_that_are_not_page_multiples_and_decode_rows_match() {
        let reqs = [
            Req {
                first_pos: 0,
                kv_before: 17,
                q_len: 1,
            },
            Req {
                first_pos: 0,
                kv_before: 0,
                q_len: 33,
            },
            Req {
                first_pos: 16,
                kv_before: 31,
                q_len: 2,
            },
            Req {
                first_pos: 0,
                kv_before: 15,
                q_len: 1,
            },
        ];
        for dtype in KvDtype::ALL {
            let case = Case {
                dtype,
                head_dim: 128,
                block_size: 16,
                gqa: 4,
                causal: true,
                window: Some(12),
                seed: 42,
            };
            check_case(&case, &reqs);
        }
    }

    #[test]
    fn a_step_without_prepare_is_an_error_not_a_panic() {
        let cfg = BackendConfig {
            block_size: 16,
            groups: vec![GroupSpec {
                window: None,
                num_blocks: 4,
            }],
            layers: vec![LayerSpec {
                group: 0,
                attn: LayerAttn {
                    q_heads: 2,
                    kv_heads: 1,
                    head_dim: 64,
                    causal: true,
                    window: None,
                    sm_scale: None,
                },
                dtype: KvDtype::Bf16,
                scales: KvScales::default(),
            }],
        };
        let mut be = CpuBackend::new(cfg).unwrap();
        let q = vec![0.0; 128];
        let mut o = vec![0.0; 128];
        assert!(matches!(
            be.attention(0, &q, &mut o),
            Err(BackendError::NotPrepared)
        ));
        assert!(matches!(
            CpuBackend::new(BackendConfig {
                block_size: 16,
                groups: vec![GroupSpec {
                    window: None,
                    num_blocks: 4
                }],
                layers: vec![LayerSpec {
                    group: 0,
                    attn: LayerAttn {
                        q_heads: 2,
                        kv_heads: 1,
                        head_dim: 72,
                        causal: true,
                        window: None,
                        sm_scale: None
                    },
                    dtype: KvDtype::Nvfp4,
                    scales: KvScales::default(),
                }],
            }),
            Err(BackendError::Layout(_))
        ));
    }
}

//! Random paged-attention scenarios, the f64 CPU reference and a naive low-precision one, and
//! FlashAttention's acceptance bound (`max|gpu - ref| <= 2 * max|lowp_naive - ref| + atol`,
//! hopper/test_util.py). Shared by the GPU tests, the benchmark and the worker's self-test. Pure.

use half::bf16;
use kvfleet_engine::engine::quant;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::plan::CsrBatch;
use super::spec::KernelSpec;

/// One request of a scenario.
#[derive(Clone, Copy, Debug)]
pub struct RequestShape {
    /// Query tokens this step (1 for decode).
    pub q_len: usize,
    /// Keys held (including this step's own tokens).
    pub n_keys: usize,
    /// Absolute position of the first held key.
    pub first_pos: usize,
}

/// Host copy of a batch, its KV pools and Q.
pub struct Scenario {
    pub spec: KernelSpec,
    pub kv_heads: usize,
    pub num_blocks: usize,
    pub batch: CsrBatch,
    /// bf16 bits `[total_q, q_heads, head_dim]`.
    pub q: Vec<u16>,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
    pub k_block_scales: Vec<u8>,
    pub v_block_scales: Vec<u8>,
    pub k_scale: f32,
    pub v_scale: f32,
    pub window: i32,
    pub sm_scale: f32,
}

fn normal(rng: &mut StdRng) -> f32 {
    // Box-Muller
    let u1: f64 = rng.random::<f64>().max(1e-12);
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

fn to_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

impl Scenario {
    /// Random scenario. Pages are a random permutation of the pool; `distinct_pages` caps how
    /// many distinct page contents are drawn (the rest repeat them) so large benchmark pools
    /// build quickly; `None` draws every page.
    pub fn random(
        spec: KernelSpec,
        kv_heads: usize,
        reqs: &[RequestShape],
        window: i32,
        seed: u64,
        distinct_pages: Option<usize>,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let page = spec.page.get();
        let d = spec.head_dim.get();
        let g = spec.group.get();
        let dtype = spec.dtype;
        let mut batch = CsrBatch {
            qo_indptr: vec![0],
            kv_indptr: vec![0],
            ..Default::default()
        };
        let total_pages: usize = reqs.iter().map(|r| r.n_keys.div_ceil(page)).sum();
        let num_blocks = total_pages + 3;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            let j = rng.random_range(0..=i);
            ids.swap(i, j);
        }
        let mut next = 0;
        for r in reqs {
            let pages = r.n_keys.div_ceil(page);
            batch.kv_indices.extend_from_slice(&ids[next..next + pages]);
            next += pages;
            batch
                .qo_indptr
                .push(batch.qo_indptr.last().copied().unwrap_or(0) + r.q_len as u32);
            batch.kv_indptr.push(batch.kv_indices.len() as u32);
            batch.kv_last_page_len.push(if pages == 0 {
                0
            } else {
                (r.n_keys - (pages - 1) * page) as u32
            });
            batch.kv_first_pos.push(r.first_pos as u32);
        }
        // Values: N(0,1) keys with a per-head offset (realistic: scores are not all near 0), N(0,1) values.
        let amax = 4.5f32;
        let k_scale = quant::suggested_scale(dtype, amax);
        let v_scale = quant::suggested_scale(dtype, amax);
        let rb = dtype.data_bytes(d);
        let sb = dtype.scale_bytes(d);
        let rows = num_blocks * kv_heads * page;
        let mut k = vec![0u8; rows * rb];
        let mut v = vec![0u8; rows * rb];
        let mut ks = vec![0u8; rows * sb];
        let mut vs = vec![0u8; rows * sb];
        let page_rows = kv_heads * page;
        let distinct = distinct_pages.unwrap_or(num_blocks).clamp(1, num_blocks);
        for p in 0..num_blocks {
            if p < distinct {
                for row in p * page_rows..(p + 1) * page_rows {
                    let kx: Vec<f32> = (0..d)
                        .map(|_| to_bf16((normal(&mut rng) * 1.2).clamp(-amax, amax)))
                        .collect();
                    let vx: Vec<f32> = (0..d)
                        .map(|_| to_bf16(normal(&mut rng).clamp(-amax, amax)))
                        .collect();
                    let (r, s) = (row * rb..(row + 1) * rb, row * sb..(row + 1) * sb);
                    quant::encode_vector_as_kernels(
                        dtype,
                        &kx,
                        k_scale,
                        &mut k[r.clone()],
                        &mut ks[s.clone()],
                    );
                    quant::encode_vector_as_kernels(dtype, &vx, v_scale, &mut v[r], &mut vs[s]);
                }
            } else {
                let src = p % distinct;
                let (a, b) = (src * page_rows, p * page_rows);
                k.copy_within(a * rb..(a + page_rows) * rb, b * rb);
                v.copy_within(a * rb..(a + page_rows) * rb, b * rb);
                ks.copy_within(a * sb..(a + page_rows) * sb, b * sb);
                vs.copy_within(a * sb..(a + page_rows) * sb, b * sb);
            }
        }
        let total_q = batch.total_q();
        let q = (0..total_q * kv_heads * g * d)
            .map(|_| bf16::from_f32(normal(&mut rng)).to_bits())
            .collect();
        Scenario {
            spec,
            kv_heads,
            num_blocks,
            batch,
            q,
            k,
            v,
            k_block_scales: ks,
            v_block_scales: vs,
            k_scale,
            v_scale,
            window,
            sm_scale: 1.0 / (d as f32).sqrt(),
        }
    }

    fn q_heads(&self) -> usize {
        self.kv_heads * self.spec.group.get()
    }

    /// Dequantized key or value row of held key `j` of request `r`, KV head `h`.
    fn kv_row(&self, value: bool, r: usize, j: usize, h: usize) -> Vec<f32> {
        let page = self.spec.page.get();
        let d = self.spec.head_dim.get();
        let dt = self.spec.dtype;
        let pid = self.batch.kv_indices[self.batch.kv_indptr[r] as usize + j / page] as usize;
        let row = (pid * self.kv_heads + h) * page + j % page;
        let (rb, sb) = (dt.data_bytes(d), dt.scale_bytes(d));
        let (pool, scales, scale) = if value {
            (&self.v, &self.v_block_scales, self.v_scale)
        } else {
            (&self.k, &self.k_block_scales, self.k_scale)
        };
        let mut out = vec![0f32; d];
        quant::decode_vector_as_kernels(
            dt,
            &pool[row * rb..(row + 1) * rb],
            &scales[row * sb..(row + 1) * sb],
            scale,
            &mut out,
        );
        out
    }

    /// f64 reference and naive bf16 reference for the rows of `requests` (all when `None`).
    /// `last_tokens` limits each request to its first token and its last `n` tokens (long
    /// prefills in benchmarks); `None` checks every token.
    pub fn references(&self, requests: Option<&[usize]>, last_tokens: Option<usize>) -> Vec<RowRef> {
        let d = self.spec.head_dim.get();
        let g = self.spec.group.get();
        let page = self.spec.page.get();
        let all: Vec<usize> = (0..self.batch.num_requests()).collect();
        let reqs = requests.unwrap_or(&all);
        let mut out = Vec::new();
        for &r in reqs {
            let q_len = self.batch.q_len(r);
            let n_keys = self.batch.num_keys(r, page);
            let first = self.batch.kv_first_pos[r] as i64;
            let qo0 = self.batch.qo_indptr[r] as usize;
            for h in 0..self.kv_heads {
                let keys: Vec<Vec<f32>> = (0..n_keys).map(|j| self.kv_row(false, r, j, h)).collect();
                let vals: Vec<Vec<f32>> = (0..n_keys).map(|j| self.kv_row(true, r, j, h)).collect();
                for t in 0..q_len {
                    if let Some(n) = last_tokens {
                        if t != 0 && t + n < q_len {
                            continue;
                        }
                    }
                    let qpos = first + n_keys as i64 - q_len as i64 + t as i64;
                    let visible: Vec<usize> = (0..n_keys)
                        .filter(|&j| {
                            let kpos = first + j as i64;
                            (!self.spec.mask.causal() || kpos <= qpos)
                                && (!self.spec.mask.sliding() || qpos - kpos < self.window as i64)
                        })
                        .collect();
                    for gi in 0..g {
                        let qh = h * g + gi;
                        let qoff = ((qo0 + t) * self.q_heads() + qh) * d;
                        let qv: Vec<f32> = self.q[qoff..qoff + d]
                            .iter()
                            .map(|b| bf16::from_bits(*b).to_f32())
                            .collect();
                        out.push(self.row_reference(r, t, qh, &qv, &keys, &vals, &visible));
                    }
                }
            }
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn row_reference(
        &self,
        r: usize,
        t: usize,
        qh: usize,
        qv: &[f32],
        keys: &[Vec<f32>],
        vals: &[Vec<f32>],
        visible: &[usize],
    ) -> RowRef {
        let d = qv.len();
        let scale = self.sm_scale as f64;
        // f64
        let s: Vec<f64> = visible
            .iter()
            .map(|&j| {
                keys[j]
                    .iter()
                    .zip(qv)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let l: f64 = p.iter().sum();
        let mut exact = vec![0f64; d];
        for (pi, &j) in p.iter().zip(visible) {
            for (e, vv) in exact.iter_mut().zip(&vals[j]) {
                *e += pi * *vv as f64;
            }
        }
        if l > 0.0 {
            exact.iter_mut().for_each(|e| *e /= l);
        }
        // naive low precision: bf16 S, bf16 P (softmax in f32), bf16 O, f32 accumulation
        let s16: Vec<f32> = visible
            .iter()
            .map(|&j| to_bf16(keys[j].iter().zip(qv).map(|(a, b)| a * b).sum::<f32>() * self.sm_scale))
            .collect();
        let m16 = s16.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e16: Vec<f32> = s16.iter().map(|x| (x - m16).exp()).collect();
        let l16: f32 = e16.iter().sum();
        let p16: Vec<f32> = e16.iter().map(|x| to_bf16(x / l16)).collect();
        let mut lowp = vec![0f32; d];
        for (pi, &j) in p16.iter().zip(visible) {
            for (e, vv) in lowp.iter_mut().zip(&vals[j]) {
                *e += pi * vv;
            }
        }
        let lowp = lowp.into_iter().map(to_bf16).collect();
        RowRef {
            request: r,
            token: t,
            q_head: qh,
            exact,
            lowp,
        }
    }

    /// Compares a GPU output (bf16 bits, `[total_q, q_heads, head_dim]`) with the references.
    pub fn check(&self, refs: &[RowRef], gpu: &[u16], atol: f64) -> Result<Comparison, String> {
        let d = self.spec.head_dim.get();
        let mut cmp = Comparison::default();
        for rr in refs {
            let off =
                ((self.batch.qo_indptr[rr.request] as usize + rr.token) * self.q_heads() + rr.q_head) * d;
            for i in 0..d {
                let gv = bf16::from_bits(gpu[off + i]).to_f32() as f64;
                if !gv.is_finite() {
                    return Err(format!(
                        "{}: request {} token {} head {} element {i} is {gv} (unwritten or NaN)",
                        self.spec.key(),
                        rr.request,
                        rr.token,
                        rr.q_head
                    ));
                }
                cmp.max_gpu_err = cmp.max_gpu_err.max((gv - rr.exact[i]).abs());
                cmp.max_lowp_err = cmp.max_lowp_err.max((rr.lowp[i] as f64 - rr.exact[i]).abs());
                cmp.max_ref = cmp.max_ref.max(rr.exact[i].abs());
            }
        }
        cmp.bound = 2.0 * cmp.max_lowp_err + atol;
        if cmp.max_gpu_err <= cmp.bound {
            Ok(cmp)
        } else {
            Err(format!(
                "{}: max|gpu-ref| {:.3e} > bound {:.3e} ({cmp:?})",
                self.spec.key(),
                cmp.max_gpu_err,
                cmp.bound
            ))
        }
    }
}

/// References for one output row.
#[derive(Clone, Debug)]
pub struct RowRef {
    pub request: usize,
    pub token: usize,
    pub q_head: usize,
    pub exact: Vec<f64>,
    pub lowp: Vec<f32>,
}

/// Errors found by [`Scenario::check`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Comparison {
    pub max_gpu_err: f64,
    pub max_lowp_err: f64,
    pub bound: f64,
    pub max_ref: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{GroupSize, HeadDim, KvDtype, Mask, PageSize};

    #[test]
    fn lowp_reference_is_close_but_not_equal_to_exact() {
        let spec = KernelSpec {
            dtype: KvDtype::Bf16,
            head_dim: HeadDim::D64,
            page: PageSize::P16,
            group: GroupSize::G2,
            mask: Mask::Causal,
        };
        let reqs = [RequestShape {
            q_len: 3,
            n_keys: 40,
            first_pos: 0,
        }];
        let sc = Scenario::random(spec, 2, &reqs, 0, 7, None);
        let refs = sc.references(None, None);
        assert_eq!(refs.len(), 3 * 4);
        let err = refs
            .iter()
            .flat_map(|r| r.exact.iter().zip(&r.lowp).map(|(a, b)| (a - *b as f64).abs()))
            .fold(0f64, f64::max);
        assert!(err > 0.0 && err < 0.05, "lowp error {err}");
        // a GPU output equal to the exact reference (rounded to bf16) passes the bound
        let mut out = vec![0u16; sc.q.len()];
        for r in &refs {
            let off = (r.token * 4 + r.q_head) * 64;
            for i in 0..64 {
                out[off + i] = bf16::from_f64(r.exact[i]).to_bits();
            }
        }
        sc.check(&refs, &out, 1e-3).unwrap();
        // and a wrong one (one element off by 0.5) fails it
        out[5] = bf16::from_f32(bf16::from_bits(out[5]).to_f32() + 0.5).to_bits();
        assert!(sc.check(&refs, &out, 1e-3).is_err());
    }
}

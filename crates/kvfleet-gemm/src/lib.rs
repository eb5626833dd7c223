//! kvfleet's CPU matrix product, `x · wᵀ` (weights `[out, in]` row-major): an AVX2 + FMA
//! kernel of four rows by two columns, split over column blocks across rayon threads, with a
//! portable fallback that rounds the same way. Each output element's additions are fixed (see
//! [`dot`]), so a row's result never depends on the batch around it.

use rayon::prelude::*;

/// Up to this many rows, [`matmul_t`] splits columns finely (for threads).
const SMALL_BATCH: usize = 4;

/// One output element of [`matmul_t`] the slow, portable way: eight lanes, lane `l` the fused
/// multiply-adds of elements `l, l + 8, ...` in order; the lanes summed in order; then the
/// fused multiply-adds of the `k mod 8` last elements. The AVX2 kernel makes exactly these
/// roundings (one FMA lane per lane), so both give the same bits.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let k = a.len().min(b.len());
    let full = k / 8 * 8;
    let mut acc = [0f32; 8];
    for (x, y) in a[..full].chunks_exact(8).zip(b[..full].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in a[full..k].iter().zip(&b[full..k]) {
        tail = x.mul_add(*y, tail);
    }
    acc.iter().fold(0f32, |s, v| s + v) + tail
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: each rayon task writes a disjoint column range of the output through this pointer.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    // A method call makes closures capture the whole (Send) wrapper, not the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[t, n] = x[t, k] · w[n, k]ᵀ`, split over column blocks of `n` across rayon threads.
///
/// Every output element is [`dot`] of its row and column, with the same additions in the same
/// order whatever `t` is: a row's result does not depend on the rows computed beside it. So a
/// request's logits are the same in a step of its own, in a step batched with others' decodes
/// and prefill chunks, and in a speculative step's verification rows, bit for bit, which is
/// what makes speculation on the CPU emit exactly the tokens it emits without (a GEMM library
/// sums in its own blocked order, different for the few-row and many-row paths). Four rows and
/// two columns at a time keep eight dot products in registers.
pub fn matmul_t(x: &[f32], t: usize, k: usize, w: &[f32], n: usize, out: &mut [f32]) {
    assert!(x.len() >= t * k && w.len() >= n * k && out.len() >= t * n);
    if t == 0 || n == 0 || k == 0 {
        out[..t * n].fill(0.0);
        return;
    }
    // Few rows: small column blocks, for threads; many: larger, so each x row block is reused
    // across more columns while the columns stay in cache.
    let cols = if t <= SMALL_BATCH { 16 } else { 64 };
    let optr = SendPtr(out.as_mut_ptr());
    w[..n * k].par_chunks(k * cols).enumerate().for_each(|(b, wb)| {
        let j0 = b * cols;
        // SAFETY: this task writes only columns j0..j0 + wb.len() / k of the t x n output
        // (disjoint per task), rows 0..t, all in bounds (asserted above).
        unsafe { columns(x, t, k, wb, j0, n, optr) }
    });
}

/// [`matmul_t`] for the columns of `wb` starting at `j0`: the AVX2 + FMA kernel where the CPU
/// has it, else [`dot`] (the same bits, slowly).
///
/// # Safety
/// `out` must point to a `t x n` row-major matrix whose columns `j0..j0 + wb.len() / k` no
/// other thread writes.
unsafe fn columns(x: &[f32], t: usize, k: usize, wb: &[f32], j0: usize, n: usize, out: SendPtr) {
    let o = out.get();
    let ncols = wb.len() / k;
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked); x holds t rows of k, wb ncols rows of k;
        // the caller's contract covers the output.
        unsafe { fma::columns(x.as_ptr(), t, k, wb.as_ptr(), ncols, o.add(j0), n) };
        return;
    }
    for i in 0..t {
        let xi = &x[i * k..(i + 1) * k];
        for j in 0..ncols {
            // SAFETY: i < t and j0 + j < n: within the caller's columns of the output.
            unsafe { *o.add(i * n + j0 + j) = dot(xi, &wb[j * k..(j + 1) * k]) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    /// `out[i * n + j] = dot(x row i, w row j)` for `t` rows and `ncols` columns, four rows by
    /// two columns a tile (eight accumulators of eight lanes in registers).
    ///
    /// # Safety
    /// AVX2 and FMA available; `x` holds `t * k`, `w` `ncols * k` floats; `out` has room for
    /// rows `0..t` of stride `n`, columns `0..ncols`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn columns(
        x: *const f32,
        t: usize,
        k: usize,
        w: *const f32,
        ncols: usize,
        out: *mut f32,
        n: usize,
    ) {
        let mut i = 0;
        while i < t {
            let r = (t - i).min(4);
            let mut j = 0;
            // One row: four columns a tile (four independent FMA chains, one x load for four).
            let width = if r == 1 { 4 } else { 2 };
            while j < ncols {
                let c = (ncols - j).min(width);
                // SAFETY: rows i..i + r < t and columns j..j + c < ncols are in bounds.
                unsafe {
                    let (xp, wp, op) = (x.add(i * k), w.add(j * k), out.add(i * n + j));
                    match (r, c) {
                        (4, 2) => tile::<4, 2>(xp, wp, k, op, n),
                        (4, _) => tile::<4, 1>(xp, wp, k, op, n),
                        (3, 2) => tile::<3, 2>(xp, wp, k, op, n),
                        (3, _) => tile::<3, 1>(xp, wp, k, op, n),
                        (2, 2) => tile::<2, 2>(xp, wp, k, op, n),
                        (2, _) => tile::<2, 1>(xp, wp, k, op, n),
                        (_, 4) => tile::<1, 4>(xp, wp, k, op, n),
                        (_, 3) => tile::<1, 3>(xp, wp, k, op, n),
                        (_, 2) => tile::<1, 2>(xp, wp, k, op, n),
                        _ => tile::<1, 1>(xp, wp, k, op, n),
                    }
                }
                j += c;
            }
            i += r;
        }
    }

    /// One `R x C` tile: lane `l` of each accumulator fuses the products of elements
    /// `l, l + 8, ...` in order, the lanes are summed in order, then the tail (as [`super::dot`]).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        out: *mut f32,
        n: usize,
    ) {
        // Row starts once; `wrapping_add` in the loop: no per-load checks in debug builds.
        let xr: [*const f32; R] = std::array::from_fn(|i| x.wrapping_add(i * k));
        let wr: [*const f32; C] = std::array::from_fn(|j| w.wrapping_add(j * k));
        let full = k / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut p = 0;
        while p < full {
            // SAFETY (whole block): p + 8 <= full <= k, within every row of x and w.
            unsafe {
                let mut wv = [_mm256_setzero_ps(); C];
                for (v, wj) in wv.iter_mut().zip(&wr) {
                    *v = _mm256_loadu_ps(wj.wrapping_add(p));
                }
                for (row, xi) in acc.iter_mut().zip(&xr) {
                    let xv = _mm256_loadu_ps(xi.wrapping_add(p));
                    for (a, wj) in row.iter_mut().zip(&wv) {
                        *a = _mm256_fmadd_ps(xv, *wj, *a);
                    }
                }
            }
            p += 8;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, a) in row.iter().enumerate() {
                let mut lanes = [0f32; 8];
                // SAFETY: lanes holds 8 floats; the tail reads elements full..k of rows i, j.
                unsafe {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
                    let mut tail = 0f32;
                    for q in full..k {
                        tail = (*xr[i].wrapping_add(q)).mul_add(*wr[j].wrapping_add(q), tail);
                    }
                    *out.wrapping_add(i * n + j) = lanes.iter().fold(0f32, |s, v| s + v) + tail;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// A row's product is the same bits alone, among 3, 4, 13 or 200 rows, and equal to `dot`.
    #[test]
    fn matmul_rows_do_not_depend_on_the_rows_beside_them() {
        use rand::{Rng, SeedableRng};
        let mut r = rand::rngs::StdRng::seed_from_u64(5);
        let (k, n) = (203, 37);
        let x: Vec<f32> = (0..200 * k).map(|_| r.random_range(-1.0..1.0)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| r.random_range(-1.0..1.0)).collect();
        let mut alone = vec![0f32; n];
        super::matmul_t(&x[7 * k..8 * k], 1, k, &w, n, &mut alone);
        for (j, v) in alone.iter().enumerate() {
            assert_eq!(
                v.to_bits(),
                super::dot(&x[7 * k..8 * k], &w[j * k..(j + 1) * k]).to_bits()
            );
        }
        for t in [3usize, 4, 13, 200] {
            let first = 8usize.saturating_sub(t).min(200 - t);
            let mut out = vec![0f32; t * n];
            super::matmul_t(&x[first * k..(first + t) * k], t, k, &w, n, &mut out);
            let row = &out[(7 - first) * n..(8 - first) * n];
            assert!(
                row.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()),
                "row 7 among {t} rows differs from row 7 alone"
            );
        }
    }

    /// Not a test: the GEMM's speed against matrixmultiply's on prefill- and decode-sized
    /// products (`cargo test --release -p kvfleet-engine matmul_speed -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement, run by hand"]
    fn matmul_speed() {
        for (t, k, n) in [
            (512, 576, 1536),
            (512, 1536, 576),
            (1, 576, 1536),
            (16, 576, 1536),
        ] {
            let x = vec![0.5f32; t * k];
            let w = vec![0.25f32; n * k];
            let mut out = vec![0f32; t * n];
            let reps = (2_000_000_000 / (t * k * n)).max(1);
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                super::matmul_t(&x, t, k, &w, n, &mut out);
            }
            let ours = t0.elapsed().as_secs_f64() / reps as f64;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                unsafe {
                    matrixmultiply::sgemm(
                        t,
                        k,
                        n,
                        1.0,
                        x.as_ptr(),
                        k as isize,
                        1,
                        w.as_ptr(),
                        1,
                        k as isize,
                        0.0,
                        out.as_mut_ptr(),
                        n as isize,
                        1,
                    );
                }
            }
            let lib = t0.elapsed().as_secs_f64() / reps as f64;
            let gf = |s: f64| 2.0 * (t * k * n) as f64 / s / 1e9;
            eprintln!(
                "t {t} k {k} n {n}: ours {:.2} GFLOP/s, matrixmultiply (1 thread) {:.2} GFLOP/s",
                gf(ours),
                gf(lib)
            );
        }
    }
}

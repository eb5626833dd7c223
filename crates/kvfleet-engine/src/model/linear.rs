//! The CPU linear op: a projection's weights in their format, and how to apply them. A family
//! file says "project x through W" ([`Linear::project`]) and never which format; a new format
//! is a variant of [`LinearQuantization`] and its arm here. The GPU's counterpart is
//! `kvfleet_cuda::gpu::linear::Linear`. The shape follows vLLM's linear methods
//! (vllm-project/vllm `model_executor/layers/linear.py`, `LinearMethodBase`: the method object
//! holds and applies a layer's weights; the model never names a kernel).

use std::borrow::Cow;
use std::sync::Arc;

use super::fp8::{fake_quantize_rows, quantize_rows};
use super::w4::{W4Method, W4Weight};
use kvfleet_gemm::matmul_t;

/// How the linear layers (Q, K, V, O, gate, up, down) compute. Embeddings, norms and the
/// LM head are never quantized (as in vLLM's `fp8` method, whose quantized layers are the
/// transformer blocks' linears: a low-precision head costs the most accuracy for the least
/// memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinearQuantization {
    /// f32 weights and activations as loaded.
    #[default]
    None,
    /// FP8 W8A8, simulated in f32: each weight row (output channel) quantized to e4m3 with
    /// its own scale at load, each linear layer's input quantized per token (row) before the
    /// GEMM, both with `scale = amax / 448` ([`super::fp8::fake_quantize_rows`]). The GEMM then
    /// computes what an FP8 GEMM with per-channel and per-token scales does, up to the f32
    /// summation order; this is the reference of the GPU's FP8 path.
    Fp8,
    /// 4-bit weights as a checkpoint stores them ([`super::w4`]), kept packed and dequantized
    /// a tile of rows at a time inside the product; activations stay f32.
    W4A16(W4Method),
}

/// One projection: its weight `[out, in]` row-major in f32 (as loaded, or the dequantized
/// values of its format) and the format that says how an input meets it.
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    w: Vec<f32>,
    cols: usize,
    format: LinearQuantization,
    /// A packed 4-bit weight (`w` is then empty); shared, so cloning a model copies no weights.
    packed: Option<Arc<W4Weight>>,
}

impl Linear {
    /// A projection of `cols` inputs with the f32 weight `w` (`[w.len() / cols, cols]`).
    pub fn new(w: Vec<f32>, cols: usize) -> Self {
        Linear {
            w,
            cols,
            format: LinearQuantization::None,
            packed: None,
        }
    }

    /// A projection whose weight stays packed in 4 bits ([`LinearQuantization::W4A16`]).
    pub fn from_w4(w: W4Weight) -> Self {
        Linear {
            w: Vec::new(),
            cols: w.cols,
            format: LinearQuantization::W4A16(w.method),
            packed: Some(Arc::new(w)),
        }
    }

    /// The packed 4-bit weight, when the format is [`LinearQuantization::W4A16`].
    pub fn w4(&self) -> Option<&W4Weight> {
        self.packed.as_deref()
    }

    /// Inputs (columns of the weight).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The same projection with its weight as f32 values (a packed weight dequantized; the
    /// others cloned): the reference a packed product is compared with.
    pub fn dequantized(&self) -> Linear {
        match &self.packed {
            Some(p) => Linear::new(p.dequantize(), self.cols),
            None => self.clone(),
        }
    }

    /// Outputs (rows of the weight).
    pub fn rows(&self) -> usize {
        match &self.packed {
            Some(p) => p.rows,
            None => self.w.len() / self.cols.max(1),
        }
    }

    /// The weight `[out, in]` as the products use it (FP8: the dequantized e4m3 values).
    /// Empty for a packed 4-bit weight ([`Linear::w4`] holds it; [`Linear::dequantized`]
    /// expands it).
    pub fn weight(&self) -> &[f32] {
        &self.w
    }

    pub fn format(&self) -> LinearQuantization {
        self.format
    }

    /// `out = x W^T` for the `t` rows of `x` (`[t, in]` into `[t, out]`).
    pub fn project(&self, x: &[f32], t: usize, out: &mut [f32]) {
        if let Some(p) = &self.packed {
            return p.project(x, t, out);
        }
        let x = self.input(x);
        matmul_t(&x, t, self.cols, &self.w, self.rows(), out);
    }

    /// What the product multiplies: `x` itself, or with FP8 each row quantized per token and
    /// dequantized (a copy; the unquantized path copies nothing).
    fn input<'a>(&self, x: &'a [f32]) -> Cow<'a, [f32]> {
        match self.format {
            LinearQuantization::None | LinearQuantization::W4A16(_) => Cow::Borrowed(x),
            LinearQuantization::Fp8 => {
                let mut q = x.to_vec();
                fake_quantize_rows(&mut q, self.cols);
                Cow::Owned(q)
            }
        }
    }

    /// Switches to FP8 W8A8 ([`LinearQuantization::Fp8`]): the weight becomes its
    /// per-output-channel e4m3 quantization, dequantized to f32 ([`quantize_rows`]). A second
    /// call does nothing, and so does a call on a packed 4-bit weight (quantized already: the
    /// worker refuses `--quantization fp8` for such a checkpoint).
    pub fn quantize_fp8(&mut self) {
        if matches!(
            self.format,
            LinearQuantization::Fp8 | LinearQuantization::W4A16(_)
        ) {
            return;
        }
        self.w = quantize_rows(&self.w, self.rows(), self.cols).dequantize();
        self.format = LinearQuantization::Fp8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_linear_equals_the_hand_computed_per_row_and_per_token_dequantized_product() {
        // Weight rows (output channels) with amax 2 and 6: scales 2/448 and 6/448. Row 0 maps to
        // 224, -448, 112 (all e4m3 codes, so exact); in row 1, 0.3 maps to 22.4, whose nearest
        // code is 22 (step 2 between 16 and 32). One scale for the whole matrix (6/448) would
        // round row 0 too (2 -> 149.3 -> 144), so the test tells per-row scales apart.
        let w = [1.0f32, -2.0, 0.5, 3.0, 0.3, -6.0];
        let mut lin = Linear::new(w.to_vec(), 3);
        lin.quantize_fp8();
        let want_w = [1.0, -2.0, 0.5, 3.0, 22.0 * 6.0 / 448.0, -6.0];
        for (a, b) in lin.weight().iter().zip(&want_w) {
            assert!((a - b).abs() < 1e-6, "{:?}", lin.weight());
        }
        // Token rows with amax 1 and 0.7 (scales 1/448 and 0.7/448): -0.13 maps to -58.24, nearest
        // code -60 (step 4 between 32 and 64); row 1 maps to 64, 128, -448 exactly.
        let x = [1.0f32, 0.5, -0.13, 0.1, 0.2, -0.7];
        let xq = lin.input(&x);
        let want_x = [1.0, 0.5, -60.0 / 448.0, 0.1, 0.2, -0.7];
        for (a, b) in xq.iter().zip(&want_x) {
            assert!((a - b).abs() < 1e-6, "{xq:?}");
        }
        let mut out = [0f32; 4];
        lin.project(&x, 2, &mut out);
        for i in 0..2 {
            for j in 0..2 {
                let want: f32 = (0..3).map(|p| want_x[i * 3 + p] * want_w[j * 3 + p]).sum();
                assert!(
                    (out[i * 2 + j] - want).abs() < 1e-5,
                    "({i}, {j}): {} vs {want}",
                    out[i * 2 + j]
                );
            }
        }
        // Unquantized, the input is passed through, not copied.
        assert!(matches!(Linear::new(w.to_vec(), 3).input(&x), Cow::Borrowed(_)));
        let again = {
            let mut a = lin.clone();
            a.quantize_fp8();
            a
        };
        assert_eq!(again, lin, "a second call does nothing");
    }
}

//! The model's weights on the device: uploaded from the CPU model (bf16 matrices; norms,
//! biases and RoPE frequencies f32, Q/K/V and gate/up fused), or random ones made on the device.
//! With FP8 weights the four linear matrices of each layer are e4m3 with a scale a row
//! ([`Mat::Fp8`]): quantized on the host from the CPU model's weights, or on the device from the
//! random bf16 ones; the embeddings and the LM head stay bf16 ([`super::fp8`] says why).

use cudarc::driver::CudaSlice;
use half::bf16;
use kvfleet_engine::model::fp8::quantize_rows;
use kvfleet_engine::model::llama::{inv_freq, Llama, LlamaConfig};
use rayon::prelude::*;

use crate::device::Gpu;

use super::error::{drv, GpuError};
use super::kernels::ModelKernels;
use super::linear::{Linear, Mat};

/// One layer's tensors.
pub(super) struct LayerW {
    pub attn_norm: CudaSlice<f32>,
    /// `[qw + 2 kw, d]`: Q rows, then K rows, then V rows.
    pub wqkv: Linear,
    /// `[qw + 2 kw]` (zeros where the model has no bias for a projection).
    pub bqkv: Option<CudaSlice<f32>>,
    pub q_norm: Option<CudaSlice<f32>>,
    pub k_norm: Option<CudaSlice<f32>>,
    /// `[d, qw]`.
    pub wo: Linear,
    pub ffn_norm: CudaSlice<f32>,
    /// `[2 ff, d]`: gate rows, then up rows.
    pub wgu: Linear,
    /// `[d, ff]`.
    pub wdown: Linear,
    /// Gemma 3: RMSNorm weights of the attention and MLP outputs.
    pub post_attn_norm: Option<CudaSlice<f32>>,
    pub post_ffn_norm: Option<CudaSlice<f32>>,
}

impl LayerW {
    /// The Q and K norms, when the layer has both.
    pub fn qk_norm(&self) -> Option<(&CudaSlice<f32>, &CudaSlice<f32>)> {
        self.q_norm.as_ref().zip(self.k_norm.as_ref())
    }
}

pub(super) struct Weights {
    /// `[vocab, d]`.
    pub embed: CudaSlice<u16>,
    pub layers: Vec<LayerW>,
    pub out_norm: CudaSlice<f32>,
    /// `[vocab, d]`; `None` when tied to `embed`.
    pub lm_head: Option<CudaSlice<u16>>,
    /// `[rope_dims / 2]`.
    pub inv_freq: CudaSlice<f32>,
    /// Gemma 3: `[rope_dims / 2]` of the local layers (their own RoPE base).
    pub inv_freq_local: Option<CudaSlice<f32>>,
    /// Bytes of every tensor above ([`Weights::allocated`]).
    pub bytes: usize,
}

/// The factor folded into the Q norm's weights so that the attention kernels' `1 / sqrt(head_dim)`
/// becomes Gemma's `query_pre_attn_scalar ** -0.5` (1 when the two agree, as for 270M). RoPE is
/// linear, so scaling Q before it equals scaling it after.
fn gemma_q_scale(c: &LlamaConfig) -> f32 {
    c.gemma3
        .as_ref()
        .map_or(1.0, |g| g.query_scale * (c.head_dim as f32).sqrt())
}

/// The local layers' inverse frequencies (Gemma 3's own RoPE base), `None` for other models.
fn gemma_inv_freq_local(c: &LlamaConfig) -> Option<Vec<f32>> {
    c.gemma3.as_ref().map(|g| {
        let mut local = c.clone();
        local.rope_theta = g.rope_theta_local;
        inv_freq(&local, None)
    })
}

pub(super) fn to_bf16(parts: &[&[f32]]) -> Vec<u16> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        let start = out.len();
        out.resize(start + p.len(), 0);
        out[start..]
            .par_iter_mut()
            .zip(p.par_iter())
            .for_each(|(o, x)| *o = bf16::from_f32(*x).to_bits());
    }
    out
}

fn upload_f32(gpu: &Gpu, v: &[f32]) -> Result<CudaSlice<f32>, GpuError> {
    Ok(gpu.upload(v)?)
}

/// Rows per task when quantizing on the host.
const QUANTIZE_ROWS: usize = 64;

/// The row-major matrix the parts make (rows of `cols`), uploaded as bf16 or, with `fp8`,
/// quantized per row on the host (`quantize_rows`, in parallel over blocks of rows).
fn upload_mat(gpu: &Gpu, parts: &[&[f32]], cols: usize, fp8: bool) -> Result<Linear, GpuError> {
    let rows = parts.iter().map(|p| p.len()).sum::<usize>() / cols.max(1);
    if !fp8 {
        return Ok(Linear::new(Mat::Bf16(gpu.upload(&to_bf16(parts))?), rows, cols));
    }
    let blocks: Vec<_> = parts
        .iter()
        .flat_map(|p| p.chunks(QUANTIZE_ROWS * cols))
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|b| quantize_rows(b, b.len() / cols, cols))
        .collect();
    let (mut q, mut scale) = (Vec::new(), Vec::new());
    for b in blocks {
        q.extend_from_slice(&b.data);
        scale.extend_from_slice(&b.scale);
    }
    let w = Mat::Fp8 {
        q: gpu.upload(&q)?,
        scale: gpu.upload(&scale)?,
    };
    Ok(Linear::new(w, rows, cols))
}

impl Weights {
    /// Converts the CPU model's f32 weights to bf16 (norms, biases and RoPE frequencies stay
    /// f32) and uploads them, fusing Q/K/V and gate/up.
    /// With `fp8`, the linear layers' matrices are quantized per row to e4m3.
    pub fn upload(gpu: &Gpu, m: &Llama, fp8: bool) -> Result<Self, GpuError> {
        let c = &m.config;
        let t = m.tensors();
        let (qw, kw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let up16 =
            |parts: &[&[f32]]| -> Result<CudaSlice<u16>, GpuError> { Ok(gpu.upload(&to_bf16(parts))?) };
        let mat = |parts: &[&[f32]], cols: usize| upload_mat(gpu, parts, cols, fp8);
        let embed = up16(&[t.embed])?;
        let lm_head = t.lm_head.map(|h| up16(&[h])).transpose()?;
        let mut layers = Vec::with_capacity(t.layers.len());
        for l in &t.layers {
            let bqkv = if l.bq.is_some() || l.bk.is_some() || l.bv.is_some() {
                let mut b = vec![0f32; qw + 2 * kw];
                for (src, off) in [(l.bq, 0), (l.bk, qw), (l.bv, qw + kw)] {
                    if let Some(src) = src {
                        b[off..off + src.len()].copy_from_slice(src);
                    }
                }
                Some(upload_f32(gpu, &b)?)
            } else {
                None
            };
            let q_scale = gemma_q_scale(c);
            layers.push(LayerW {
                attn_norm: upload_f32(gpu, l.attn_norm)?,
                wqkv: mat(&[l.wq, l.wk, l.wv], c.d_model)?,
                bqkv,
                q_norm: l
                    .q_norm
                    .map(|n| upload_f32(gpu, &n.iter().map(|w| w * q_scale).collect::<Vec<_>>()))
                    .transpose()?,
                k_norm: l.k_norm.map(|n| upload_f32(gpu, n)).transpose()?,
                wo: mat(&[l.wo], qw)?,
                ffn_norm: upload_f32(gpu, l.ffn_norm)?,
                wgu: mat(&[l.w_gate, l.w_up], c.d_model)?,
                wdown: mat(&[l.w_down], c.d_ff)?,
                post_attn_norm: l.post_attn_norm.map(|n| upload_f32(gpu, n)).transpose()?,
                post_ffn_norm: l.post_ffn_norm.map(|n| upload_f32(gpu, n)).transpose()?,
            });
        }
        Ok(Weights {
            embed,
            layers,
            out_norm: upload_f32(gpu, t.out_norm)?,
            lm_head,
            inv_freq: upload_f32(gpu, t.inv_freq)?,
            inv_freq_local: gemma_inv_freq_local(c).map(|f| upload_f32(gpu, &f)).transpose()?,
            bytes: 0,
        }
        .counted())
    }

    /// Random weights made on the device (uniform in ±1/sqrt(fan-in), like [`Llama::dummy`]
    /// but a different stream of numbers): for capacity and throughput of large geometries
    /// without building them on the host.
    /// With `fp8`, the linear layers' matrices are quantized per row on the device.
    pub fn random(
        gpu: &Gpu,
        k: &ModelKernels,
        c: &LlamaConfig,
        seed: u64,
        fp8: bool,
    ) -> Result<Self, GpuError> {
        let s = gpu.stream();
        let (d, ff) = (c.d_model, c.d_ff);
        let (qw, kw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut tensor = 0u64;
        let mut rand = |rows: usize, cols: usize| -> Result<CudaSlice<u16>, GpuError> {
            let mut buf = s
                .alloc_zeros::<u16>(rows * cols)
                .map_err(drv("allocating dummy weights"))?;
            tensor += 1;
            let a = 1.0 / (cols as f32).sqrt();
            k.fill_uniform(&mut buf, seed.wrapping_mul(0x1000_0001).wrapping_add(tensor), a)?;
            Ok(buf)
        };
        let embed = rand(c.vocab, d)?;
        let lm_head = if c.tied_embeddings {
            None
        } else {
            Some(rand(c.vocab, d)?)
        };
        let mut mat = |rows: usize, cols: usize| -> Result<Linear, GpuError> {
            let w = rand(rows, cols)?;
            let Some(f) = k.fp8.as_ref().filter(|_| fp8) else {
                return Ok(Linear::new(Mat::Bf16(w), rows, cols));
            };
            let mut q = s
                .alloc_zeros::<u8>(rows * cols)
                .map_err(drv("allocating dummy weights"))?;
            let mut scale = s
                .alloc_zeros::<f32>(rows)
                .map_err(drv("allocating dummy weights"))?;
            f.quantize_rows(s, &w, rows, cols, cols, &mut q, &mut scale)?;
            Ok(Linear::new(Mat::Fp8 { q, scale }, rows, cols))
        };
        let ones = |n: usize| upload_f32(gpu, &vec![1.0; n]);
        let mut layers = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            layers.push(LayerW {
                attn_norm: ones(d)?,
                wqkv: mat(qw + 2 * kw, d)?,
                bqkv: if c.attn_bias {
                    Some(upload_f32(gpu, &vec![0.0; qw + 2 * kw])?)
                } else {
                    None
                },
                q_norm: c.qk_norm.then(|| ones(c.head_dim)).transpose()?,
                k_norm: c.qk_norm.then(|| ones(c.head_dim)).transpose()?,
                wo: mat(d, qw)?,
                ffn_norm: ones(d)?,
                wgu: mat(2 * ff, d)?,
                wdown: mat(d, ff)?,
                post_attn_norm: c.gemma3.as_ref().map(|_| ones(d)).transpose()?,
                post_ffn_norm: c.gemma3.as_ref().map(|_| ones(d)).transpose()?,
            });
        }
        Ok(Weights {
            embed,
            layers,
            out_norm: ones(d)?,
            lm_head,
            inv_freq: upload_f32(gpu, &inv_freq(c, None))?,
            inv_freq_local: gemma_inv_freq_local(c).map(|f| upload_f32(gpu, &f)).transpose()?,
            bytes: 0,
        }
        .counted())
    }

    /// `self` with [`Weights::bytes`] set to the bytes of every tensor it holds.
    fn counted(mut self) -> Self {
        fn f(t: &CudaSlice<f32>) -> usize {
            4 * t.len()
        }
        fn h(t: &CudaSlice<u16>) -> usize {
            2 * t.len()
        }
        let of = |t: &Option<CudaSlice<f32>>| t.as_ref().map_or(0, f);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.wqkv.bytes()
                    + l.wo.bytes()
                    + l.wgu.bytes()
                    + l.wdown.bytes()
                    + f(&l.attn_norm)
                    + f(&l.ffn_norm)
                    + of(&l.bqkv)
                    + of(&l.q_norm)
                    + of(&l.k_norm)
                    + of(&l.post_attn_norm)
                    + of(&l.post_ffn_norm)
            })
            .sum();
        self.bytes = layers
            + h(&self.embed)
            + self.lm_head.as_ref().map_or(0, h)
            + f(&self.out_norm)
            + f(&self.inv_freq)
            + of(&self.inv_freq_local);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_query_scale_is_folded_only_where_it_differs_from_the_kernels() {
        let mut c = LlamaConfig::gemma3(18, 640, 2048, 262_144, 512);
        assert_eq!(gemma_q_scale(&c), 1.0, "270M: query_pre_attn_scalar = head_dim");
        c.gemma3.as_mut().unwrap().query_scale = 1.0 / 144f32.sqrt();
        assert!((gemma_q_scale(&c) - 16.0 / 12.0).abs() < 1e-6);
        assert_eq!(gemma_q_scale(&LlamaConfig::llama(2, 64, 96, 4, 2, 40)), 1.0);
        let local = gemma_inv_freq_local(&c).unwrap();
        assert!((local[1] - 10_000f32.powf(-2.0 / 256.0)).abs() < 1e-9);
        assert!(gemma_inv_freq_local(&LlamaConfig::llama(2, 64, 96, 4, 2, 40)).is_none());
    }
}

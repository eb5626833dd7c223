//! The weights loader: one reader of the model's tensors under their GGUF names
//! (`blk.N.attn_q.weight`, ...) for every format. A GGUF file ([`Llama::from_gguf`]) gives
//! them dequantized to f32 and has an optional tensor when the file holds it; a Hugging Face
//! checkpoint ([`Llama::from_tensors`], names mapped in `hf.rs`) has one when the config says
//! so. Random weights ([`Llama::dummy`]) fill the same layers. Q/K rows arrive in the layout
//! `rope_neox` rotates (llama.cpp's converter permutes `llama` files for adjacent pairs).

use rand::{Rng, SeedableRng};

use super::gguf::Gguf;
use super::linear::{Linear, LinearQuantization};
use super::llama::{inv_freq, inv_freq_local, Layer, Llama, LlamaConfig, LoadError};
use super::moe::{MoeLayer, MoeShapes, MoeTensors};

/// A tensor a block may lack, and what says whether it is there in a checkpoint whose config
/// decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Optional {
    /// Q/K/V biases (`attn_bias`: Qwen2).
    Bias,
    /// RMSNorm of each Q and K head (`qk_norm`: Qwen3, Gemma 3).
    QkNorm,
    /// `output.weight` (absent when the head is tied to the embeddings).
    Head,
    /// `rope_freqs.weight` (llama3 RoPE scaling in a GGUF file; a checkpoint's config gives
    /// the factors instead).
    RopeFactors,
}

/// Reads tensors by GGUF name with their logical shape (`[out, in]` or `[n]`), checking each
/// has as many elements. `linear` may supply a projection in a packed format (4-bit
/// checkpoints, [`super::w4`]); where it gives none the f32 tensor is read.
struct Reader<S, H, L> {
    source: S,
    has: H,
    linear: L,
}

/// A linear hook that supplies no packed weight.
fn no_packed<E>(_: &str, _: usize, _: usize) -> Result<Option<Linear>, E> {
    Ok(None)
}

impl<S, H: Fn(Optional, &str) -> bool, L> Reader<S, H, L> {
    /// Projection `name` (`[rows, cols]`): packed as `linear` gives it, else f32.
    fn lin<E>(&mut self, name: &str, rows: usize, cols: usize) -> Result<Linear, E>
    where
        S: FnMut(&str, &[usize]) -> Result<Vec<f32>, E>,
        L: FnMut(&str, usize, usize) -> Result<Option<Linear>, E>,
        E: From<LoadError>,
    {
        match (self.linear)(name, rows, cols)? {
            Some(l) if l.rows() == rows && l.cols() == cols => Ok(l),
            Some(l) => Err(LoadError::Shape {
                name: name.into(),
                got: l.rows() * l.cols(),
                want: rows * cols,
            }
            .into()),
            None => Ok(Linear::new(self.get(name, &[rows, cols])?, cols)),
        }
    }

    fn get<E>(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, E>
    where
        S: FnMut(&str, &[usize]) -> Result<Vec<f32>, E>,
        E: From<LoadError>,
    {
        let w = (self.source)(name, shape)?;
        let want = shape.iter().product();
        if w.len() != want {
            return Err(LoadError::Shape {
                name: name.into(),
                got: w.len(),
                want,
            }
            .into());
        }
        Ok(w)
    }

    fn opt<E>(&mut self, kind: Optional, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>, E>
    where
        S: FnMut(&str, &[usize]) -> Result<Vec<f32>, E>,
        E: From<LoadError>,
    {
        if (self.has)(kind, name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The model of `cfg` from its tensors; `freq_factors` divide RoPE's inverse frequencies
    /// (llama3 scaling), one per rotated pair.
    fn model<E>(mut self, cfg: LlamaConfig, freq_factors: Option<&[f32]>) -> Result<Llama, E>
    where
        S: FnMut(&str, &[usize]) -> Result<Vec<f32>, E>,
        L: FnMut(&str, usize, usize) -> Result<Option<Linear>, E>,
        E: From<LoadError>,
    {
        if let Some(f) = freq_factors {
            if f.len() != cfg.rope_dims / 2 {
                return Err(LoadError::Geometry(format!(
                    "{} RoPE frequency factors for {} rotated pairs",
                    f.len(),
                    cfg.rope_dims / 2
                ))
                .into());
            }
        }
        let (d, hd) = (cfg.d_model, cfg.head_dim);
        let (qw, kw) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let (qn, kn) = if cfg.qk_norm_full { (qw, kw) } else { (hd, hd) };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let moe = cfg.moe.as_ref().filter(|m| m.is_sparse(i));
            // A sparse layer has no dense MLP: its weights stay empty.
            let ff = if moe.is_some() { 0 } else { cfg.d_ff };
            let moe = match moe {
                Some(m) => {
                    let MoeShapes {
                        router,
                        experts: [g, u, dn],
                        shared,
                    } = MoeLayer::shapes(m, d);
                    let mut shared_t = None;
                    if let Some([sg, su, sd, sgate]) = shared {
                        shared_t = Some([
                            self.get(&n("ffn_gate_shexp.weight"), &sg)?,
                            self.get(&n("ffn_up_shexp.weight"), &su)?,
                            self.get(&n("ffn_down_shexp.weight"), &sd)?,
                            self.get(&n("ffn_gate_inp_shexp.weight"), &sgate)?,
                        ]);
                    }
                    let t = MoeTensors {
                        router: self.get(&n("ffn_gate_inp.weight"), &router)?,
                        gate: self.get(&n("ffn_gate_exps.weight"), &g)?,
                        up: self.get(&n("ffn_up_exps.weight"), &u)?,
                        down: self.get(&n("ffn_down_exps.weight"), &dn)?,
                        shared: shared_t,
                    };
                    Some(MoeLayer::new(m, d, t))
                }
                None => None,
            };
            let mlp = |r: &mut Self, name: &str, shape: [usize; 2]| -> Result<Linear, E> {
                match ff {
                    0 => Ok(Linear::new(Vec::new(), shape[1])),
                    _ => r.lin(&n(name), shape[0], shape[1]),
                }
            };
            let post_norm = |r: &mut Self, name: &str| -> Result<Option<Vec<f32>>, E> {
                match cfg.gemma3 {
                    Some(_) => r.get(&n(name), &[d]).map(Some),
                    None => Ok(None),
                }
            };
            layers.push(Layer {
                attn_norm: self.get(&n("attn_norm.weight"), &[d])?,
                wq: self.lin(&n("attn_q.weight"), qw, d)?,
                wk: self.lin(&n("attn_k.weight"), kw, d)?,
                wv: self.lin(&n("attn_v.weight"), kw, d)?,
                wo: self.lin(&n("attn_output.weight"), d, qw)?,
                bq: self.opt(Optional::Bias, &n("attn_q.bias"), &[qw])?,
                bk: self.opt(Optional::Bias, &n("attn_k.bias"), &[kw])?,
                bv: self.opt(Optional::Bias, &n("attn_v.bias"), &[kw])?,
                q_norm: self.opt(Optional::QkNorm, &n("attn_q_norm.weight"), &[qn])?,
                k_norm: self.opt(Optional::QkNorm, &n("attn_k_norm.weight"), &[kn])?,
                ffn_norm: self.get(&n("ffn_norm.weight"), &[d])?,
                w_gate: mlp(&mut self, "ffn_gate.weight", [ff, d])?,
                w_up: mlp(&mut self, "ffn_up.weight", [ff, d])?,
                w_down: mlp(&mut self, "ffn_down.weight", [d, ff])?,
                post_attn_norm: post_norm(&mut self, "post_attention_norm.weight")?,
                post_ffn_norm: post_norm(&mut self, "post_ffw_norm.weight")?,
                moe,
            });
        }
        Ok(Llama {
            embed: self.get("token_embd.weight", &[cfg.vocab, d])?,
            out_norm: self.get("output_norm.weight", &[d])?,
            lm_head: self.opt(Optional::Head, "output.weight", &[cfg.vocab, d])?,
            inv_freq: inv_freq(&cfg, freq_factors),
            inv_freq_local: inv_freq_local(&cfg),
            quantization: packed_format(&layers),
            layers,
            config: cfg,
        })
    }
}

/// The model's linear format when a loader kept its projections packed (the first packed one
/// found: a checkpoint has one method), else [`LinearQuantization::None`].
fn packed_format(layers: &[Layer]) -> LinearQuantization {
    layers
        .iter()
        .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
        .map(Linear::format)
        .find(|f| matches!(f, LinearQuantization::W4A16(_)))
        .unwrap_or(LinearQuantization::None)
}

impl Llama {
    /// Loads and dequantises every tensor of a GGUF model.
    pub fn from_gguf(g: &Gguf) -> Result<Self, LoadError> {
        let cfg = LlamaConfig::from_gguf(g)?;
        let source = |name: &str, _: &[usize]| g.dequantize(name).map_err(LoadError::from);
        let mut reader = Reader {
            source,
            has: |_: Optional, name: &str| g.tensor_info(name).is_some(),
            linear: no_packed::<LoadError>,
        };
        let factors = reader.opt(Optional::RopeFactors, "rope_freqs.weight", &[cfg.rope_dims / 2])?;
        reader.model(cfg, factors.as_deref())
    }

    /// Builds the model from tensors a checkpoint reader supplies. `get(name, shape)` is asked
    /// for each tensor under its GGUF name (`blk.N.attn_q.weight`, ...) with the logical shape
    /// `[out, in]` (or `[n]`), and only for the tensors `cfg` says exist (biases with
    /// `attn_bias`, QK norms with `qk_norm`, `output.weight` unless `tied_embeddings`). Q/K rows
    /// must already be in the layout `cfg.rope_neox` rotates. `freq_factors` divide RoPE's
    /// inverse frequencies (llama3 scaling), one per rotated pair.
    pub fn from_tensors<E: From<LoadError>>(
        cfg: LlamaConfig,
        freq_factors: Option<&[f32]>,
        source: impl FnMut(&str, &[usize]) -> Result<Vec<f32>, E>,
    ) -> Result<Self, E> {
        Self::from_tensors_packed(cfg, freq_factors, source, no_packed::<E>)
    }

    /// [`Llama::from_tensors`] with `linear(name, rows, cols)` asked first for each projection
    /// (`blk.N.attn_q.weight`, ...): a packed [`Linear`] it returns is kept as it is (4-bit
    /// checkpoints), `None` reads the f32 tensor through `source`.
    pub fn from_tensors_packed<E: From<LoadError>>(
        cfg: LlamaConfig,
        freq_factors: Option<&[f32]>,
        source: impl FnMut(&str, &[usize]) -> Result<Vec<f32>, E>,
        linear: impl FnMut(&str, usize, usize) -> Result<Option<Linear>, E>,
    ) -> Result<Self, E> {
        cfg.check()?;
        if cfg.gemma3.is_some() {
            let what = "gemma3 from a Hugging Face checkpoint (load its GGUF file instead)";
            return Err(LoadError::Architecture(what.into()).into());
        }
        let (bias, qk_norm, head) = (cfg.attn_bias, cfg.qk_norm, !cfg.tied_embeddings);
        let reader = Reader {
            source,
            has: move |kind: Optional, _: &str| match kind {
                Optional::Bias => bias,
                Optional::QkNorm => qk_norm,
                Optional::Head => head,
                Optional::RopeFactors => false,
            },
            linear,
        };
        reader.model(cfg, freq_factors)
    }

    /// Random weights of any geometry (vLLM's `--load-format dummy`): for capacity and
    /// throughput measurements, not for text.
    pub fn dummy(cfg: LlamaConfig, seed: u64) -> Result<Self, LoadError> {
        cfg.check()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (d, hd, ff) = (cfg.d_model, cfg.head_dim, cfg.d_ff);
        let (qw, kw) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let mut rand_mat = |rows: usize, cols: usize| -> Vec<f32> {
            let a = 1.0 / (cols as f32).sqrt();
            (0..rows * cols).map(|_| rng.random_range(-a..a)).collect()
        };
        let (qn, kn) = if cfg.qk_norm_full { (qw, kw) } else { (hd, hd) };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let moe = cfg.moe.as_ref().filter(|m| m.is_sparse(i)).map(|m| {
                let MoeShapes {
                    router,
                    experts: [g, u, dn],
                    shared,
                } = MoeLayer::shapes(m, d);
                let mut r = |s: &[usize]| rand_mat(s[..s.len() - 1].iter().product(), s[s.len() - 1]);
                let t = MoeTensors {
                    router: r(&router),
                    gate: r(&g),
                    up: r(&u),
                    down: r(&dn),
                    shared: shared.map(|s| s.map(|s| r(&s))),
                };
                MoeLayer::new(m, d, t)
            });
            let ff = if moe.is_some() { 0 } else { ff };
            layers.push(Layer {
                attn_norm: vec![1.0; d],
                wq: Linear::new(rand_mat(qw, d), d),
                wk: Linear::new(rand_mat(kw, d), d),
                wv: Linear::new(rand_mat(kw, d), d),
                wo: Linear::new(rand_mat(d, qw), qw),
                bq: cfg.attn_bias.then(|| vec![0.0; qw]),
                bk: cfg.attn_bias.then(|| vec![0.0; kw]),
                bv: cfg.attn_bias.then(|| vec![0.0; kw]),
                q_norm: cfg.qk_norm.then(|| vec![1.0; qn]),
                k_norm: cfg.qk_norm.then(|| vec![1.0; kn]),
                ffn_norm: vec![1.0; d],
                w_gate: Linear::new(rand_mat(ff, d), d),
                w_up: Linear::new(rand_mat(ff, d), d),
                w_down: Linear::new(rand_mat(d, ff), ff),
                post_attn_norm: cfg.gemma3.as_ref().map(|_| vec![1.0; d]),
                post_ffn_norm: cfg.gemma3.as_ref().map(|_| vec![1.0; d]),
                moe,
            });
        }
        let embed = rand_mat(cfg.vocab, d);
        let lm_head = (!cfg.tied_embeddings).then(|| rand_mat(cfg.vocab, d));
        Ok(Llama {
            embed,
            layers,
            out_norm: vec![1.0; d],
            lm_head,
            inv_freq: inv_freq(&cfg, None),
            inv_freq_local: inv_freq_local(&cfg),
            config: cfg,
            quantization: LinearQuantization::None,
        })
    }
}

/// Borrowed f32 weights of one layer (matrices `[out, in]` row-major), for other backends.
pub struct LayerTensors<'a> {
    pub attn_norm: &'a [f32],
    pub wq: &'a [f32],
    pub wk: &'a [f32],
    pub wv: &'a [f32],
    pub wo: &'a [f32],
    pub bq: Option<&'a [f32]>,
    pub bk: Option<&'a [f32]>,
    pub bv: Option<&'a [f32]>,
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub ffn_norm: &'a [f32],
    pub w_gate: &'a [f32],
    pub w_up: &'a [f32],
    pub w_down: &'a [f32],
    /// Gemma 3: RMSNorm weights of the attention and MLP outputs (`None` for the Llama family).
    pub post_attn_norm: Option<&'a [f32]>,
    pub post_ffn_norm: Option<&'a [f32]>,
}

/// Borrowed f32 weights of the whole model (see [`Llama::tensors`]).
pub struct LlamaTensors<'a> {
    /// `[vocab, d_model]`.
    pub embed: &'a [f32],
    pub layers: Vec<LayerTensors<'a>>,
    pub out_norm: &'a [f32],
    /// `[vocab, d_model]`; `None` when tied to `embed`.
    pub lm_head: Option<&'a [f32]>,
    /// Per rotated pair: the inverse frequency, already divided by any rope_freqs factor.
    pub inv_freq: &'a [f32],
}

impl Llama {
    /// The same model with every packed (4-bit) projection dequantized to f32: what a packed
    /// model computes, in the f32 path (tests and accuracy figures; a copy of every weight).
    pub fn dequantized(&self) -> Llama {
        let mut m = self.clone();
        for l in &mut m.layers {
            for w in l.linears_mut() {
                *w = w.dequantized();
            }
        }
        m.quantization = packed_format(&m.layers);
        m
    }

    /// Bytes the blocks' linear layers hold on the host: f32 values, or a packed weight's
    /// codes, scales, zeros and `g_idx` ([`super::w4::W4Weight::bytes`]).
    pub fn linear_weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .map(|w| w.w4().map_or(w.weight().len() * 4, |p| p.bytes()))
            .sum()
    }

    /// The model's weights, e.g. to upload them to a GPU (`model::gpu`). A packed (4-bit)
    /// projection's slice is empty: check [`Llama::quantization`] first.
    pub fn tensors(&self) -> LlamaTensors<'_> {
        LlamaTensors {
            embed: &self.embed,
            layers: self
                .layers
                .iter()
                .map(|l| LayerTensors {
                    attn_norm: &l.attn_norm,
                    wq: l.wq.weight(),
                    wk: l.wk.weight(),
                    wv: l.wv.weight(),
                    wo: l.wo.weight(),
                    bq: l.bq.as_deref(),
                    bk: l.bk.as_deref(),
                    bv: l.bv.as_deref(),
                    q_norm: l.q_norm.as_deref(),
                    k_norm: l.k_norm.as_deref(),
                    ffn_norm: &l.ffn_norm,
                    w_gate: l.w_gate.weight(),
                    w_up: l.w_up.weight(),
                    w_down: l.w_down.weight(),
                    post_attn_norm: l.post_attn_norm.as_deref(),
                    post_ffn_norm: l.post_ffn_norm.as_deref(),
                })
                .collect(),
            out_norm: &self.out_norm,
            lm_head: self.lm_head.as_deref(),
            inv_freq: &self.inv_freq,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both readers ask the same names: what the checkpoint's config says a block holds is
    /// what the GGUF reader finds in a file of that geometry.
    #[test]
    fn optional_tensors_follow_the_config_of_a_checkpoint() {
        let mut cfg = LlamaConfig::llama(1, 8, 16, 2, 1, 10);
        cfg.attn_bias = true;
        cfg.tied_embeddings = true;
        let mut asked = Vec::new();
        let m = Llama::from_tensors::<LoadError>(cfg, None, |name, shape| {
            asked.push(name.to_string());
            Ok(vec![0.5; shape.iter().product()])
        })
        .unwrap();
        for name in ["blk.0.attn_q.bias", "blk.0.attn_v.bias", "token_embd.weight"] {
            assert!(asked.iter().any(|a| a == name), "{name} not read");
        }
        for name in ["blk.0.attn_q_norm.weight", "output.weight"] {
            assert!(!asked.iter().any(|a| a == name), "{name} read");
        }
        assert!(m.tensors().lm_head.is_none());
        assert_eq!(m.tensors().layers[0].bq, Some(&[0.5f32; 8][..]), "2 heads of 4");
        let e = Llama::from_tensors::<LoadError>(LlamaConfig::llama(1, 8, 16, 2, 1, 10), None, |_, _| {
            Ok(vec![0.0; 3])
        })
        .unwrap_err();
        assert!(matches!(e, LoadError::Shape { want: 8, .. }), "{e}");
    }
}

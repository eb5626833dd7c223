//! The attention hook of the forward pass, and a contiguous per-sequence KV cache behind it.
//!
//! The forward pass hands each layer's new keys, values and queries to a [`KvAttention`]; the
//! implementation stores K/V however it likes (contiguous here, paged in the worker's engine)
//! and returns causal attention over every cached and new position of each sequence.

use std::collections::HashMap;

use rayon::prelude::*;

use crate::engine::capacity::ModelLayer;

/// A sequence's identity in the KV cache.
pub type SeqId = u64;

/// Errors of the KV cache.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KvError {
    #[error("sequence {seq} has {cached} cached tokens at layer {layer}, but the batch starts it at position {start}; positions must be contiguous")]
    Position {
        seq: SeqId,
        layer: usize,
        cached: usize,
        start: usize,
    },
    #[error("KV cache is full ({capacity} tokens); lower max_tokens or the number of concurrent requests")]
    Full { capacity: usize },
    #[error("layer {0} is outside the model")]
    Layer(usize),
    #[error("attention backend failed: {0}")]
    Backend(String),
}

/// Attention geometry shared by the model and its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnGeometry {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnGeometry {
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Its per-layer KV list: every layer full attention (a drafter's, or a model's as laid out
    /// by `engine::capacity::pool_layout`).
    pub fn kv_layers(&self) -> Vec<ModelLayer> {
        let l = ModelLayer {
            q_heads: self.n_heads,
            kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            window: None,
        };
        vec![l; self.n_layers]
    }
}

/// One sequence's rows in a batch: `len` consecutive rows of q/k/v/out starting at the sum of
/// the preceding entries' `len`, for positions `start_pos..start_pos + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnSeq {
    pub seq: SeqId,
    pub start_pos: usize,
    pub len: usize,
}

/// A step's `(q, k, v)` rows of one layer, as [`KvAttention::attend`] takes them.
pub type Qkv<'a> = (&'a [f32], &'a [f32], &'a [f32]);

/// Where attention runs: stores the new K/V of a layer and attends over the cache.
pub trait KvAttention: Send {
    /// For `layer`: appends `k`, `v` (`[tokens, n_kv_heads * head_dim]`) of each sequence's
    /// new positions, then writes into `out` (`[tokens, n_heads * head_dim]`) the causal
    /// attention of `q` (`[tokens, n_heads * head_dim]`) over positions `0..=pos`.
    fn attend(
        &mut self,
        layer: usize,
        seqs: &[AttnSeq],
        qkv: Qkv<'_>,
        out: &mut [f32],
    ) -> Result<(), KvError>;

    /// Tokens cached for `seq` (at layer 0), 0 when unknown.
    fn cached_len(&self, seq: SeqId) -> usize;

    /// Frees everything held for `seq`.
    fn release(&mut self, seq: SeqId);
}

/// Keys and values of one layer, each `[pos, n_kv_heads * head_dim]`.
type LayerKv = (Vec<f32>, Vec<f32>);

/// A KV cache with one growing contiguous buffer per sequence and layer (f32), up to a total
/// token capacity.
#[derive(Debug)]
pub struct ContiguousKv {
    geo: AttnGeometry,
    capacity_tokens: usize,
    used_tokens: usize,
    /// seq -> per layer (keys, values), each `[pos, n_kv_heads * head_dim]`.
    seqs: HashMap<SeqId, Vec<LayerKv>>,
}

impl ContiguousKv {
    pub fn new(geo: AttnGeometry, capacity_tokens: usize) -> Self {
        ContiguousKv {
            geo,
            capacity_tokens,
            used_tokens: 0,
            seqs: HashMap::new(),
        }
    }

    pub fn capacity_tokens(&self) -> usize {
        self.capacity_tokens
    }

    pub fn used_tokens(&self) -> usize {
        self.used_tokens
    }
}

impl KvAttention for ContiguousKv {
    fn attend(
        &mut self,
        layer: usize,
        seqs: &[AttnSeq],
        (q, k, v): Qkv<'_>,
        out: &mut [f32],
    ) -> Result<(), KvError> {
        let g = self.geo;
        if layer >= g.n_layers {
            return Err(KvError::Layer(layer));
        }
        let (qw, kw) = (g.q_width(), g.kv_width());
        // Validate and append first, so a failure leaves no half-written layer.
        let new_tokens: usize = seqs.iter().map(|s| s.len).sum();
        for s in seqs {
            let cached = self.seqs.get(&s.seq).map_or(0, |l| l[layer].0.len() / kw);
            if cached != s.start_pos {
                return Err(KvError::Position {
                    seq: s.seq,
                    layer,
                    cached,
                    start: s.start_pos,
                });
            }
        }
        if layer == 0 {
            if self.used_tokens + new_tokens > self.capacity_tokens {
                return Err(KvError::Full {
                    capacity: self.capacity_tokens,
                });
            }
            self.used_tokens += new_tokens;
        }
        let mut row = 0;
        for s in seqs {
            let layers = self
                .seqs
                .entry(s.seq)
                .or_insert_with(|| vec![(Vec::new(), Vec::new()); g.n_layers]);
            let (kc, vc) = &mut layers[layer];
            kc.extend_from_slice(&k[row * kw..(row + s.len) * kw]);
            vc.extend_from_slice(&v[row * kw..(row + s.len) * kw]);
            row += s.len;
        }
        let mut row = 0;
        for s in seqs {
            let (kc, vc) = &self.seqs[&s.seq][layer];
            let qs = &q[row * qw..(row + s.len) * qw];
            let os = &mut out[row * qw..(row + s.len) * qw];
            attend_contiguous(g, s.start_pos, qs, kc, vc, os);
            row += s.len;
        }
        Ok(())
    }

    fn cached_len(&self, seq: SeqId) -> usize {
        self.seqs
            .get(&seq)
            .map_or(0, |l| l[0].0.len() / self.geo.kv_width())
    }

    fn release(&mut self, seq: SeqId) {
        if let Some(l) = self.seqs.remove(&seq) {
            self.used_tokens -= l[0].0.len() / self.geo.kv_width();
        }
    }
}

/// Causal GQA attention of `q` rows (positions `start_pos..`) over contiguous `keys`/`values`
/// (`[pos, n_kv_heads * head_dim]`); the reference the paged backends are compared with.
pub fn attend_contiguous(
    g: AttnGeometry,
    start_pos: usize,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    out: &mut [f32],
) {
    let hd = g.head_dim;
    let kw = g.kv_width();
    let group = g.n_heads / g.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    out.par_chunks_mut(hd)
        .zip(q.par_chunks(hd))
        .enumerate()
        .for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, (o, qh))| {
            let (t, h) = (i / g.n_heads, i % g.n_heads);
            let kvh = h / group;
            let n = start_pos + t + 1;
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in 0..n {
                let kr = &keys[p * kw + kvh * hd..p * kw + (kvh + 1) * hd];
                let s = qh.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.fill(0.0);
            for (p, s) in scores.iter().enumerate() {
                let w = s / sum;
                let vr = &values[p * kw + kvh * hd..p * kw + (kvh + 1) * hd];
                for (oo, vv) in o.iter_mut().zip(vr) {
                    *oo += w * vv;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: AttnGeometry = AttnGeometry {
        n_layers: 1,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 2,
    };

    fn rows(n: usize, w: usize, f: impl Fn(usize) -> f32) -> Vec<f32> {
        (0..n * w).map(f).collect()
    }

    #[test]
    fn chunked_prefill_then_decode_equals_one_shot_prefill() {
        let (qw, kw) = (G.q_width(), G.kv_width());
        let q = rows(5, qw, |i| ((i * 7) % 11) as f32 * 0.1);
        let k = rows(5, kw, |i| ((i * 5) % 7) as f32 * 0.2 - 0.5);
        let v = rows(5, kw, |i| i as f32);
        let mut one = ContiguousKv::new(G, 100);
        let mut out1 = vec![0.0; 5 * qw];
        let s = |start_pos, len| AttnSeq {
            seq: 1,
            start_pos,
            len,
        };
        one.attend(0, &[s(0, 5)], (&q, &k, &v), &mut out1).unwrap();
        let mut two = ContiguousKv::new(G, 100);
        let mut out2 = vec![0.0; 5 * qw];
        two.attend(
            0,
            &[s(0, 3)],
            (&q[..3 * qw], &k[..3 * kw], &v[..3 * kw]),
            &mut out2[..3 * qw],
        )
        .unwrap();
        two.attend(
            0,
            &[s(3, 2)],
            (&q[3 * qw..], &k[3 * kw..], &v[3 * kw..]),
            &mut out2[3 * qw..],
        )
        .unwrap();
        for (a, b) in out1.iter().zip(&out2) {
            assert!((a - b).abs() < 1e-5);
        }
        // The first position attends only to itself: output equals its own value row.
        assert_eq!(&out1[..2], &v[..2]);
        assert_eq!(&out1[4..6], &v[2..4], "head 2 reads kv head 1");
        assert_eq!(two.cached_len(1), 5);
    }

    #[test]
    fn out_of_order_positions_and_overflow_are_errors() {
        let (qw, kw) = (G.q_width(), G.kv_width());
        let mut kv = ContiguousKv::new(G, 3);
        let mut out = vec![0.0; 4 * qw];
        let e = kv
            .attend(
                0,
                &[AttnSeq {
                    seq: 9,
                    start_pos: 2,
                    len: 1,
                }],
                (&[0.0; 8], &[0.0; 4], &[0.0; 4]),
                &mut out[..qw],
            )
            .unwrap_err();
        assert!(matches!(
            e,
            KvError::Position {
                cached: 0,
                start: 2,
                ..
            }
        ));
        let e = kv
            .attend(
                0,
                &[AttnSeq {
                    seq: 9,
                    start_pos: 0,
                    len: 4,
                }],
                (&vec![0.0; 4 * qw], &vec![0.0; 4 * kw], &vec![0.0; 4 * kw]),
                &mut out,
            )
            .unwrap_err();
        assert_eq!(e, KvError::Full { capacity: 3 });
        kv.attend(
            0,
            &[AttnSeq {
                seq: 9,
                start_pos: 0,
                len: 3,
            }],
            (&vec![0.0; 3 * qw], &vec![0.0; 3 * kw], &vec![0.0; 3 * kw]),
            &mut out[..3 * qw],
        )
        .unwrap();
        assert_eq!(kv.used_tokens(), 3);
        kv.release(9);
        assert_eq!(kv.used_tokens(), 0);
    }
}

//! The f64 oracle every backend is tested against: dense, unpaged, two-pass softmax.

use super::layout::LayerAttn;

/// One request for the oracle: its query tokens and the keys/values it holds.
pub struct RefRequest<'a> {
    /// `[q_len, q_heads, head_dim]`.
    pub q: &'a [f64],
    /// Absolute position of the first query token.
    pub q_pos0: usize,
    /// `[n, kv_heads, head_dim]`, positions `first_pos .. first_pos + n`.
    pub k: &'a [f64],
    pub v: &'a [f64],
    pub first_pos: usize,
}

/// Output `[total_q, q_heads, head_dim]` for the requests in order.
pub fn attention(attn: &LayerAttn, reqs: &[RefRequest<'_>]) -> Vec<f64> {
    let (qh, kvh, d) = (attn.q_heads, attn.kv_heads, attn.head_dim);
    let group = qh / kvh;
    let scale = attn.scale() as f64;
    let mut out = Vec::new();
    for r in reqs {
        let q_len = r.q.len() / (qh * d);
        let n = r.k.len() / (kvh * d);
        for j in 0..q_len {
            let q_pos = (r.q_pos0 + j) as u32;
            for h in 0..qh {
                let kh = h / group;
                let q = &r.q[(j * qh + h) * d..][..d];
                let mut scores = Vec::with_capacity(n);
                for i in 0..n {
                    let key_pos = (r.first_pos + i) as u32;
                    if !attn.visible(q_pos, key_pos) {
                        continue;
                    }
                    let k = &r.k[(i * kvh + kh) * d..][..d];
                    let s: f64 = q.iter().zip(k).map(|(a, b)| a * b).sum();
                    scores.push((i, s * scale));
                }
                let mut o = vec![0f64; d];
                if !scores.is_empty() {
                    let m = scores.iter().fold(f64::NEG_INFINITY, |m, &(_, s)| m.max(s));
                    let z: f64 = scores.iter().map(|&(_, s)| (s - m).exp()).sum();
                    for &(i, s) in &scores {
                        let p = (s - m).exp() / z;
                        let v = &r.v[(i * kvh + kh) * d..][..d];
                        for (o, v) in o.iter_mut().zip(v) {
                            *o += p * v;
                        }
                    }
                }
                out.extend_from_slice(&o);
            }
        }
    }
    out
}

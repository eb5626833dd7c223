//! Per-request sampling: greedy, temperature, top-k, top-p, seeded, plus the stop conditions
//! (stop tokens, stop strings, max tokens) applied to the streamed text.

use rand::{Rng, SeedableRng};

/// Sampling settings of one request (OpenAI semantics: temperature 0 is greedy).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1.0: all).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens until `max_tokens` (vLLM's extension;
    /// benchmarks use it for fixed output lengths).
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 16,
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    /// Checks ranges; the message names the offending field as OpenAI's API does.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(format!("temperature {} must be in [0, 2]", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if self.stop.len() > 4 || self.stop.iter().any(String::is_empty) {
            return Err("stop takes at most 4 non-empty strings".into());
        }
        Ok(())
    }
}

/// Draws tokens from logits for one request.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => rand::rngs::StdRng::seed_from_u64(s),
            None => rand::rngs::StdRng::from_os_rng(),
        };
        Sampler {
            params,
            rng,
            scratch: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the next token is the argmax of the logits (temperature 0 or top-k 1), which a
    /// device can pick without the logits leaving it.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == 1
    }

    /// The next token for `logits` (one row over the vocabulary).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let p = &self.params;
        let c = &mut self.scratch;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (l / p.temperature, i as u32)),
        );
        let k = if p.top_k == 0 {
            c.len()
        } else {
            p.top_k.min(c.len())
        };
        if k < c.len() {
            c.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
            c.truncate(k);
        }
        c.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        let max = c[0].0;
        let mut sum = 0.0;
        for e in c.iter_mut() {
            e.0 = (e.0 - max).exp();
            sum += e.0;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                acc += e.0 / sum;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            sum = c.iter().map(|e| e.0).sum();
        }
        let mut r = self.rng.random::<f32>() * sum;
        for e in c.iter() {
            r -= e.0;
            if r <= 0.0 {
                return e.1;
            }
        }
        c.last().map_or(0, |e| e.1)
    }
}

pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in xs.iter().enumerate() {
        if *v > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// Applies stop strings to streamed text: text that might begin a stop string is held back
/// until it is known not to.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            held: String::new(),
        }
    }

    /// Adds text; returns the text safe to emit and whether a stop string was reached (the
    /// stop string itself and everything after it are dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.held.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The held-back text at the end of a generation that stopped for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_picks_the_argmax() {
        let mut s = Sampler::new(params(0.0, 0, 1.0, 1));
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [2.0, 1.9, 1.8, -5.0, 1.7];
        let mut s = Sampler::new(params(1.0, 2, 1.0, 3));
        for _ in 0..200 {
            assert!(s.sample(&logits) < 2);
        }
        // Token 0 alone has more than 5% probability.
        let mut s = Sampler::new(params(1.0, 0, 0.05, 3));
        for _ in 0..50 {
            assert_eq!(s.sample(&logits), 0);
        }
    }

    #[test]
    fn same_seed_gives_same_draws_and_temperature_spreads_them() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed));
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
        let distinct: std::collections::HashSet<_> = draw(5).into_iter().collect();
        assert!(distinct.len() > 5);
    }

    #[test]
    fn stop_strings_hold_back_partial_matches_and_cut_at_the_stop() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("hello E"), ("hello ".into(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("x"), ("ENx".into(), false));
        assert_eq!(m.push(" done\n"), (" done".into(), false));
        assert_eq!(m.push("\nmore"), (String::new(), true));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("aEN"), ("a".into(), false));
        assert_eq!(m.finish(), "EN");
    }

    #[test]
    fn bad_params_are_rejected_with_the_field_name() {
        let p = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(p.check().unwrap_err().contains("top_p"));
        let p = SamplingParams {
            temperature: 3.0,
            ..Default::default()
        };
        assert!(p.check().unwrap_err().contains("temperature"));
    }
}

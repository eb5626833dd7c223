//! Per-request sampling: greedy, temperature, top-k, top-p, min-p, seeded; the logit
//! adjustments of penalties, `logit_bias` and `min_tokens` (a sparse list a row, [`Adjust`]);
//! log-probabilities; and the stop conditions (stop tokens, stop strings, max tokens) applied to
//! the streamed text.

use std::collections::{BTreeMap, HashMap, HashSet};

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
    /// End-of-sequence and `stop_token_ids` are banned (their logits -inf), and stop strings
    /// not looked for, until this many tokens were generated (vLLM).
    pub min_tokens: usize,
    /// More tokens that end the generation (finish reason `stop`), as vLLM's `stop_token_ids`.
    pub stop_token_ids: Vec<u32>,
    /// Keep the stop string (or a stop token's text) that ended the generation in the output.
    pub include_stop_str_in_output: bool,
    /// Drop control tokens' text from the output (vLLM's default); false keeps it.
    pub skip_special_tokens: bool,
    /// vLLM / Hugging Face: a logit `l` of a token seen in the prompt or the output becomes
    /// `l / r` when positive, `l * r` otherwise (1: off).
    pub repetition_penalty: f32,
    /// OpenAI: minus this once for every token the output already holds ([-2, 2]).
    pub presence_penalty: f32,
    /// OpenAI: minus this times the count of each token in the output ([-2, 2]).
    pub frequency_penalty: f32,
    /// Keep the tokens whose probability is at least `min_p` times the largest (0: off).
    pub min_p: f32,
    /// Added to the logit of each token id ([-100, 100]); ids unique.
    pub logit_bias: Vec<(u32, f32)>,
    /// Return each generated token's log-probability and this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Return each prompt token's log-probability (the first's is none) and this many
    /// alternatives (completions' `echo` with `logprobs`).
    pub prompt_logprobs: Option<usize>,
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
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

/// The most alternatives a token's log-probabilities list (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl SamplingParams {
    /// Checks ranges; the message names the offending field as OpenAI's API does.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(format!("temperature {} must be in [0, 2]", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        // 0 only for a request that scores its prompt (`echo` with `logprobs`, as vLLM takes).
        if self.max_tokens == 0 && self.prompt_logprobs.is_none() {
            return Err("max_tokens must be at least 1".into());
        }
        if self.stop.len() > 4 || self.stop.iter().any(String::is_empty) {
            return Err("stop takes at most 4 non-empty strings".into());
        }
        if self.min_tokens > self.max_tokens {
            return Err(format!(
                "min_tokens {} must be at most max_tokens {}",
                self.min_tokens, self.max_tokens
            ));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            return Err(format!(
                "repetition_penalty {} must be in (0, 2]",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} {v} must be in [-2, 2]"));
            }
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(format!(
                "logit_bias of token {id} is {b}; a bias must be in [-100, 100]"
            ));
        }
        for (name, n) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if n.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
                return Err(format!(
                    "{name} asks for more than {MAX_TOP_LOGPROBS} alternatives"
                ));
            }
        }
        Ok(())
    }

    /// Whether any parameter adjusts logits before the pick (penalties, bias, `min_tokens`).
    pub fn adjusts_logits(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
    }
}

/// Draws tokens from logits for one request: each token takes one `u64` from the request's
/// random stream (seeded when `seed` is set) as the [`Draw::key`] of its row, whether the draw
/// then runs on the host ([`RowPick::pick`]) or on a GPU (`kernels/sampling.cu`), so a seeded
/// request gives the same tokens on either device for the same logits.
///
/// It also keeps the request's token counts (prompt tokens seen, output tokens counted) from
/// which [`Sampler::next_row`] builds each step's [`Adjust`] list.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
    /// Distinct prompt tokens (kept only with a repetition penalty).
    prompt: HashSet<u32>,
    /// Each output token's count so far.
    counts: HashMap<u32, u32>,
    generated: usize,
    /// Tokens `min_tokens` bans: the model's end-of-sequence tokens and `stop_token_ids`.
    banned: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self::for_request(params, &[], &[])
    }

    /// A sampler for a request with its prompt (for the repetition penalty) and the model's
    /// end-of-sequence tokens (banned, with `stop_token_ids`, until `min_tokens`).
    pub fn for_request(params: SamplingParams, prompt: &[u32], eos: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => rand::rngs::StdRng::seed_from_u64(s),
            None => rand::rngs::StdRng::from_os_rng(),
        };
        let prompt = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        let mut banned: Vec<u32> = eos.iter().chain(&params.stop_token_ids).copied().collect();
        banned.sort_unstable();
        banned.dedup();
        Sampler {
            params,
            rng,
            prompt,
            counts: HashMap::new(),
            generated: 0,
            banned,
        }
    }

    /// Counts a generated token (the penalties and `min_tokens` read the counts).
    pub fn accept(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
        self.generated += 1;
    }

    /// The logit adjustments of the next token, sorted by token id, one entry a token: the
    /// repetition penalty over prompt and output tokens, the presence and frequency penalties
    /// over output tokens, `logit_bias`, and bans until `min_tokens`.
    pub fn adjustments(&self) -> Vec<Adjust> {
        let p = &self.params;
        if !p.adjusts_logits() {
            return Vec::new();
        }
        let mut by_id: BTreeMap<u32, Adjust> = BTreeMap::new();
        if p.repetition_penalty != 1.0 {
            for &t in self.prompt.iter().chain(self.counts.keys()) {
                by_id.entry(t).or_insert_with(|| Adjust::none(t)).factor = p.repetition_penalty;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.counts {
                by_id.entry(t).or_insert_with(|| Adjust::none(t)).add -=
                    p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
        for &(t, b) in &p.logit_bias {
            by_id.entry(t).or_insert_with(|| Adjust::none(t)).bias = b;
        }
        if self.generated < p.min_tokens {
            for &t in &self.banned {
                by_id.entry(t).or_insert_with(|| Adjust::none(t)).add = f32::NEG_INFINITY;
            }
        }
        by_id
            .into_values()
            .filter(|a| *a != Adjust::none(a.token))
            .collect()
    }

    /// The next row's sampling: its pick (taking the next key of the random stream for a draw),
    /// its adjustments, and whether the step must return its logits (log-probabilities).
    pub fn next_row(&mut self) -> RowSample {
        RowSample {
            pick: self.next_pick(),
            adjust: self.adjustments(),
            keep_logits: self.params.logprobs.is_some(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the next token is the argmax of the logits (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == 1
    }

    /// How the next token is to be picked, for the device that holds the logits; a draw takes
    /// the next key of the request's random stream.
    pub fn next_pick(&mut self) -> RowPick {
        if self.is_greedy() {
            return RowPick::Greedy;
        }
        let p = &self.params;
        RowPick::Draw(Draw {
            temperature: p.temperature,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            key: self.rng.random(),
        })
    }

    /// The next token for `logits` (one row over the vocabulary), picked on the host with the
    /// request's adjustments; the token is counted.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let t = self.next_row().pick(logits);
        self.accept(t);
        t
    }
}

/// One token's logit adjustment in a row: `l' = r(l + bias) + add`, where `r(x)` is `x / factor`
/// for `x > 0` and `x * factor` otherwise (the repetition penalty; 1: none) and `add` holds the
/// presence and frequency penalties, or -inf for a banned token. The host
/// ([`RowSample::pick`]) and the GPU's `kvf_adjust_rows` (`kernels/sampling.cu`) apply it the
/// same way, in f32 with the same operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adjust {
    pub token: u32,
    pub bias: f32,
    pub factor: f32,
    pub add: f32,
}

/// f32 words of one [`Adjust`] as the GPU reads it: token, bias, factor, add.
pub const ADJUST_WORDS: usize = 4;

impl Adjust {
    /// No change to `token`'s logit.
    pub fn none(token: u32) -> Self {
        Adjust {
            token,
            bias: 0.0,
            factor: 1.0,
            add: 0.0,
        }
    }

    /// The adjusted logit.
    pub fn apply(&self, l: f32) -> f32 {
        let x = l + self.bias;
        let x = if x > 0.0 { x / self.factor } else { x * self.factor };
        x + self.add
    }

    /// The words the GPU reads ([`ADJUST_WORDS`]).
    pub fn words(&self) -> [u32; ADJUST_WORDS] {
        [
            self.token,
            self.bias.to_bits(),
            self.factor.to_bits(),
            self.add.to_bits(),
        ]
    }
}

/// How a step treats one row: the row's [`Adjust`] list applied to its logits (token ids
/// unique), then its [`RowPick`]; `keep_logits` asks the step for the raw logits row back
/// (before any adjustment: the log-probabilities vLLM reports by default).
#[derive(Debug, Clone, PartialEq)]
pub struct RowSample {
    pub pick: RowPick,
    pub adjust: Vec<Adjust>,
    pub keep_logits: bool,
}

impl From<RowPick> for RowSample {
    fn from(pick: RowPick) -> Self {
        RowSample {
            pick,
            adjust: Vec::new(),
            keep_logits: false,
        }
    }
}

impl RowSample {
    /// The token this row chooses from its raw logits, on the host: adjusted, then picked.
    pub fn pick(&self, logits: &[f32]) -> u32 {
        if self.adjust.is_empty() {
            return self.pick.pick(logits);
        }
        let mut row = logits.to_vec();
        apply_adjustments(&mut row, &self.adjust);
        self.pick.pick(&row)
    }
}

/// Applies a row's adjustments in place (ids outside the row are skipped).
pub fn apply_adjustments(row: &mut [f32], adjust: &[Adjust]) {
    for a in adjust {
        if let Some(l) = row.get_mut(a.token as usize) {
            *l = a.apply(*l);
        }
    }
}

/// A token's log-probability under a row's distribution, with the row's most likely tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The `n` most likely tokens, most likely first (the lower id first on ties).
    pub top: Vec<(u32, f32)>,
}

/// The log-softmax of a raw logits row at `token`, and its `top` most likely tokens; computed
/// in f64 (logsumexp around the maximum) and rounded to f32. A row without a finite logit
/// gives -inf.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let m = logits
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = if m.is_finite() {
        m + logits
            .iter()
            .filter(|x| !x.is_nan())
            .map(|&x| (x as f64 - m).exp())
            .sum::<f64>()
            .ln()
    } else {
        f64::INFINITY
    };
    let lp = |x: f32| {
        if x.is_nan() {
            f32::NEG_INFINITY
        } else {
            (x as f64 - lse) as f32
        }
    };
    let mut best: Vec<(u32, f32)> = Vec::new();
    if top > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let key = |i: &u32| order_key(logits[*i as usize]);
        let n = top.min(idx.len());
        if n < idx.len() {
            idx.select_nth_unstable_by(n - 1, |a, b| key(b).cmp(&key(a)).then(a.cmp(b)));
            idx.truncate(n);
        }
        idx.sort_unstable_by(|a, b| key(b).cmp(&key(a)).then(a.cmp(b)));
        best = idx.into_iter().map(|i| (i, lp(logits[i as usize]))).collect();
    }
    TokenLogprobs {
        token,
        logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |&x| lp(x)),
        top: best,
    }
}

/// How a step picks one row's next token. The host ([`RowPick::pick`]) and the GPU's
/// `kvf_pick_rows` (`kernels/sampling.cu`) implement the same definition, so only token ids
/// leave a GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowPick {
    /// The argmax, the first maximum on ties.
    Greedy,
    /// A draw from the softmax of `logits / temperature`, restricted by top-k, then top-p.
    Draw(Draw),
}

/// One draw (temperature 0 or top-k 1: the argmax, as [`RowPick::Greedy`]): with
/// `s = logits / temperature` and `m` its maximum,
/// 0. min-p (`min_p > 0`, `m` finite): keep the tokens with `s >= m + ln(min_p)` (f32), i.e.
///    whose probability is at least `min_p` times the largest (vLLM applies it first too);
/// 1. top-k (`0 < top_k < vocab`): of those, keep the tokens whose `s` is at least the
///    `top_k`-th largest of the row (ties with it stay);
/// 2. top-p (`top_p < 1`): of those, keep the tokens whose `s` is at least the largest value
///    `t` such that the kept tokens with `s >= t` hold `top_p` of the kept softmax mass (the
///    smallest set of most likely tokens reaching `top_p`, ties with its last one stay);
/// 3. the token is the kept one with the largest `s + gumbel(key, i)` (the Gumbel-max trick:
///    a draw from the softmax over the kept tokens), the lowest index on ties.
///
/// Every step works on an order-preserving integer key of `s` (NaN counts as -inf), so the
/// host and the GPU keep the same sets: a boundary can differ only where the two devices'
/// float sums of the softmax mass differ, and the winner only where two scores are within
/// an ulp of `logf`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    pub temperature: f32,
    /// 0: every token.
    pub top_k: u32,
    /// 1: every token.
    pub top_p: f32,
    /// 0: every token.
    pub min_p: f32,
    /// The row's random key: the Gumbel noise of token `i` is a function of `(key, i)`.
    pub key: u64,
}

impl RowPick {
    /// The token this pick chooses from one row of logits, on the host.
    pub fn pick(&self, logits: &[f32]) -> u32 {
        match self {
            RowPick::Greedy => argmax(logits),
            RowPick::Draw(d) => d.pick(logits),
        }
    }
}

impl Draw {
    /// The token this draw chooses from one row of logits, on the host.
    pub fn pick(&self, logits: &[f32]) -> u32 {
        if logits.is_empty() || self.temperature <= 0.0 || self.top_k == 1 || self.temperature.is_nan() {
            return argmax(logits);
        }
        let t = self.temperature;
        let keys: Vec<u32> = logits.iter().map(|&x| order_key(x / t)).collect();
        let floor = self.kept_from(&keys);
        // `>`: the first of equal scores stays; a row of -inf only gives token 0, as the GPU's.
        let mut best = (f32::NEG_INFINITY, 0);
        for (i, &k) in keys.iter().enumerate() {
            let score = key_value(k) + gumbel(self.key, i as u32);
            if k >= floor && score > best.0 {
                best = (score, i as u32);
            }
        }
        best.1
    }

    /// The smallest key the draw keeps after top-k and top-p (0: every token).
    fn kept_from(&self, keys: &[u32]) -> u32 {
        let v = keys.len();
        let mut floor = 0;
        if self.min_p > 0.0 {
            let m = key_value(keys.iter().copied().max().unwrap_or(0));
            if m.is_finite() {
                floor = order_key(min_p_threshold(m, self.min_p));
            }
        }
        let k = self.top_k as usize;
        if k > 0 && k < v {
            let mut sorted = keys.to_vec();
            let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
            floor = floor.max(*kth);
        }
        if self.top_p < 1.0 {
            let mut kept: Vec<u32> = keys.iter().copied().filter(|&k| k >= floor).collect();
            kept.sort_unstable_by(|a, b| b.cmp(a));
            let max = key_value(kept[0]);
            if max.is_finite() {
                let mass = |k: u32| ((key_value(k) - max) as f64).exp();
                let z: f64 = kept.iter().map(|&k| mass(k)).sum();
                let target = self.top_p as f64 * z;
                let mut acc = 0.0;
                let mut i = 0;
                while i < kept.len() {
                    // A run of equal keys is kept or dropped together.
                    let key = kept[i];
                    while i < kept.len() && kept[i] == key {
                        acc += mass(key);
                        i += 1;
                    }
                    if acc >= target {
                        floor = key;
                        break;
                    }
                }
            }
        }
        floor
    }
}

/// The smallest scaled logit min-p keeps when the largest is `m`: `m + ln(min_p)` in f32 (as
/// `kernels/sampling.cu` computes it with `logf`).
pub fn min_p_threshold(m: f32, min_p: f32) -> f32 {
    m + min_p.ln()
}

/// An order-preserving `u32` of a scaled logit: `a < b` iff `order_key(a) < order_key(b)`;
/// NaN maps as -inf.
pub fn order_key(s: f32) -> u32 {
    let s = if s.is_nan() { f32::NEG_INFINITY } else { s };
    let b = s.to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The scaled logit of an [`order_key`].
pub fn key_value(k: u32) -> f32 {
    f32::from_bits(if k >> 31 == 1 { k & 0x7fff_ffff } else { !k })
}

/// The Gumbel noise of token `i` under a row's `key`: `-ln(-ln(u))` with `u` in (0, 1) from the
/// splitmix64 finaliser of `key + i * 0x9E3779B97F4A7C15` (23 bits, exact in f32), as
/// `kernels/sampling.cu` computes it.
pub fn gumbel(key: u64, i: u32) -> f32 {
    const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut z = key
        .wrapping_add((i as u64).wrapping_mul(GOLDEN))
        .wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let u = ((z >> 41) as f32 + 0.5) * (1.0 / 8_388_608.0);
    -(-u.ln()).ln()
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
/// until it is known not to. Each stop string runs a Knuth-Morris-Pratt automaton over the text
/// as it arrives, so a byte is examined a bounded number of times (amortised: at most twice per
/// stop string) however long the stop strings are, and the text held back is only the longest
/// tail that is still a prefix of one of them.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<StopAutomaton>,
    /// Keep the stop string in the text (`include_stop_str_in_output`).
    include: bool,
    held: String,
    /// Byte comparisons made so far (the linear bound is tested on it).
    examined: u64,
}

/// One stop string's automaton: `state` bytes of it match the end of the text so far.
#[derive(Debug)]
struct StopAutomaton {
    text: Vec<u8>,
    /// `fail[i]`: the longest proper prefix of `text[..=i]` that is also its suffix.
    fail: Vec<u32>,
    state: usize,
}

impl StopAutomaton {
    fn new(text: &str) -> Self {
        let text = text.as_bytes().to_vec();
        let mut fail = vec![0u32; text.len()];
        let mut k = 0usize;
        for i in 1..text.len() {
            while k > 0 && text[i] != text[k] {
                k = fail[k - 1] as usize;
            }
            if text[i] == text[k] {
                k += 1;
            }
            fail[i] = k as u32;
        }
        StopAutomaton { text, fail, state: 0 }
    }

    /// Feeds one byte; true when the whole stop string now ends the text.
    fn step(&mut self, b: u8, examined: &mut u64) -> bool {
        let mut q = self.state;
        loop {
            *examined += 1;
            if self.text[q] == b {
                q += 1;
                break;
            }
            if q == 0 {
                break;
            }
            q = self.fail[q - 1] as usize;
        }
        if q == self.text.len() {
            self.state = self.fail[q - 1] as usize;
            return true;
        }
        self.state = q;
        false
    }
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| StopAutomaton::new(s))
                .collect(),
            include: false,
            held: String::new(),
            examined: 0,
        }
    }

    /// A matcher that keeps the stop string it stops at in the text it returns.
    pub fn including_stop(mut self, include: bool) -> Self {
        self.include = include;
        self
    }

    /// Adds text; returns the text safe to emit and whether a stop string was reached (the
    /// stop string itself, unless [`StopMatcher::including_stop`], and everything after it are
    /// dropped). Of stop strings completed by the same text, the one that starts first wins.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        let base = self.held.len();
        self.held.push_str(text);
        // (start, end) of the first match.
        let mut first: Option<(usize, usize)> = None;
        for stop in &mut self.stops {
            for (i, &b) in text.as_bytes().iter().enumerate() {
                if stop.step(b, &mut self.examined) {
                    // A match starts inside the held tail: the automaton's state before this
                    // text was at most that tail's length.
                    let start = base + i + 1 - stop.text.len();
                    if first.is_none_or(|(f, _)| start < f) {
                        first = Some((start, base + i + 1));
                    }
                    break;
                }
            }
        }
        if let Some((at, end)) = first {
            let out = self.held[..if self.include { end } else { at }].to_string();
            self.held.clear();
            for stop in &mut self.stops {
                stop.state = 0;
            }
            return (out, true);
        }
        // Hold back the longest tail that is a prefix of some stop string; it starts with a
        // stop string's first byte, so on a character boundary.
        let keep = self.stops.iter().map(|s| s.state).max().unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The held-back text at the end of a generation that stopped for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Byte comparisons made so far: at most twice the bytes pushed per stop string.
    pub fn examined(&self) -> u64 {
        self.examined
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

    /// Draws with keys 0..n: how often each token came up.
    fn counts(d: Draw, logits: &[f32], n: u64) -> Vec<u64> {
        let mut c = vec![0u64; logits.len()];
        for key in 0..n {
            c[Draw { key, ..d }.pick(logits) as usize] += 1;
        }
        c
    }

    /// The softmax of `logits / t` over `kept` (others 0).
    fn softmax(logits: &[f32], t: f32, kept: &[usize]) -> Vec<f64> {
        let m = kept
            .iter()
            .map(|&i| logits[i] as f64 / t as f64)
            .fold(f64::MIN, f64::max);
        let mut p = vec![0.0; logits.len()];
        for &i in kept {
            p[i] = (logits[i] as f64 / t as f64 - m).exp();
        }
        let z: f64 = p.iter().sum();
        p.iter().map(|x| x / z).collect()
    }

    #[test]
    fn draws_follow_the_softmax_of_the_kept_tokens() {
        let logits = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 1.5, -3.0];
        let n = 200_000;
        let cases: [(f32, u32, f32, &[usize]); 4] = [
            (1.0, 0, 1.0, &[0, 1, 2, 3, 4, 5, 6, 7]),
            (0.5, 0, 1.0, &[0, 1, 2, 3, 4, 5, 6, 7]),
            // The three largest: 2.0, 1.5, 1.0.
            (1.0, 3, 1.0, &[5, 6, 0]),
            // At t = 1 the largest probabilities are 0.405, 0.245, 0.149, 0.090, ...:
            // 0.405 + 0.245 < 0.7 <= 0.405 + 0.245 + 0.149, so three tokens stay.
            (1.0, 0, 0.7, &[5, 6, 0]),
        ];
        for (t, top_k, top_p, kept) in cases {
            let d = Draw {
                temperature: t,
                top_k,
                top_p,
                min_p: 0.0,
                key: 0,
            };
            let got = counts(d, &logits, n);
            let want = softmax(&logits, t, kept);
            for (i, (&c, &p)) in got.iter().zip(&want).enumerate() {
                let f = c as f64 / n as f64;
                // Five standard deviations of a binomial frequency.
                let tol = 5.0 * (p * (1.0 - p) / n as f64).sqrt() + 1e-9;
                assert!(
                    (f - p).abs() <= tol,
                    "t {t} top_k {top_k} top_p {top_p}: token {i} drawn {f:.4}, softmax {p:.4}"
                );
            }
        }
    }

    #[test]
    fn ties_at_the_top_k_and_top_p_boundaries_stay() {
        let logits = [1.0, 1.0, 1.0, 0.0, 1.0];
        let d = Draw {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            min_p: 0.0,
            key: 0,
        };
        let c = counts(d, &logits, 4_000);
        assert_eq!(c[3], 0, "{c:?}");
        assert!([0, 1, 2, 4].iter().all(|&i| c[i] > 800), "{c:?}");
        // Token 0 alone holds under 30%: the four equal ones stay together.
        let d = Draw {
            top_k: 0,
            top_p: 0.3,
            ..d
        };
        let c = counts(d, &logits, 4_000);
        assert_eq!(c[3], 0, "{c:?}");
        assert!([0, 1, 2, 4].iter().all(|&i| c[i] > 800), "{c:?}");
    }

    #[test]
    fn order_keys_sort_as_the_floats_and_invert() {
        let xs = [
            f32::NEG_INFINITY,
            -3.0e38,
            -2.0,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            0.5,
            7.0,
            3.0e38,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{} {}", w[0], w[1]);
            assert_eq!(
                order_key(w[0]) < order_key(w[1]),
                w[0].to_bits() != w[1].to_bits()
            );
        }
        for x in xs {
            assert_eq!(key_value(order_key(x)).to_bits(), x.to_bits());
        }
        assert_eq!(order_key(f32::NAN), order_key(f32::NEG_INFINITY));
    }

    #[test]
    fn a_draw_is_a_function_of_its_key_and_a_row_of_minus_inf_gives_token_0() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32 * 0.05).cos()).collect();
        let d = Draw {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.0,
            key: 0xdead_beef,
        };
        assert_eq!(d.pick(&logits), d.pick(&logits));
        let distinct: std::collections::HashSet<_> =
            (0..200).map(|key| Draw { key, ..d }.pick(&logits)).collect();
        assert!(distinct.len() > 10, "{distinct:?}");
        assert!(distinct.len() <= 40);
        assert_eq!(d.pick(&[f32::NEG_INFINITY; 5]), 0);
        assert_eq!(d.pick(&[f32::NAN, f32::NEG_INFINITY]), 0);
    }

    /// What [`StopMatcher::push`] must answer after `text` arrived as the stream `seen`
    /// (everything pushed so far) of which `emitted` bytes went out, computed from scratch.
    fn reference(stops: &[&str], seen: &str, emitted: usize) -> (String, bool) {
        let hit = stops.iter().filter_map(|s| seen.find(s)).min();
        if let Some(at) = hit {
            return (seen[emitted..at].to_string(), true);
        }
        let keep = stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&k| s.is_char_boundary(k) && seen.ends_with(&s[..k])))
            .max()
            .unwrap_or(0);
        (seen[emitted..seen.len() - keep].to_string(), false)
    }

    #[test]
    fn stop_matching_agrees_with_a_search_from_scratch_on_random_streams() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // A small alphabet makes overlaps and near misses frequent; `é` checks boundaries.
        let alphabet = ["a", "b", "ab", "é", "\n"];
        for _ in 0..400 {
            let word = |rng: &mut rand::rngs::StdRng, n: usize| -> String {
                (0..n)
                    .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                    .collect()
            };
            let stops: Vec<String> = (0..rng.random_range(1..=4))
                .map(|_| {
                    let n = rng.random_range(1..6);
                    word(&mut rng, n)
                })
                .collect();
            let refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let mut m = StopMatcher::new(stops.clone());
            let (mut seen, mut emitted) = (String::new(), 0);
            for _ in 0..40 {
                let n = rng.random_range(0..4);
                let piece = word(&mut rng, n);
                seen.push_str(&piece);
                let want = reference(&refs, &seen, emitted);
                let got = m.push(&piece);
                assert_eq!(got, want, "stops {stops:?}, stream {seen:?}");
                if got.1 {
                    break;
                }
                emitted += got.0.len();
            }
        }
    }

    /// Issue 35: three 1.3 MB stop strings made every token's check quadratic in their length
    /// (on the serving loop, slowing every other request). The automata examine each byte of
    /// text a bounded number of times, whatever the stop strings' length.
    #[test]
    fn stop_matching_examines_each_byte_a_bounded_number_of_times_whatever_the_stop_length() {
        // The worst case of a naive matcher: text that keeps matching a long prefix.
        let long = format!("{}b", "a".repeat(200_000));
        let stops = vec![long.clone(), long.clone(), format!("{}c", "a".repeat(100_000))];
        let mut m = StopMatcher::new(stops.clone());
        let mut emitted = 0;
        let bytes = 300_000;
        for _ in 0..bytes {
            emitted += m.push("a").0.len();
        }
        assert!(
            m.examined() <= 2 * bytes as u64 * stops.len() as u64,
            "{} comparisons for {bytes} bytes",
            m.examined()
        );
        // Held back: the longest tail that can still start a stop string.
        assert_eq!(emitted, bytes - 200_000);
        let (out, hit) = m.push("b");
        assert!(hit);
        assert_eq!(out, "a".repeat(bytes - 200_000 - emitted));
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

    fn greedy_with(p: SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..p
        }
    }

    #[test]
    fn an_adjustment_divides_positive_logits_multiplies_negative_ones_then_adds() {
        let a = Adjust {
            token: 0,
            bias: 1.0,
            factor: 2.0,
            add: -0.5,
        };
        // (3 + 1) / 2 - 0.5 and (-3 + 1) * 2 - 0.5.
        assert_eq!(a.apply(3.0), 1.5);
        assert_eq!(a.apply(-3.0), -4.5);
        assert_eq!(Adjust::none(7).apply(-1.25), -1.25);
        let ban = Adjust {
            add: f32::NEG_INFINITY,
            ..Adjust::none(1)
        };
        assert_eq!(ban.apply(1e30), f32::NEG_INFINITY);
    }

    #[test]
    fn the_adjustment_list_follows_the_token_counts() {
        let p = SamplingParams {
            repetition_penalty: 1.5,
            presence_penalty: 0.25,
            frequency_penalty: 0.5,
            logit_bias: vec![(9, 3.0), (4, -1.0)],
            min_tokens: 2,
            stop_token_ids: vec![8],
            ..Default::default()
        };
        let mut s = Sampler::for_request(p, &[4, 5, 5], &[2]);
        let list = |s: &Sampler| s.adjustments();
        let a = list(&s);
        // Sorted by id, one entry a token: bans of EOS (2) and the stop id (8), the prompt's
        // tokens under the repetition penalty, the bias.
        assert_eq!(a.iter().map(|a| a.token).collect::<Vec<_>>(), [2, 4, 5, 8, 9]);
        assert_eq!(a[0].add, f32::NEG_INFINITY);
        assert_eq!((a[1].factor, a[1].bias, a[1].add), (1.5, -1.0, 0.0));
        assert_eq!((a[2].factor, a[2].add), (1.5, 0.0));
        assert_eq!(a[3].add, f32::NEG_INFINITY);
        assert_eq!((a[4].factor, a[4].bias), (1.0, 3.0));
        s.accept(7);
        s.accept(7);
        let a = list(&s);
        // Two tokens generated: the bans are lifted; token 7 now counts twice.
        assert!(a.iter().all(|a| a.add.is_finite()), "{a:?}");
        let seven = a.iter().find(|a| a.token == 7).unwrap();
        assert_eq!((seven.factor, seven.add), (1.5, -(0.5 * 2.0 + 0.25)));
        assert!(!a.iter().any(|a| a.token == 2 || a.token == 8), "{a:?}");
        // Neutral parameters: no list at all.
        let s = Sampler::for_request(SamplingParams::default(), &[1, 2, 3], &[2]);
        assert!(s.adjustments().is_empty());
    }

    #[test]
    fn min_tokens_bans_eos_and_stop_ids_for_the_pick_until_reached() {
        // EOS (token 0) is the argmax; min_tokens 2 picks the next best twice, then EOS.
        let logits = [5.0, 1.0, 2.0, 0.5];
        let p = greedy_with(SamplingParams {
            min_tokens: 2,
            stop_token_ids: vec![2],
            ..Default::default()
        });
        let mut s = Sampler::for_request(p, &[], &[0]);
        assert_eq!(s.sample(&logits), 1);
        assert_eq!(s.sample(&logits), 1);
        assert_eq!(s.sample(&logits), 0);
    }

    #[test]
    fn logit_bias_and_penalties_move_the_greedy_pick() {
        let logits = [2.0, 1.0, 0.0, -1.0];
        let mut s = Sampler::new(greedy_with(SamplingParams {
            logit_bias: vec![(3, 100.0)],
            ..Default::default()
        }));
        assert_eq!(s.sample(&logits), 3);
        // Frequency penalty 1.5: token 0 drops below token 1 after one use (2 - 1.5 < 1), token
        // 1 below token 0 after one use (1 - 1.5 < 0.5), so the greedy pick alternates.
        let mut s = Sampler::new(greedy_with(SamplingParams {
            frequency_penalty: 1.5,
            ..Default::default()
        }));
        let picks: Vec<u32> = (0..4).map(|_| s.sample(&logits)).collect();
        assert_eq!(picks, [0, 1, 0, 2]);
        // Presence penalty: a used token loses the same amount whatever its count.
        let mut s = Sampler::new(greedy_with(SamplingParams {
            presence_penalty: 1.5,
            ..Default::default()
        }));
        let picks: Vec<u32> = (0..4).map(|_| s.sample(&logits)).collect();
        assert_eq!(picks, [0, 1, 0, 0]);
        // Repetition penalty 4 over the prompt tokens 0 and 1: 2 -> 0.5 and 1 -> 0.25, still
        // above token 2's 0, so the argmax stays; a bias of 0.75 on token 2 (not in the prompt,
        // not divided) then wins.
        let mut s = Sampler::for_request(
            greedy_with(SamplingParams {
                repetition_penalty: 4.0,
                ..Default::default()
            }),
            &[0, 1],
            &[],
        );
        assert_eq!(s.sample(&logits), 0);
        let mut s = Sampler::for_request(
            greedy_with(SamplingParams {
                repetition_penalty: 4.0,
                logit_bias: vec![(2, 0.75)],
                ..Default::default()
            }),
            &[0, 1],
            &[],
        );
        assert_eq!(s.sample(&logits), 2);
    }

    #[test]
    fn min_p_keeps_only_tokens_within_its_ratio_of_the_most_likely() {
        // Probabilities at t = 1 relative to the largest: 1, e^-0.5, e^-1, e^-2, e^-3.
        let logits = [3.0, 2.5, 2.0, 1.0, 0.0];
        let d = Draw {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.3,
            key: 0,
        };
        // e^-1 = 0.37 >= 0.3 > e^-2: tokens 0, 1, 2 stay.
        let c = counts(d, &logits, 20_000);
        assert_eq!(c[3] + c[4], 0, "{c:?}");
        let want = softmax(&logits, 1.0, &[0, 1, 2]);
        for i in 0..3 {
            let f = c[i] as f64 / 20_000.0;
            assert!((f - want[i]).abs() < 0.02, "{c:?} {want:?}");
        }
        // With top-k 2 the smaller set wins; min_p 1 keeps the argmax alone.
        let c = counts(Draw { top_k: 2, ..d }, &logits, 4_000);
        assert_eq!(c[2] + c[3] + c[4], 0, "{c:?}");
        let c = counts(Draw { min_p: 1.0, ..d }, &logits, 1_000);
        assert_eq!(c[0], 1_000, "{c:?}");
        // At temperature 2 the same ratio keeps more: e^-1.5 = 0.22 < 0.3 <= e^-1.
        let c = counts(
            Draw {
                temperature: 2.0,
                ..d
            },
            &logits,
            20_000,
        );
        assert!(c[3] > 0 && c[4] == 0, "{c:?}");
    }

    #[test]
    fn log_probabilities_are_the_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let lp = token_logprobs(&logits, 4, 3);
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let want = |i: usize| (logits[i] as f64 - z.ln()) as f32;
        assert!((lp.logprob - want(4)).abs() < 1e-6);
        // Ties: the lower id first.
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 0]);
        for &(i, l) in &lp.top {
            assert!((l - want(i as usize)).abs() < 1e-6);
        }
        let total: f64 = (0..5).map(|i| (want(i) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(token_logprobs(&logits, 1, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 1, 9).top.len(), 5);
    }

    #[test]
    fn a_row_keeps_its_logits_only_when_it_asks_for_log_probabilities() {
        let mut s = Sampler::new(SamplingParams {
            logprobs: Some(2),
            ..Default::default()
        });
        assert!(s.next_row().keep_logits);
        assert!(!Sampler::new(SamplingParams::default()).next_row().keep_logits);
    }

    #[test]
    fn stop_strings_can_stay_in_the_output() {
        let mut m = StopMatcher::new(vec!["END".into()]).including_stop(true);
        assert_eq!(m.push("a E"), ("a ".into(), false));
        assert_eq!(m.push("NDxyz"), ("END".into(), true));
    }

    #[test]
    fn ranges_of_the_extra_parameters_are_checked_by_name() {
        for (p, name) in [
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..Default::default()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(1, 101.0)],
                    ..Default::default()
                },
                "logit_bias",
            ),
            (
                SamplingParams {
                    min_tokens: 17,
                    ..Default::default()
                },
                "min_tokens",
            ),
            (
                SamplingParams {
                    logprobs: Some(21),
                    ..Default::default()
                },
                "logprobs",
            ),
        ] {
            assert!(p.check().unwrap_err().contains(name), "{name}");
        }
        let scoring = SamplingParams {
            max_tokens: 0,
            prompt_logprobs: Some(1),
            ..Default::default()
        };
        assert!(scoring.check().is_ok());
        assert!(SamplingParams {
            max_tokens: 0,
            ..Default::default()
        }
        .check()
        .is_err());
    }
}

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

    /// The rows of a speculative step: the next token's, then one after each of `drafts` (the
    /// proposed tokens), each with its own key of the random stream and the adjustments of the
    /// tokens before it as if the proposals before it were accepted (a row is used only then).
    /// The token counts are left as they were: the caller [`Sampler::accept`]s what it takes.
    pub fn verify_rows(&mut self, drafts: &[u32]) -> Vec<RowSample> {
        let mut rows = Vec::with_capacity(drafts.len() + 1);
        rows.push(self.next_row());
        if drafts.is_empty() {
            return rows;
        }
        if !self.params.adjusts_logits() {
            rows.extend(drafts.iter().map(|_| self.next_row()));
            return rows;
        }
        let (counts, generated) = (self.counts.clone(), self.generated);
        for &d in drafts {
            self.accept(d);
            rows.push(self.next_row());
        }
        self.counts = counts;
        self.generated = generated;
        rows
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
mod tests;

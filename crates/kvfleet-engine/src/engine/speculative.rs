//! Speculative decoding's host side: the settings (vLLM's `--speculative-config` keys), the
//! n-gram proposer (prompt lookup: the tokens that followed the last occurrence of the
//! sequence's own last n tokens), the acceptance of a verified proposal, and the per-request
//! back-off that stops proposing where proposals keep failing.
//!
//! Verification is exact. A proposal from the n-gram proposer is a point mass: the rejection
//! rule of speculative sampling (accept proposed token `d` with probability `min(1, p(d) /
//! q(d)) = p(d)`, else draw from `p` with `d` removed and renormalised) is the same as drawing
//! `x ~ p` as usual and accepting `d` when `x == d`, emitting `x` otherwise. So each
//! verification row is an ordinary sampled row of the request (its own random key, and the
//! logit adjustments of the tokens before it), the request accepts proposals while the row's
//! pick equals them, and the first row that differs gives the correction: the tokens emitted are
//! distributed exactly as without speculation, and greedy requests emit the same tokens.

use serde::Deserialize;

/// Speculation methods (vLLM's `method`). All three run on this engine; the drafter methods
/// (EAGLE-3, DFlash) on the CPU engine only, so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMethod {
    Ngram,
    Eagle3,
    Dflash,
}

impl SpecMethod {
    /// Whether the method runs a drafter checkpoint (`model`).
    pub fn needs_drafter(self) -> bool {
        self != SpecMethod::Ngram
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SpecMethod::Ngram => "ngram",
            SpecMethod::Eagle3 => "eagle3",
            SpecMethod::Dflash => "dflash",
        }
    }
}

/// Most tokens one step may propose for a request.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Default of `prompt_lookup_max`: the longest n-gram looked up.
pub const DEFAULT_PROMPT_LOOKUP_MAX: usize = 4;
/// Default of `prompt_lookup_min`.
pub const DEFAULT_PROMPT_LOOKUP_MIN: usize = 1;
/// Default of `disable_by_batch_size`: speculation stops while this many requests run. At
/// this batch a decode step of a small model is still bound by weight reads, so verifying a
/// few more tokens a request costs little; far above it the step is compute-bound and every
/// rejected token is paid in full (see bench/RESULTS.md, "Speculative decoding").
pub const DEFAULT_DISABLE_BY_BATCH_SIZE: usize = 32;

/// Speculative decoding settings, in vLLM's `--speculative-config` JSON keys.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecConfig {
    pub method: SpecMethod,
    pub num_speculative_tokens: usize,
    #[serde(default)]
    pub prompt_lookup_max: Option<usize>,
    #[serde(default)]
    pub prompt_lookup_min: Option<usize>,
    #[serde(default)]
    pub disable_by_batch_size: Option<usize>,
    /// A drafter checkpoint (eagle3, dflash).
    #[serde(default)]
    pub model: Option<String>,
    /// The drafter's shape the deployment declared (`draftModel.geometry`), which the capacity
    /// plan counted: the loaded drafter must have it. Not a vLLM key.
    #[serde(skip)]
    pub declared: Option<kvfleet_core::api::DraftGeometry>,
}

impl SpecConfig {
    /// An n-gram configuration proposing `k` tokens with the default lookup.
    pub fn ngram(k: usize) -> Self {
        SpecConfig {
            method: SpecMethod::Ngram,
            num_speculative_tokens: k,
            prompt_lookup_max: None,
            prompt_lookup_min: None,
            disable_by_batch_size: None,
            model: None,
            declared: None,
        }
    }

    /// Parses vLLM's `--speculative-config` JSON and checks it; the error names the key.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let c: SpecConfig = serde_json::from_str(text).map_err(|e| {
            format!("--speculative-config: {e} (keys: method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, disable_by_batch_size, model)")
        })?;
        c.check()?;
        Ok(c)
    }

    /// What this engine can run: n-gram with 1 to 16 tokens and a lookup of 1 to 16 tokens, or
    /// an EAGLE-3 or DFlash drafter checkpoint (`model`) with 1 to 16 tokens.
    pub fn check(&self) -> Result<(), String> {
        match self.method {
            SpecMethod::Ngram if self.model.is_some() => {
                return Err("speculative model: n-gram speculation takes no draft model".into())
            }
            SpecMethod::Ngram => {}
            SpecMethod::Eagle3 | SpecMethod::Dflash => {
                let m = self.method.as_str();
                if self.model.as_deref().is_none_or(str::is_empty) {
                    return Err(format!(
                        "speculative model: method {m} needs the drafter checkpoint directory in `model`"
                    ));
                }
                for (key, set) in [
                    ("prompt_lookup_max", self.prompt_lookup_max.is_some()),
                    ("prompt_lookup_min", self.prompt_lookup_min.is_some()),
                ] {
                    if set {
                        return Err(format!("{key} applies to method ngram only, not {m}"));
                    }
                }
            }
        }
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&self.num_speculative_tokens) {
            return Err(format!(
                "num_speculative_tokens {} must be in [1, {MAX_SPECULATIVE_TOKENS}]",
                self.num_speculative_tokens
            ));
        }
        let (lo, hi) = (self.lookup_min(), self.lookup_max());
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&hi) || lo == 0 || lo > hi {
            return Err(format!(
                "prompt_lookup_min {lo} and prompt_lookup_max {hi} must satisfy 1 <= min <= max <= {MAX_SPECULATIVE_TOKENS}"
            ));
        }
        if self.disable_by_batch_size.is_some_and(|b| b < 2) {
            return Err("disable_by_batch_size must be at least 2".into());
        }
        Ok(())
    }

    pub fn lookup_max(&self) -> usize {
        self.prompt_lookup_max
            .unwrap_or(DEFAULT_PROMPT_LOOKUP_MAX.max(self.prompt_lookup_min.unwrap_or(0)))
    }

    pub fn lookup_min(&self) -> usize {
        self.prompt_lookup_min
            .unwrap_or(DEFAULT_PROMPT_LOOKUP_MIN.min(self.lookup_max_given()))
    }

    fn lookup_max_given(&self) -> usize {
        self.prompt_lookup_max.unwrap_or(DEFAULT_PROMPT_LOOKUP_MAX)
    }

    /// Requests running at which speculation stops.
    pub fn disable_at(&self) -> usize {
        self.disable_by_batch_size
            .unwrap_or(DEFAULT_DISABLE_BY_BATCH_SIZE)
    }

    /// The tokens to propose after `tokens` (prompt and output so far), `k` of them or none:
    /// see [`ngram_propose`].
    pub fn propose(&self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        ngram_propose(tokens, self.lookup_min(), self.lookup_max(), k, out)
    }
}

/// The n-gram proposal into `out` (cleared first): for `n` from `max_n` down to `min_n`, the
/// latest earlier occurrence of the last `n` tokens, and the `k` tokens that followed it. The
/// most recent match is taken (in an edit or a summary, what follows a phrase's latest use is
/// the likeliest continuation); where the match is so recent that fewer than `k` tokens follow
/// it, the copy runs on into its own proposal (a text repeating with period `p` goes on
/// repeating), so a proposal always has `k` tokens. Empty when nothing matches.
pub fn ngram_propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = tokens.len();
    if k == 0 || min_n == 0 {
        return;
    }
    for n in (min_n..=max_n).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        // An occurrence starting at `i` must end before the suffix does, so that a token follows it.
        for i in (0..len - n).rev() {
            if tokens[i] == suffix[0] && &tokens[i..i + n] == suffix {
                for j in i + n..i + n + k {
                    let t = if j < len { tokens[j] } else { out[j - len] };
                    out.push(t);
                }
                return;
            }
        }
    }
}

/// How many of `drafts` a verification accepts: the leading ones equal to the picks of their
/// rows (`picks[j]` is the token chosen where `drafts[j]` was proposed). The step then emits
/// `picks[..=accepted]`: the accepted proposals and one more (the correction, or the bonus
/// token after all of them).
pub fn accepted(picks: &[u32], drafts: &[u32]) -> usize {
    picks.iter().zip(drafts).take_while(|(p, d)| p == d).count()
}

/// A request's proposal back-off: after a proposal of which nothing was accepted the request
/// skips the next 1, 2, 4, ... up to [`Backoff::MAX_SKIP`] steps; any accepted token resets it.
/// A request whose text does not repeat itself stops paying for verification rows, and one
/// whose text turns repetitive later gets speculation back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backoff {
    skip: u32,
    wait: u32,
}

impl Backoff {
    pub const MAX_SKIP: u32 = 32;

    /// Whether to propose this step (counts a skipped step).
    pub fn ready(&mut self) -> bool {
        if self.wait > 0 {
            self.wait -= 1;
            return false;
        }
        true
    }

    /// Records a verified proposal of `proposed` tokens of which `accepted` were taken.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        if accepted == 0 {
            self.skip = (self.skip * 2).clamp(1, Self::MAX_SKIP);
            self.wait = self.skip;
        } else {
            self.skip = 0;
            self.wait = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_match_of_the_longest_ngram_proposes_what_followed_it() {
        let propose = |tokens: &[u32], min_n, max_n, k| {
            let mut out = vec![99];
            ngram_propose(tokens, min_n, max_n, k, &mut out);
            out
        };
        //            0  1  2  3  4  5  6  7  8  9 10 11
        let tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3];
        // Suffix [1, 2, 3] occurs at 0 and 4; the latest, at 4, was followed by 7, 5, 1.
        assert_eq!(propose(&tokens, 1, 3, 3), [7, 5, 1]);
        // Past the end of the sequence the copy runs on into the proposal: 7 5 1 2 3 | 7 5 ...
        assert_eq!(propose(&tokens, 1, 3, 8), [7, 5, 1, 2, 3, 7, 5, 1]);
        // A token repeated: the latest match is one back, and the proposal repeats it.
        assert_eq!(propose(&[3, 8, 8, 8], 1, 2, 4), [8, 8, 8, 8]);
        // No 2-gram [6, 4] occurs earlier and min_n 2 forbids a 1-gram fallback.
        assert_eq!(propose(&[4, 4, 6, 4], 2, 2, 3), [] as [u32; 0]);
        // A 1-gram falls back when the longer ones miss: [8, 4] never occurred, [4] did.
        assert_eq!(propose(&[4, 6, 8, 4], 1, 2, 2), [6, 8]);
        assert_eq!(propose(&[5], 1, 4, 2), [] as [u32; 0]);
    }

    #[test]
    fn acceptance_is_the_leading_run_of_picks_equal_to_the_proposal() {
        assert_eq!(accepted(&[7, 5, 9, 4], &[7, 5, 1]), 2);
        assert_eq!(accepted(&[8, 5, 1, 4], &[7, 5, 1]), 0);
        assert_eq!(accepted(&[7, 5, 1, 4], &[7, 5, 1]), 3);
    }

    #[test]
    fn a_failing_request_backs_off_and_an_accepted_token_resets_it() {
        let mut b = Backoff::default();
        assert!(b.ready());
        b.record(4, 0);
        assert!(!b.ready());
        assert!(b.ready());
        b.record(4, 0);
        assert_eq!((b.ready(), b.ready(), b.ready()), (false, false, true));
        for _ in 0..10 {
            b.record(4, 0);
        }
        assert_eq!(b.skip, Backoff::MAX_SKIP);
        b.record(4, 1);
        assert!(b.ready());
    }

    #[test]
    fn settings_parse_from_vllm_json_and_refuse_what_does_not_run_here() {
        let c =
            SpecConfig::from_json(r#"{"method":"ngram","num_speculative_tokens":5,"prompt_lookup_max":3}"#)
                .unwrap();
        assert_eq!((c.lookup_min(), c.lookup_max(), c.disable_at()), (1, 3, 32));
        let c =
            SpecConfig::from_json(r#"{"method":"eagle3","num_speculative_tokens":3,"model":"/d"}"#).unwrap();
        assert_eq!((c.method, c.model.as_deref()), (SpecMethod::Eagle3, Some("/d")));
        let e = SpecConfig::from_json(r#"{"method":"eagle3","num_speculative_tokens":3}"#).unwrap_err();
        assert!(e.contains("eagle3") && e.contains("`model`"), "{e}");
        let e = SpecConfig::from_json(
            r#"{"method":"eagle3","num_speculative_tokens":3,"model":"/d","prompt_lookup_max":2}"#,
        )
        .unwrap_err();
        assert!(e.contains("prompt_lookup_max"), "{e}");
        let e = SpecConfig::from_json(r#"{"method":"dflash","num_speculative_tokens":3}"#).unwrap_err();
        assert!(e.contains("dflash") && e.contains("`model`"), "{e}");
        let e =
            SpecConfig::from_json(r#"{"method":"ngram","num_speculative_tokens":3,"typo":1}"#).unwrap_err();
        assert!(e.contains("typo"), "{e}");
        let e = SpecConfig::from_json(r#"{"method":"ngram","num_speculative_tokens":0}"#).unwrap_err();
        assert!(e.contains("num_speculative_tokens"), "{e}");
        let e = SpecConfig::from_json(
            r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":5,"prompt_lookup_max":3}"#,
        )
        .unwrap_err();
        assert!(e.contains("prompt_lookup_min 5"), "{e}");
        // Only min given: max follows it up to the default.
        let c =
            SpecConfig::from_json(r#"{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":6}"#)
                .unwrap();
        assert_eq!((c.lookup_min(), c.lookup_max()), (6, 6));
    }
}

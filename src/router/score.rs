//! Which replica a request goes to: the one whose prefix cache saves the most of its prompt,
//! unless that costs more in queueing than it saves, or the replica has no KV room.
//!
//! Each ready replica gets
//!
//! ```text
//! score = prefixWeight * cached / prompt  -  loadWeight * (busy - least) / (most - least)
//! ```
//!
//! where `cached` is the prompt tokens its cache would serve (from its KV events), and `busy`
//! its requests in flight: the larger of what this router has sent it and not seen finish, and
//! the running plus waiting requests it reported at the last scrape (other routers send it work
//! too); `least` and `most` are the least and most busy of the candidates. The load term is
//! relative to the others, as llm-d's queue scorer normalises queue depth between the
//! candidates (llm-d-inference-scheduler `pkg/plugins/scorer/queue.go`): the least busy loses
//! nothing, the busiest `loadWeight`, whatever maxNumSeqs is. With the defaults (2 and 1), a
//! hit on most of the prompt (a conversation's history, a long shared document) outweighs any
//! load difference, while a short shared prefix (a chat template's default system prompt: 16
//! of 94 tokens, worth 0.34) does not outweigh one request more: before, the load term was
//! `busy / maxNumSeqs`, 4/64 against that 0.34, and guidellm's chat benchmark at concurrency 4
//! sent 44 of 44 requests to the replica that first cached the system prompt (issue 60).
//!
//! Past the scores, a guard: when the replica ranked first has at least `imbalanceRequests`
//! more requests in flight than the least busy one, and more than `imbalanceRatio` times as
//! many, the least busy goes first (reason `balance`), as SGLang's router falls back to the
//! shortest queue when the cache-aware choice is imbalanced beyond its thresholds
//! (sglang `sgl-router/src/policies/cache_aware.rs`). A replica whose window-aware free tokens
//! (less what this router sent it since that scrape) cannot hold the prompt's uncached tokens
//! is *full* and ranked after every replica that can, so a request never queues behind a full
//! pool while another has room.
//!
//! Ties (equal score to 1e-9) go to the replica a session id (`x-session-id`) maps to by
//! rendezvous hashing, then to the one with fewer requests in flight, then to the one whose
//! cache holds fewer blocks, then to the one with more free KV tokens, then round-robin. A new
//! prefix (no replica holds any of it) therefore goes where the fewest prefixes are: the blocks
//! of a prefix just sent count as held at once, so the next new prefix goes elsewhere rather
//! than wherever the rotation stands.

use std::hash::{Hash, Hasher};

/// The score's weights and the imbalance guard (`spec.routing.router.score`; `kvfleet router
/// --prefix-weight --load-weight --imbalance-requests --imbalance-ratio`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    /// Weight of the fraction of the prompt served from cache.
    pub prefix: f64,
    /// Weight of the replica's load relative to the other candidates' (0 for the least busy,
    /// all of it for the busiest).
    pub load: f64,
    /// The guard's absolute threshold: requests in flight more than the least busy replica.
    pub imbalance_requests: usize,
    /// The guard's relative threshold: times the least busy replica's requests in flight.
    pub imbalance_ratio: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            prefix: DEFAULT_PREFIX_WEIGHT,
            load: DEFAULT_LOAD_WEIGHT,
            imbalance_requests: DEFAULT_IMBALANCE_REQUESTS,
            imbalance_ratio: DEFAULT_IMBALANCE_RATIO,
        }
    }
}

/// Default weight of the fraction of the prompt served from cache.
pub const DEFAULT_PREFIX_WEIGHT: f64 = 2.0;
/// Default weight of the relative load.
pub const DEFAULT_LOAD_WEIGHT: f64 = 1.0;
/// Default absolute threshold of the imbalance guard (requests in flight).
pub const DEFAULT_IMBALANCE_REQUESTS: usize = 32;
/// Default relative threshold of the imbalance guard.
pub const DEFAULT_IMBALANCE_RATIO: f64 = 2.0;

/// What the router knows of one ready replica when a request arrives.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Candidate {
    /// Replica name (pod name, or its URL outside Kubernetes).
    pub name: String,
    /// Prompt tokens its prefix cache would serve.
    pub cached_tokens: usize,
    /// Requests this router sent it that have not finished.
    pub inflight: usize,
    /// Running and waiting requests at its last scrape (`None`: not scraped yet).
    pub reported_busy: Option<usize>,
    /// Window-aware free KV tokens at its last scrape, less the prompt tokens this router
    /// sent it since (`None`: unknown).
    pub free_tokens: Option<usize>,
    /// Its maxNumSeqs (0: unknown).
    pub max_num_seqs: usize,
    /// Blocks its prefix cache holds or is computing for requests this router just sent.
    pub held_blocks: usize,
}

/// Why the first-ranked replica won.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The only ready replica.
    Only,
    /// It holds a longer prefix than the others.
    Prefix,
    /// No prefix difference decided: it is the least loaded.
    Load,
    /// Tied; the request's session maps to it.
    Affinity,
    /// Every replica is full; it is the least bad.
    AllFull,
    /// The best-scored replica was too much busier than the least busy (the imbalance guard).
    Balance,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Only => "only",
            Reason::Prefix => "prefix",
            Reason::Load => "load",
            Reason::Affinity => "affinity",
            Reason::AllFull => "all_full",
            Reason::Balance => "balance",
        }
    }
}

impl Candidate {
    fn busy(&self) -> usize {
        self.inflight.max(self.reported_busy.unwrap_or(0))
    }

    fn full(&self, prompt_tokens: usize) -> bool {
        self.free_tokens
            .is_some_and(|free| free < prompt_tokens.saturating_sub(self.cached_tokens).max(1))
    }

    /// The score, with `least` and `most` the least and most busy candidates' loads.
    fn score(&self, prompt_tokens: usize, w: &Weights, least: usize, most: usize) -> f64 {
        let hit = if prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / prompt_tokens as f64
        };
        let load = if most > least {
            (self.busy() - least) as f64 / (most - least) as f64
        } else {
            0.0
        };
        w.prefix * hit - w.load * load
    }
}

/// Candidates in the order to try them (best first; the rest are fallbacks for a connection
/// that fails before the first byte), and why the first won. `session` is the request's
/// session id, `turn` a counter that rotates exact ties.
pub fn rank(
    prompt_tokens: usize,
    candidates: &[Candidate],
    session: Option<&str>,
    turn: usize,
    w: &Weights,
) -> (Vec<usize>, Reason) {
    let n = candidates.len();
    if n <= 1 {
        return ((0..n).collect(), Reason::Only);
    }
    let affinity = session.map(|s| {
        (0..n)
            .max_by_key(|&i| rendezvous(s, &candidates[i].name))
            .unwrap_or(0)
    });
    let full: Vec<bool> = candidates.iter().map(|c| c.full(prompt_tokens)).collect();
    // The load is relative to the candidates with room (a full one is ranked last anyway).
    let room = |i: &usize| !full[*i] || full.iter().all(|f| *f);
    let busy = || (0..n).filter(room).map(|i| candidates[i].busy());
    let (least, most) = (busy().min().unwrap_or(0), busy().max().unwrap_or(0));
    let scores: Vec<f64> = candidates
        .iter()
        .map(|c| c.score(prompt_tokens, w, least, most))
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        full[a]
            .cmp(&full[b])
            .then_with(|| {
                let (sa, sb) = (scores[a], scores[b]);
                if (sa - sb).abs() <= 1e-9 {
                    std::cmp::Ordering::Equal
                } else {
                    sb.total_cmp(&sa)
                }
            })
            .then_with(|| (affinity != Some(a)).cmp(&(affinity != Some(b))))
            .then_with(|| candidates[a].busy().cmp(&candidates[b].busy()))
            .then_with(|| candidates[a].held_blocks.cmp(&candidates[b].held_blocks))
            .then_with(|| candidates[b].free_tokens.cmp(&candidates[a].free_tokens))
            .then_with(|| ((a + n - turn % n) % n).cmp(&((b + n - turn % n) % n)))
    });
    // The imbalance guard: the least busy replica with room goes first when the best-scored
    // one is past both thresholds.
    let first_busy = candidates[order[0]].busy();
    if !full[order[0]]
        && first_busy >= least + w.imbalance_requests.max(1)
        && first_busy as f64 > w.imbalance_ratio * least as f64
    {
        if let Some(at) = order
            .iter()
            .position(|&i| !full[i] && candidates[i].busy() == least)
        {
            let idle = order.remove(at);
            order.insert(0, idle);
            return (order, Reason::Balance);
        }
    }
    let (first, second) = (order[0], order[1]);
    let reason = if full[first] {
        Reason::AllFull
    } else if (scores[first] - scores[second]).abs() <= 1e-9 && affinity == Some(first) && !full[second] {
        Reason::Affinity
    } else if candidates[first].cached_tokens > candidates[second].cached_tokens {
        Reason::Prefix
    } else {
        Reason::Load
    };
    (order, reason)
}

/// Rendezvous (highest random weight) hash: a session keeps its replica while that replica
/// stays, and only the sessions of a replica that goes move.
fn rendezvous(session: &str, replica: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    session.hash(&mut h);
    replica.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Weights = Weights {
        prefix: DEFAULT_PREFIX_WEIGHT,
        load: DEFAULT_LOAD_WEIGHT,
        imbalance_requests: DEFAULT_IMBALANCE_REQUESTS,
        imbalance_ratio: DEFAULT_IMBALANCE_RATIO,
    };

    fn c(name: &str, cached: usize, inflight: usize, free: Option<usize>) -> Candidate {
        Candidate {
            name: name.into(),
            cached_tokens: cached,
            inflight,
            reported_busy: None,
            free_tokens: free,
            max_num_seqs: 64,
            held_blocks: 0,
        }
    }

    #[test]
    fn a_new_prefix_goes_to_the_replica_holding_fewest_blocks_then_most_room() {
        // Nobody holds the prompt, all equally busy: b carries the least cache.
        let mut cands = [
            c("a", 0, 2, Some(50_000)),
            c("b", 0, 2, Some(10_000)),
            c("c", 0, 2, Some(90_000)),
        ];
        (cands[0].held_blocks, cands[1].held_blocks, cands[2].held_blocks) = (500, 250, 750);
        for turn in 0..6 {
            let (order, why) = rank(4_200, &cands, None, turn, &W);
            assert_eq!((order, why), (vec![1, 0, 2], Reason::Load), "turn {turn}");
        }
        // Equal holdings: the most free tokens, whatever the turn.
        for c in &mut cands {
            c.held_blocks = 250;
        }
        for turn in 0..6 {
            assert_eq!(
                rank(4_200, &cands, None, turn, &W).0,
                vec![2, 0, 1],
                "turn {turn}"
            );
        }
        // Four new prefixes over two idle replicas at the same turn: each one's blocks count as
        // held once sent (pending), so they alternate where the turn alone would stack them.
        let mut two = [c("a", 0, 0, Some(100_000)), c("b", 0, 0, Some(100_000))];
        let mut placed = Vec::new();
        for turn in [0, 0, 0, 0] {
            let first = rank(4_200, &two, None, turn, &W).0[0];
            two[first].held_blocks += 262;
            placed.push(first);
        }
        assert_eq!(placed, vec![0, 1, 0, 1]);
        // A prefix hit still beats holding less.
        let mut hit = [c("a", 0, 0, Some(100_000)), c("b", 3_968, 0, Some(100_000))];
        hit[1].held_blocks = 10_000;
        assert_eq!(rank(4_200, &hit, None, 0, &W), (vec![1, 0], Reason::Prefix));
    }

    #[test]
    fn the_replica_holding_the_prefix_wins_over_a_moderate_load_difference() {
        let cands = [c("a", 0, 0, Some(100_000)), c("b", 3_968, 30, Some(100_000))];
        let (order, why) = rank(4_200, &cands, None, 0, &W);
        assert_eq!((order[0], why), (1, Reason::Prefix));
        // Up to the imbalance guard: fully busy (64 of 64) against an idle replica, the idle
        // one computes the prefix too.
        let cands = [c("a", 0, 0, Some(100_000)), c("b", 3_968, 64, Some(100_000))];
        assert_eq!(rank(4_200, &cands, None, 0, &W), (vec![0, 1], Reason::Balance));
        // A short hit does not win even one request's difference...
        let cands = [c("a", 0, 0, Some(100_000)), c("b", 160, 1, Some(100_000))];
        let (order, why) = rank(4_200, &cands, None, 0, &W);
        assert_eq!((order[0], why), (0, Reason::Load));
    }

    #[test]
    fn a_replica_without_room_for_the_uncached_tokens_is_skipped() {
        // b holds the prefix but has 100 free tokens for 232 uncached ones.
        let cands = [c("a", 0, 5, Some(50_000)), c("b", 3_968, 0, Some(100))];
        let (order, why) = rank(4_200, &cands, None, 0, &W);
        assert_eq!((order, why), (vec![0, 1], Reason::Load));
        // With room for exactly what it must compute it is not full.
        let cands = [c("a", 0, 5, Some(50_000)), c("b", 3_968, 0, Some(232))];
        assert_eq!(rank(4_200, &cands, None, 0, &W).0[0], 1);
        // Every replica full: the best of them, said so.
        let cands = [c("a", 0, 5, Some(10)), c("b", 3_968, 0, Some(100))];
        assert_eq!(rank(4_200, &cands, None, 0, &W), (vec![1, 0], Reason::AllFull));
        // Unknown room (not scraped yet) is not full.
        let cands = [c("a", 0, 5, Some(10)), c("b", 0, 9, None)];
        assert_eq!(rank(4_200, &cands, None, 0, &W).0[0], 1);
    }

    #[test]
    fn the_load_counts_what_other_routers_sent_too() {
        let mut a = c("a", 0, 1, None);
        a.reported_busy = Some(50);
        let b = c("b", 0, 10, None);
        assert_eq!(rank(100, &[a, b], None, 0, &W).0[0], 1);
    }

    #[test]
    fn ties_go_to_the_session_then_the_less_busy_then_round_robin() {
        let cands: Vec<Candidate> = (0..4).map(|i| c(&format!("pod-{i}"), 0, 0, None)).collect();
        // A session always lands on the same replica, and sessions spread.
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..64 {
            let sid = format!("session-{s}");
            let (first, why) = rank(100, &cands, Some(&sid), 0, &W);
            assert_eq!(rank(100, &cands, Some(&sid), 7, &W).0[0], first[0]);
            assert_eq!(why, Reason::Affinity);
            seen.insert(first[0]);
        }
        assert_eq!(seen.len(), 4, "64 sessions over 4 replicas use all of them");
        // Without a session: exact ties rotate with the turn.
        let firsts: Vec<usize> = (0..4).map(|t| rank(100, &cands, None, t, &W).0[0]).collect();
        assert_eq!(firsts, vec![0, 1, 2, 3]);
        // A prefix difference beats the session.
        let mut cands = cands;
        cands[2].cached_tokens = 64;
        for s in 0..16 {
            assert_eq!(rank(100, &cands, Some(&format!("s{s}")), 0, &W).0[0], 2);
        }
    }

    /// Issue 60: a chat template's default system prompt (16 of 94 tokens) cached on one
    /// replica only. At concurrency 4 over two replicas, the one holding it got every request
    /// (0.34 of prefix against 4/64 of load); now one request more outweighs it, so the
    /// closed loop settles two and two.
    #[test]
    fn a_short_shared_prefix_does_not_outweigh_one_request_more() {
        // A closed loop of 4: before each arrival the oldest request finishes (FIFO). The
        // three before the first arrival all went to the holder.
        let mut flight: std::collections::VecDeque<usize> = [0, 0, 0, 0].into();
        let mut sent = (0usize, 0usize);
        for turn in 0..40 {
            flight.pop_front();
            let busy = |r: usize| flight.iter().filter(|f| **f == r).count();
            let cands = [
                c("holder", 16, busy(0), Some(10_000)),
                c("other", 0, busy(1), Some(10_000)),
            ];
            let (order, why) = rank(94, &cands, None, turn, &W);
            if order[0] == 0 {
                sent.0 += 1;
                assert!(busy(0) <= busy(1), "turn {turn}: {flight:?} {why:?}");
            } else {
                sent.1 += 1;
            }
            flight.push_back(order[0]);
        }
        assert!(sent.0.abs_diff(sent.1) <= 2, "split {sent:?}");
        // At equal load the short hit still decides.
        let cands = [c("holder", 16, 2, Some(10_000)), c("other", 0, 2, Some(10_000))];
        assert_eq!(rank(94, &cands, None, 0, &W), (vec![0, 1], Reason::Prefix));
    }

    #[test]
    fn the_imbalance_guard_sends_a_hit_to_the_least_busy_past_both_thresholds() {
        // A 95% hit on a replica with 40 in flight against one with 2: the guard.
        let cands = [c("a", 3_968, 40, Some(100_000)), c("b", 0, 2, Some(100_000))];
        assert_eq!(rank(4_200, &cands, None, 0, &W), (vec![1, 0], Reason::Balance));
        // 33 more but not twice as many (40 against 73): the hit stays.
        let cands = [c("a", 3_968, 73, Some(100_000)), c("b", 0, 40, Some(100_000))];
        assert_eq!(rank(4_200, &cands, None, 0, &W), (vec![0, 1], Reason::Prefix));
        // Fifteen times as many but fewer than 32 more: the hit stays.
        let cands = [c("a", 3_968, 30, Some(100_000)), c("b", 0, 2, Some(100_000))];
        assert_eq!(rank(4_200, &cands, None, 0, &W).0[0], 0);
        // The thresholds are settings: a guard of 8 requests moves it.
        let tight = Weights {
            imbalance_requests: 8,
            ..W
        };
        assert_eq!(
            rank(4_200, &cands, None, 0, &tight),
            (vec![1, 0], Reason::Balance)
        );
        // A full replica is never where the guard sends it.
        let cands = [c("a", 3_968, 40, Some(100_000)), c("b", 0, 2, Some(10))];
        assert_eq!(rank(4_200, &cands, None, 0, &W).0[0], 0);
    }

    #[test]
    fn one_or_no_replica() {
        assert_eq!(rank(10, &[], None, 0, &W), (vec![], Reason::Only));
        assert_eq!(
            rank(10, &[c("a", 0, 0, Some(0))], None, 3, &W),
            (vec![0], Reason::Only)
        );
    }
}

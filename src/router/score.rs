//! Which replica a request goes to: the one that holds most of its prompt in its prefix cache,
//! unless it has no KV room for the rest or is much busier than the others.
//!
//! Each ready replica gets
//!
//! ```text
//! score = PREFIX_WEIGHT * cached / prompt  -  LOAD_WEIGHT * busy / maxNumSeqs
//! ```
//!
//! where `cached` is the prompt tokens its cache would serve (from its KV events), and `busy`
//! its requests in flight: the larger of what this router has sent it and not seen finish, and
//! the running plus waiting requests it reported at the last scrape (other routers send it work
//! too). A replica whose window-aware free tokens (less what this router sent it since that
//! scrape) cannot hold the prompt's uncached tokens is *full* and ranked after every replica
//! that can, so a request never queues behind a full pool while another has room. The weights
//! make a prefix hit win over a moderate load difference (a 95% hit is worth nearly two
//! replicas' worth of queue), the way llm-d weighs its prefix scorer above its load scorers.
//!
//! Ties (equal score to 1e-9) go to the replica a session id (`x-session-id`) maps to by
//! rendezvous hashing, then to the one with fewer requests in flight, then to the one whose
//! cache holds fewer blocks, then to the one with more free KV tokens, then round-robin. A new
//! prefix (no replica holds any of it) therefore goes where the fewest prefixes are: the blocks
//! of a prefix just sent count as held at once, so the next new prefix goes elsewhere rather
//! than wherever the rotation stands.

use std::hash::{Hash, Hasher};

/// Weight of the fraction of the prompt served from cache.
pub const PREFIX_WEIGHT: f64 = 2.0;
/// Weight of the replica's occupancy (requests in flight over maxNumSeqs).
pub const LOAD_WEIGHT: f64 = 1.0;

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
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Only => "only",
            Reason::Prefix => "prefix",
            Reason::Load => "load",
            Reason::Affinity => "affinity",
            Reason::AllFull => "all_full",
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

    fn score(&self, prompt_tokens: usize) -> f64 {
        let hit = if prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / prompt_tokens as f64
        };
        let seqs = self.max_num_seqs.max(1) as f64;
        PREFIX_WEIGHT * hit - LOAD_WEIGHT * self.busy() as f64 / seqs
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
    let scores: Vec<f64> = candidates.iter().map(|c| c.score(prompt_tokens)).collect();
    let full: Vec<bool> = candidates.iter().map(|c| c.full(prompt_tokens)).collect();
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
            let (order, why) = rank(4_200, &cands, None, turn);
            assert_eq!((order, why), (vec![1, 0, 2], Reason::Load), "turn {turn}");
        }
        // Equal holdings: the most free tokens, whatever the turn.
        for c in &mut cands {
            c.held_blocks = 250;
        }
        for turn in 0..6 {
            assert_eq!(rank(4_200, &cands, None, turn).0, vec![2, 0, 1], "turn {turn}");
        }
        // Four new prefixes over two idle replicas at the same turn: each one's blocks count as
        // held once sent (pending), so they alternate where the turn alone would stack them.
        let mut two = [c("a", 0, 0, Some(100_000)), c("b", 0, 0, Some(100_000))];
        let mut placed = Vec::new();
        for turn in [0, 0, 0, 0] {
            let first = rank(4_200, &two, None, turn).0[0];
            two[first].held_blocks += 262;
            placed.push(first);
        }
        assert_eq!(placed, vec![0, 1, 0, 1]);
        // A prefix hit still beats holding less.
        let mut hit = [c("a", 0, 0, Some(100_000)), c("b", 3_968, 0, Some(100_000))];
        hit[1].held_blocks = 10_000;
        assert_eq!(rank(4_200, &hit, None, 0), (vec![1, 0], Reason::Prefix));
    }

    #[test]
    fn the_replica_holding_the_prefix_wins_over_a_moderate_load_difference() {
        let cands = [c("a", 0, 0, Some(100_000)), c("b", 3_968, 30, Some(100_000))];
        let (order, why) = rank(4_200, &cands, None, 0);
        assert_eq!((order[0], why), (1, Reason::Prefix));
        // Fully busy (64 of 64) the hit is still worth more than an idle replica...
        let cands = [c("a", 0, 0, Some(100_000)), c("b", 3_968, 64, Some(100_000))];
        assert_eq!(rank(4_200, &cands, None, 0).0[0], 1);
        // ...but a short hit is not.
        let cands = [c("a", 0, 0, Some(100_000)), c("b", 160, 40, Some(100_000))];
        let (order, why) = rank(4_200, &cands, None, 0);
        assert_eq!((order[0], why), (0, Reason::Load));
    }

    #[test]
    fn a_replica_without_room_for_the_uncached_tokens_is_skipped() {
        // b holds the prefix but has 100 free tokens for 232 uncached ones.
        let cands = [c("a", 0, 5, Some(50_000)), c("b", 3_968, 0, Some(100))];
        let (order, why) = rank(4_200, &cands, None, 0);
        assert_eq!((order, why), (vec![0, 1], Reason::Load));
        // With room for exactly what it must compute it is not full.
        let cands = [c("a", 0, 5, Some(50_000)), c("b", 3_968, 0, Some(232))];
        assert_eq!(rank(4_200, &cands, None, 0).0[0], 1);
        // Every replica full: the best of them, said so.
        let cands = [c("a", 0, 5, Some(10)), c("b", 3_968, 0, Some(100))];
        assert_eq!(rank(4_200, &cands, None, 0), (vec![1, 0], Reason::AllFull));
        // Unknown room (not scraped yet) is not full.
        let cands = [c("a", 0, 5, Some(10)), c("b", 0, 9, None)];
        assert_eq!(rank(4_200, &cands, None, 0).0[0], 1);
    }

    #[test]
    fn the_load_counts_what_other_routers_sent_too() {
        let mut a = c("a", 0, 1, None);
        a.reported_busy = Some(50);
        let b = c("b", 0, 10, None);
        assert_eq!(rank(100, &[a, b], None, 0).0[0], 1);
    }

    #[test]
    fn ties_go_to_the_session_then_the_less_busy_then_round_robin() {
        let cands: Vec<Candidate> = (0..4).map(|i| c(&format!("pod-{i}"), 0, 0, None)).collect();
        // A session always lands on the same replica, and sessions spread.
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..64 {
            let sid = format!("session-{s}");
            let (first, why) = rank(100, &cands, Some(&sid), 0);
            assert_eq!(rank(100, &cands, Some(&sid), 7).0[0], first[0]);
            assert_eq!(why, Reason::Affinity);
            seen.insert(first[0]);
        }
        assert_eq!(seen.len(), 4, "64 sessions over 4 replicas use all of them");
        // Without a session: exact ties rotate with the turn.
        let firsts: Vec<usize> = (0..4).map(|t| rank(100, &cands, None, t).0[0]).collect();
        assert_eq!(firsts, vec![0, 1, 2, 3]);
        // A prefix difference beats the session.
        let mut cands = cands;
        cands[2].cached_tokens = 64;
        for s in 0..16 {
            assert_eq!(rank(100, &cands, Some(&format!("s{s}")), 0).0[0], 2);
        }
    }

    #[test]
    fn one_or_no_replica() {
        assert_eq!(rank(10, &[], None, 0), (vec![], Reason::Only));
        assert_eq!(
            rank(10, &[c("a", 0, 0, Some(0))], None, 3),
            (vec![0], Reason::Only)
        );
    }
}

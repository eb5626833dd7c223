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

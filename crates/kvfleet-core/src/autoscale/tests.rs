use super::*;

const CAP: u64 = 100_000;

fn obs(t: f64, current: u32, demand: &[u64]) -> Observation {
    Observation {
        now_seconds: t,
        current_replicas: current,
        ready: demand
            .iter()
            .map(|&d| Sample {
                demand_tokens: d,
                capacity_tokens: CAP,
            })
            .collect(),
        pending_demand_tokens: 0,
        capacity_hint_tokens: None,
    }
}

/// Runs `steps` of (time, demand per ready replica) from `start` replicas, applying every
/// decision; returns the decisions.
fn run(policy: &Policy, start: u32, steps: &[(f64, u64)]) -> Vec<Decision> {
    let mut a = Autoscaler::default();
    let mut current = start;
    let mut out = Vec::new();
    for &(t, per_replica) in steps {
        let d = a.decide(policy, &obs(t, current, &vec![per_replica; current as usize]));
        current = d.desired;
        out.push(d);
    }
    out
}

fn every_15s(from: f64, to: f64, demand: u64) -> Vec<(f64, u64)> {
    let mut v = Vec::new();
    let mut t = from;
    while t < to {
        v.push((t, demand));
        t += 15.0;
    }
    v
}

#[test]
fn recommendation_is_demand_over_target_times_capacity_rounded_up() {
    let p = Policy::with_bounds(1, 10);
    let d = Autoscaler::default().decide(&p, &obs(0.0, 1, &[250_000]));
    // 250k / (0.8 x 100k) = 3.125 -> 4; the default steps allow 1 + 4 = 5.
    assert_eq!(d.recommendation, 4);
    assert_eq!(d.desired, 4);
    assert_eq!(d.reason, Reason::ScaleUp);
    assert_eq!(d.demand_ratio, Some(2.5));
}

#[test]
fn pending_demand_counts_with_the_replicas_demand() {
    let p = Policy::with_bounds(1, 10);
    let mut o = obs(0.0, 1, &[40_000]);
    o.pending_demand_tokens = 200_000;
    let d = Autoscaler::default().decide(&p, &o);
    // (40k + 200k) / 80k = 3.
    assert_eq!(d.recommendation, 3);
}

#[test]
fn capacity_is_the_mean_of_the_ready_replicas() {
    let p = Policy::with_bounds(1, 10);
    let mut o = obs(0.0, 2, &[]);
    o.ready = vec![
        Sample {
            demand_tokens: 240_000,
            capacity_tokens: 100_000,
        },
        Sample {
            demand_tokens: 240_000,
            capacity_tokens: 300_000,
        },
    ];
    let d = Autoscaler::default().decide(&p, &o);
    // 480k / (0.8 x 200k) = 3; with the smaller replica's capacity it would be 6.
    assert_eq!(d.recommendation, 3);
    assert_eq!(d.desired, 3);
}

#[test]
fn within_tolerance_the_current_count_is_kept() {
    let p = Policy::with_bounds(1, 10);
    // 170k over 2 x 100k = 0.85, 0.85 / 0.8 = 1.06: within 0.1, though ceil(170/80) = 3.
    let d = Autoscaler::default().decide(&p, &obs(0.0, 2, &[85_000, 85_000]));
    assert_eq!((d.recommendation, d.desired, d.reason), (2, 2, Reason::Stable));
    // 180k: 0.9 / 0.8 = 1.125, outside.
    let d = Autoscaler::default().decide(&p, &obs(0.0, 2, &[90_000, 90_000]));
    assert_eq!((d.recommendation, d.desired, d.reason), (3, 3, Reason::ScaleUp));
    // A tolerance of 0.2 keeps 2 there too.
    let wide = Policy { tolerance: 0.2, ..p };
    let d = Autoscaler::default().decide(&wide, &obs(0.0, 2, &[90_000, 90_000]));
    assert_eq!(d.desired, 2);
}

#[test]
fn the_recommendation_is_clamped_to_max_and_min() {
    let p = Policy::with_bounds(2, 4);
    let d = Autoscaler::default().decide(&p, &obs(0.0, 4, &[900_000; 4]));
    assert_eq!(
        (d.recommendation, d.desired, d.reason),
        (4, 4, Reason::AtMaxReplicas)
    );
    assert!(d.message.contains("capped at maxReplicas"), "{}", d.message);
    let d = Autoscaler::default().decide(&p, &obs(0.0, 2, &[1_000, 1_000]));
    assert_eq!(
        (d.recommendation, d.desired, d.reason),
        (2, 2, Reason::AtMinReplicas)
    );
}

#[test]
fn counts_outside_the_bounds_are_brought_back_at_once() {
    let p = Policy::with_bounds(2, 4);
    let d = Autoscaler::default().decide(&p, &obs(0.0, 9, &[0; 9]));
    assert_eq!((d.desired, d.reason), (4, Reason::AtMaxReplicas));
    let d = Autoscaler::default().decide(&p, &obs(0.0, 1, &[0]));
    assert_eq!((d.desired, d.reason), (2, Reason::AtMinReplicas));
}

#[test]
fn scale_down_waits_for_the_highest_recommendation_of_its_window() {
    let p = Policy::with_bounds(1, 10);
    // 4 replicas busy at t = 0 (recommendation 4), idle-ish from t = 15 (recommendation 1).
    let mut steps = vec![(0.0, 64_000)];
    steps.extend(every_15s(15.0, 330.0, 10_000));
    let ds = run(&p, 4, &steps);
    assert_eq!(ds[0].desired, 4);
    // t = 15 .. 285: the t = 0 recommendation is inside the 300 s window.
    for d in &ds[1..=19] {
        assert_eq!(
            (d.desired, d.reason),
            (4, Reason::HeldByStabilization),
            "{}",
            d.message
        );
    }
    // t = 300: the window (now - 300 s, now] no longer holds t = 0 (the HPA's strict cutoff).
    assert_eq!(ds[20].desired, 1);
    assert_eq!(ds[20].reason, Reason::ScaleDown);
}

#[test]
fn scale_up_takes_the_lowest_recommendation_of_its_window() {
    let p = Policy {
        scale_up: Rules {
            stabilization_window_seconds: 60,
            ..Rules::default_up()
        },
        ..Policy::with_bounds(1, 10)
    };
    // Calm at t = 0, a burst from t = 15: no change until t = 0 leaves the 60 s window.
    let mut steps = vec![(0.0, 50_000)];
    steps.extend(every_15s(15.0, 90.0, 200_000));
    let ds = run(&p, 1, &steps);
    for d in &ds[..=3] {
        assert_eq!(d.desired, 1, "{}", d.message);
    }
    assert_eq!(ds[3].reason, Reason::HeldByStabilization);
    assert_eq!(ds[4].desired, 3, "t = 60: {}", ds[4].message);
}

#[test]
fn scale_up_steps_count_the_changes_already_made_in_their_period() {
    let p = Policy {
        scale_up: Rules {
            stabilization_window_seconds: 0,
            select: Select::Max,
            steps: vec![Step::pods(1, 60)],
        },
        ..Policy::with_bounds(1, 10)
    };
    let mut a = Autoscaler::default();
    // Each replica reports 400k: 5 replicas' worth for one.
    let d = a.decide(&p, &obs(0.0, 1, &[400_000]));
    assert_eq!((d.desired, d.reason), (2, Reason::LimitedByStep));
    let d = a.decide(&p, &obs(30.0, 2, &[200_000, 200_000]));
    assert_eq!((d.desired, d.reason), (2, Reason::LimitedByStep));
    let d = a.decide(&p, &obs(61.0, 2, &[200_000, 200_000]));
    assert_eq!(d.desired, 3);
}

#[test]
fn select_max_takes_the_larger_step_and_min_the_smaller() {
    let steps = vec![Step::percent(100, 15), Step::pods(1, 15)];
    let with = |select| Policy {
        scale_up: Rules {
            stabilization_window_seconds: 0,
            select,
            steps: steps.clone(),
        },
        ..Policy::with_bounds(1, 20)
    };
    // 4 replicas that need 16: +100% allows 8, +1 pod allows 5.
    let o = obs(0.0, 4, &[320_000; 4]);
    assert_eq!(Autoscaler::default().decide(&with(Select::Max), &o).desired, 8);
    assert_eq!(Autoscaler::default().decide(&with(Select::Min), &o).desired, 5);
    assert_eq!(
        Autoscaler::default().decide(&with(Select::Disabled), &o).desired,
        4
    );
}

#[test]
fn percent_scale_down_truncates_as_the_hpa_does() {
    let p = Policy {
        scale_down: Rules {
            stabilization_window_seconds: 0,
            select: Select::Max,
            steps: vec![Step::percent(50, 60)],
        },
        ..Policy::with_bounds(1, 20)
    };
    let mut a = Autoscaler::default();
    // 5 idle replicas: 50% of 5 = 2.5, truncated to 2 left.
    let d = a.decide(&p, &obs(0.0, 5, &[1_000; 5]));
    assert_eq!((d.desired, d.reason), (2, Reason::LimitedByStep));
    // Within the period the start is still 5: no further change.
    let d = a.decide(&p, &obs(30.0, 2, &[1_000; 2]));
    assert_eq!((d.desired, d.reason), (2, Reason::LimitedByStep));
    let d = a.decide(&p, &obs(61.0, 2, &[1_000; 2]));
    assert_eq!(d.desired, 1);
}

#[test]
fn disabled_scale_down_never_removes_a_replica() {
    let p = Policy {
        scale_down: Rules {
            stabilization_window_seconds: 0,
            select: Select::Disabled,
            steps: vec![],
        },
        ..Policy::with_bounds(1, 10)
    };
    let ds = run(&p, 5, &every_15s(0.0, 600.0, 0));
    assert!(ds.iter().all(|d| d.desired == 5));
    assert_eq!(ds[0].reason, Reason::LimitedByStep);
}

#[test]
fn scale_to_zero_needs_zero_demand_for_the_whole_scale_down_window() {
    let p = Policy::with_bounds(0, 4);
    // Demand at t = 0, none after: zero only once t = 0 is 300 s behind.
    let mut steps = vec![(0.0, 10_000)];
    steps.extend(every_15s(15.0, 330.0, 0));
    let ds = run(&p, 1, &steps);
    for d in &ds[..=19] {
        assert_eq!(d.desired, 1, "{}", d.message);
    }
    assert_eq!(ds[19].reason, Reason::HeldByStabilization);
    assert_eq!(
        (ds[20].desired, ds[20].reason),
        (0, Reason::ScaleToZero),
        "t = 300"
    );
}

#[test]
fn a_new_autoscaler_watches_a_whole_window_before_scaling_to_zero() {
    let p = Policy::with_bounds(0, 4);
    let ds = run(&p, 2, &every_15s(1000.0, 1330.0, 0));
    // From 2 to 1 at once (the recommendation is 0, held at 1), to 0 after 300 s.
    assert_eq!(ds[0].desired, 1);
    assert_eq!(ds[19].desired, 1, "{}", ds[19].message);
    assert!(ds[19].message.contains("scaling to zero"), "{}", ds[19].message);
    assert_eq!(ds[20].desired, 0, "t = 1300: {}", ds[20].message);
}

#[test]
fn min_replicas_one_never_scales_to_zero() {
    let p = Policy::with_bounds(1, 4);
    let ds = run(&p, 1, &every_15s(0.0, 1200.0, 0));
    assert!(ds.iter().all(|d| d.desired == 1));
    assert_eq!(ds.last().map(|d| d.reason), Some(Reason::Stable));
}

#[test]
fn pending_demand_brings_a_replica_from_zero_at_once_despite_the_up_window() {
    let p = Policy {
        scale_up: Rules {
            stabilization_window_seconds: 300,
            ..Rules::default_up()
        },
        ..Policy::with_bounds(0, 10)
    };
    let mut a = Autoscaler::default();
    // Idle at 0 for a while, then one request waits in the router.
    for t in [0.0, 15.0, 30.0] {
        assert_eq!(a.decide(&p, &obs(t, 0, &[])).desired, 0);
    }
    let mut o = obs(45.0, 0, &[]);
    o.pending_demand_tokens = 2_000;
    o.capacity_hint_tokens = Some(CAP);
    let d = a.decide(&p, &o);
    assert_eq!((d.desired, d.reason), (1, Reason::ScaleFromZero));
    // Without any capacity known it still brings one.
    o.capacity_hint_tokens = None;
    let d = Autoscaler::default().decide(&p, &o);
    assert_eq!((d.desired, d.reason), (1, Reason::ScaleFromZero));
}

#[test]
fn a_large_queue_at_zero_starts_as_many_replicas_as_the_steps_allow() {
    let p = Policy::with_bounds(0, 10);
    let mut o = obs(0.0, 0, &[]);
    o.pending_demand_tokens = 800_000;
    o.capacity_hint_tokens = Some(CAP);
    let d = Autoscaler::default().decide(&p, &o);
    // 800k / 80k = 10 recommended; 100% of 0 is 0 but 4 pods per 15 s allow 4.
    assert_eq!(
        (d.recommendation, d.desired, d.reason),
        (10, 4, Reason::ScaleFromZero)
    );
}

#[test]
fn replicas_that_do_not_answer_are_never_scaled_down() {
    let p = Policy::with_bounds(1, 10);
    let mut o = obs(0.0, 3, &[]);
    o.capacity_hint_tokens = Some(CAP);
    let d = Autoscaler::default().decide(&p, &o);
    assert_eq!((d.desired, d.reason), (3, Reason::NoSignal));
    o.capacity_hint_tokens = None;
    let d = Autoscaler::default().decide(&p, &o);
    assert_eq!((d.desired, d.reason), (3, Reason::NoSignal));
}

#[test]
fn a_steady_load_near_the_target_never_flaps() {
    let p = Policy::with_bounds(1, 10);
    // Demand wobbling +-5% around 3 replicas at the target.
    let mut a = Autoscaler::default();
    let mut current = 3;
    let mut changes = 0;
    for i in 0..400 {
        let wobble = if i % 2 == 0 { 76_000 } else { 84_000 };
        let d = a.decide(
            &p,
            &obs(f64::from(i) * 15.0, current, &vec![wobble; current as usize]),
        );
        changes += u32::from(d.desired != current);
        current = d.desired;
    }
    assert_eq!((changes, current), (0, 3));
}

#[test]
fn reasons_read_as_their_names() {
    let all = [
        (Reason::ScaleUp, "ScaleUp"),
        (Reason::ScaleDown, "ScaleDown"),
        (Reason::Stable, "Stable"),
        (Reason::ScaleFromZero, "ScaleFromZero"),
        (Reason::ScaleToZero, "ScaleToZero"),
        (Reason::LimitedByStep, "LimitedByStep"),
        (Reason::HeldByStabilization, "HeldByStabilization"),
        (Reason::AtMaxReplicas, "AtMaxReplicas"),
        (Reason::AtMinReplicas, "AtMinReplicas"),
        (Reason::NoSignal, "NoSignal"),
    ];
    for (r, s) in all {
        assert_eq!(r.to_string(), s);
        assert_eq!(format!("{r:?}"), s);
    }
}

#[test]
fn defaults_are_the_hpa_documented_behaviour() {
    let up = Rules::default_up();
    assert_eq!(up.stabilization_window_seconds, 0);
    assert_eq!(up.select, Select::Max);
    assert_eq!(up.steps, vec![Step::percent(100, 15), Step::pods(4, 15)]);
    let down = Rules::default_down();
    assert_eq!(down.stabilization_window_seconds, 300);
    assert_eq!(down.steps, vec![Step::percent(100, 15)]);
    assert_eq!(Policy::with_bounds(1, 2).check(), Ok(()));
}

#[test]
fn invalid_policies_are_refused_with_what_to_change() {
    let bad = |f: fn(&mut Policy)| {
        let mut p = Policy::with_bounds(1, 4);
        f(&mut p);
        p.check().unwrap_err()
    };
    assert_eq!(bad(|p| p.max_replicas = 0), PolicyError::MaxZero);
    assert_eq!(
        bad(|p| p.min_replicas = 5),
        PolicyError::MaxBelowMin { min: 5, max: 4 }
    );
    assert_eq!(bad(|p| p.target_demand_ratio = 1.5), PolicyError::Target(1.5));
    let nan = bad(|p| p.target_demand_ratio = f64::NAN).to_string();
    assert!(nan.contains("(0, 1]"), "{nan}");
    assert_eq!(bad(|p| p.tolerance = 1.0), PolicyError::Tolerance(1.0));
    assert_eq!(
        bad(|p| p.scale_down.steps[0].period_seconds = 0),
        PolicyError::Step {
            direction: "scaleDown",
            index: 0
        }
    );
    assert_eq!(
        bad(|p| p.scale_up.stabilization_window_seconds = 4000),
        PolicyError::Window {
            direction: "scaleUp",
            seconds: 4000
        }
    );
    assert!(matches!(
        bad(|p| p.scale_up.steps.clear()),
        PolicyError::NoSteps { .. }
    ));
}

//! Per-step host overhead of the scheduler: `schedule` (admission, page allocation,
//! sliding-window frees, the CSR step plan) plus `complete` (positions, tokens, finishes),
//! with 256 requests decoding. Target: under 100 us per step.
//!
//! `cargo bench --bench scheduler` (release). Prints the median and p99 of N steps per case.

use std::time::Instant;

use kvfleet_engine::engine::layout::{GroupSpec, StepPlan};
use kvfleet_engine::engine::scheduler::{Scheduler, SchedulerConfig};

struct Case {
    name: &'static str,
    groups: Vec<GroupSpec>,
    prompt: usize,
}

fn run(case: &Case, running: usize, steps: usize) -> (f64, f64, f64, usize) {
    let cfg = SchedulerConfig {
        block_size: 16,
        max_num_seqs: running,
        max_num_batched_tokens: 8192,
        max_model_len: 32768,
        max_waiting: 100_000,
        prefix_caching: true,
    };
    let mut s = Scheduler::new(cfg, &case.groups);
    for id in 0..running as u64 {
        s.submit(id, case.prompt, 20_000).expect("fits");
    }
    let mut plan = StepPlan::default();
    let mut events = Vec::new();
    // Warm up until every request finished its prefill and decodes.
    while s.num_running() < running || s.schedule_peek_prefilling() {
        s.schedule(&mut plan, &mut events);
        s.complete(&mut events);
        events.clear();
    }
    let mut times = Vec::with_capacity(steps);
    let mut kv_indices = 0;
    for _ in 0..steps {
        let t0 = Instant::now();
        let n = s.schedule(&mut plan, &mut events);
        s.complete(&mut events);
        times.push(t0.elapsed().as_secs_f64() * 1e6);
        assert_eq!(n, running, "every request decodes one token");
        kv_indices = plan.groups.iter().map(|g| g.kv_indices.len()).sum();
        events.clear();
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p99 = times[times.len() * 99 / 100];
    let min = times[0];
    (median, p99, min, kv_indices)
}

fn main() {
    let steps = 2000;
    let cases = [
        Case {
            name: "full attention, context 1024+",
            groups: vec![GroupSpec {
                window: None,
                num_blocks: 600_000,
            }],
            prompt: 1024,
        },
        Case {
            name: "full + sliding(1024), context 4096+",
            groups: vec![
                GroupSpec {
                    window: None,
                    num_blocks: 600_000,
                },
                GroupSpec {
                    window: Some(1024),
                    num_blocks: 200_000,
                },
            ],
            prompt: 4096,
        },
    ];
    println!("| case | running | steps | median us/step | p99 us/step | min us/step | pages in plan |");
    println!("|---|---|---|---|---|---|---|");
    for case in &cases {
        let (median, p99, min, pages) = run(case, 256, steps);
        println!(
            "| {} | 256 | {steps} | {median:.1} | {p99:.1} | {min:.1} | {pages} |",
            case.name
        );
    }
}

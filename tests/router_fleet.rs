//! `kvfleet router` in front of three real CPU workers (the embedded SmolLM2, small KV pools,
//! KV events on) on loopback: requests that share a prefix land on the replica that holds it
//! and the router's predicted hit equals the `cached_tokens` the worker reports (completions
//! by token ids and chats tokenized by the router as the worker does); a replica without KV room
//! for a request's uncached tokens is skipped although it holds the prefix; a killed replica's
//! requests go to the others before any byte, none lost.
//!
//! Needs the embedded model (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod worker_support;
use worker_support::{free_port, header, http, Spawned};

fn spawn(mode: &str, name: &str, args: &[&str]) -> Spawned {
    Spawned::start("router-fleet", mode, name, args)
}

/// One routed request: (replica, predicted cached tokens, reported cached tokens).
fn routed(router: u16, path: &str, body: &Value) -> (String, u64, u64) {
    let (st, head, b) = http(router, "POST", path, &body.to_string(), &[]);
    assert_eq!(st, 200, "{head}\n{b}");
    let v: Value = serde_json::from_str(&b).unwrap_or_else(|e| panic!("{e}: {b}"));
    let replica = header(&head, "x-kvfleet-replica")
        .expect("replica header")
        .to_string();
    let predicted = header(&head, "x-kvfleet-predicted-cached-tokens")
        .unwrap()
        .parse()
        .unwrap();
    let reported = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (replica, predicted, reported)
}

fn state(router: u16) -> Vec<Value> {
    let (_, _, b) = http(router, "GET", "/v1/router/state", "", &[]);
    let v: Value = serde_json::from_str(&b).unwrap();
    v["replicas"].as_array().unwrap().clone()
}

/// Waits until `cond` holds of the router's view of `replica`.
fn wait_state(router: u16, replica: &str, what: &str, cond: impl Fn(&Value) -> bool) {
    let t0 = Instant::now();
    loop {
        let all = state(router);
        let r = all
            .iter()
            .find(|r| r["name"] == replica)
            .unwrap_or_else(|| panic!("{replica} not in {all:?}"));
        if cond(r) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "router never saw {what} on {replica}: {r}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 300 + (seed * 7919 + i * 31) % 20_000).collect()
}

/// Sum of the samples of `name` whose labels include every one of `labels` (`k="v"`).
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn router_sends_a_prefix_to_its_replica_skips_a_full_one_and_survives_a_killed_one() {
    let model = "SmolLM2-135M-Instruct";
    let worker_args = |kv: &str| -> Vec<String> {
        [
            "--max-kv-tokens",
            "512",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
            "--kv-events-endpoint",
            kv,
        ]
        .map(String::from)
        .to_vec()
    };
    let kv: Vec<String> = (0..3)
        .map(|_| format!("tcp://127.0.0.1:{}", free_port()))
        .collect();
    let mut workers: Vec<Spawned> = (0..3)
        .map(|i| {
            let a = worker_args(&kv[i]);
            spawn(
                "worker",
                &format!("w{i}"),
                &a.iter().map(String::as_str).collect::<Vec<_>>(),
            )
        })
        .collect();
    for w in &mut workers {
        w.wait_http("/readyz", Duration::from_secs(180));
    }
    let specs: Vec<String> = workers
        .iter()
        .zip(&kv)
        .map(|(w, k)| format!("http://127.0.0.1:{},{k}", w.port))
        .collect();
    let mut args = vec!["--scrape-interval-ms", "50"];
    for s in &specs {
        args.extend(["--worker", s.as_str()]);
    }
    let mut router = spawn("router", "router", &args);
    router.wait_http("/health", Duration::from_secs(60));
    let r = router.port;
    let name_of = |i: usize| format!("http://127.0.0.1:{}", workers[i].port);
    for i in 0..3 {
        wait_state(r, &name_of(i), "a subscription and a scrape", |s| {
            s["subscribed"] == true && s["scraped"] == true
        });
    }
    // ZeroMQ delivers to a subscriber only once its subscription reached the publisher.
    std::thread::sleep(Duration::from_millis(500));

    // 1. Placement: the first request of a prefix goes anywhere; once its blocks are announced,
    //    every request sharing the prefix goes to the same replica, predicted == reported.
    let mut homes = Vec::new();
    for group in 0..3u32 {
        let shared = tokens(group, 64);
        let first = json!({"model": model, "prompt": shared.iter().chain(&tokens(100 + group, 16)).collect::<Vec<_>>(),
            "max_tokens": 2, "temperature": 0});
        let (home, predicted, reported) = routed(r, "/v1/completions", &first);
        assert_eq!((predicted, reported), (0, 0), "a cold prefix");
        wait_state(r, &home, "the prefix's blocks", |s| {
            s["cachedBlocks"].as_u64().unwrap() >= 4
        });
        for k in 0..3u32 {
            let body = json!({"model": model, "prompt": shared.iter().chain(&tokens(200 + 10 * group + k, 16)).collect::<Vec<_>>(),
                "max_tokens": 2, "temperature": 0});
            let (replica, predicted, reported) = routed(r, "/v1/completions", &body);
            assert_eq!(
                replica, home,
                "group {group} request {k} left the replica holding its prefix"
            );
            assert_eq!(predicted, 64, "4 blocks of 16 shared");
            assert_eq!(
                predicted, reported,
                "the router's prediction is the worker's count"
            );
        }
        homes.push(home);
    }
    // Chats: the router renders and tokenizes as the worker does.
    let system = "You are a careful assistant for a shipping company. ".repeat(5);
    let chat = |q: &str| {
        json!({"model": model, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    let (chat_home, _, _) = routed(r, "/v1/chat/completions", &chat("Where is parcel 1?"));
    wait_state(r, &chat_home, "the chat's blocks", |s| {
        s["cachedBlocks"].as_u64().unwrap() > 0
    });
    let (replica, predicted, reported) = routed(r, "/v1/chat/completions", &chat("And parcel 2?"));
    assert_eq!(replica, chat_home);
    assert!(
        predicted >= 48,
        "the system prompt's blocks are predicted: {predicted}"
    );
    assert_eq!(predicted, reported);

    // 2. A full replica is skipped: a long request fills its home's pool, and a request that
    //    shares its prefix but brings more new tokens than the pool has free goes elsewhere.
    let home = homes[0].clone();
    let filler_prompt: Vec<u32> = tokens(0, 64).into_iter().chain(tokens(900, 300)).collect();
    let filler = json!({"model": model, "prompt": filler_prompt, "max_tokens": 40,
        "temperature": 0, "ignore_eos": true});
    let filler_thread = std::thread::spawn(move || routed(r, "/v1/completions", &filler));
    wait_state(r, &home, "its pool filling", |s| {
        s["freeTokens"].as_u64().unwrap() < 200 && s["running"].as_u64().unwrap() >= 1
    });
    let body = json!({"model": model, "prompt": tokens(0, 64).into_iter().chain(tokens(901, 200)).collect::<Vec<_>>(),
        "max_tokens": 2, "temperature": 0});
    let (replica, predicted, _) = routed(r, "/v1/completions", &body);
    assert_ne!(
        replica, home,
        "a replica without room for 200 new tokens got the request"
    );
    assert_eq!(predicted, 0, "the other replicas do not hold this prefix");
    let (filled, _, _) = filler_thread.join().unwrap();
    assert_eq!(filled, home, "the filler went to its prefix's replica");

    // 3. A killed replica: requests for its prefix go to the others, none lost.
    let victim = homes[1].clone();
    let idx = (0..3).find(|&i| name_of(i) == victim).unwrap();
    workers[idx].child.kill().unwrap();
    workers[idx].child.wait().unwrap();
    for k in 0..4u32 {
        let body = json!({"model": model, "prompt": tokens(1, 64).into_iter().chain(tokens(700 + k, 16)).collect::<Vec<_>>(),
            "max_tokens": 2, "temperature": 0});
        let (replica, _, _) = routed(r, "/v1/completions", &body);
        assert_ne!(replica, victim);
    }
    let (_, _, m) = http(r, "GET", "/metrics", "", &[]);
    let victim_label = format!("pod=\"{victim}\"");
    assert!(
        metric(
            &m,
            "kvfleet_router_upstream_errors_total",
            &["kind=\"connect\"", &victim_label]
        ) >= 1.0,
        "{m}"
    );
    assert!(metric(&m, "kvfleet_router_requests_total", &[]) >= 20.0, "{m}");
    assert!(
        metric(&m, "kvfleet_router_requests_total", &["reason=\"fallback\""]) >= 1.0,
        "{m}"
    );
    assert!(
        metric(&m, "kvfleet_router_requests_total", &["reason=\"prefix\""]) >= 10.0,
        "{m}"
    );
    assert!(
        metric(
            &m,
            "kvfleet_router_prefix_predictions_total",
            &["outcome=\"exact\""]
        ) >= 10.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "kvfleet_router_prefix_predictions_total",
            &["outcome=\"over\""]
        ),
        0.0,
        "{m}"
    );
}

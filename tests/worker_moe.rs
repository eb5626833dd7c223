//! The real `kvfleet worker` serving the tiny mixture-of-experts checkpoints of
//! `tests/fixtures/moe` (one per family, written with transformers by `generate.py`) on the CPU
//! engine: over HTTP, each prompt's greedy continuation is transformers' token for token, with
//! its log-probabilities (transformers run with K and V rounded to bf16, as the worker's KV
//! pools store them).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

mod worker_support;
use worker_support::{free_port, http, kvfleet_bin, smollm2, Spawned};

/// `kvfleet worker` on the CPU engine serving the checkpoint `dir` ([`kvfleet_bin`]: a binary
/// `KVFLEET_TEST_BIN` names, else this build's).
fn start(dir: &Path, name: &str) -> Spawned {
    let port = free_port();
    let log = std::env::temp_dir().join(format!("kvfleet-worker-moe-{}-{name}.log", std::process::id()));
    let child = Command::new(kvfleet_bin())
        .args(["worker", "--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--model",
            dir.to_str().unwrap(),
            "--attention-backend",
            "KVFLEET_CPU",
        ])
        .args(["--max-model-len", "1024"])
        .env("KVFLEET_SMOLLM2_GGUF", smollm2())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Spawned { child, port, log }
}

fn fixture(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/moe")
        .join(family)
}

#[test]
fn each_moe_family_served_over_http_continues_greedily_as_transformers_does() {
    for family in ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"] {
        let dir = fixture(family);
        let want: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        let tokenizer = kvfleet_engine::model::hf::load_tokenizer(&dir).unwrap();
        let mut w = start(&dir, family);
        w.wait_http("/readyz", Duration::from_secs(120));
        assert!(w.log().contains(family), "{}", w.log());
        let mut worst = 0f64;
        for (i, p) in want["prompts"].as_array().unwrap().iter().enumerate() {
            // The worker's pools hold K and V in bf16: the fixture's continuation with K and V
            // rounded so.
            let greedy: Vec<u32> = p["greedy_bf16_kv"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let body = serde_json::json!({
                "model": family, "prompt": p["ids"], "max_tokens": greedy.len(),
                "temperature": 0, "logprobs": 0, "ignore_eos": true,
            });
            let (status, _, text) = http(w.port, "POST", "/v1/completions", &body.to_string(), &[]);
            assert_eq!(status, 200, "{family} prompt {i}: {text}\n{}", w.log());
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let lp = &v["choices"][0]["logprobs"];
            // A token comes back as its text (bytes that are not UTF-8 lossily, as vLLM does),
            // and its log-probability, which tells apart tokens of the same text.
            let tokens: Vec<String> = greedy
                .iter()
                .map(|&id| String::from_utf8_lossy(tokenizer.token_bytes(id, true)).into_owned())
                .collect();
            let got: Vec<&str> = lp["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap())
                .collect();
            assert_eq!(got, tokens, "{family} prompt {i}: {v}");
            for (j, (a, b)) in lp["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .zip(p["greedy_bf16_kv_logprobs"].as_array().unwrap())
                .enumerate()
            {
                let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
                worst = worst.max((a - b).abs());
                assert!(
                    (a - b).abs() < 1e-3,
                    "{family} prompt {i} token {j}: log-probability {a} vs transformers' {b}"
                );
            }
            assert_eq!(v["usage"]["completion_tokens"], greedy.len(), "{v}");
        }
        eprintln!("{family}: greedy tokens equal; max |log-prob difference| {worst:.2e}");
        // Expert load: an observation per expert of each sparse layer each step, as many
        // tokens as the steps routed (every token to top-k = 2 experts).
        let (_, _, metrics) = http(w.port, "GET", "/metrics", "", &[]);
        let series = |name: &str| {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"))
        };
        let (count, sum) = (
            series("kvfleet_moe_expert_tokens_count"),
            series("kvfleet_moe_expert_tokens_sum"),
        );
        assert!(count > 0.0 && count % 8.0 == 0.0, "{count}");
        assert!(sum > 0.0 && sum % 2.0 == 0.0, "{sum}");
    }
}

//! Issue 56: `kvfleet worker --model DIR` serves 4-bit checkpoints (AWQ GEMM, GPTQ,
//! compressed-tensors W4A16; `tests/fixtures/int4/`, written by its `generate.py`) on the CPU
//! engine, their weights packed; a completion's greedy tokens and their log-probabilities are
//! those of the same model with its weights dequantized to f32, computed here in-process.
//! `--quantization fp8` on such a checkpoint stops the worker naming the format.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvfleet_engine::model::hf;
use kvfleet_engine::model::sampling::argmax;

mod worker_support;
use worker_support::{http, Spawned};

const SUITE: &str = "worker-w4";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/int4")
        .join(name)
}

/// The greedy continuation of `prompt` by the fixture's model with f32 weights: each token as
/// the worker's log-probabilities show it (its bytes, lossily UTF-8) and its log-probability.
fn greedy_f32(name: &str, prompt: &str, n: usize) -> Vec<(String, f64)> {
    let dir = fixture(name);
    let tok = hf::load_tokenizer(&dir).unwrap();
    let m = hf::load_model(&dir).unwrap().dequantized();
    let mut ids = tok.encode(prompt, true);
    let mut out = Vec::new();
    for _ in 0..n {
        // `prompt_logits` gives every position but the last: one more token, then the row of
        // the last real one.
        let last = ids.len() - 1;
        let padded: Vec<u32> = ids.iter().copied().chain([0]).collect();
        let row = m
            .prompt_logits(&padded, |i, row| (i == last).then(|| row.to_vec()))
            .unwrap()
            .into_iter()
            .flatten()
            .next()
            .unwrap();
        let id = argmax(&row);
        let max = row.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v)) as f64;
        let lse = row.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln() + max;
        out.push((
            String::from_utf8_lossy(tok.token_bytes(id, true)).into_owned(),
            row[id as usize] as f64 - lse,
        ));
        ids.push(id);
    }
    out
}

#[test]
fn the_cpu_worker_serves_each_4bit_checkpoint_with_the_greedy_tokens_of_its_f32_dequantization() {
    let prompt = "The capital of France is";
    let n = 10;
    for name in [
        "awq-g32",
        "awq-g128",
        "gptq-g32-sym",
        "gptq-g64-asym-act",
        "gptq-channel-v2",
        "ct-group-asym",
        "ct-channel-sym",
        "ct-pkg-group-asym",
    ] {
        let dir = fixture(name);
        let mut w = Spawned::start(
            SUITE,
            "worker",
            name,
            &[
                "--model",
                dir.to_str().unwrap(),
                "--attention-backend",
                "KVFLEET_CPU",
                "--max-model-len",
                "256",
            ],
        );
        w.wait_http("/readyz", Duration::from_secs(120));
        let body = serde_json::json!({
            "model": name, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "logprobs": 0, "ignore_eos": true,
        })
        .to_string();
        let (st, _, resp) = http(w.port, "POST", "/v1/completions", &body, &[]);
        assert_eq!(st, 200, "{name}: {resp}\n{}", w.log());
        let v: serde_json::Value = serde_json::from_str(&resp).unwrap();
        let lp = &v["choices"][0]["logprobs"];
        let served: Vec<(String, f64)> = lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .zip(lp["token_logprobs"].as_array().unwrap())
            .map(|(t, l)| (t.as_str().unwrap().to_string(), l.as_f64().unwrap()))
            .collect();
        let want = greedy_f32(name, prompt, n);
        assert_eq!(served.len(), n, "{name}: {v}");
        for (i, ((st, sl), (wt, wl))) in served.iter().zip(&want).enumerate() {
            assert_eq!(st, wt, "{name}: token {i}: served {served:?}, f32 {want:?}");
            // The worker keeps K/V in bf16; the reference attends over f32 K/V.
            assert!(
                (sl - wl).abs() < 2e-2,
                "{name}: token {i} log-probability {sl} vs {wl}"
            );
        }
    }
}

#[test]
fn fp8_at_load_on_a_4bit_checkpoint_stops_the_worker_naming_its_format() {
    let dir = fixture("awq-g32");
    let mut w = Spawned::start(
        SUITE,
        "worker",
        "fp8-on-awq",
        &["--model", dir.to_str().unwrap(), "--quantization", "fp8"],
    );
    let t0 = Instant::now();
    let code = loop {
        if let Some(s) = w.child.try_wait().unwrap() {
            break s.code();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "still running\n{}",
            w.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(code, Some(2), "{}", w.log());
    let log = w.log();
    assert!(
        log.contains("AWQ 4-bit") && log.contains("--quantization"),
        "{log}"
    );
}

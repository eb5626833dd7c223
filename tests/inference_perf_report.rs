//! inference-perf's server-side report, read through a real Prometheus scraping a real
//! `kvfleet worker` (issue 34): the PromQL that inference-perf 0.7.0's vLLM client issues, with
//! its label filter and its window, must return a non-zero request rate, time to first token,
//! inter-token latency and KV-cache usage, and every metric it reads must be one the worker
//! exports (or one named below as not exported, with the reason).
//!
//! The queries are inference-perf's own, rendered by its code into
//! tests/fixtures/inference_perf_vllm_queries.json (bench/clients/inference_perf_queries.py):
//! kubernetes-sigs/inference-perf, inference_perf/client/modelserver/vllm_client.py
//! (`get_prometheus_metric_metadata`, filters `model_name='...'`) and
//! inference_perf/client/modelserver/metrics/{counter,gauge,histogram}/base.py (`get_queries`).
//! The window and evaluation time follow
//! inference_perf/client/server_metrics/prometheus_client/base.py (`collect_metrics_for_stage`):
//! evaluated at the stage's end plus the scrape interval plus 2 s, over the span from the
//! stage's start to that instant, rendered in whole seconds. inference-perf itself needs
//! Python >= 3.12 and pulls transformers, datasets, boto3 and google-cloud-storage, so CI does
//! not install it; bench/clients.md runs the real tool.
//!
//! Needs the embedded model (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`) and Prometheus
//! (`KVFLEET_PROMETHEUS`, PATH or .tools/bin).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

mod prom_support;
mod tools_support;
mod worker_support;
use prom_support::{
    check_alive, first_value, http, metric_names, prom_query, prom_query_at, start_prometheus, wait_for,
};
use worker_support::Spawned;

/// inference-perf's PROMETHEUS_SCRAPE_BUFFER_SEC (prometheus_client/base.py).
const SCRAPE_BUFFER_S: f64 = 2.0;
const SCRAPE_INTERVAL_S: f64 = 1.0;
/// The longest the stage goes on waiting for a scrape to see requests running; the report's
/// assertions then say what it did not see.
const STAGE_LIMIT: Duration = Duration::from_secs(120);

/// Series inference-perf's vLLM client asks for that the worker does not export, with why.
/// inference-perf reads an absent series as 0 (`execute_query`), as it does against a vLLM
/// started without the flag that enables one.
const NOT_EXPORTED: &[(&str, &str)] = &[
    (
        "vllm:external_prefix_cache_hits",
        "no KV connector: there is no external cache",
    ),
    (
        "vllm:external_prefix_cache_queries",
        "no KV connector: there is no external cache",
    ),
    ("vllm:mm_cache_hits", "text-only models: no multimodal cache"),
    ("vllm:mm_cache_queries", "text-only models: no multimodal cache"),
    (
        "vllm:corrupted_requests",
        "vLLM exports it only with VLLM_COMPUTE_NANS_IN_LOGITS=1",
    ),
    (
        "vllm:kv_block_idle_before_evict_seconds",
        "vLLM exports it only with --kv-cache-metrics",
    ),
    (
        "vllm:kv_block_lifetime_seconds",
        "vLLM exports it only with --kv-cache-metrics",
    ),
    (
        "vllm:kv_block_reuse_gap_seconds",
        "vLLM exports it only with --kv-cache-metrics",
    ),
];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn prometheus() -> PathBuf {
    tools_support::find_tool(
        "KVFLEET_PROMETHEUS",
        "prometheus",
        "install the Debian package `prometheus` (`.ci/install-tools` does it) or point the variable at the binary",
    )
}

/// False for NaN (a query that errored) as for zero.
fn positive(value: f64) -> bool {
    value > 0.0
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

/// One metric of inference-perf's report: its field, PromQL name, kind and rendered queries.
struct ReportMetric {
    field: String,
    kind: String,
    metric: String,
    queries: Vec<String>,
}

fn report_metrics() -> Vec<ReportMetric> {
    let path = repo().join("tests/fixtures/inference_perf_vllm_queries.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text).expect("fixture JSON");
    assert_eq!(
        json["filters"], "model_name='${model}'",
        "inference-perf filters on the served model"
    );
    json["metrics"]
        .as_array()
        .expect("metrics")
        .iter()
        .map(|m| ReportMetric {
            field: m["field"].as_str().expect("field").to_owned(),
            kind: m["kind"].as_str().expect("kind").to_owned(),
            metric: m["metric"].as_str().expect("metric").to_owned(),
            queries: m["queries"]
                .as_array()
                .expect("queries")
                .iter()
                .map(|q| q.as_str().expect("query").to_owned())
                .collect(),
        })
        .collect()
}

/// The series names one inference-perf metric may be read from, as it queries them: a counter
/// under `NAME_total` or `NAME` (either), a histogram under `_sum`, `_count` and `_bucket`
/// (all), a gauge under its name.
fn exposed_names(m: &ReportMetric) -> (Vec<String>, bool) {
    let base = m.metric.as_str();
    match m.kind.as_str() {
        "CounterMetric" => {
            let base = base.strip_suffix("_total").unwrap_or(base);
            (vec![format!("{base}_total"), base.to_owned()], false)
        }
        "HistogramMetric" => (
            ["_sum", "_count", "_bucket"]
                .iter()
                .map(|s| format!("{base}{s}"))
                .collect(),
            true,
        ),
        "GaugeMetric" => (vec![base.to_owned()], true),
        other => panic!("{}: unknown metric kind {other}", m.field),
    }
}

#[test]
fn the_fixture_holds_inference_perfs_four_report_metrics_and_their_query_shapes() {
    let metrics = report_metrics();
    let by_field: BTreeMap<&str, &ReportMetric> = metrics.iter().map(|m| (m.field.as_str(), m)).collect();
    for (field, metric, kind, queries) in [
        ("requests", "vllm:request_success", "CounterMetric", 3),
        (
            "time_to_first_token",
            "vllm:time_to_first_token_seconds",
            "HistogramMetric",
            5,
        ),
        (
            "inter_token_latency",
            "vllm:inter_token_latency_seconds",
            "HistogramMetric",
            5,
        ),
        ("kv_cache_usage", "vllm:kv_cache_usage_perc", "GaugeMetric", 4),
    ] {
        let m = by_field
            .get(field)
            .unwrap_or_else(|| panic!("no {field} in the fixture"));
        assert_eq!(
            (m.metric.as_str(), m.kind.as_str(), m.queries.len()),
            (metric, kind, queries)
        );
        for q in &m.queries {
            assert!(
                q.contains("{model_name='${model}'}"),
                "{field}: unfiltered query {q}"
            );
            assert!(q.contains("[${window}"), "{field}: no window in {q}");
            let (names, _) = exposed_names(m);
            let read = metric_names(q);
            assert!(
                !read.is_empty() && read.iter().all(|n| names.contains(n)),
                "{field}: {q} reads {read:?}, not only {names:?}"
            );
        }
    }
}

/// Starts the worker and a Prometheus scraping it every second, streams completions from 4
/// concurrent clients as inference-perf's stage would until a scrape has seen them running,
/// then evaluates every query of inference-perf's report at the stage's evaluation time over
/// its window.
#[test]
fn inference_perfs_server_side_report_reads_rate_ttft_itl_and_kv_usage_from_prometheus() {
    let metrics = report_metrics();
    let scratch = std::env::temp_dir().join(format!("kvfleet-inference-perf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).expect("scratch");

    let mut worker = Spawned::start("inference-perf", "worker", "smollm2", &[]);
    worker.wait_http("/readyz", Duration::from_secs(180));
    let port = worker.port;
    let (_, models) = http(port, "GET", "/v1/models", None).expect("GET /v1/models");
    let models: Value = serde_json::from_str(&models).expect("models JSON");
    // inference-perf takes the first served model when none is configured.
    let model = models["data"][0]["id"]
        .as_str()
        .expect("a served model")
        .to_owned();

    let config = format!(
        "global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\nscrape_configs:\n  - job_name: kvfleet-worker\n    \
         static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
    );
    let (mut prom, prom_port) = start_prometheus(&prometheus(), &scratch, &config);
    wait_for("worker target up", Duration::from_secs(60), || {
        check_alive(&mut prom)?;
        let up = prom_query(prom_port, r#"up{job="kvfleet-worker"} == 1"#)?;
        if up.is_empty() {
            return Err("target not up".into());
        }
        Ok(())
    });

    // The stage: 4 concurrent clients streaming completions, ignore_eos as inference-perf sends by
    // default so every request decodes its max_tokens. A stage in a real run lasts long enough for
    // many scrapes; here each client goes on sending until Prometheus has sampled the worker with
    // requests running and KV in use (at least one request each, at most STAGE_LIMIT). A fixed
    // number of requests made this depend on the machine's speed: on CI (stop 44) four requests
    // finished within one scrape interval and no sample saw them running.
    let start = now();
    // Prometheus's rate() and increase() see only what changed between two samples inside the
    // window, so a sample taken before the first request must fall in it: with the window starting
    // at `start`, wait two scrape intervals before sending (a stage's own first seconds in a real
    // run). Without this, a prefill finished before the window's first sample counted as no
    // prompt tokens and no TTFT at all (CI, stop 40).
    std::thread::sleep(Duration::from_secs_f64(2.0 * SCRAPE_INTERVAL_S));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let model = model.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut answers = Vec::new();
                for r in 0.. {
                    let body = serde_json::json!({
                        "model": model, "prompt": format!("Client {c}, request {r}: tell a story about"),
                        "max_tokens": 12, "stream": true, "ignore_eos": true, "temperature": 0,
                    })
                    .to_string();
                    answers.push(http(port, "POST", "/v1/completions", Some(&body)));
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
                answers
            })
        })
        .collect();
    let seen = |expr: &str| -> bool {
        let expr = expr.replace("${model}", &model);
        prom_query(prom_port, &expr)
            .map(|r| !r.is_empty())
            .unwrap_or(false)
    };
    let stage_end = now() + STAGE_LIMIT.as_secs_f64();
    while now() < stage_end
        && !(seen("max_over_time(vllm:num_requests_running{model_name='${model}'}[5m]) > 0")
            && seen("max_over_time(vllm:kv_cache_usage_perc{model_name='${model}'}[5m]) > 0"))
    {
        check_alive(&mut prom).expect("prometheus");
        std::thread::sleep(Duration::from_millis(250));
    }
    stop.store(true, Ordering::Relaxed);
    let mut sent = 0;
    for c in clients {
        for r in c.join().expect("client thread") {
            let (status, body) = r.expect("completion");
            assert_eq!(status, 200, "{body}\n{}", worker.log());
            assert!(body.contains("data: [DONE]"), "not a finished stream: {body}");
            sent += 1;
        }
    }
    let end = now();
    let eval = end + SCRAPE_INTERVAL_S + SCRAPE_BUFFER_S;
    // Rounded up: rounding down would cut the window's oldest second, the one holding the sample
    // taken before the first request.
    let window = format!("{}s", (eval - start).ceil() as u64);
    std::thread::sleep(Duration::from_secs_f64((eval - now()).max(0.0) + 0.5));

    // Every query, as inference-perf evaluates it: the first sample's value, 0 when empty.
    let mut failures = Vec::new();
    let mut report: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for m in &metrics {
        let values = m
            .queries
            .iter()
            .map(|q| {
                let expr = q.replace("${model}", &model).replace("${window}", &window);
                match prom_query_at(prom_port, &expr, Some(eval)) {
                    Ok(result) => first_value(&result).unwrap_or(0.0),
                    Err(error) => {
                        failures.push(format!("{}: {expr}: {error}", m.field));
                        f64::NAN
                    }
                }
            })
            .collect();
        report.insert(m.field.clone(), values);
    }
    println!("inference-perf report over {window} ({sent} requests, model {model}):");
    for (field, values) in &report {
        println!("  {field:40} {values:?}");
    }
    let v = |field: &str, i: usize| {
        report
            .get(field)
            .and_then(|v| v.get(i).copied())
            .unwrap_or(f64::NAN)
    };

    // Counters: [total, avg rate, rate]; histograms: [avg, p50, p90, p99, rate]; gauges:
    // [avg, p50, p90, p99].
    for (what, value) in [
        ("request rate", v("requests", 2)),
        ("requests finished", v("requests", 0)),
        ("output token rate", v("output_tokens", 2)),
        ("prompt token rate", v("prompt_tokens", 2)),
        ("TTFT mean", v("time_to_first_token", 0)),
        ("TTFT p50", v("time_to_first_token", 1)),
        ("TTFT p90", v("time_to_first_token", 2)),
        ("ITL mean", v("inter_token_latency", 0)),
        ("ITL p50", v("inter_token_latency", 1)),
        ("ITL rate", v("inter_token_latency", 4)),
        ("KV-cache usage mean", v("kv_cache_usage", 0)),
        ("KV-cache usage p99", v("kv_cache_usage", 3)),
        ("running requests p99", v("num_requests_running", 3)),
    ] {
        if !positive(value) {
            failures.push(format!("{what} is {value}, not > 0"));
        }
    }
    // The same stage seen two ways must agree: the first token comes before the last, and the
    // KV-cache usage is a fraction.
    let (ttft, e2e) = (v("time_to_first_token", 0), v("request_latency", 0));
    if !positive(e2e) || ttft > e2e {
        failures.push(format!("mean TTFT {ttft} above mean end-to-end latency {e2e}"));
    }
    let kv_p99 = v("kv_cache_usage", 3);
    if kv_p99.is_nan() || kv_p99 > 1.0 {
        failures.push(format!("KV-cache usage p99 {kv_p99} above 1"));
    }

    // Every series inference-perf reads is exported, or named in NOT_EXPORTED.
    let (_, exposition) = http(port, "GET", "/metrics", None).expect("GET /metrics");
    let exported: BTreeSet<&str> = exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let mut missing = BTreeSet::new();
    for m in &metrics {
        let (names, all) = exposed_names(m);
        let found = names.iter().filter(|n| exported.contains(n.as_str())).count();
        let complete = if all { found == names.len() } else { found > 0 };
        if !complete {
            missing.insert(m.metric.as_str());
        }
    }
    let excused: BTreeSet<&str> = NOT_EXPORTED.iter().map(|(n, _)| *n).collect();
    if missing != excused {
        failures.push(format!(
            "read by inference-perf but not exported: {:?}; named as not exported but exported: {:?}",
            missing.difference(&excused).collect::<Vec<_>>(),
            excused.difference(&missing).collect::<Vec<_>>()
        ));
    }

    drop(prom);
    let log = worker.log();
    drop(worker);
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(
        failures.is_empty(),
        "{} failures:\n{}\nworker log:\n{log}",
        failures.len(),
        failures.join("\n")
    );
}

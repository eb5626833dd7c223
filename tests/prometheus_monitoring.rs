//! Prometheus rules and Grafana dashboards, checked with the real tools (Debian package
//! `prometheus`): `promtool check rules`, `promtool test rules`, and a real Prometheus that
//! scrapes a real `kvfleet worker` on loopback and answers every dashboard query.
//!
//! Tools are found through `KVFLEET_PROMTOOL` / `KVFLEET_PROMETHEUS`, then `PATH`, then
//! `.tools/bin/`. A missing tool fails the test with the way to install it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

// === tools ===

mod prom_support;
mod tools_support;
use prom_support::{
    check_alive, first_value, free_port, http, metric_names, prom_query, start_prometheus, wait_for, Proc,
};
use tools_support::find_tool;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

const INSTALL_PROMETHEUS: &str = "install the Debian package `prometheus` (apt-get install -y prometheus; \
     `.ci/install-tools` does it) and stop the service it may start, or point the variable at the binary";

fn promtool() -> PathBuf {
    find_tool("KVFLEET_PROMTOOL", "promtool", INSTALL_PROMETHEUS)
}

fn prometheus() -> PathBuf {
    find_tool("KVFLEET_PROMETHEUS", "prometheus", INSTALL_PROMETHEUS)
}

fn rules_file() -> PathBuf {
    repo().join("deploy/prometheus/kvfleet-rules.yaml")
}

fn yaml(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let value: serde_yaml::Value =
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::to_value(value).expect("JSON")
}

fn run_promtool(args: &[&str]) -> String {
    let out = Command::new(promtool())
        .args(args)
        .current_dir(repo())
        .output()
        .expect("cannot run promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool {} failed:\n{text}",
        args.join(" ")
    );
    text
}

fn alert_names() -> BTreeSet<String> {
    let rules = yaml(&rules_file());
    rules["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

fn rule_test_files() -> Vec<PathBuf> {
    let dir = repo().join("deploy/prometheus/tests");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no promtool tests under {}", dir.display());
    files
}

// === tests: rules ===

#[test]
fn promtool_check_rules_accepts_the_rules() {
    let out = run_promtool(&["check", "rules", "deploy/prometheus/kvfleet-rules.yaml"]);
    assert!(out.contains("SUCCESS"), "{out}");
    // The chart's copy is checked too (tests/chart.rs checks it is identical).
    run_promtool(&[
        "check",
        "rules",
        "charts/kvfleet/files/prometheus/kvfleet-rules.yaml",
    ]);
}

#[test]
fn promtool_unit_tests_of_the_rules_pass() {
    for file in rule_test_files() {
        let rel = file.strip_prefix(repo()).expect("inside the repo");
        let out = run_promtool(&["test", "rules", rel.to_str().expect("UTF-8")]);
        assert!(out.contains("SUCCESS"), "{out}");
    }
}

/// The acceptance rule: every alert has a unit test where it fires and one where it does not.
#[test]
fn every_alert_has_a_firing_and_a_quiet_unit_test() {
    let mut fires = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for file in rule_test_files() {
        let tests = yaml(&file);
        for test in tests["tests"].as_array().expect("tests") {
            for case in test["alert_rule_test"].as_array().into_iter().flatten() {
                let name = case["alertname"].as_str().expect("alertname").to_owned();
                let expected = case["exp_alerts"].as_array().map(Vec::len).unwrap_or(0);
                if expected > 0 {
                    fires.insert(name);
                } else {
                    quiet.insert(name);
                }
            }
        }
    }
    let alerts = alert_names();
    assert!(
        alerts.len() >= 5,
        "expected at least five alerts, found {alerts:?}"
    );
    let never_fires: Vec<_> = alerts.difference(&fires).collect();
    let never_quiet: Vec<_> = alerts.difference(&quiet).collect();
    assert!(
        never_fires.is_empty(),
        "alerts without a test where they fire: {never_fires:?}"
    );
    assert!(
        never_quiet.is_empty(),
        "alerts without a test where they stay quiet: {never_quiet:?}"
    );
    let unknown: Vec<_> = fires.union(&quiet).filter(|a| !alerts.contains(*a)).collect();
    assert!(
        unknown.is_empty(),
        "tests name alerts that do not exist: {unknown:?}"
    );
}

// === dashboards ===

struct Query {
    dashboard: String,
    panel: String,
    expr: String,
}

fn dashboards() -> Vec<(String, Value)> {
    let dir = repo().join("deploy/grafana");
    let mut out: Vec<(String, Value)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("dashboard");
            let json: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.file_name().expect("name").to_string_lossy().into_owned(), json)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(out.len(), 3, "fleet, deployment and operator dashboards");
    out
}

fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        out.push(panel);
        out.extend(panel["panels"].as_array().into_iter().flatten());
    }
    out
}

fn queries() -> Vec<Query> {
    let mut out = Vec::new();
    for (file, dashboard) in dashboards() {
        for panel in panels(&dashboard) {
            for target in panel["targets"].as_array().into_iter().flatten() {
                out.push(Query {
                    dashboard: file.clone(),
                    panel: panel["title"].as_str().unwrap_or_default().to_owned(),
                    expr: target["expr"]
                        .as_str()
                        .expect("every target has an expr")
                        .to_owned(),
                });
            }
        }
    }
    out
}

/// Worker metrics: a query reading only these must return data from a running worker.
fn is_worker_metric(name: &str) -> bool {
    let base = name
        .strip_suffix("_bucket")
        .or_else(|| name.strip_suffix("_count"))
        .or_else(|| name.strip_suffix("_sum"))
        .unwrap_or(name);
    base.starts_with("vllm:")
        || [
            "kvfleet_kv_cache_capacity_tokens",
            "kvfleet_kv_cache_predicted_capacity_tokens",
            "kvfleet_kv_demand_tokens",
            "kvfleet_kv_capacity_tokens",
            "kvfleet_kv_cache_blocks",
            "kvfleet_kv_cache_usage_ratio",
            "kvfleet_kv_cache_max_concurrency",
            "kvfleet_requests",
            "kvfleet_preemptions_total",
            "kvfleet_requests_finished_total",
            "kvfleet_requests_failed_total",
            "kvfleet_requests_timed_out_total",
            "kvfleet_tokens_total",
            "kvfleet_attention_seconds",
            "kvfleet_gpu_info",
        ]
        .contains(&base)
}

#[test]
fn dashboards_are_well_formed_and_templated_on_the_datasource() {
    for (file, dashboard) in dashboards() {
        assert!(
            dashboard["uid"]
                .as_str()
                .is_some_and(|u| u.starts_with("kvfleet-")),
            "{file}: uid"
        );
        let vars: BTreeSet<&str> = dashboard["templating"]["list"]
            .as_array()
            .expect("templating")
            .iter()
            .filter_map(|v| v["name"].as_str())
            .collect();
        assert!(vars.contains("datasource"), "{file}: no datasource variable");
        let mut ids = BTreeSet::new();
        for panel in panels(&dashboard) {
            let id = panel["id"].as_u64().expect("panel id");
            assert!(ids.insert(id), "{file}: duplicate panel id {id}");
            if panel["type"] == "row" {
                continue;
            }
            assert_eq!(
                panel["datasource"]["uid"], "${datasource}",
                "{file}: {}",
                panel["title"]
            );
            assert!(
                !panel["targets"].as_array().expect("targets").is_empty(),
                "{file}: {} has no query",
                panel["title"]
            );
            let grid = &panel["gridPos"];
            let right = grid["x"].as_u64().expect("x") + grid["w"].as_u64().expect("w");
            assert!(right <= 24, "{file}: {} sticks out of the grid", panel["title"]);
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("expr");
                for var in ["$namespace", "$deployment", "$pod"] {
                    if expr.contains(var) {
                        assert!(vars.contains(&var[1..]), "{file}: {expr} uses undefined {var}");
                    }
                }
            }
        }
    }
}

/// docs/dashboards.md lists the metric contract the controller, webhook and worker implement;
/// every metric a dashboard or rule reads must be in it.
#[test]
fn every_metric_read_by_dashboards_and_rules_is_documented() {
    let doc = std::fs::read_to_string(repo().join("docs/dashboards.md")).expect("docs/dashboards.md");
    let mut exprs: Vec<String> = queries().into_iter().map(|q| q.expr).collect();
    let rules = yaml(&rules_file());
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            exprs.push(rule["expr"].as_str().expect("expr").to_owned());
        }
    }
    let recorded: BTreeSet<String> = rules["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .filter_map(|r| r["record"].as_str().map(str::to_owned))
        .collect();
    let mut missing = BTreeSet::new();
    for expr in &exprs {
        for name in metric_names(expr) {
            let base = name
                .strip_suffix("_bucket")
                .or_else(|| name.strip_suffix("_count"))
                .or_else(|| name.strip_suffix("_sum"))
                .unwrap_or(&name);
            if name != "ALERTS" && !recorded.contains(&name) && !doc.contains(&format!("`{base}`")) {
                missing.insert(name.clone());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "metrics read but not listed in docs/dashboards.md: {missing:?}"
    );
}

#[test]
fn metric_names_finds_selectors_not_functions_or_labels() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (pod, le) (rate(kvfleet_attention_seconds_bucket{pod=~"$pod"}[$__rate_interval]))) and on (pod) vllm:num_requests_running"#,
    );
    assert_eq!(
        names,
        BTreeSet::from([
            "kvfleet_attention_seconds_bucket".to_owned(),
            "vllm:num_requests_running".to_owned()
        ])
    );
}

// === a real Prometheus scraping a real worker ===

/// Grafana's variables, as the dashboards would send them with "All" selected.
fn substitute_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "15s")
        .replace("$__range", "5m")
        .replace("$__interval", "2s")
        .replace("$namespace", ".*")
        .replace("$deployment", ".*")
        .replace("$pod", ".*")
}

/// Starts `kvfleet worker` on loopback, a real Prometheus scraping it every second with the
/// rules of deploy/prometheus loaded, submits load, then runs every dashboard query through
/// Prometheus's HTTP API: a query must not error, and a query over worker metrics only must
/// return series.
#[test]
fn dashboard_queries_return_data_from_prometheus_scraping_a_real_worker() {
    let prometheus_bin = prometheus();
    let scratch = std::env::temp_dir().join(format!("kvfleet-prometheus-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).expect("scratch directory");

    // The worker, serving the embedded SmolLM2 on the CPU engine.
    let worker_port = free_port();
    let mut worker = Proc(
        Command::new(env!("CARGO_BIN_EXE_kvfleet"))
            .args(["worker", "--listen", &format!("127.0.0.1:{worker_port}")])
            // Speculation on, so that the speculative-decoding panels' counters exist.
            .args([
                "--speculative-config",
                r#"{"method":"ngram","num_speculative_tokens":3}"#,
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(scratch.join("worker.log")).expect("worker.log"))
            .spawn()
            .expect("cannot start kvfleet worker"),
        "kvfleet worker",
    );
    wait_for("kvfleet worker /readyz", Duration::from_secs(120), || {
        check_alive(&mut worker)?;
        match http(worker_port, "GET", "/readyz", None) {
            Ok((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });

    // Prometheus, with the relabelings of the controller's ServiceMonitor/PodMonitor: the
    // target carries the pod label as service discovery would, and `inferencedeployment`
    // must come out of the relabeling (namespace and pod the operator sets itself).
    let relabel: Vec<serde_json::Value> = kvfleet::controller::desired::monitor_relabelings()
        .as_array()
        .expect("relabelings")
        .iter()
        .map(|r| {
            serde_json::json!({
                "action": r["action"], "source_labels": r["sourceLabels"], "target_label": r["targetLabel"],
            })
        })
        .collect();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules}\n\
         scrape_configs:\n  - job_name: kvfleet-worker\n    static_configs:\n      - targets: ['127.0.0.1:{worker_port}']\n        \
         labels: {{namespace: ml, pod: demo-0, __meta_kubernetes_pod_label_kvfleet_io_inference_deployment: demo}}\n    \
         relabel_configs: {relabel}\n",
        rules = rules_file().display(),
        relabel = serde_json::Value::Array(relabel),
    );
    let (mut prom, prom_port) = start_prometheus(&prometheus_bin, &scratch, &config);

    // Real traffic to the served model so that usage, requests and latencies move: 8
    // completions in the background while Prometheus scrapes.
    let load: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"prompt":"Story number {i}: once upon a time","max_tokens":48,"temperature":0}}"#
                );
                http(worker_port, "POST", "/v1/completions", Some(&body))
            })
        })
        .collect();

    // Enough scrapes for rate() over 15s windows and for the recording rules to run.
    wait_for("worker target up", Duration::from_secs(60), || {
        check_alive(&mut prom)?;
        let up = prom_query(prom_port, r#"up{job="kvfleet-worker"} == 1"#)?;
        if up.is_empty() {
            return Err("target not up".into());
        }
        let samples = prom_query(prom_port, "count_over_time(kvfleet_kv_cache_capacity_tokens[1m])")?;
        match first_value(&samples) {
            Some(n) if n >= 8.0 => Ok(()),
            other => Err(format!("{other:?} samples")),
        }
    });

    let mut failures = Vec::new();
    let mut worker_queries = 0;
    for q in queries() {
        let expr = substitute_variables(&q.expr);
        let worker_only = metric_names(&q.expr).iter().all(|m| is_worker_metric(m));
        match prom_query(prom_port, &expr) {
            Err(error) => failures.push(format!("{} / {}: {expr}: {error}", q.dashboard, q.panel)),
            Ok(result) if worker_only && result.is_empty() => failures.push(format!(
                "{} / {}: {expr}: no data from the worker",
                q.dashboard, q.panel
            )),
            Ok(_) => {}
        }
        worker_queries += usize::from(worker_only);
    }
    // Template variables resolve to the labels of the scraped worker.
    for (label, expected) in [
        ("namespace", "ml"),
        ("inferencedeployment", "demo"),
        ("pod", "demo-0"),
    ] {
        let expr = format!("count by ({label}) (kvfleet_kv_cache_capacity_tokens)");
        let found = prom_query(prom_port, &expr).unwrap_or_default();
        if !found.iter().any(|s| s["metric"][label] == expected) {
            failures.push(format!("variable {label}: {expected} not found"));
        }
    }
    for h in load {
        match h.join() {
            Ok(Ok((200, _))) => {}
            other => failures.push(format!("a completion failed: {other:?}")),
        }
    }
    // The load reached the engine: tokens were computed.
    let tokens = prom_query(prom_port, "max(kvfleet_tokens_total)").unwrap_or_default();
    let computed = first_value(&tokens).unwrap_or(0.0);
    if computed <= 0.0 {
        failures.push("kvfleet_tokens_total stayed 0 after the completions".to_owned());
    }
    // The recording rules ran on the scraped data.
    for record in [
        "inferencedeployment:kvfleet_kv_cache_capacity_tokens:sum",
        "cluster:kvfleet_kv_cache_usage:ratio",
    ] {
        if prom_query(prom_port, record)
            .map(|r| r.is_empty())
            .unwrap_or(true)
        {
            failures.push(format!("recording rule {record} produced nothing"));
        }
    }
    drop(prom);
    drop(worker);
    if !failures.is_empty() {
        let log = std::fs::read_to_string(scratch.join("worker.log")).unwrap_or_default();
        failures.push(format!("worker log:\n{log}"));
    }
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(worker_queries >= 20, "only {worker_queries} worker queries found");
    assert!(
        failures.is_empty(),
        "{} dashboard queries failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Issue 36: the deployment dashboard shows speculative decoding's acceptance per pod and by
/// position, from vLLM's counters.
#[test]
fn the_deployment_dashboard_shows_speculative_acceptance() {
    let dashboards = dashboards();
    let (_, deployment) = dashboards
        .iter()
        .find(|(name, _)| name.contains("deployment"))
        .expect("the deployment dashboard");
    let exprs: Vec<String> = panels(deployment)
        .iter()
        .filter(|p| {
            p["title"]
                .as_str()
                .is_some_and(|t| t.starts_with("Speculative decoding"))
        })
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(exprs.len(), 2, "{exprs:?}");
    let names: BTreeSet<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    for m in [
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:spec_decode_num_drafts_total",
    ] {
        assert!(names.contains(m), "{m} in {names:?}");
    }
}

/// Issue 29: the deployment dashboard shows each pod's prefix-cache hit rate, from the
/// counters vLLM's dashboards read (tokens found over tokens looked up).
#[test]
fn the_deployment_dashboard_shows_the_prefix_cache_hit_rate() {
    let (_, dashboard) = dashboards()
        .into_iter()
        .find(|(f, _)| f == "kvfleet-deployment.json")
        .expect("deployment dashboard");
    let panel = panels(&dashboard)
        .into_iter()
        .find(|p| p["title"].as_str().is_some_and(|t| t.contains("hit rate")))
        .expect("a hit-rate panel");
    let expr = panel["targets"][0]["expr"].as_str().expect("expr");
    let names = metric_names(expr);
    assert!(names.contains("vllm:prefix_cache_hits_total"), "{expr}");
    assert!(names.contains("vllm:prefix_cache_queries_total"), "{expr}");
    let (hits, queries) = expr.split_once(" / ").expect("a ratio");
    assert!(hits.contains("hits") && queries.contains("queries"), "{expr}");
    assert_eq!(panel["fieldConfig"]["defaults"]["unit"], "percentunit");
}

/// Issue 31: the fleet dashboard's Autoscaling row shows demand, capacity and replicas over
/// time per InferenceDeployment, from the workers' gauges and the autoscaler's series.
#[test]
fn the_fleet_dashboard_has_an_autoscaling_row_with_demand_capacity_and_replicas_per_deployment() {
    let (_, dashboard) = dashboards()
        .into_iter()
        .find(|(f, _)| f == "kvfleet-fleet.json")
        .expect("fleet dashboard");
    let top = dashboard["panels"].as_array().expect("panels");
    let row = top
        .iter()
        .position(|p| p["type"] == "row" && p["title"] == "Autoscaling")
        .expect("a row Autoscaling");
    let under: Vec<&Value> = top[row + 1..].iter().take_while(|p| p["type"] != "row").collect();
    let read: BTreeSet<String> = under
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .flat_map(|t| metric_names(t["expr"].as_str().expect("expr")))
        .collect();
    for metric in [
        "kvfleet_kv_demand_tokens",
        "kvfleet_kv_capacity_tokens",
        "kvfleet_autoscaling_replicas",
        "kvfleet_autoscaling_tokens",
    ] {
        assert!(
            read.contains(metric),
            "the Autoscaling row does not read {metric}: {read:?}"
        );
    }
    for p in &under {
        assert_eq!(p["type"], "timeseries", "{}: over time", p["title"]);
        for t in p["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            assert!(
                expr.contains("by (namespace, inferencedeployment"),
                "{}: not per InferenceDeployment: {expr}",
                p["title"]
            );
        }
    }
    let replicas = under
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .find(|t| {
            t["expr"]
                .as_str()
                .is_some_and(|e| e.contains("kvfleet_autoscaling_replicas"))
        })
        .expect("a replicas query");
    assert!(
        replicas["legendFormat"]
            .as_str()
            .is_some_and(|l| l.contains("{{kind}}")),
        "desired, max, ... told apart: {replicas}"
    );
}

//! `validate()` against 500 GPU nodes built like bench/webhook.rs builds its cache.
//!
//! Specs: every InferenceDeployment in deploy/examples/*.yaml and every InferenceDeployment
//! object in tests/fixtures/admission/*.json whose spec parses. For each spec, `CALLS`
//! calls after a warm-up; prints median and p99 per spec and over all calls.
//! Run: `cargo bench --bench validate` (env: KVFLEET_BENCH_NODES, KVFLEET_BENCH_CALLS).

#[path = "../tests/webhook_support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvfleet::api::InferenceDeploymentSpec;
use kvfleet::validate::{validate, ClusterFacts, NodeFacts};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    out.sort();
    out
}

/// (name, spec) of every realistic spec in the repository.
fn specs() -> Vec<(String, InferenceDeploymentSpec)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for path in files(&root.join("deploy/examples"), "yaml") {
        let text = std::fs::read_to_string(&path).expect("example");
        let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("example yaml");
        if doc.get("kind").and_then(|k| k.as_str()) != Some("InferenceDeployment") {
            continue;
        }
        let Some(spec) = doc.get("spec") else { continue };
        if let Ok(spec) = serde_yaml::from_value::<InferenceDeploymentSpec>(spec.clone()) {
            out.push((path.file_name().unwrap().to_string_lossy().into_owned(), spec));
        }
    }
    for path in files(&root.join("tests/fixtures/admission"), "json") {
        let review: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("fixture")).expect("fixture json");
        let object = &review["request"]["object"];
        if object["kind"] != "InferenceDeployment" {
            continue;
        }
        if let Ok(spec) = serde_json::from_value::<InferenceDeploymentSpec>(object["spec"].clone()) {
            out.push((path.file_name().unwrap().to_string_lossy().into_owned(), spec));
        }
    }
    out
}

fn main() {
    let nodes = env_or("KVFLEET_BENCH_NODES", 500) as usize;
    let calls = env_or("KVFLEET_BENCH_CALLS", 2000).max(1) as usize;
    let mut node_facts: Vec<NodeFacts> = support::fleet(nodes).iter().map(NodeFacts::from_node).collect();
    // As the webhook's cache hands them out.
    node_facts.sort_by(|a, b| a.name.cmp(&b.name));
    let facts = ClusterFacts {
        nodes: node_facts,
        ..ClusterFacts::default()
    };
    let specs = specs();
    println!(
        "validate benchmark: {nodes} GPU nodes, {} specs, {calls} calls each",
        specs.len()
    );
    let mut all = Vec::with_capacity(specs.len() * calls);
    for (name, spec) in &specs {
        for _ in 0..calls.min(100) {
            std::hint::black_box(validate(std::hint::black_box(spec), &facts));
        }
        let mut samples = Vec::with_capacity(calls);
        for _ in 0..calls {
            let start = Instant::now();
            std::hint::black_box(validate(std::hint::black_box(spec), std::hint::black_box(&facts)));
            samples.push(start.elapsed());
        }
        samples.sort();
        println!(
            "validate() {name:<40} median {:>9} p99 {:>9}",
            us(percentile(&samples, 0.5)),
            us(percentile(&samples, 0.99)),
        );
        all.extend(samples);
    }
    all.sort();
    println!(
        "validate() all specs: median {} p99 {} ({} calls)",
        us(percentile(&all, 0.5)),
        us(percentile(&all, 0.99)),
        all.len()
    );
}

//! Reconciles 1,000 InferenceDeployments against an in-process mock API server and reports
//! wall time per sweep (median of 5) and the process's peak resident memory (VmHWM).
//!
//! Run: `cargo bench --bench reconcile` (release profile). Every pass takes the full path:
//! validate, build desired objects, 6 server-side applies, status apply and one Event, i.e.
//! 8 HTTP round trips through kube's client stack (serialization, buffering, deserialization).
//! The mock answers at once, so the figure is the controller's own CPU cost, not the API
//! server's latency.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use http::{Request, Response};
use k8s_openapi::api::core::v1::Node;
use kube::client::Body;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher;
use kube::Client;
use kvfleet::api::{
    AttentionBackend, InferenceDeployment, InferenceDeploymentSpec, KvCacheDtype, ResolvedConfig,
};
use kvfleet::controller::desired::Settings;
use kvfleet::controller::metrics::Metrics;
use kvfleet::controller::{reconcile, Context};
use kvfleet::validate::{labels, ClusterFacts, Verdict};
use serde_json::{json, Value};

const OBJECTS: usize = 1000;
const SWEEPS: usize = 5;
const CONCURRENCY: usize = 16;

/// Admits every spec on the nodes with a GPU product label (the real rules live in validate::).
fn admit_gpu_nodes(_spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Verdict {
    Verdict {
        resolved: Some(ResolvedConfig {
            kv_cache_dtype: KvCacheDtype::Bfloat16,
            attention_backend: AttentionBackend::KvfleetCuda,
            compute_capabilities: vec!["9.0".into()],
            products: vec!["NVIDIA-H100-80GB-HBM3".into()],
        }),
        compatible_nodes: facts
            .nodes
            .iter()
            .filter(|n| n.labels.contains_key(labels::PRODUCT))
            .map(|n| n.name.clone())
            .collect(),
        ..Verdict::default()
    }
}

fn object(i: usize) -> DeserializeGuard<InferenceDeployment> {
    let o: InferenceDeployment = serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": format!("model-{i}"), "namespace": format!("ns-{}", i % 20),
                     "uid": format!("00000000-0000-0000-0000-{i:012}"), "generation": 1},
        "spec": {"replicas": 2,
                 "model": {"name": "meta-llama/Llama-3.1-8B-Instruct",
                           "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128}},
                 "engine": {"runtime": "kvfleet", "tensorParallelSize": 1}}
    }))
    .expect("fixture");
    DeserializeGuard(Ok(o))
}

/// Answers like an API server that accepts everything: applies and events echo the body.
async fn api_server(mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>) {
    while let Some((req, send)) = handle.next_request().await {
        let (parts, body) = req.into_parts();
        let bytes = body.collect_bytes().await.unwrap_or_default();
        let (code, out) = match parts.method.as_str() {
            "PATCH" | "POST" => (200, bytes.to_vec()),
            "DELETE" => (
                404,
                serde_json::to_vec(&json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "reason": "NotFound", "code": 404}))
                .unwrap_or_default(),
            ),
            _ => (
                200,
                serde_json::to_vec(&json!({"kind": "List", "apiVersion": "v1", "metadata": {}, "items": []}))
                    .unwrap_or_default(),
            ),
        };
        let _ = serde_json::from_slice::<Value>(&out);
        send.send_response(
            Response::builder()
                .status(code)
                .body(Body::from(out))
                .expect("response"),
        );
    }
}

fn vm_hwm_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        tokio::spawn(api_server(handle));
        let client = Client::new(service, "default");
        let mut writer: Writer<Node> = Writer::default();
        for n in 0..50 {
            let node: Node = serde_json::from_value(json!({"metadata": {"name": format!("gpu-{n}"),
                "labels": {labels::PRODUCT: "NVIDIA-H100-80GB-HBM3"}}}))
            .expect("node");
            writer.apply_watcher_event(&watcher::Event::Apply(node));
        }
        let registry = prometheus::Registry::new();
        let mut ctx = Context::new(
            client,
            writer.as_reader(),
            Settings::default(),
            Metrics::new(&registry).expect("metrics"),
            None,
        );
        ctx.validate = admit_gpu_nodes;
        let ctx = Arc::new(ctx);
        let objects: Vec<Arc<DeserializeGuard<InferenceDeployment>>> =
            (0..OBJECTS).map(|i| Arc::new(object(i))).collect();
        let hwm_before = vm_hwm_kib().unwrap_or(0);

        let mut times: Vec<Duration> = Vec::new();
        for sweep in 0..SWEEPS + 1 {
            let start = Instant::now();
            let failures = futures::stream::iter(objects.iter().cloned())
                .map(|o| reconcile(o, ctx.clone()))
                .buffer_unordered(CONCURRENCY)
                .filter(|r| futures::future::ready(r.is_err()))
                .count()
                .await;
            let t = start.elapsed();
            assert_eq!(failures, 0, "every reconcile succeeds against the mock");
            if sweep > 0 {
                // sweep 0 warms the allocator and the event cache
                times.push(t);
            }
        }
        times.sort();
        let median = times[times.len() / 2];
        println!(
            "reconcile {OBJECTS} InferenceDeployments (concurrency {CONCURRENCY}, 8 API calls each): \
             median {:.1} ms per sweep of {SWEEPS} ({:.1} us per object); min {:.1} ms, max {:.1} ms",
            median.as_secs_f64() * 1e3,
            median.as_secs_f64() * 1e6 / OBJECTS as f64,
            times[0].as_secs_f64() * 1e3,
            times[times.len() - 1].as_secs_f64() * 1e3,
        );
        match vm_hwm_kib() {
            Some(h) => println!(
                "peak RSS (VmHWM): {:.1} MiB (before the sweeps: {:.1} MiB)",
                h as f64 / 1024.0,
                hwm_before as f64 / 1024.0
            ),
            None => println!("peak RSS: /proc/self/status not available on this OS"),
        }
    });
}

//! Reconcile passes against an HTTP-level mock API server (`tower_test::mock::pair` behind
//! `kube::Client::new`). Each scenario lists the exact requests it expects, in order
//! (method, path, field manager, body essentials); an expected request that does not come
//! within 1 s fails the test, and so does any request after the last expected one.
//!
//! Validation here is a small stand-in (`gpu_product_rules`) because the real rule engine
//! lives in `validate::` (compat issue); these tests are about what the controller does with
//! a verdict, not about the rules.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{
    Node, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::ApiResource;
use kube::client::Body;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher;
use kube::Client;
use kvfleet::api::{
    AttentionBackend, InferenceDeployment, InferenceDeploymentSpec, KvCacheDtype, ResolvedConfig,
};
use kvfleet::controller::desired::{MonitorKind, Settings, MEASURED_TOKENS_ANNOTATION};
use kvfleet::controller::metrics::Metrics;
use kvfleet::controller::reconcile::{CAPACITY_POLL, RESYNC};
use kvfleet::controller::{error_policy, reconcile, Context, FIELD_MANAGER};
use kvfleet::validate::{labels, ClusterFacts, Denial, Verdict};
use serde_json::{json, Value};
use tower_test::mock;

type Handle = mock::Handle<Request<Body>, Response<Body>>;

// === fixtures ===

const NS: &str = "ml";
const PRODUCT: &str = "NVIDIA-GeForce-RTX-3090";

/// Admits a spec when a schedulable node carries one of the selected GPU products; denies nvfp4.
fn gpu_product_rules(spec: &InferenceDeploymentSpec, facts: &ClusterFacts) -> Verdict {
    if spec.engine.kv_cache_dtype == KvCacheDtype::Nvfp4 {
        return Verdict {
            denials: vec![Denial {
                field: "spec.engine.kvCacheDtype".into(),
                reason: "UnsupportedKvCacheDtype".into(),
                message: "nvfp4 KV cache requires sm_100/sm_103; use fp8".into(),
            }],
            ..Verdict::default()
        };
    }
    let wanted: Vec<String> = spec
        .gpu
        .as_ref()
        .and_then(|g| g.selector.as_ref())
        .map(|s| s.products.clone())
        .unwrap_or_default();
    let nodes: Vec<_> = facts
        .nodes
        .iter()
        .filter(|n| !n.unschedulable)
        .filter(|n| {
            n.labels
                .get(labels::PRODUCT)
                .is_some_and(|p| wanted.is_empty() || wanted.contains(p))
        })
        .collect();
    if nodes.is_empty() {
        return Verdict {
            denials: vec![Denial {
                field: "spec.gpu.selector".into(),
                reason: "NoCompatibleNodes".into(),
                message: "no schedulable node carries a selected GPU product".into(),
            }],
            ..Verdict::default()
        };
    }
    let products: Vec<String> = nodes.iter().map(|n| n.labels[labels::PRODUCT].clone()).collect();
    Verdict {
        resolved: Some(ResolvedConfig {
            kv_cache_dtype: KvCacheDtype::Bfloat16,
            attention_backend: AttentionBackend::KvfleetCuda,
            compute_capabilities: vec!["8.6".into()],
            products: products.clone(),
        }),
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: labels::PRODUCT.into(),
                        operator: "In".into(),
                        values: Some(products),
                    }]),
                    ..NodeSelectorTerm::default()
                }],
            }),
            ..NodeAffinity::default()
        }),
        compatible_nodes: nodes.iter().map(|n| n.name.clone()).collect(),
        ..Verdict::default()
    }
}

fn gpu_node(name: &str) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            labels::PRODUCT: PRODUCT, labels::COMPUTE_MAJOR: "8", labels::COMPUTE_MINOR: "6"}},
        "status": {"allocatable": {"nvidia.com/gpu": "2"}}
    }))
    .unwrap()
}

fn inference_deployment(generation: i64, replicas: i32) -> InferenceDeployment {
    serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "llama", "namespace": NS, "uid": "6d1c1b8e-1111-4c5e-8a2e-000000000001",
                     "generation": generation, "resourceVersion": "10"},
        "spec": {
            "replicas": replicas,
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct",
                      "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128}},
            "engine": {"runtime": "kvfleet", "tensorParallelSize": 2, "maxNumSeqs": 64},
            "gpu": {"selector": {"products": [PRODUCT]}}
        }
    }))
    .unwrap()
}

/// A status as the controller would have written it for a compatible, rolled-out generation.
fn settled(mut o: InferenceDeployment, observed: i64) -> InferenceDeployment {
    let t = Time(Timestamp::from_second(1_700_000_000).unwrap());
    let c = |type_: &str, status: &str, reason: &str| {
        json!({"type": type_, "status": status, "reason": reason, "message": "", "observedGeneration": observed,
               "lastTransitionTime": t})
    };
    o.status = Some(
        serde_json::from_value(json!({
            "observedGeneration": observed,
            "conditions": [c("Compatible", "True", "CompatibleNodesFound"),
                           c("CapacityPlanned", "False", "PlannerUnavailable"),
                           c("Available", "True", "MinimumReplicasAvailable"),
                           c("Progressing", "False", "RolloutComplete"),
                           c("Degraded", "False", "AsExpected")],
            "resolved": {"kvCacheDtype": "bfloat16", "attentionBackend": "KVFLEET_CUDA"},
            "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
            "selector": "kvfleet.io/inference-deployment=llama"
        }))
        .unwrap(),
    );
    o
}

struct Harness {
    ctx: Arc<Context>,
    nodes: Writer<Node>,
    handle: Handle,
    registry: prometheus::Registry,
}

fn harness(nodes: &[Node]) -> Harness {
    harness_with(nodes, Settings::default())
}

fn harness_with(nodes: &[Node], settings: Settings) -> Harness {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    let mut writer: Writer<Node> = Writer::default();
    for n in nodes {
        writer.apply_watcher_event(&watcher::Event::Apply(n.clone()));
    }
    let registry = prometheus::Registry::new();
    let mut ctx = Context::new(
        client,
        writer.as_reader(),
        settings,
        Metrics::new(&registry).unwrap(),
        Some("test".into()),
    );
    ctx.validate = gpu_product_rules;
    Harness {
        ctx: Arc::new(ctx),
        nodes: writer,
        handle,
        registry,
    }
}

// === the scripted API server ===

/// One request as the mock server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    query: HashMap<String, String>,
    body: Value,
}

enum Reply {
    /// Return the request body (what an apply returns, minus defaulting).
    Echo,
    /// Return the request body with `status` set.
    EchoWithStatus(Value),
    Json(u16, Value),
}

struct Call {
    method: &'static str,
    path: String,
    reply: Reply,
}

fn call(method: &'static str, path: impl Into<String>, reply: Reply) -> Call {
    Call {
        method,
        path: path.into(),
        reply,
    }
}

fn apply_call(resource_path: &str) -> Call {
    call("PATCH", resource_path, Reply::Echo)
}

fn status_failure(code: u16, reason: &str) -> Reply {
    Reply::Json(
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": format!("mock {reason}"), "reason": reason, "code": code}),
    )
}

fn ns_path(group_version: &str, plural: &str, name: &str) -> String {
    let prefix = if group_version == "v1" {
        "/api/v1".to_string()
    } else {
        format!("/apis/{group_version}")
    };
    format!("{prefix}/namespaces/{NS}/{plural}/{name}")
}

const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/ml/events";
const PODS: &str = "/api/v1/namespaces/ml/pods";
const PREFLIGHT_FAILURES_ZERO: &str =
    r#"kvfleet_preflight_failures_total{inferencedeployment="llama",namespace="ml"} 0"#;

fn pod_list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
}

fn metrics_text(h: &Harness) -> String {
    prometheus::TextEncoder::new()
        .encode_to_string(&h.registry.gather())
        .unwrap()
}
const STATUS: &str = "/apis/kvfleet.io/v1alpha1/namespaces/ml/inferencedeployments/llama/status";

/// Serves `calls` in order, failing on a mismatch or after 1 s without the next request.
async fn serve(mut handle: Handle, calls: Vec<Call>) -> (Handle, Vec<Seen>) {
    let mut seen = Vec::new();
    for (i, c) in calls.into_iter().enumerate() {
        let next = tokio::time::timeout(Duration::from_secs(1), handle.next_request()).await;
        let (req, send) = next
            .unwrap_or_else(|_| panic!("expected request #{i} {} {} never came", c.method, c.path))
            .expect("client dropped");
        let (parts, body) = req.into_parts();
        let bytes = body.collect_bytes().await.unwrap();
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("request body is JSON")
        };
        let query = parts
            .uri
            .query()
            .unwrap_or_default()
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let s = Seen {
            method: parts.method.to_string(),
            path: parts.uri.path().to_string(),
            query,
            body: body.clone(),
        };
        assert_eq!(
            (s.method.as_str(), s.path.as_str()),
            (c.method, c.path.as_str()),
            "request #{i}: {s:?}"
        );
        let (code, out) = match c.reply {
            Reply::Echo => (200, body),
            Reply::EchoWithStatus(st) => {
                let mut b = body;
                b["status"] = st;
                (200, b)
            }
            Reply::Json(code, v) => (code, v),
        };
        send.send_response(
            Response::builder()
                .status(StatusCode::from_u16(code).unwrap())
                .body(Body::from(serde_json::to_vec(&out).unwrap()))
                .unwrap(),
        );
        seen.push(s);
    }
    (handle, seen)
}

/// Runs one reconcile pass against the script and checks nothing else was requested.
async fn run_pass(
    h: &mut Harness,
    obj: DeserializeGuard<InferenceDeployment>,
    calls: Vec<Call>,
) -> (Result<Action, kvfleet::controller::Error>, Vec<Seen>) {
    let handle = std::mem::replace(&mut h.handle, mock::pair::<Request<Body>, Response<Body>>().1);
    let server = tokio::spawn(serve(handle, calls));
    let result = tokio::time::timeout(Duration::from_secs(5), reconcile(Arc::new(obj), h.ctx.clone())).await;
    // A mismatch panics the server task: report that first, it says which request was wrong.
    let (mut handle, seen) = tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .expect("mock server finished")
        .expect("mock server did not panic");
    if let Ok(Some((req, _))) = tokio::time::timeout(Duration::from_millis(100), handle.next_request()).await
    {
        let (parts, body) = req.into_parts();
        let body = body.collect_bytes().await.unwrap_or_default();
        panic!(
            "unexpected extra request {} {}: {}",
            parts.method,
            parts.uri,
            String::from_utf8_lossy(&body)
        );
    }
    let result = result.expect("reconcile finished within 5 s");
    h.handle = handle;
    (result, seen)
}

fn guard(o: InferenceDeployment) -> DeserializeGuard<InferenceDeployment> {
    DeserializeGuard(Ok(o))
}

fn assert_applied(s: &Seen, kind: &str) {
    assert_eq!(
        s.query.get("fieldManager").map(String::as_str),
        Some(FIELD_MANAGER),
        "{s:?}"
    );
    assert_eq!(s.query.get("force").map(String::as_str), Some("true"), "{s:?}");
    assert_eq!(s.body["kind"], kind, "{s:?}");
    if kind != "InferenceDeployment" {
        let owner = &s.body["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "InferenceDeployment");
        assert_eq!(owner["name"], "llama");
        assert_eq!(owner["controller"], true);
    }
}

fn condition<'a>(status_body: &'a Value, type_: &str) -> &'a Value {
    status_body["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("condition {type_} in {status_body}"))
}

fn event_reasons(seen: &[Seen]) -> Vec<(String, String)> {
    seen.iter()
        .filter(|s| s.path == EVENTS)
        .map(|s| {
            (
                s.body["type"].as_str().unwrap_or_default().to_string(),
                s.body["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

const UID: &str = "6d1c1b8e-1111-4c5e-8a2e-000000000001";

/// The owner reference the controller puts on what it creates for `llama`.
fn owner_ref() -> Value {
    json!({"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "name": "llama",
           "uid": UID, "controller": true, "blockOwnerDeletion": true})
}

/// An existing object `name` owned by the InferenceDeployment `llama`.
fn owned(api_version: &str, kind: &str, name: &str) -> Value {
    json!({"apiVersion": api_version, "kind": kind,
           "metadata": {"name": name, "namespace": NS, "ownerReferences": [owner_ref()]}})
}

fn not_found() -> Reply {
    status_failure(404, "NotFound")
}

/// The ownership reads before any apply (none of the objects exists yet): one per object
/// the default spec (2 replicas, kvfleet, no `network`) wants.
const LOOKUPS: usize = 6;
/// The orphan sweep: one LIST per managed kind.
const SWEEP: usize = 9;
/// Requests of [`children_apply_calls`]`(true)`: the reads, the applies and the sweep.
const CHILDREN: usize = LOOKUPS + 6 + SWEEP;

/// The objects the default spec wants, in apply order.
fn child_paths() -> Vec<String> {
    vec![
        ns_path("v1", "configmaps", "llama-config"),
        ns_path("v1", "serviceaccounts", "llama-worker"),
        ns_path("rbac.authorization.k8s.io/v1", "rolebindings", "llama-worker"),
        ns_path("apps/v1", "deployments", "llama"),
        ns_path("v1", "services", "llama"),
        ns_path("policy/v1", "poddisruptionbudgets", "llama"),
    ]
}

/// Ownership reads, then applies, of `paths` (none exists yet), then the sweep finding nothing.
fn reads_applies_and_sweep(paths: &[String]) -> Vec<Call> {
    let mut v: Vec<Call> = paths
        .iter()
        .map(|p| call("GET", p.clone(), not_found()))
        .collect();
    v.extend(paths.iter().map(|p| apply_call(p)));
    v.extend(sweep(&[], &[]));
    v
}

fn children_apply_calls(replicas_pdb: bool) -> Vec<Call> {
    let mut paths = child_paths();
    if !replicas_pdb {
        paths.pop();
    }
    reads_applies_and_sweep(&paths)
}

/// Every kind the controller manages, in the order the sweep lists them.
const SWEPT: [(&str, &str); SWEEP] = [
    ("v1", "configmaps"),
    ("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "rolebindings"),
    ("networking.k8s.io/v1", "networkpolicies"),
    ("apps/v1", "deployments"),
    ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    ("v1", "services"),
    ("policy/v1", "poddisruptionbudgets"),
];

/// The label selector of the sweep, as the request's query carries it.
const OWNED_SELECTOR: &str =
    "app.kubernetes.io%2Fmanaged-by%3Dkvfleet%2Capp.kubernetes.io%2Finstance%3Dllama";

fn list_path(group_version: &str, plural: &str) -> String {
    let p = ns_path(group_version, plural, "");
    p.trim_end_matches('/').to_string()
}

fn object_list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items})
}

fn deleted() -> Reply {
    Reply::Json(
        200,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}),
    )
}

/// The sweep: one LIST per managed kind answering `found` (plural, objects); the
/// LeaderWorkerSet API is not installed (404) unless `found` names it. After a kind's LIST,
/// a DELETE of each (plural, name) in `deletes`.
fn sweep(found: &[(&str, Vec<Value>)], deletes: &[(&str, &str)]) -> Vec<Call> {
    let mut v = Vec::new();
    for (gv, plural) in SWEPT {
        let items = found
            .iter()
            .find(|(p, _)| *p == plural)
            .map(|(_, items)| items.clone());
        let reply = match items {
            Some(items) => Reply::Json(200, object_list(items)),
            None if plural == "leaderworkersets" => not_found(),
            None => Reply::Json(200, object_list(vec![])),
        };
        v.push(call("GET", list_path(gv, plural), reply));
        for (_, name) in deletes.iter().filter(|(p, _)| *p == plural) {
            v.push(call("DELETE", ns_path(gv, plural, name), deleted()));
        }
    }
    v
}

/// The labels kvfleet puts on what it creates for `llama` (runtime `runtime`).
fn our_labels(runtime: &str) -> Value {
    json!({"kvfleet.io/inference-deployment": "llama", "app.kubernetes.io/name": runtime,
           "app.kubernetes.io/instance": "llama", "app.kubernetes.io/component": "inference",
           "app.kubernetes.io/managed-by": "kvfleet"})
}

/// An object as the sweep finds it: our labels, with `owners` as its owner references.
fn labelled(api_version: &str, kind: &str, name: &str, owners: Value) -> Value {
    json!({"apiVersion": api_version, "kind": kind,
           "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{kind}-{name}"),
                        "labels": our_labels("kvfleet"), "ownerReferences": owners}})
}

/// An object kvfleet created for `llama`: our labels and our owner reference.
fn ours(api_version: &str, kind: &str, name: &str) -> Value {
    labelled(api_version, kind, name, json!([owner_ref()]))
}

// === scenarios ===

#[tokio::test]
async fn create_applies_every_owned_object_then_status_then_a_spec_applied_event() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut calls = children_apply_calls(true);
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(inference_deployment(1, 2)), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));

    assert!(
        seen[..LOOKUPS].iter().all(|s| s.method == "GET"),
        "ownership is read first"
    );
    for (s, kind) in seen[LOOKUPS..].iter().zip([
        "ConfigMap",
        "ServiceAccount",
        "RoleBinding",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    ]) {
        assert_applied(s, kind);
    }
    // Then every managed kind is listed by our labels (the LeaderWorkerSet API, not
    // installed here, answers 404 and is skipped); nothing is left to delete.
    for s in &seen[LOOKUPS + 6..CHILDREN] {
        assert_eq!(s.method, "GET", "{s:?}");
        assert_eq!(
            s.query.get("labelSelector").map(String::as_str),
            Some(OWNED_SELECTOR),
            "{s:?}"
        );
    }
    assert_applied(&seen[CHILDREN], "InferenceDeployment");
    let dep = &seen[LOOKUPS + 3].body;
    assert_eq!(dep["spec"]["replicas"], 2);
    let pod = &dep["spec"]["template"]["spec"];
    assert_eq!(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], "2");
    assert_eq!(
        pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchExpressions"][0]["values"][0],
        PRODUCT
    );
    let status = &seen[CHILDREN].body;
    assert_eq!(status["status"]["observedGeneration"], 1);
    assert_eq!(
        status["status"]["selector"],
        "kvfleet.io/inference-deployment=llama"
    );
    assert_eq!(status["status"]["resolved"]["kvCacheDtype"], "bfloat16");
    assert_eq!(condition(status, "Compatible")["status"], "True");
    assert_eq!(condition(status, "Compatible")["reason"], "CompatibleNodesFound");
    assert_eq!(
        condition(status, "CapacityPlanned")["reason"],
        "PlannerUnavailable"
    );
    assert_eq!(condition(status, "Available")["reason"], "NoReplicasReady");
    assert_eq!(condition(status, "Progressing")["status"], "True");
    assert_eq!(
        event_reasons(&seen),
        vec![("Normal".into(), "SpecApplied".into())]
    );
    assert!(
        metrics_text(&h).contains(PREFLIGHT_FAILURES_ZERO),
        "exported at 0 so that increase() sees the first failure"
    );
}

#[tokio::test]
async fn update_rolls_out_the_new_config_and_reports_measured_capacity_from_pod_annotations() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut obj = settled(inference_deployment(2, 2), 1);
    obj.spec.engine.max_num_seqs = 128;
    let ready = json!({"observedGeneration": 2, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                       "availableReplicas": 2});
    let pod = |name: &str, tokens: &str| {
        json!({"metadata": {"name": name, "namespace": NS, "annotations": {MEASURED_TOKENS_ANNOTATION: tokens}},
               "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    };
    let pods = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {},
                      "items": [pod("llama-a", "25200"), pod("llama-b", "24800")]});
    let mut calls = children_apply_calls(true);
    calls[LOOKUPS + 3] = call(
        "PATCH",
        ns_path("apps/v1", "deployments", "llama"),
        Reply::EchoWithStatus(ready),
    );
    calls.push(call(
        "GET",
        format!("/api/v1/namespaces/{NS}/pods"),
        Reply::Json(200, pods),
    ));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));

    let worker_yaml = seen[LOOKUPS].body["data"]["worker.yaml"].as_str().unwrap();
    assert!(worker_yaml.contains("maxNumSeqs: 128"), "{worker_yaml}");
    let list = &seen[CHILDREN];
    assert_eq!(
        list.query.get("labelSelector").map(String::as_str),
        Some("kvfleet.io%2Finference-deployment%3Dllama")
    );
    let status = &seen[CHILDREN + 1].body;
    assert_eq!(status["status"]["observedGeneration"], 2);
    assert_eq!(
        status["status"]["capacity"]["measuredTokensPerReplica"], 24800,
        "smallest ready pod"
    );
    assert_eq!(status["status"]["readyReplicas"], 2);
    assert_eq!(condition(status, "Progressing")["reason"], "RolloutComplete");
    assert_eq!(
        event_reasons(&seen),
        vec![
            ("Normal".into(), "SpecApplied".into()),
            ("Normal".into(), "CapacityMeasured".into())
        ]
    );
}

#[tokio::test]
async fn scale_to_one_replica_sets_deployment_replicas_and_removes_the_pdb() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let obj = settled(inference_deployment(3, 1), 2);
    let mut paths = child_paths();
    paths.pop();
    let mut calls: Vec<Call> = paths
        .iter()
        .map(|p| call("GET", p.clone(), not_found()))
        .collect();
    calls.extend(paths.iter().map(|p| apply_call(p)));
    // The PodDisruptionBudget of the 2-replica generation, ours, is found by the sweep and
    // removed: a PDB over one pod would block every drain.
    calls.extend(sweep(
        &[(
            "poddisruptionbudgets",
            vec![ours("policy/v1", "PodDisruptionBudget", "llama")],
        )],
        &[("poddisruptionbudgets", "llama")],
    ));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    result.unwrap();
    assert_eq!(seen[5 + 3].body["spec"]["replicas"], 1);
    let delete = &seen[5 + 5 + SWEEP];
    assert_eq!(
        (delete.method.as_str(), delete.path.as_str()),
        (
            "DELETE",
            ns_path("policy/v1", "poddisruptionbudgets", "llama").as_str()
        )
    );
    assert_eq!(
        delete.body["preconditions"]["uid"], "uid-PodDisruptionBudget-llama",
        "only the object that was listed"
    );
    assert_eq!(seen[5 + 5 + SWEEP + 1].body["status"]["observedGeneration"], 3);
    assert_eq!(
        event_reasons(&seen),
        vec![
            ("Normal".into(), "SpecApplied".into()),
            ("Warning".into(), "Unavailable".into())
        ]
    );
}

#[tokio::test]
async fn a_spec_that_turns_incompatible_is_not_applied_and_gets_a_warning_event() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut obj = settled(inference_deployment(4, 2), 3);
    obj.spec.engine.kv_cache_dtype = KvCacheDtype::Nvfp4;
    let running = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "llama", "namespace": NS, "ownerReferences": [owner_ref()], "generation": 3},
        "spec": {"selector": {"matchLabels": {"kvfleet.io/inference-deployment": "llama"}},
                 "template": {"spec": {"containers": []}}},
        "status": {"observedGeneration": 3, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}});
    let calls = vec![
        // Only a read of what runs: nothing owned is touched.
        call(
            "GET",
            ns_path("apps/v1", "deployments", "llama"),
            Reply::Json(200, running),
        ),
        // The pods that run, for preflight failures.
        call("GET", PODS, Reply::Json(200, pod_list(vec![]))),
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
        call("POST", EVENTS, Reply::Echo),
    ];
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    assert_eq!(result.unwrap(), Action::await_change());
    let status = &seen[2].body;
    assert_applied(&seen[2], "InferenceDeployment");
    assert_eq!(status["status"]["observedGeneration"], 4);
    let compat = condition(status, "Compatible");
    assert_eq!(compat["status"], "False");
    assert_eq!(compat["reason"], "UnsupportedKvCacheDtype");
    assert!(compat["message"].as_str().unwrap().contains("use fp8"));
    assert_eq!(condition(status, "Degraded")["reason"], "SpecNotApplied");
    assert_eq!(
        condition(status, "Available")["status"],
        "True",
        "old pods still serve"
    );
    assert_eq!(
        status["status"]["resolved"]["kvCacheDtype"], "bfloat16",
        "describes what runs"
    );
    assert_eq!(
        event_reasons(&seen),
        vec![
            ("Warning".into(), "UnsupportedKvCacheDtype".into()),
            ("Warning".into(), "SpecNotApplied".into())
        ]
    );
    assert!(seen[3].body["note"].as_str().unwrap().contains("nvfp4"));
}

#[tokio::test]
async fn node_pool_change_flips_compatible_within_one_reconcile_each_way() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let obj = settled(inference_deployment(1, 2), 1);

    // The only GPU node leaves.
    h.nodes
        .apply_watcher_event(&watcher::Event::Delete(gpu_node("gpu-1")));
    let running = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "llama", "namespace": NS, "ownerReferences": [owner_ref()], "generation": 1},
        "spec": {"selector": {}, "template": {}},
        "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 0, "updatedReplicas": 2}});
    let calls = vec![
        call(
            "GET",
            ns_path("apps/v1", "deployments", "llama"),
            Reply::Json(200, running),
        ),
        call("GET", PODS, Reply::Json(200, pod_list(vec![]))),
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
        call("POST", EVENTS, Reply::Echo),
        call("POST", EVENTS, Reply::Echo),
    ];
    let (result, seen) = run_pass(&mut h, guard(obj.clone()), calls).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(
        condition(&seen[2].body, "Compatible")["reason"],
        "NoCompatibleNodes"
    );
    // The spec did not change, the nodes did: Degraded says so, not "fix the spec".
    let degraded = condition(&seen[2].body, "Degraded");
    assert!(
        degraded["message"]
            .as_str()
            .unwrap()
            .starts_with("the nodes changed, not the spec: generation 1 was admitted on"),
        "{degraded}"
    );
    assert_eq!(
        event_reasons(&seen),
        vec![
            ("Warning".into(), "NoCompatibleNodes".into()),
            ("Warning".into(), "Unavailable".into()),
            ("Warning".into(), "NodesChanged".into())
        ]
    );

    // A GPU node joins: the status written above is what the next pass reads.
    let mut after = obj;
    after.status = Some(serde_json::from_value(seen[2].body["status"].clone()).unwrap());
    h.nodes
        .apply_watcher_event(&watcher::Event::Apply(gpu_node("gpu-2")));
    let mut calls = children_apply_calls(true);
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(after), calls).await;
    result.unwrap();
    let status = &seen[CHILDREN].body;
    assert_eq!(condition(status, "Compatible")["status"], "True");
    assert!(condition(status, "Compatible")["message"]
        .as_str()
        .unwrap()
        .starts_with("1 node(s)"));
    assert_eq!(
        event_reasons(&seen),
        vec![("Normal".into(), "CompatibleNodesFound".into())]
    );
}

#[tokio::test]
async fn a_conflict_on_the_status_update_is_retried_in_the_same_pass() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut calls = children_apply_calls(true);
    calls.push(call("PATCH", STATUS, status_failure(409, "Conflict")));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(inference_deployment(1, 2)), calls).await;
    result.unwrap();
    assert_eq!(
        seen[CHILDREN].body,
        seen[CHILDREN + 1].body,
        "the same status is sent again"
    );
}

#[tokio::test]
async fn persistent_conflicts_fail_the_pass_and_are_counted_and_retried_soon() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut calls = children_apply_calls(true);
    for _ in 0..3 {
        calls.push(call("PATCH", STATUS, status_failure(409, "Conflict")));
    }
    let obj = Arc::new(guard(inference_deployment(1, 2)));
    let (result, _) = run_pass(&mut h, (*obj).clone(), calls).await;
    let err = result.unwrap_err();
    assert!(err.is_conflict(), "{err}");
    assert_eq!(err.metric_label(), "conflict");
    let action = error_policy(obj, &err, h.ctx.clone());
    assert_eq!(action, Action::requeue(Duration::from_millis(500)));
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&h.registry.gather())
        .unwrap();
    assert!(
        text.contains(r#"kvfleet_controller_reconcile_failures_total{category="conflict"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("kvfleet_controller_reconcile_runs_total 1"),
        "{text}"
    );
}

#[tokio::test]
async fn transient_api_errors_back_off_exponentially() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let calls = vec![call(
        "GET",
        ns_path("v1", "configmaps", "llama-config"),
        status_failure(503, "ServiceUnavailable"),
    )];
    let obj = Arc::new(guard(inference_deployment(1, 2)));
    let (result, _) = run_pass(&mut h, (*obj).clone(), calls).await;
    let err = result.unwrap_err();
    assert_eq!(err.metric_label(), "api");
    assert_eq!(
        error_policy(obj.clone(), &err, h.ctx.clone()),
        Action::requeue(Duration::from_secs(5))
    );
    assert_eq!(
        error_policy(obj.clone(), &err, h.ctx.clone()),
        Action::requeue(Duration::from_secs(10))
    );
    assert_eq!(
        error_policy(obj, &err, h.ctx.clone()),
        Action::requeue(Duration::from_secs(20))
    );
}

#[tokio::test]
async fn deletion_touches_nothing_and_leaves_cleanup_to_owner_references() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut obj = settled(inference_deployment(1, 2), 1);
    obj.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    let (result, seen) = run_pass(&mut h, guard(obj), vec![]).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert!(seen.is_empty());
}

#[tokio::test]
async fn what_is_remembered_of_an_object_goes_with_it_whichever_way_it_goes() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let create = || {
        let mut calls = children_apply_calls(true);
        calls.push(apply_call(STATUS));
        calls.push(call("POST", EVENTS, Reply::Echo));
        calls
    };
    let (result, _) = run_pass(&mut h, guard(inference_deployment(1, 2)), create()).await;
    result.unwrap();
    assert!(h.ctx.remembers("ml/llama"));
    assert!(metrics_text(&h).contains(PREFLIGHT_FAILURES_ZERO));

    // Deleted without this controller seeing a deletion timestamp (no finalizer): the watch
    // no longer holds it, and another object is left alone.
    h.ctx.forget_absent(|key| key != "ml/llama");
    assert!(!h.ctx.remembers("ml/llama"));
    assert!(
        !metrics_text(&h).contains(r#"inferencedeployment="llama""#),
        "{}",
        metrics_text(&h)
    );

    // Seen while being deleted (a foreground deletion): forgotten at once. (A fresh
    // controller: the Event recorder would patch the same Event as a series.)
    let mut h = harness(&[gpu_node("gpu-1")]);
    let (result, _) = run_pass(&mut h, guard(inference_deployment(1, 2)), create()).await;
    result.unwrap();
    assert!(h.ctx.remembers("ml/llama"));
    let mut deleting = settled(inference_deployment(1, 2), 1);
    deleting.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    let (result, _) = run_pass(&mut h, guard(deleting), vec![]).await;
    result.unwrap();
    assert!(!h.ctx.remembers("ml/llama"));
    assert!(!metrics_text(&h).contains(r#"inferencedeployment="llama""#));

    // A pass that failed for an object that is gone since: its backoff count goes too.
    let obj = Arc::new(guard(inference_deployment(1, 2)));
    let calls = vec![call(
        "GET",
        ns_path("v1", "configmaps", "llama-config"),
        status_failure(503, "ServiceUnavailable"),
    )];
    let (result, _) = run_pass(&mut h, (*obj).clone(), calls).await;
    error_policy(obj, &result.unwrap_err(), h.ctx.clone());
    h.ctx.forget("ml/llama");
    assert!(!h.ctx.remembers("ml/llama"));
}

#[tokio::test]
async fn a_malformed_object_gets_a_warning_event_and_waits_for_a_change() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let bad: DeserializeGuard<InferenceDeployment> = serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "llama", "namespace": NS, "uid": "u-1"},
        "spec": {"replicas": "many", "model": {"name": "x"}}
    }))
    .unwrap();
    assert!(bad.0.is_err());
    let calls = vec![call("POST", EVENTS, Reply::Echo)];
    let (result, seen) = run_pass(&mut h, bad, calls).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(seen[0].body["reason"], "MalformedObject");
    assert_eq!(seen[0].body["type"], "Warning");
    assert_eq!(seen[0].body["regarding"]["name"], "llama");
}

#[tokio::test]
async fn a_service_monitor_is_applied_only_when_discovery_found_the_crd() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    *h.ctx.monitor.write().unwrap() = Some(MonitorKind {
        resource: ApiResource {
            group: "monitoring.coreos.com".into(),
            version: "v1".into(),
            api_version: "monitoring.coreos.com/v1".into(),
            kind: "ServiceMonitor".into(),
            plural: "servicemonitors".into(),
        },
        kind: "ServiceMonitor".into(),
    });
    let monitor_path = ns_path("monitoring.coreos.com/v1", "servicemonitors", "llama");
    let mut paths = child_paths();
    paths.push(monitor_path.clone());
    let mut calls = reads_applies_and_sweep(&paths);
    // Where discovery found the monitoring API, both monitor kinds are swept too: our
    // ServiceMonitor is wanted and kept; the PodMonitor API is not installed here (404).
    calls.push(call(
        "GET",
        list_path("monitoring.coreos.com/v1", "servicemonitors"),
        Reply::Json(
            200,
            object_list(vec![ours("monitoring.coreos.com/v1", "ServiceMonitor", "llama")]),
        ),
    ));
    calls.push(call(
        "GET",
        list_path("monitoring.coreos.com/v1", "podmonitors"),
        not_found(),
    ));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(inference_deployment(1, 2)), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    let monitor = &seen[paths.len() + paths.len() - 1];
    assert_applied(monitor, "ServiceMonitor");
    assert_eq!(monitor.body["spec"]["endpoints"][0]["path"], "/metrics");
    assert!(seen.iter().all(|s| s.method != "DELETE"), "{seen:?}");
}

#[tokio::test]
async fn ready_workers_without_a_measurement_are_polled_again_soon() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let obj = settled(inference_deployment(1, 2), 1);
    let ready = json!({"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2});
    let pods = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []});
    let mut calls = children_apply_calls(true);
    calls[LOOKUPS + 3] = call(
        "PATCH",
        ns_path("apps/v1", "deployments", "llama"),
        Reply::EchoWithStatus(ready),
    );
    calls.push(call(
        "GET",
        format!("/api/v1/namespaces/{NS}/pods"),
        Reply::Json(200, pods),
    ));
    calls.push(apply_call(STATUS));
    let (result, _) = run_pass(&mut h, guard(obj), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(CAPACITY_POLL));
}

#[tokio::test]
async fn workers_that_fail_preflight_are_counted_once_across_passes() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let obj = settled(inference_deployment(1, 2), 1);
    let crashing = json!({"observedGeneration": 1, "replicas": 2, "readyReplicas": 0, "updatedReplicas": 2});
    let finished = Timestamp::now().to_string();
    let worker = |uid: &str, code: i32| {
        json!({"metadata": {"name": format!("llama-{uid}"), "namespace": NS, "uid": uid},
               "status": {"containerStatuses": [{"name": "kvfleet", "image": "kvfleet", "imageID": "",
                   "ready": false, "restartCount": 1,
                   "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                   "lastState": {"terminated": {"exitCode": code, "reason": "Error",
                       "containerID": format!("containerd://{uid}-0"), "finishedAt": finished}}}]}})
    };
    // One pod refused the GPU (exit 3); the other was OOM-killed (137), which is not preflight.
    let pods = pod_list(vec![worker("a", 3), worker("b", 137)]);
    let script = |status_write: bool| {
        let mut calls = children_apply_calls(true);
        calls[LOOKUPS + 3] = call(
            "PATCH",
            ns_path("apps/v1", "deployments", "llama"),
            Reply::EchoWithStatus(crashing.clone()),
        );
        calls.push(call("GET", PODS, Reply::Json(200, pods.clone())));
        if status_write {
            calls.push(apply_call(STATUS));
            calls.push(call("POST", EVENTS, Reply::Echo));
            calls.push(call("POST", EVENTS, Reply::Echo));
        }
        calls
    };
    let (result, seen) = run_pass(&mut h, guard(obj.clone()), script(true)).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    // Not only a counter: Degraded with the worker's reason, and a Warning Event.
    let degraded = condition(&seen[CHILDREN + 1].body, "Degraded");
    assert_eq!(
        (degraded["status"].as_str(), degraded["reason"].as_str()),
        (Some("True"), Some("PreflightFailed"))
    );
    assert!(
        degraded["message"].as_str().unwrap().starts_with(
            "worker pod llama-a exits with code 3 at start (the configuration cannot run on this GPU)"
        ),
        "{degraded}"
    );
    assert!(
        event_reasons(&seen).contains(&("Warning".into(), "PreflightFailed".into())),
        "{:?}",
        event_reasons(&seen)
    );
    assert_eq!(
        seen[CHILDREN].query.get("labelSelector").map(String::as_str),
        Some("kvfleet.io%2Finference-deployment%3Dllama"),
        "the one LIST of the pass"
    );
    let counted = r#"kvfleet_preflight_failures_total{inferencedeployment="llama",namespace="ml"} 1"#;
    assert!(metrics_text(&h).contains(counted), "{}", metrics_text(&h));

    // The next pass sees the same terminations: nothing new is counted.
    let mut again = obj;
    again.status = Some(serde_json::from_value(seen[CHILDREN + 1].body["status"].clone()).unwrap());
    let (result, _) = run_pass(&mut h, guard(again), script(false)).await;
    result.unwrap();
    assert!(metrics_text(&h).contains(counted), "{}", metrics_text(&h));
}

#[tokio::test]
async fn with_the_real_rules_a_3090_pool_admits_and_the_planners_prediction_reaches_status() {
    let mut node = gpu_node("gpu-1");
    node.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(labels::MEMORY_MIB.into(), "24576".into());
    let mut h = harness(&[node]);
    Arc::get_mut(&mut h.ctx).unwrap().validate = kvfleet::validate::validate;
    let mut calls = children_apply_calls(true);
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    // The kvfleet engine runs one GPU per replica: the real rules deny tensorParallelSize 2.
    let mut obj = inference_deployment(1, 2);
    obj.spec.engine.tensor_parallel_size = 1;
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    result.unwrap();
    let status = &seen[CHILDREN].body;
    assert_eq!(condition(status, "Compatible")["status"], "True", "{status}");
    assert_eq!(
        condition(status, "CapacityPlanned")["reason"],
        "CapacityPredicted",
        "{status}"
    );
    assert!(status["status"]["capacity"]["tokensPerReplica"].as_i64().unwrap() > 0);
    let affinity = &seen[LOOKUPS + 3].body["spec"]["template"]["spec"]["affinity"]["nodeAffinity"];
    assert!(!affinity.is_null(), "pods are kept on compatible nodes");
    let cfg = kvfleet::contract::config::WorkerConfig::parse(
        seen[LOOKUPS].body["data"]["worker.yaml"].as_str().unwrap(),
    )
    .expect("the worker accepts the rendered config");
    assert!(cfg.resolved.is_some());
    // The CRD's default gpuMemoryUtilization (0.9) draws no warning: no AdmittedWithWarnings.
    assert_eq!(
        event_reasons(&seen),
        vec![("Normal".into(), "SpecApplied".into())]
    );
}

// === ownership (issue 22) ===

#[tokio::test]
async fn a_service_kvfleet_did_not_create_is_never_applied_over_and_is_named_in_degraded_and_an_event() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    // Someone else's Service of the name kvfleet would use: created by hand, no owner.
    let theirs = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "llama", "namespace": NS, "uid": "0000-their-service"},
        "spec": {"ports": [{"port": 443}]}});
    let mut calls: Vec<Call> = child_paths()
        .into_iter()
        .map(|p| call("GET", p, not_found()))
        .collect();
    calls[4].reply = Reply::Json(200, theirs);
    // No PATCH and no DELETE of any child: straight to status, then the Event.
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(inference_deployment(1, 2)), calls).await;
    assert_eq!(
        result.unwrap(),
        Action::requeue(kvfleet::controller::reconcile::OWNERSHIP_RETRY)
    );
    assert!(
        seen.iter()
            .all(|s| s.method == "GET" || s.path == STATUS || s.path == EVENTS),
        "nothing but reads, status and the Event: {seen:?}"
    );
    let status = &seen[LOOKUPS].body;
    let degraded = condition(status, "Degraded");
    assert_eq!(degraded["status"], "True");
    assert_eq!(degraded["reason"], "OwnershipConflict");
    let message = degraded["message"].as_str().unwrap();
    assert!(message.contains("Service ml/llama"), "{message}");
    assert!(message.contains("created outside kvfleet"), "{message}");
    assert_eq!(
        event_reasons(&seen),
        vec![("Warning".into(), "OwnershipConflict".into())],
        "no SpecApplied: nothing was applied"
    );
    let note = seen[LOOKUPS + 1].body["note"].as_str().unwrap();
    assert!(note.contains("Service ml/llama"), "{note}");
}

#[tokio::test]
async fn an_object_owned_by_another_controller_blocks_the_apply_and_names_its_owner() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let other = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "llama-config", "namespace": NS, "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "billing", "uid": "0000-billing", "controller": true}]}});
    let mut calls: Vec<Call> = child_paths()
        .into_iter()
        .map(|p| call("GET", p, not_found()))
        .collect();
    calls[0].reply = Reply::Json(200, other);
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(inference_deployment(1, 2)), calls).await;
    result.unwrap();
    let message = condition(&seen[LOOKUPS].body, "Degraded")["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("ConfigMap ml/llama-config (owned by Deployment billing)"),
        "{message}"
    );
}

#[tokio::test]
async fn objects_this_inference_deployment_owns_are_applied_as_before() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut calls = children_apply_calls(true);
    calls[4].reply = Reply::Json(200, owned("v1", "Service", "llama"));
    calls[3].reply = Reply::Json(200, owned("apps/v1", "Deployment", "llama"));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(inference_deployment(1, 2)), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    assert_applied(&seen[LOOKUPS + 3], "Deployment");
    assert_applied(&seen[LOOKUPS + 4], "Service");
    assert_ne!(
        condition(&seen[CHILDREN].body, "Degraded")["reason"],
        "OwnershipConflict"
    );
}

#[tokio::test]
async fn a_pdb_kvfleet_did_not_create_is_not_deleted_on_scale_down() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let obj = settled(inference_deployment(3, 1), 2);
    let mut paths = child_paths();
    paths.pop();
    let mut calls: Vec<Call> = paths
        .iter()
        .map(|p| call("GET", p.clone(), not_found()))
        .collect();
    calls.extend(paths.iter().map(|p| apply_call(p)));
    // A PodDisruptionBudget of that name that someone else made, even with our labels: not
    // wanted at one replica, and not ours to delete; the rest is applied.
    calls.extend(sweep(
        &[(
            "poddisruptionbudgets",
            vec![labelled("policy/v1", "PodDisruptionBudget", "llama", json!(null))],
        )],
        &[],
    ));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    result.unwrap();
    assert!(seen.iter().all(|s| s.method != "DELETE"), "{seen:?}");
    assert_ne!(
        condition(&seen[5 + 5 + SWEEP].body, "Degraded")["reason"],
        "OwnershipConflict"
    );
}

// === multi-node replicas (issue 18 item 4) ===

const LWS_DISCOVERY: &str = "/apis/leaderworkerset.x-k8s.io/v1";

/// A node as GPU Feature Discovery labels an 8 x H100 machine.
fn h100_node(name: &str) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            labels::PRODUCT: "NVIDIA-H100-80GB-HBM3", labels::COMPUTE_MAJOR: "9",
            labels::COMPUTE_MINOR: "0", labels::COUNT: "8", labels::MEMORY_MIB: "81559"}},
        "status": {"allocatable": {"nvidia.com/gpu": "8"}}
    }))
    .unwrap()
}

/// A vLLM spec of tensorParallelSize 16: more GPUs than one H100 node has.
fn tp16(generation: i64) -> InferenceDeployment {
    let mut o = inference_deployment(generation, 1);
    o.spec = serde_json::from_value(json!({
        "replicas": 1,
        "model": {"name": "meta-llama/Llama-3.1-70B-Instruct",
                  "geometry": {"layers": 80, "queryHeads": 64, "kvHeads": 8, "headDim": 128},
                  "weights": {"format": "dummy"}},
        "engine": {"runtime": "vllm", "tensorParallelSize": 16}
    }))
    .unwrap();
    o
}

fn multi_node_harness() -> Harness {
    let mut h = harness(&[h100_node("h100-0"), h100_node("h100-1")]);
    Arc::get_mut(&mut h.ctx).unwrap().validate = kvfleet::validate::validate;
    h
}

#[tokio::test]
async fn without_the_leader_worker_set_crd_a_multi_node_spec_is_denied_naming_the_crd_and_its_install() {
    let mut h = multi_node_harness();
    let calls = vec![
        // Discovery: the API server does not serve leaderworkerset.x-k8s.io/v1.
        call("GET", LWS_DISCOVERY, not_found()),
        // Denied: nothing applied; a Deployment of ours would only be reported on.
        call("GET", ns_path("apps/v1", "deployments", "llama"), not_found()),
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
    ];
    let (result, seen) = run_pass(&mut h, guard(tp16(1)), calls).await;
    // Installing the CRD wakes no watch: the object is looked at again.
    assert_eq!(
        result.unwrap(),
        Action::requeue(kvfleet::controller::reconcile::CRD_RETRY)
    );
    let status = &seen[2].body;
    let c = condition(status, "Compatible");
    assert_eq!(c["status"], "False", "{status}");
    assert_eq!(c["reason"], "LeaderWorkerSetCrdMissing");
    let msg = c["message"].as_str().unwrap();
    assert!(
        msg.contains("leaderworkersets.leaderworkerset.x-k8s.io/v1")
            && msg.contains("kubernetes-sigs/lws")
            && msg.contains("spans 2 nodes"),
        "{msg}"
    );
    assert_eq!(
        event_reasons(&seen),
        vec![("Warning".into(), "LeaderWorkerSetCrdMissing".into())]
    );
}

#[tokio::test]
async fn with_the_crd_a_tp16_spec_on_8_gpu_nodes_applies_a_leader_worker_set_and_no_deployment() {
    let mut h = multi_node_harness();
    let resources = json!({"kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": "leaderworkerset.x-k8s.io/v1",
        "resources": [{"name": "leaderworkersets", "singularName": "leaderworkerset",
                       "namespaced": true, "kind": "LeaderWorkerSet",
                       "verbs": ["get", "list", "watch", "create", "patch"]}]});
    let lws_path = ns_path("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "llama");
    // What the set wants, in apply order: worker identity, the LeaderWorkerSet, the Service.
    let wanted = [
        ns_path("v1", "serviceaccounts", "llama-worker"),
        ns_path("rbac.authorization.k8s.io/v1", "rolebindings", "llama-worker"),
        lws_path.clone(),
        ns_path("v1", "services", "llama"),
    ];
    let mut calls = vec![call("GET", LWS_DISCOVERY, Reply::Json(200, resources))];
    calls.extend(wanted.iter().map(|p| call("GET", p.clone(), not_found())));
    for p in &wanted {
        calls.push(if *p == lws_path {
            call(
                "PATCH",
                p.clone(),
                Reply::EchoWithStatus(json!({"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1})),
            )
        } else {
            apply_call(p)
        });
    }
    // The Deployment of the single-node generation before, ours: deleted once the
    // LeaderWorkerSet is applied.
    calls.extend(sweep(
        &[
            ("deployments", vec![ours("apps/v1", "Deployment", "llama")]),
            (
                "leaderworkersets",
                vec![ours("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llama")],
            ),
        ],
        &[("deployments", "llama")],
    ));
    calls.extend([
        call("GET", PODS, Reply::Json(200, pod_list(vec![]))),
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
        call("POST", EVENTS, Reply::Echo),
    ]);
    let (result, seen) = run_pass(&mut h, guard(tp16(1)), calls).await;
    result.unwrap();
    let lws = &seen[1 + 4 + 2];
    assert_applied(lws, "LeaderWorkerSet");
    let lwt = &lws.body["spec"]["leaderWorkerTemplate"];
    assert_eq!(lwt["size"], 2);
    assert_eq!(
        lwt["leaderTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "8"
    );
    assert!(
        seen.iter()
            .all(|s| !s.path.contains("/deployments") || s.method != "PATCH"),
        "no Deployment is applied"
    );
    let deletes: Vec<&str> = seen
        .iter()
        .filter(|s| s.method == "DELETE")
        .map(|s| s.path.as_str())
        .collect();
    assert_eq!(deletes, [ns_path("apps/v1", "deployments", "llama").as_str()]);
    let status = &seen[seen.len() - 3].body;
    assert_eq!(condition(status, "Compatible")["status"], "True", "{status}");
    assert_eq!(condition(status, "Available")["status"], "True", "{status}");
    assert_eq!(status["status"]["readyReplicas"], 1);
    assert_eq!(
        event_reasons(&seen),
        vec![
            ("Normal".into(), "SpecApplied".into()),
            ("Normal".into(), "Available".into())
        ]
    );
}

#[tokio::test]
async fn a_switch_from_a_leader_worker_set_back_to_one_node_deletes_the_leader_worker_set() {
    let mut h = multi_node_harness();
    // tensorParallelSize 8 fits one 8-GPU node again: a Deployment, no discovery call.
    let mut obj = settled(tp16(2), 1);
    obj.spec.engine.tensor_parallel_size = 8;
    let wanted = [
        ns_path("v1", "serviceaccounts", "llama-worker"),
        ns_path("rbac.authorization.k8s.io/v1", "rolebindings", "llama-worker"),
        ns_path("apps/v1", "deployments", "llama"),
        ns_path("v1", "services", "llama"),
    ];
    let mut calls: Vec<Call> = vec![
        call(
            "GET",
            wanted[0].clone(),
            Reply::Json(200, ours("v1", "ServiceAccount", "llama-worker")),
        ),
        call(
            "GET",
            wanted[1].clone(),
            Reply::Json(
                200,
                ours("rbac.authorization.k8s.io/v1", "RoleBinding", "llama-worker"),
            ),
        ),
        call("GET", wanted[2].clone(), not_found()),
        call(
            "GET",
            wanted[3].clone(),
            Reply::Json(200, ours("v1", "Service", "llama")),
        ),
    ];
    calls.extend(wanted.iter().map(|p| apply_call(p)));
    calls.extend(sweep(
        &[
            (
                "serviceaccounts",
                vec![ours("v1", "ServiceAccount", "llama-worker")],
            ),
            (
                "rolebindings",
                vec![ours(
                    "rbac.authorization.k8s.io/v1",
                    "RoleBinding",
                    "llama-worker",
                )],
            ),
            ("deployments", vec![ours("apps/v1", "Deployment", "llama")]),
            (
                "leaderworkersets",
                vec![ours("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llama")],
            ),
            ("services", vec![ours("v1", "Service", "llama")]),
        ],
        &[("leaderworkersets", "llama")],
    ));
    calls.extend([
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
        call("POST", EVENTS, Reply::Echo),
    ]);
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    assert_applied(&seen[4 + 2], "Deployment");
    let deletes: Vec<&Seen> = seen.iter().filter(|s| s.method == "DELETE").collect();
    assert_eq!(deletes.len(), 1, "{seen:?}");
    assert_eq!(
        deletes[0].path,
        ns_path("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "llama"),
        "the LeaderWorkerSet does not outlive the switch back to one node"
    );
    assert_eq!(
        deletes[0].body["preconditions"]["uid"],
        "uid-LeaderWorkerSet-llama"
    );
    assert_eq!(deletes[0].body["propagationPolicy"], "Background");
}

// === the owned set: a switch of runtime leaves nothing behind (issue 33) ===

/// `llama` on `runtime: vllm` (2 replicas on the RTX 3090 node).
fn vllm_llama(generation: i64) -> InferenceDeployment {
    let mut o = settled(inference_deployment(generation, 2), generation - 1);
    o.spec.engine.runtime = kvfleet::api::Runtime::Vllm;
    o
}

#[tokio::test]
async fn a_switch_from_kvfleet_to_vllm_deletes_the_config_map_and_keeps_what_vllm_still_wants() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    // vLLM's capacity sidecar annotates its pod too: the worker ServiceAccount and RoleBinding
    // stay wanted; only the worker config goes.
    let mut paths = child_paths();
    paths.remove(0);
    let mut calls: Vec<Call> = paths
        .iter()
        .map(|p| call("GET", p.clone(), not_found()))
        .collect();
    calls.extend(paths.iter().map(|p| apply_call(p)));
    calls.extend(sweep(
        &[
            ("configmaps", vec![ours("v1", "ConfigMap", "llama-config")]),
            (
                "serviceaccounts",
                vec![ours("v1", "ServiceAccount", "llama-worker")],
            ),
            (
                "rolebindings",
                vec![ours(
                    "rbac.authorization.k8s.io/v1",
                    "RoleBinding",
                    "llama-worker",
                )],
            ),
            ("deployments", vec![ours("apps/v1", "Deployment", "llama")]),
            ("services", vec![ours("v1", "Service", "llama")]),
            (
                "poddisruptionbudgets",
                vec![ours("policy/v1", "PodDisruptionBudget", "llama")],
            ),
        ],
        &[("configmaps", "llama-config")],
    ));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(vllm_llama(2)), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    let applied: Vec<&str> = seen
        .iter()
        .filter(|s| s.method == "PATCH" && s.path != STATUS)
        .map(|s| s.body["kind"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        applied,
        [
            "ServiceAccount",
            "RoleBinding",
            "Deployment",
            "Service",
            "PodDisruptionBudget"
        ]
    );
    let deletes: Vec<&str> = seen
        .iter()
        .filter(|s| s.method == "DELETE")
        .map(|s| s.path.as_str())
        .collect();
    assert_eq!(deletes, [ns_path("v1", "configmaps", "llama-config").as_str()]);
}

#[tokio::test]
async fn an_object_with_our_labels_and_another_owner_or_none_is_never_deleted() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut paths = child_paths();
    paths.remove(0);
    let mut calls: Vec<Call> = paths
        .iter()
        .map(|p| call("GET", p.clone(), not_found()))
        .collect();
    calls.extend(paths.iter().map(|p| apply_call(p)));
    let billing = json!([{"apiVersion": "apps/v1", "kind": "Deployment", "name": "billing",
                          "uid": "0000-billing", "controller": true}]);
    // A ConfigMap of the name kvfleet used, now someone else's; one with our labels and no
    // owner (copied by hand); a RoleBinding owned by an InferenceDeployment of the same name
    // that was deleted and created again (another uid). None is this object's.
    let mut earlier = owner_ref();
    earlier["uid"] = json!("6d1c1b8e-0000-4c5e-8a2e-00000000dead");
    calls.extend(sweep(
        &[
            (
                "configmaps",
                vec![
                    labelled("v1", "ConfigMap", "llama-config", billing),
                    labelled("v1", "ConfigMap", "llama-notes", json!(null)),
                ],
            ),
            (
                "rolebindings",
                vec![labelled(
                    "rbac.authorization.k8s.io/v1",
                    "RoleBinding",
                    "llama-old",
                    json!([earlier]),
                )],
            ),
        ],
        &[],
    ));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(vllm_llama(2)), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    assert!(seen.iter().all(|s| s.method != "DELETE"), "{seen:?}");
}

#[tokio::test]
async fn a_sweep_that_cannot_list_a_kind_fails_the_pass_and_deletes_nothing_after_it() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut calls = children_apply_calls(true);
    // Forbidden (RBAC without `list`): unlike 404, not a kind that is not installed.
    calls[LOOKUPS + 6 + 1].reply = status_failure(403, "Forbidden");
    calls.truncate(LOOKUPS + 6 + 2);
    let obj = Arc::new(guard(inference_deployment(1, 2)));
    let (result, _) = run_pass(&mut h, (*obj).clone(), calls).await;
    let err = result.unwrap_err();
    assert_eq!(err.metric_label(), "forbidden");
    assert!(
        kvfleet::error_chain(&err).contains("list ServiceAccounts"),
        "{}",
        kvfleet::error_chain(&err)
    );
}

// === worker NetworkPolicy (issue 22, item 7) ===

const POLICY: &str = "llama-worker";

fn policy_path() -> String {
    ns_path("networking.k8s.io/v1", "networkpolicies", POLICY)
}

/// The objects of the default spec with `network`: the NetworkPolicy after the worker
/// identity, before the Deployment.
fn child_paths_with_policy() -> Vec<String> {
    let mut paths = child_paths();
    paths.insert(3, policy_path());
    paths
}

fn with_network(mut o: InferenceDeployment, allow_from: Value) -> InferenceDeployment {
    o.spec.network = Some(serde_json::from_value(json!({"allowFrom": allow_from})).unwrap());
    o
}

#[tokio::test]
async fn spec_network_applies_a_worker_network_policy_before_the_deployment() {
    let metrics =
        json!([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]);
    let settings = Settings {
        worker_metrics_from: serde_json::from_value(metrics.clone()).unwrap(),
        ..Settings::default()
    };
    let mut h = harness_with(&[gpu_node("gpu-1")], settings);
    let clients = json!([{"podSelector": {"matchLabels": {"app": "gateway"}}}]);
    let obj = with_network(inference_deployment(1, 2), clients.clone());
    let paths = child_paths_with_policy();
    let mut calls = reads_applies_and_sweep(&paths);
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    // After the ConfigMap, ServiceAccount and RoleBinding; before the Deployment.
    let np = &seen[paths.len() + 3];
    assert_applied(np, "NetworkPolicy");
    assert_eq!(np.body["metadata"]["name"], POLICY);
    assert_eq!(
        np.body["spec"]["podSelector"],
        json!({"matchLabels": {"kvfleet.io/inference-deployment": "llama"}})
    );
    assert_eq!(np.body["spec"]["policyTypes"], json!(["Ingress"]));
    let rules = np.body["spec"]["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 2, "{rules:?}");
    assert_eq!(rules[0]["from"], clients);
    assert_eq!(rules[1]["from"], metrics);
    for r in rules {
        assert_eq!(r["ports"], json!([{"port": "http", "protocol": "TCP"}]));
    }
    assert_applied(&seen[paths.len() + 4], "Deployment");
}

#[tokio::test]
async fn a_network_policy_kvfleet_did_not_create_blocks_the_apply_and_is_named() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let obj = with_network(inference_deployment(1, 2), json!([{"podSelector": {}}]));
    let theirs = json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": POLICY, "namespace": NS}, "spec": {"podSelector": {}}});
    let mut calls: Vec<Call> = child_paths_with_policy()
        .into_iter()
        .map(|p| call("GET", p, not_found()))
        .collect();
    calls[3].reply = Reply::Json(200, theirs);
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    assert_eq!(
        result.unwrap(),
        Action::requeue(kvfleet::controller::reconcile::OWNERSHIP_RETRY)
    );
    assert!(
        seen.iter()
            .all(|s| s.method == "GET" || s.path == STATUS || s.path == EVENTS),
        "nothing applied: {seen:?}"
    );
    let degraded = condition(&seen[LOOKUPS + 1].body, "Degraded");
    assert_eq!(degraded["reason"], "OwnershipConflict");
    let message = degraded["message"].as_str().unwrap();
    assert!(message.contains("NetworkPolicy ml/llama-worker"), "{message}");
    assert_eq!(
        event_reasons(&seen),
        vec![("Warning".into(), "OwnershipConflict".into())]
    );
}

#[tokio::test]
async fn removing_spec_network_deletes_our_policy_and_never_someone_elses() {
    // Ours (from the generation that had spec.network): deleted.
    let mut h = harness(&[gpu_node("gpu-1")]);
    let paths = child_paths();
    let mut calls: Vec<Call> = paths
        .iter()
        .map(|p| call("GET", p.clone(), not_found()))
        .collect();
    calls.extend(paths.iter().map(|p| apply_call(p)));
    calls.extend(sweep(
        &[(
            "networkpolicies",
            vec![ours("networking.k8s.io/v1", "NetworkPolicy", POLICY)],
        )],
        &[("networkpolicies", POLICY)],
    ));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(inference_deployment(1, 2)), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    let deletes: Vec<&str> = seen
        .iter()
        .filter(|s| s.method == "DELETE")
        .map(|s| s.path.as_str())
        .collect();
    assert_eq!(deletes, [policy_path().as_str()]);

    // Someone else's of that name, with our labels, and no spec.network: not ours to delete,
    // and no conflict either, since kvfleet wants no object of that name.
    let mut h = harness(&[gpu_node("gpu-1")]);
    let mut calls: Vec<Call> = paths
        .iter()
        .map(|p| call("GET", p.clone(), not_found()))
        .collect();
    calls.extend(paths.iter().map(|p| apply_call(p)));
    calls.extend(sweep(
        &[(
            "networkpolicies",
            vec![labelled(
                "networking.k8s.io/v1",
                "NetworkPolicy",
                POLICY,
                json!(null),
            )],
        )],
        &[],
    ));
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(inference_deployment(1, 2)), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    assert!(seen.iter().all(|s| s.method != "DELETE"), "{seen:?}");
    assert_ne!(
        condition(&seen[CHILDREN].body, "Degraded")["reason"],
        "OwnershipConflict"
    );
}

// === routing (issue 30) ===

const POOL_DISCOVERY: &str = "/apis/inference.networking.k8s.io/v1";

/// `llama` behind the kvfleet router (the stand-in rules admit it on the RTX 3090 node).
fn routed_llama(generation: i64) -> InferenceDeployment {
    let mut o = inference_deployment(generation, 2);
    o.spec.routing = Some(serde_json::from_value(json!({"mode": "kvfleet"})).unwrap());
    o
}

#[tokio::test]
async fn mode_kvfleet_applies_the_router_and_its_identity_and_points_the_service_at_it() {
    let mut h = harness(&[gpu_node("gpu-1")]);
    let rbac = "rbac.authorization.k8s.io/v1";
    let paths = [
        ns_path("v1", "configmaps", "llama-config"),
        ns_path("v1", "serviceaccounts", "llama-worker"),
        ns_path(rbac, "rolebindings", "llama-worker"),
        ns_path("v1", "serviceaccounts", "llama-router"),
        ns_path(rbac, "roles", "llama-router"),
        ns_path(rbac, "rolebindings", "llama-router"),
        ns_path("networking.k8s.io/v1", "networkpolicies", "llama-worker"),
        ns_path("apps/v1", "deployments", "llama"),
        ns_path("v1", "services", "llama-workers"),
        ns_path("apps/v1", "deployments", "llama-router"),
        ns_path("v1", "services", "llama"),
        ns_path("policy/v1", "poddisruptionbudgets", "llama"),
        ns_path("policy/v1", "poddisruptionbudgets", "llama-router"),
    ];
    let mut calls = reads_applies_and_sweep(&paths);
    calls.push(apply_call(STATUS));
    calls.push(call("POST", EVENTS, Reply::Echo));
    let (result, seen) = run_pass(&mut h, guard(routed_llama(1)), calls).await;
    assert_eq!(result.unwrap(), Action::requeue(RESYNC));
    let applied = &seen[paths.len()..2 * paths.len()];
    for (s, kind) in applied.iter().zip([
        "ConfigMap",
        "ServiceAccount",
        "RoleBinding",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
        "Deployment",
        "Service",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
    ]) {
        assert_applied(s, kind);
    }
    assert_eq!(
        applied[4].body["rules"][0]["resources"],
        json!(["endpointslices"])
    );
    // The workers' kv-events port admits only the router (issue 62).
    assert_eq!(
        applied[6].body["spec"]["ingress"][1]["from"],
        json!([{"podSelector": {"matchLabels": {"kvfleet.io/router": "llama"}}}])
    );
    assert_eq!(applied[8].body["spec"]["clusterIP"], "None");
    let router = &applied[9].body["spec"];
    assert_eq!(router["replicas"], 2);
    assert_eq!(router["template"]["spec"]["containers"][0]["args"][0], "router");
    assert_eq!(
        applied[10].body["spec"]["selector"],
        json!({"kvfleet.io/router": "llama"}),
        "the Service selects the router"
    );
    // Status still reads the workers' Deployment.
    let status = &seen[2 * paths.len() + SWEEP].body;
    assert_eq!(
        status["status"]["selector"],
        "kvfleet.io/inference-deployment=llama"
    );
    assert_eq!(condition(status, "Compatible")["status"], "True");
}

/// `llama` on vLLM in an InferencePool, judged by the real rules on two H100 nodes.
fn pooled_llama(generation: i64) -> InferenceDeployment {
    let mut o = inference_deployment(generation, 1);
    o.spec = serde_json::from_value(json!({
        "replicas": 1,
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct",
                  "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128},
                  "weights": {"format": "dummy"}},
        "engine": {"runtime": "vllm"},
        "routing": {"mode": "inferencePool", "endpointPicker": {"name": "llama-epp", "port": 9002}}
    }))
    .unwrap();
    o
}

#[tokio::test]
async fn without_the_inference_pool_crd_mode_inference_pool_is_denied_naming_the_crd_and_looked_at_again() {
    let mut h = multi_node_harness();
    let calls = vec![
        // Discovery: the API server does not serve inference.networking.k8s.io/v1.
        call("GET", POOL_DISCOVERY, not_found()),
        call("GET", ns_path("apps/v1", "deployments", "llama"), not_found()),
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
    ];
    let (result, seen) = run_pass(&mut h, guard(pooled_llama(1)), calls).await;
    assert_eq!(
        result.unwrap(),
        Action::requeue(kvfleet::controller::reconcile::CRD_RETRY)
    );
    let status = &seen[2].body;
    let c = condition(status, "Compatible");
    assert_eq!(c["status"], "False", "{status}");
    assert_eq!(c["reason"], "InferencePoolCrdMissing");
    let msg = c["message"].as_str().unwrap();
    assert!(
        msg.contains("inferencepools.inference.networking.k8s.io") && msg.contains("routing mode service"),
        "{msg}"
    );
    assert_eq!(
        event_reasons(&seen),
        vec![("Warning".into(), "InferencePoolCrdMissing".into())]
    );
    assert!(!h.ctx.inference_pool.load(std::sync::atomic::Ordering::Relaxed));
}

#[tokio::test]
async fn with_the_crd_mode_inference_pool_applies_the_pool_and_sweeps_inference_pools() {
    let mut h = multi_node_harness();
    let resources = json!({"kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": "inference.networking.k8s.io/v1",
        "resources": [{"name": "inferencepools", "singularName": "inferencepool",
                       "namespaced": true, "kind": "InferencePool",
                       "verbs": ["get", "list", "watch", "create", "patch", "delete"]}]});
    let pool = ns_path("inference.networking.k8s.io/v1", "inferencepools", "llama");
    let wanted = [
        ns_path("v1", "serviceaccounts", "llama-worker"),
        ns_path("rbac.authorization.k8s.io/v1", "rolebindings", "llama-worker"),
        ns_path("apps/v1", "deployments", "llama"),
        ns_path("v1", "services", "llama"),
        pool.clone(),
    ];
    let mut calls = vec![call("GET", POOL_DISCOVERY, Reply::Json(200, resources))];
    calls.extend(reads_applies_and_sweep(&wanted));
    // Served: the sweep lists InferencePools after the other kinds; ours is wanted.
    calls.push(call(
        "GET",
        list_path("inference.networking.k8s.io/v1", "inferencepools"),
        Reply::Json(
            200,
            object_list(vec![ours(
                "inference.networking.k8s.io/v1",
                "InferencePool",
                "llama",
            )]),
        ),
    ));
    calls.extend([apply_call(STATUS), call("POST", EVENTS, Reply::Echo)]);
    let (result, seen) = run_pass(&mut h, guard(pooled_llama(1)), calls).await;
    result.unwrap();
    let applied = &seen[1 + wanted.len() + 4];
    assert_applied(applied, "InferencePool");
    assert_eq!(
        applied.body["spec"],
        json!({"selector": {"matchLabels": {"kvfleet.io/inference-deployment": "llama"}},
               "targetPorts": [{"number": 8000}],
               "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}}})
    );
    // The workers publish KV events for the endpoint picker.
    let dep = &seen[1 + wanted.len() + 2].body;
    let args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap();
    assert!(args.iter().any(|a| a == "--kv-events-config"), "{args:?}");
    assert!(seen.iter().all(|s| s.method != "DELETE"));
    assert!(h.ctx.inference_pool.load(std::sync::atomic::Ordering::Relaxed));
}

// === pods on nodes that can no longer run them (issue 35) ===

/// A node GPU Feature Discovery relabelled as a Tesla T4 (7.5), which the spec does not select.
fn relabelled_node(name: &str) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            labels::PRODUCT: "Tesla-T4", labels::COMPUTE_MAJOR: "7", labels::COMPUTE_MINOR: "5"}},
        "status": {"allocatable": {"nvidia.com/gpu": "2"}}
    }))
    .unwrap()
}

/// A running worker pod of `llama` bound to `node`.
fn bound_pod(name: &str, node: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"),
                        "labels": {"kvfleet.io/inference-deployment": "llama"}},
           "spec": {"containers": [], "nodeName": node},
           "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
}

/// One pass over a settled `llama` whose Deployment has 2 ready replicas and whose pods are
/// `pods`: a status write when `writes`, then `events` Events.
fn pass_with_pods(pods: Vec<Value>, writes: bool, events: usize) -> Vec<Call> {
    let ready = json!({"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2});
    let mut calls = children_apply_calls(true);
    calls[LOOKUPS + 3] = call(
        "PATCH",
        ns_path("apps/v1", "deployments", "llama"),
        Reply::EchoWithStatus(ready),
    );
    calls.push(call("GET", PODS, Reply::Json(200, pod_list(pods))));
    if writes {
        calls.push(apply_call(STATUS));
    }
    calls.extend((0..events).map(|_| call("POST", EVENTS, Reply::Echo)));
    calls
}

#[tokio::test]
async fn a_pod_on_a_relabelled_node_is_named_in_a_condition_and_once_in_a_warning_event() {
    let mut h = harness(&[gpu_node("gpu-1"), relabelled_node("gpu-2")]);
    let obj = settled(inference_deployment(1, 2), 1);
    let pods = vec![bound_pod("llama-a", "gpu-1"), bound_pod("llama-b", "gpu-2")];
    let (result, seen) = run_pass(&mut h, guard(obj.clone()), pass_with_pods(pods.clone(), true, 1)).await;
    assert_eq!(result.unwrap(), Action::requeue(CAPACITY_POLL));
    let status = &seen[CHILDREN + 1].body;
    let c = condition(status, "PodsOnIncompatibleNodes");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("True"), Some("NodeNoLongerCompatible"))
    );
    let msg = c["message"].as_str().unwrap();
    assert!(
        msg.starts_with("1 of 2 bound worker pod(s) run on a node that can no longer run kvCacheDtype bfloat16 with attentionBackend KVFLEET_CUDA")
            && msg.contains("pod llama-b on node gpu-2 (Tesla-T4, compute capability 7.5)")
            && !msg.contains("llama-a")
            && msg.contains("kubectl delete pod llama-b -n ml"),
        "{msg}"
    );
    // Degraded for it, with the same message (issue 35); the Event below is the only one.
    let d = condition(status, "Degraded");
    assert_eq!(
        (d["status"].as_str(), d["reason"].as_str(), d["message"].as_str()),
        (Some("True"), Some("PodsOnIncompatibleNodes"), Some(msg))
    );
    // The Compatible condition still counts the one node that can run it.
    assert!(condition(status, "Compatible")["message"]
        .as_str()
        .unwrap()
        .starts_with("1 node(s) can run it"));
    assert_eq!(
        event_reasons(&seen),
        vec![("Warning".into(), "PodOnIncompatibleNode".into())]
    );
    let ev = &seen.iter().find(|s| s.path == EVENTS).unwrap().body;
    assert_eq!(ev["related"]["kind"], "Pod");
    assert_eq!(ev["related"]["name"], "llama-b");
    assert_eq!(ev["regarding"]["name"], "llama");
    assert!(
        ev["note"]
            .as_str()
            .unwrap()
            .starts_with("pod llama-b runs on node gpu-2 (Tesla-T4, compute capability 7.5), which can no longer run kvCacheDtype bfloat16"),
        "{ev}"
    );

    // The next pass finds the same: no status write, no second Event.
    let mut again = obj.clone();
    again.status = Some(serde_json::from_value(status["status"].clone()).unwrap());
    let (result, seen) = run_pass(
        &mut h,
        guard(again.clone()),
        pass_with_pods(pods.clone(), false, 0),
    )
    .await;
    result.unwrap();
    assert!(event_reasons(&seen).is_empty());

    // The pod is deleted and rescheduled on gpu-1: False again.
    let healed = vec![bound_pod("llama-a", "gpu-1"), bound_pod("llama-c", "gpu-1")];
    let (_, seen) = run_pass(&mut h, guard(again), pass_with_pods(healed, true, 0)).await;
    let c = condition(&seen[CHILDREN + 1].body, "PodsOnIncompatibleNodes");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("False"), Some("AllPodsOnCompatibleNodes"))
    );
    let d = condition(&seen[CHILDREN + 1].body, "Degraded");
    assert_eq!(
        (d["status"].as_str(), d["reason"].as_str()),
        (Some("False"), Some("AsExpected"))
    );
}

#[tokio::test]
async fn with_no_node_left_for_a_denied_generation_the_pods_of_the_admitted_one_are_still_checked() {
    // The only node that ran it is relabelled: the stand-in rules deny (no selected product),
    // the generation was admitted before, so its pods are checked against what they run.
    let mut h = harness(&[relabelled_node("gpu-1")]);
    let obj = settled(inference_deployment(1, 2), 1);
    let running = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "llama", "namespace": NS, "ownerReferences": [owner_ref()], "generation": 1},
        "spec": {"selector": {}, "template": {}},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}});
    let calls = vec![
        call(
            "GET",
            ns_path("apps/v1", "deployments", "llama"),
            Reply::Json(200, running),
        ),
        call(
            "GET",
            PODS,
            Reply::Json(200, pod_list(vec![bound_pod("llama-a", "gpu-1")])),
        ),
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
        call("POST", EVENTS, Reply::Echo),
        call("POST", EVENTS, Reply::Echo),
    ];
    let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
    assert_eq!(result.unwrap(), Action::await_change());
    let status = &seen[2].body;
    assert_eq!(condition(status, "Compatible")["status"], "False");
    let c = condition(status, "PodsOnIncompatibleNodes");
    assert_eq!(c["status"], "True", "{c}");
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .contains("pod llama-a on node gpu-1 (Tesla-T4"),
        "{c}"
    );
    assert_eq!(
        event_reasons(&seen),
        vec![
            ("Warning".into(), "NoCompatibleNodes".into()),
            ("Warning".into(), "NodesChanged".into()),
            ("Warning".into(), "PodOnIncompatibleNode".into())
        ]
    );
}

// === autoscaling engine keda (issue 31) ===

const KEDA_DISCOVERY: &str = "/apis/keda.sh/v1alpha1";
const PROMETHEUS: &str = "http://prometheus-operated.monitoring.svc:9090";

/// A kvfleet spec on H100s scaled by `engine`.
fn autoscaled_llama(generation: i64, engine: &str) -> InferenceDeployment {
    let mut o = inference_deployment(generation, 1);
    o.spec = serde_json::from_value(json!({
        "replicas": 1,
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct",
                  "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128},
                  "weights": {"format": "dummy"}},
        "engine": {"runtime": "kvfleet", "maxModelLen": 8192},
        "gpu": {"selector": {"products": ["NVIDIA-H100-80GB-HBM3"]}},
        "autoscaling": {"engine": engine, "minReplicas": 1, "maxReplicas": 4,
                        "scaleDown": {"stabilizationWindowSeconds": 60}}
    }))
    .unwrap();
    o
}

/// Real validation on two H100 nodes; KEDA's trigger queries `prometheus` when given.
fn keda_harness(prometheus: Option<&str>) -> Harness {
    let settings = Settings {
        keda_prometheus_address: prometheus.map(str::to_string),
        ..Settings::default()
    };
    let mut h = harness_with(&[h100_node("h100-0"), h100_node("h100-1")], settings);
    Arc::get_mut(&mut h.ctx).unwrap().validate = kvfleet::validate::validate;
    h
}

fn keda_resources() -> Value {
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "keda.sh/v1alpha1",
           "resources": [{"name": "scaledobjects", "singularName": "scaledobject", "namespaced": true,
                          "kind": "ScaledObject", "verbs": ["get", "list", "watch", "create", "patch", "delete"]}]})
}

/// What an autoscaled kvfleet spec of one replica wants besides a ScaledObject.
fn autoscaled_paths() -> Vec<String> {
    vec![
        ns_path("v1", "configmaps", "llama-config"),
        ns_path("v1", "serviceaccounts", "llama-worker"),
        ns_path("rbac.authorization.k8s.io/v1", "rolebindings", "llama-worker"),
        ns_path("apps/v1", "deployments", "llama"),
        ns_path("v1", "services", "llama"),
    ]
}

#[tokio::test]
async fn without_the_scaled_object_crd_engine_keda_is_denied_naming_the_crd_and_looked_at_again() {
    let mut h = keda_harness(Some(PROMETHEUS));
    let calls = vec![
        call("GET", KEDA_DISCOVERY, not_found()),
        call("GET", ns_path("apps/v1", "deployments", "llama"), not_found()),
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
    ];
    let (result, seen) = run_pass(&mut h, guard(autoscaled_llama(1, "keda")), calls).await;
    assert_eq!(
        result.unwrap(),
        Action::requeue(kvfleet::controller::reconcile::CRD_RETRY)
    );
    let c = condition(&seen[2].body, "Compatible");
    assert_eq!(c["status"], "False", "{}", seen[2].body);
    assert_eq!(c["reason"], "KedaScaledObjectCrdMissing");
    let msg = c["message"].as_str().unwrap();
    assert!(
        msg.contains("scaledobjects.keda.sh") && msg.contains("engine to kvfleet"),
        "{msg}"
    );
    assert_eq!(
        event_reasons(&seen),
        vec![("Warning".into(), "KedaScaledObjectCrdMissing".into())]
    );
    assert!(!h.ctx.scaled_object.load(std::sync::atomic::Ordering::Relaxed));
}

#[tokio::test]
async fn without_a_prometheus_address_engine_keda_is_denied_and_nothing_is_applied() {
    let mut h = keda_harness(None);
    let calls = vec![
        call("GET", KEDA_DISCOVERY, Reply::Json(200, keda_resources())),
        call("GET", ns_path("apps/v1", "deployments", "llama"), not_found()),
        apply_call(STATUS),
        call("POST", EVENTS, Reply::Echo),
    ];
    let (result, seen) = run_pass(&mut h, guard(autoscaled_llama(1, "keda")), calls).await;
    assert_eq!(result.unwrap(), Action::await_change());
    let c = condition(&seen[2].body, "Compatible");
    assert_eq!(c["reason"], "KedaPrometheusAddressMissing", "{}", seen[2].body);
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .contains("autoscaling.keda.prometheusAddress"),
        "{c}"
    );
    assert!(seen.iter().all(|s| s.method != "PATCH" || s.path == STATUS));
}

#[tokio::test]
async fn with_the_crd_engine_keda_applies_a_scaled_object_after_the_deployment_and_leaves_replicas_to_it() {
    let mut h = keda_harness(Some(PROMETHEUS));
    let so = ns_path("keda.sh/v1alpha1", "scaledobjects", "llama");
    let mut wanted = autoscaled_paths();
    wanted.push(so.clone());
    let mut calls = vec![call("GET", KEDA_DISCOVERY, Reply::Json(200, keda_resources()))];
    calls.extend(reads_applies_and_sweep(&wanted));
    // Served: the sweep lists ScaledObjects after the other kinds; ours is wanted.
    calls.push(call(
        "GET",
        list_path("keda.sh/v1alpha1", "scaledobjects"),
        Reply::Json(
            200,
            object_list(vec![ours("keda.sh/v1alpha1", "ScaledObject", "llama")]),
        ),
    ));
    calls.extend([apply_call(STATUS), call("POST", EVENTS, Reply::Echo)]);
    let (result, seen) = run_pass(&mut h, guard(autoscaled_llama(1, "keda")), calls).await;
    result.unwrap();
    let applies: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.method == "PATCH" && s.path != STATUS)
        .collect();
    let kinds: Vec<&str> = applies.iter().map(|s| s.body["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "ServiceAccount",
            "RoleBinding",
            "Deployment",
            "Service",
            "ScaledObject"
        ]
    );
    let dep = applies[3];
    assert!(
        dep.body["spec"].get("replicas").is_none(),
        "KEDA's HPA owns the count: {}",
        dep.body["spec"]
    );
    let applied = applies[5];
    assert_applied(applied, "ScaledObject");
    assert_eq!(applied.path, so);
    let spec = &applied.body["spec"];
    assert_eq!(spec["scaleTargetRef"]["name"], "llama");
    assert_eq!(spec["scaleTargetRef"]["kind"], "Deployment");
    assert_eq!(
        (spec["minReplicaCount"].as_i64(), spec["maxReplicaCount"].as_i64()),
        (Some(1), Some(4))
    );
    assert_eq!(spec["cooldownPeriod"], 60);
    assert_eq!(
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
            ["stabilizationWindowSeconds"],
        60
    );
    let trigger = &spec["triggers"][0];
    assert_eq!(trigger["type"], "prometheus");
    assert_eq!(trigger["metadata"]["serverAddress"], PROMETHEUS);
    assert_eq!(
        trigger["metadata"]["query"],
        r#"sum(kvfleet_kv_demand_tokens{namespace="ml",inferencedeployment="llama"}) / (0.8 * avg(kvfleet_kv_capacity_tokens{namespace="ml",inferencedeployment="llama"} > 0))"#
    );
    assert!(seen.iter().all(|s| s.method != "DELETE"));
    assert!(h.ctx.scaled_object.load(std::sync::atomic::Ordering::Relaxed));
}

#[tokio::test]
async fn switching_to_the_kvfleet_engine_or_dropping_autoscaling_deletes_our_scaled_object_and_never_another()
{
    for (what, obj) in [
        ("engine kvfleet", autoscaled_llama(2, "kvfleet")),
        ("no autoscaling", {
            let mut o = autoscaled_llama(2, "kvfleet");
            o.spec.autoscaling = None;
            o
        }),
    ] {
        let mut h = keda_harness(Some(PROMETHEUS));
        // Discovery found the CRD earlier (a pass of engine keda, or the periodic look).
        h.ctx
            .scaled_object
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let foreign = labelled(
            "keda.sh/v1alpha1",
            "ScaledObject",
            "llama-extra",
            json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "someone-else"}]),
        );
        let mut calls = reads_applies_and_sweep(&autoscaled_paths());
        calls.push(call(
            "GET",
            list_path("keda.sh/v1alpha1", "scaledobjects"),
            Reply::Json(
                200,
                object_list(vec![ours("keda.sh/v1alpha1", "ScaledObject", "llama"), foreign]),
            ),
        ));
        calls.push(call("DELETE", so_path(), deleted()));
        calls.extend([apply_call(STATUS), call("POST", EVENTS, Reply::Echo)]);
        let (result, seen) = run_pass(&mut h, guard(obj), calls).await;
        result.unwrap_or_else(|e| panic!("{what}: {e}"));
        let deletes: Vec<&Seen> = seen.iter().filter(|s| s.method == "DELETE").collect();
        assert_eq!(deletes.len(), 1, "{what}");
        // Only the object the list returned: the uid precondition.
        assert_eq!(
            deletes[0].body["preconditions"]["uid"], "uid-ScaledObject-llama",
            "{what}"
        );
        assert!(
            seen.iter().all(|s| s.path != KEDA_DISCOVERY),
            "{what}: discovery is asked only for engine keda"
        );
    }
}

fn so_path() -> String {
    ns_path("keda.sh/v1alpha1", "scaledobjects", "llama")
}

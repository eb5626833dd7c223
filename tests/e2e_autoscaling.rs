//! End-to-end: the KV-demand autoscaler drives an InferenceDeployment's workers 1 -> 3 -> 1
//! within its stabilization windows and holds still under a steady load; with
//! `minReplicas: 0` and a kvfleet router it goes to 0, and demand the router holds brings a
//! replica back (issue 31).
//!
//! Against a real control plane (`../shared/k8s`): `kvfleet controller` from this build runs on
//! the host under a ServiceAccount bound to a copy of deploy/rbac/controller.yaml's ClusterRole
//! (so the API server checks the autoscaler's scale-subresource rule), reading every interval
//! of 1 s. Nothing runs in the pods (no kubelet): the worker pods carry `stand-in/ready:
//! "false"` so the kubelet stand-in leaves them to this test, which reports each one Ready
//! with a loopback pod IP (127.0.0.N) where a stub answers `/v1/capacity` with the demand the
//! test sets: the stub stands for the worker's gauges (the gauges themselves are measured in
//! the engine's and the worker's tests). The router pod gets a loopback IP too, where a stub
//! answers `/v1/router/state` with held demand.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_autoscaling -- --ignored --nocapture`

mod e2e_support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::get;
use axum::Json;
use e2e_support::{get_json, kubectl, kubectl_ok, kubectl_stdin, ok, wait_for, Namespace, Nodes, H100};
use serde_json::{json, Value};

const NS: &str = "kvfleet-e2e-autoscaling";
const NODE: &str = "kvfleet-e2e-autoscaling-h100-0";
const NAME: &str = "scaled";
const CONTROLLER: &str = "kvfleet-e2e-autoscaling-controller";
/// Loopback addresses the stubs listen on (port 8000, the workers' and router's HTTP port).
const WORKER_IPS: [&str; 3] = ["127.0.0.31", "127.0.0.32", "127.0.0.33"];
const ROUTER_IP: &str = "127.0.0.39";
/// One stub worker's KV capacity (tokens of maxModelLen requests).
const CAPACITY: u64 = 100_000;
const SCALE: Duration = Duration::from_secs(45);

/// What the stubs answer: demand per worker IP, and the router's held demand.
#[derive(Default)]
struct Signals {
    demand: BTreeMap<String, u64>,
    held: u64,
}

type Shared = Arc<Mutex<Signals>>;

async fn capacity(State((s, ip)): State<(Shared, String)>) -> Json<Value> {
    let d = s.lock().unwrap().demand.get(&ip).copied().unwrap_or(0);
    Json(json!({"live": {"kvDemandTokens": d, "kvCapacityTokens": CAPACITY}}))
}

async fn router_state(State((s, _)): State<(Shared, String)>) -> Json<Value> {
    let held = s.lock().unwrap().held;
    Json(json!({"held": {"requests": u64::from(held > 0), "demandTokens": held}}))
}

/// Serves the stub of `ip` on port 8000.
async fn stub(ip: &str, signals: Shared) {
    let app = axum::Router::new()
        .route("/v1/capacity", get(capacity))
        .route("/v1/router/state", get(router_state))
        .with_state((signals, ip.to_string()));
    let addr: SocketAddr = format!("{ip}:8000").parse().unwrap();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap_or_else(|e| {
        panic!("stub on {addr}: {e} (is something listening on port 8000 of every address?)")
    });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
}

fn spec(min: i32, routing: &str) -> Value {
    json!({"replicas": 1,
           "model": {"name": "meta-llama/Llama-3.1-8B-Instruct",
                     "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128},
                     "weights": {"format": "dummy"}},
           "engine": {"runtime": "kvfleet", "maxModelLen": 8192},
           "gpu": {"selector": {"products": [H100.product]}},
           "pod": {"annotations": {"stand-in/ready": "false"}},
           "routing": {"mode": routing},
           "autoscaling": {"minReplicas": min, "maxReplicas": 3, "targetDemandRatio": 0.8,
                           "scaleUp": {"stabilizationWindowSeconds": 0},
                           "scaleDown": {"stabilizationWindowSeconds": 6}}})
}

fn apply(spec: Value) {
    let obj = json!({"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
                     "metadata": {"name": NAME, "namespace": NS}, "spec": spec});
    ok(
        "apply the InferenceDeployment",
        kubectl_stdin(&["apply", "--server-side", "-f", "-"], &obj.to_string()),
    );
}

/// Reports the pods of `selector` Ready with loopback IPs from `ips` (kept per pod name).
fn make_ready(selector: &str, ips: &[&str], assigned: &mut BTreeMap<String, String>) {
    let Some(list) = get_json(&["pods", "-n", NS, "-l", selector]) else {
        return;
    };
    let pods: Vec<Value> = list["items"].as_array().cloned().unwrap_or_default();
    let live: Vec<String> = pods
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .map(|p| p["metadata"]["name"].as_str().unwrap_or_default().to_string())
        .collect();
    assigned.retain(|pod, _| live.contains(pod));
    for pod in &live {
        if assigned.contains_key(pod) {
            continue;
        }
        let Some(ip) = ips.iter().find(|ip| !assigned.values().any(|a| a == *ip)) else {
            continue;
        };
        let now = jiff::Timestamp::now().to_string();
        let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                           {"type": "ContainersReady", "status": "True", "lastTransitionTime": now}]}});
        let out = kubectl(&[
            "patch",
            "pod",
            pod,
            "-n",
            NS,
            "--subresource=status",
            "--type=merge",
            "-p",
            &status.to_string(),
        ]);
        if out.status.success() {
            assigned.insert(pod.clone(), ip.to_string());
        }
    }
}

fn deployment_replicas(name: &str) -> Option<i64> {
    get_json(&["deployment", name, "-n", NS])?["spec"]["replicas"].as_i64()
}

fn autoscaling_status() -> Value {
    get_json(&["inferencedeployment", NAME, "-n", NS])
        .map_or(Value::Null, |o| o["status"]["autoscaling"].clone())
}

/// Waits until the workers' Deployment is at `want` replicas and the autoscaler's status
/// says so, reporting pods Ready as they come.
fn wait_replicas(want: i64, assigned: &mut BTreeMap<String, String>, log: &dyn Fn() -> String) -> Duration {
    let start = Instant::now();
    wait_for(&format!("{want} replicas"), SCALE, || {
        make_ready(
            &format!("kvfleet.io/inference-deployment={NAME}"),
            &WORKER_IPS,
            assigned,
        );
        let got = deployment_replicas(NAME);
        let st = autoscaling_status();
        // Every replica read: the new pods' stubs answered the autoscaler.
        if got == Some(want) && st["desiredReplicas"] == want && st["observedReplicas"] == want {
            Ok(())
        } else {
            Err(format!("deployment {got:?}, status.autoscaling {st}\n{}", log()))
        }
    });
    start.elapsed()
}

/// The replica counts the Deployment went through during `d` (no flapping: one value).
fn watch_counts(d: Duration, assigned: &mut BTreeMap<String, String>) -> Vec<i64> {
    let mut seen = Vec::new();
    let end = Instant::now() + d;
    while Instant::now() < end {
        make_ready(
            &format!("kvfleet.io/inference-deployment={NAME}"),
            &WORKER_IPS,
            assigned,
        );
        if let Some(n) = deployment_replicas(NAME) {
            if seen.last() != Some(&n) {
                seen.push(n);
            }
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    seen
}

fn set_demand(signals: &Shared, assigned: &BTreeMap<String, String>, per_replica: u64) {
    let mut s = signals.lock().unwrap();
    s.demand.clear();
    for ip in assigned.values() {
        s.demand.insert(ip.clone(), per_replica);
    }
    // A pod that becomes ready later reads the same demand.
    for ip in WORKER_IPS {
        s.demand.entry(ip.to_string()).or_insert(per_replica);
    }
}

fn scale_events() -> Vec<String> {
    let list = get_json(&[
        "events",
        "-n",
        NS,
        "--field-selector",
        &format!("involvedObject.name={NAME},involvedObject.kind=InferenceDeployment"),
    ])
    .unwrap_or(Value::Null);
    list["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|e| {
            format!(
                "{}: {}",
                e["reason"].as_str().unwrap_or(""),
                e["note"].as_str().or(e["message"].as_str()).unwrap_or("")
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn e2e_autoscaling_follows_kv_demand_1_3_1_and_to_zero_and_back() {
    e2e_support::require_cluster("e2e_autoscaling");
    let bin = env!("CARGO_BIN_EXE_kvfleet");
    let signals: Shared = Arc::default();
    for ip in WORKER_IPS.iter().chain([&ROUTER_IP]) {
        stub(ip, signals.clone()).await;
    }

    let crd_created = e2e_support::install_crd(bin);
    let ns = Namespace::create(NS);
    let mut nodes = Nodes::default();
    nodes.gpu(NODE, H100);
    let identity = e2e_support::ControllerIdentity::create(CONTROLLER, NS);
    let scratch = std::env::temp_dir().join(format!("kvfleet-e2e-autoscaling-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let controller = identity.spawn_controller(
        bin,
        &scratch,
        "info,kvfleet::controller::autoscale=debug",
        &["--autoscale-interval-seconds", "1"],
    );
    let log = || controller.log_tail();
    let mut assigned = BTreeMap::new();

    // 1. One replica at a fifth of its capacity: the autoscaler takes the count over and
    //    keeps 1 (ceil(0.2 / 0.8) = 1).
    set_demand(&signals, &assigned, CAPACITY / 5);
    apply(spec(1, "service"));
    wait_replicas(1, &mut assigned, &log);
    let st = autoscaling_status();
    assert_eq!(st["observedReplicas"], 1, "{st}");
    assert_eq!(st["capacityTokens"], CAPACITY, "{st}");

    // 2. Demand of twice one replica's capacity: ceil(2 / 0.8) = 3, at once (no scale-up
    //    window), and the new pods are read as they become ready.
    set_demand(&signals, &assigned, 2 * CAPACITY);
    let up = wait_replicas(3, &mut assigned, &log);
    // The same demand spread over three: 0.67 of capacity each, within the tolerance of the
    // 0.8 target: a steady load, and the count must not move.
    set_demand(&signals, &assigned, 2 * CAPACITY / 3);
    let steady = watch_counts(Duration::from_secs(8), &mut assigned);
    assert_eq!(steady, vec![3], "flapped under a steady load\n{}", log());
    let st = autoscaling_status();
    assert_eq!(st["observedReplicas"], 3, "{st}");

    // 3. Demand drops to a tenth per replica: back to 1, not before the 6 s scale-down window.
    set_demand(&signals, &assigned, CAPACITY / 10);
    let dropped = Instant::now();
    wait_replicas(1, &mut assigned, &log);
    let down = dropped.elapsed();
    assert!(
        down >= Duration::from_secs(5),
        "scaled down after {down:?}, inside the 6 s window"
    );
    let events = scale_events();
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("ScaleUp") && e.contains("1 -> 3")),
        "{events:#?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("ScaleDown") && e.contains("3 -> 1")),
        "{events:#?}"
    );

    // 4. minReplicas 0 behind a kvfleet router: idle, it goes to 0 after the window...
    set_demand(&signals, &assigned, 0);
    apply(spec(0, "kvfleet"));
    let mut router_ip = BTreeMap::new();
    wait_for("the router ready on its stub", SCALE, || {
        make_ready(&format!("kvfleet.io/router={NAME}"), &[ROUTER_IP], &mut router_ip);
        (!router_ip.is_empty())
            .then_some(())
            .ok_or("no router pod yet".to_string())
    });
    wait_replicas(0, &mut assigned, &log);
    let events = scale_events();
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("ScaleToZero") && e.contains("1 -> 0")),
        "{events:#?}"
    );
    // ...and demand the router holds brings one back (no replica reads anything).
    signals.lock().unwrap().held = 3000;
    let held = Instant::now();
    wait_replicas(1, &mut assigned, &log);
    let back = held.elapsed();
    let events = scale_events();
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("ScaleFromZero") && e.contains("0 -> 1")),
        "{events:#?}"
    );
    signals.lock().unwrap().held = 0;
    println!("scale up 1 -> 3: {up:?}; scale down 3 -> 1: {down:?}; held demand -> 1 replica: {back:?}");

    kubectl_ok(&["delete", "inferencedeployment", NAME, "-n", NS, "--wait=true"]);
    drop(controller);
    drop(identity);
    drop(ns);
    drop(nodes);
    e2e_support::delete_crd_if_created(crd_created);
    let _ = std::fs::remove_dir_all(&scratch);
}

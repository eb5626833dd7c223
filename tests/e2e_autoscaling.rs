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
//! The second test is the cold start with real parts: a real `kvfleet router` (hold on, one
//! static worker URL) at the router pod's loopback IP and, once the autoscaler has scaled the
//! Deployment from zero and the scheduler has bound the pod, a real `kvfleet worker` serving
//! the embedded SmolLM2 on the CPU, started by the test where a kubelet would start the
//! container (weights on the node, no image pull). It measures a streamed request's wait from
//! the moment it reaches the router to its first token, and each part of that wait.
//! `KVFLEET_E2E_BIN` runs another build of the binary (a release build for the figure in
//! `bench/RESULTS.md`).
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_autoscaling -- --ignored --nocapture`

mod e2e_support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::get;
use axum::Json;
use e2e_support::{get_json, kubectl, kubectl_ok, kubectl_stdin, ok, wait_for, Namespace, Nodes, Proc, H100};
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
/// The cold-start test's namespace, addresses and controller identity.
const COLD_NS: &str = "kvfleet-e2e-cold-start";
const COLD_WORKER_IP: &str = "127.0.0.41";
const COLD_ROUTER_IP: &str = "127.0.0.49";
const COLD_CONTROLLER: &str = "kvfleet-e2e-cold-start-controller";
/// The embedded model's id, which the router and the worker serve.
const SMOLLM2: &str = "SmolLM2-135M-Instruct";

/// Each test runs its own controller, which acts on every namespace: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
    spec_named(min, routing, "meta-llama/Llama-3.1-8B-Instruct")
}

fn spec_named(min: i32, routing: &str, model: &str) -> Value {
    json!({"replicas": 1,
           "model": {"name": model,
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
    apply_in(NS, spec);
}

fn apply_in(ns: &str, spec: Value) {
    let obj = json!({"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
                     "metadata": {"name": NAME, "namespace": ns}, "spec": spec});
    ok(
        "apply the InferenceDeployment",
        kubectl_stdin(&["apply", "--server-side", "-f", "-"], &obj.to_string()),
    );
}

/// Reports the pods of `selector` Ready with loopback IPs from `ips` (kept per pod name).
fn make_ready(selector: &str, ips: &[&str], assigned: &mut BTreeMap<String, String>) {
    make_ready_in(NS, selector, ips, assigned);
}

fn make_ready_in(ns: &str, selector: &str, ips: &[&str], assigned: &mut BTreeMap<String, String>) {
    let Some(list) = get_json(&["pods", "-n", ns, "-l", selector]) else {
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
            ns,
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
    deployment_replicas_in(NS, name)
}

fn deployment_replicas_in(ns: &str, name: &str) -> Option<i64> {
    get_json(&["deployment", name, "-n", ns])?["spec"]["replicas"].as_i64()
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
    scale_events_in(NS)
}

fn scale_events_in(ns: &str) -> Vec<String> {
    let list = get_json(&[
        "events",
        "-n",
        ns,
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
    let _serial = SERIAL.lock().await;
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

/// The embedded SmolLM2 (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`).
fn smollm2() -> String {
    let p = std::env::var("KVFLEET_SMOLLM2_GGUF").unwrap_or_else(|_| {
        format!(
            "{}/.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    assert!(
        std::path::Path::new(&p).exists(),
        "the embedded SmolLM2 is not installed at {p} (run .ci/install-tools)"
    );
    p
}

/// Reports the (one) pod of `selector` in the cold-start namespace Ready at `ip`, and again
/// until the API shows it there twice in a row (the kubelet stand-in may write its own address
/// over the first patch).
fn pin_ip(selector: &str, ip: &str) {
    let mut seen = 0;
    wait_for(&format!("a pod of {selector} ready at {ip}"), SCALE, || {
        let pods = get_json(&["pods", "-n", COLD_NS, "-l", selector])
            .and_then(|l| l["items"].as_array().cloned())
            .unwrap_or_default();
        let Some(pod) = pods.first() else {
            return Err("no pod yet".into());
        };
        if pod["status"]["podIP"] == ip {
            seen += 1;
        } else {
            seen = 0;
            let mut fresh = BTreeMap::new();
            make_ready_in(COLD_NS, selector, &[ip], &mut fresh);
        }
        (seen >= 2)
            .then_some(())
            .ok_or_else(|| format!("podIP {}", pod["status"]["podIP"]))
    });
}

/// `kvfleet MODE --listen IP:8000 ARGS...` of `bin`, the embedded model in the environment.
fn spawn_mode(bin: &str, mode: &str, ip: &str, args: &[&str], log: std::path::PathBuf) -> Proc {
    Proc::spawn(
        &format!("kvfleet {mode}"),
        std::process::Command::new(bin)
            .arg(mode)
            .args(["--listen", &format!("{ip}:8000")])
            .args(args)
            .env("KVFLEET_SMOLLM2_GGUF", smollm2())
            .env("RUST_LOG", "info"),
        log,
    )
}

/// `GET path` on `ip:8000`: (status, body), `None` while nothing answers.
fn http_get_at(ip: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect((ip, 8000)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// What the client of the cold start saw: HTTP status, the wait for its first streamed token
/// (from the request's last byte sent), and the whole stream.
struct ClientSaw {
    status: u16,
    first_token: Option<Duration>,
    stream: String,
}

/// Sends one streamed completion to the router and reads its answer, stamping the first
/// `data:` event (a completion stream's first event carries the first token).
fn stream_one(ip: &str, sent: std::sync::mpsc::Sender<Instant>) -> ClientSaw {
    let body = json!({"model": SMOLLM2, "prompt": "The capital of France is", "max_tokens": 8,
                      "temperature": 0, "stream": true})
    .to_string();
    let mut s = TcpStream::connect((ip, 8000)).expect("the router listens");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let t0 = Instant::now();
    sent.send(t0).unwrap();
    let mut raw = Vec::new();
    let mut first_token = None;
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).unwrap_or(0);
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if first_token.is_none() && String::from_utf8_lossy(&raw).contains("data: {") {
            first_token = Some(t0.elapsed());
        }
    }
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    ClientSaw {
        status,
        first_token,
        stream: text,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn e2e_cold_start_a_request_through_the_real_router_wakes_a_real_worker_from_zero() {
    e2e_support::require_cluster("e2e_autoscaling");
    let _serial = SERIAL.lock().await;
    let bin = std::env::var("KVFLEET_E2E_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvfleet").to_string());
    let crd_created = e2e_support::install_crd(env!("CARGO_BIN_EXE_kvfleet"));
    let ns = Namespace::create(COLD_NS);
    let mut nodes = Nodes::default();
    nodes.gpu("kvfleet-e2e-cold-start-h100-0", H100);
    let identity = e2e_support::ControllerIdentity::create(COLD_CONTROLLER, COLD_NS);
    let scratch = std::env::temp_dir().join(format!("kvfleet-e2e-cold-start-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let controller = identity.spawn_controller(
        &bin,
        &scratch,
        "info,kvfleet::controller::autoscale=debug",
        &["--autoscale-interval-seconds", "1"],
    );

    // The router, as its pod would run it: hold on, its replica the worker pod's address.
    let router = spawn_mode(
        &bin,
        "router",
        COLD_ROUTER_IP,
        &[
            "--worker",
            &format!("http://{COLD_WORKER_IP}:8000"),
            "--hold-timeout-seconds",
            "120",
        ],
        scratch.join("router.log"),
    );
    wait_for("the router's /health", SCALE, || {
        http_get_at(COLD_ROUTER_IP, "/health")
            .filter(|(st, _)| *st == 200)
            .ok_or_else(|| router.log_tail())
    });
    let log = || {
        format!(
            "controller:\n{}\nrouter:\n{}",
            controller.log_tail(),
            router.log_tail()
        )
    };

    // minReplicas 0 behind the router. A first worker runs until the autoscaler takes the
    // idle deployment to zero (its real gauges say no demand), then stops with its pod.
    apply_in(COLD_NS, spec_named(0, "kvfleet", SMOLLM2));
    pin_ip(&format!("kvfleet.io/router={NAME}"), COLD_ROUTER_IP);
    let selector = format!("kvfleet.io/inference-deployment={NAME}");
    let mut first = spawn_mode(&bin, "worker", COLD_WORKER_IP, &[], scratch.join("worker-0.log"));
    wait_for("the first worker's /readyz", SCALE, || {
        http_get_at(COLD_WORKER_IP, "/readyz")
            .filter(|(st, _)| *st == 200)
            .ok_or_else(|| first.log_tail())
    });
    pin_ip(&selector, COLD_WORKER_IP);
    wait_for("zero replicas", SCALE, || {
        let got = deployment_replicas_in(COLD_NS, NAME);
        (got == Some(0))
            .then_some(())
            .ok_or_else(|| format!("{got:?}\n{}", log()))
    });
    first.kill();
    wait_for("the worker pod gone", SCALE, || {
        let n = get_json(&["pods", "-n", COLD_NS, "-l", &selector])
            .and_then(|l| l["items"].as_array().map(Vec::len))
            .unwrap_or(0);
        (n == 0).then_some(()).ok_or(format!("{n} pods"))
    });

    // The first request: held by the router, its demand read by the autoscaler.
    let (sent_tx, sent_rx) = std::sync::mpsc::channel();
    let client = std::thread::spawn(move || stream_one(COLD_ROUTER_IP, sent_tx));
    let t0 = sent_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the request sent");
    let fast = Duration::from_millis(20);
    let poll = |what: &str, f: &mut dyn FnMut() -> bool| {
        let end = Instant::now() + SCALE;
        while !f() {
            assert!(Instant::now() < end, "timed out waiting for {what}\n{}", log());
            std::thread::sleep(fast);
        }
        t0.elapsed()
    };
    let held = poll("the router to hold it", &mut || {
        http_get_at(COLD_ROUTER_IP, "/v1/router/state")
            .and_then(|(_, b)| serde_json::from_str::<Value>(&b).ok())
            .is_some_and(|s| s["held"]["requests"] == 1)
    });
    let scaled = poll("the Deployment at 1", &mut || {
        deployment_replicas_in(COLD_NS, NAME) == Some(1)
    });
    let bound = poll("a bound worker pod", &mut || {
        get_json(&[
            "pods",
            "-n",
            COLD_NS,
            "-l",
            &format!("kvfleet.io/inference-deployment={NAME}"),
        ])
        .and_then(|l| l["items"].as_array().cloned())
        .is_some_and(|items| items.iter().any(|p| p["spec"]["nodeName"].is_string()))
    });

    // Where a kubelet would start the container: the real worker, weights on the node.
    let worker = spawn_mode(&bin, "worker", COLD_WORKER_IP, &[], scratch.join("worker.log"));
    let started = t0.elapsed();
    let ready = poll("the worker's /readyz", &mut || {
        http_get_at(COLD_WORKER_IP, "/readyz").is_some_and(|(st, _)| st == 200)
    });
    pin_ip(&selector, COLD_WORKER_IP);
    let saw = client.join().expect("the client thread");
    let worker_log = worker.log_tail();

    assert_eq!(
        saw.status,
        200,
        "{}\n{}\nworker:\n{worker_log}",
        saw.stream,
        log()
    );
    assert!(saw.stream.contains("[DONE]"), "{}", saw.stream);
    let first = saw.first_token.expect("a first token");
    assert!(
        first > ready,
        "the first token came before the worker was ready: {first:?} <= {ready:?}"
    );
    let events = scale_events_in(COLD_NS);
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("ScaleFromZero") && e.contains("0 -> 1")),
        "{events:#?}"
    );
    let held_after = http_get_at(COLD_ROUTER_IP, "/v1/router/state")
        .map(|(_, b)| b)
        .unwrap_or_default();
    let st: Value = serde_json::from_str(&held_after).unwrap_or(Value::Null);
    assert_eq!(st["held"]["requests"], 0, "{held_after}");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "cold start (binary {bin}): request -> held {:.0} ms; -> Deployment at 1 {:.0} ms; -> pod bound {:.0} ms; \
         worker started at {:.0} ms, ready {:.0} ms later; first token at {:.0} ms ({:.0} ms after ready)",
        ms(held),
        ms(scaled),
        ms(bound),
        ms(started),
        ms(ready - started),
        ms(first),
        ms(first - ready)
    );

    drop(worker);
    kubectl_ok(&[
        "delete",
        "inferencedeployment",
        NAME,
        "-n",
        COLD_NS,
        "--wait=true",
    ]);
    drop(router);
    drop(controller);
    drop(identity);
    drop(ns);
    drop(nodes);
    e2e_support::delete_crd_if_created(crd_created);
    let _ = std::fs::remove_dir_all(&scratch);
}

//! End-to-end faults on the real control plane (../shared/k8s), issue 22: leader failover of
//! two controller electors through a real Lease, with the leader killed and with the leader's
//! API calls hung (a TCP proxy between it and the API server stops forwarding). Measures the
//! time to a new leader and checks that two leaders never act at once. The controller never
//! takes over an object it did not create, and survives its API server being killed and
//! restarted (../shared/k8s/up), reconciling what changed after. Its status writes race two
//! other writers (status rewritten with PUT, metadata churned) and still converge with no
//! condition lost.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_faults -- --ignored --nocapture`.
//! Without KUBECONFIG the tests fail (they never skip).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use kvfleet::controller::leader::{Elector, Timing};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Faster than client-go's defaults (15/10/2 s), same proportions.
fn timing() -> Timing {
    Timing {
        lease_duration: Duration::from_secs(6),
        renew_deadline: Duration::from_secs(4),
        retry_period: Duration::from_millis(500),
        call_timeout: Duration::from_millis(1500),
    }
}

async fn config() -> Config {
    let path = std::env::var("KUBECONFIG").expect(
        "KUBECONFIG is not set: start the control plane with eval \"$(../shared/k8s/up)\" (this e2e test needs it)",
    );
    let kubeconfig = Kubeconfig::read_from(&path).expect("KUBECONFIG readable");
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("a usable kubeconfig")
}

/// A scratch namespace, deleted on drop (only what this test created).
struct Scratch {
    client: Client,
    name: String,
}

impl Scratch {
    async fn new(client: Client, what: &str) -> Self {
        let name = format!("kvfleet-e2e-faults-{what}-{}", std::process::id());
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("create the scratch namespace");
        Scratch { client, name }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let client = self.client.clone();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            tokio::runtime::Runtime::new().unwrap().block_on(async move {
                let _ = Api::<Namespace>::all(client)
                    .delete(&name, &DeleteParams::background())
                    .await;
            })
        })
        .join();
    }
}

/// A TCP proxy to the API server that can be frozen: while frozen it forwards nothing (and
/// accepts new connections without answering), as a stalled API server or network path.
struct Proxy {
    addr: std::net::SocketAddr,
    frozen: Arc<AtomicBool>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let f = frozen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let upstream = upstream.clone();
                let f = f.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let f2 = f.clone();
                    let up = async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            while f2.load(Ordering::Acquire) {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            if sw.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    };
                    let down = async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match sr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            while f.load(Ordering::Acquire) {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    };
                    tokio::join!(up, down);
                });
            }
        });
        Proxy { addr, frozen }
    }
}

struct Candidate {
    leading: watch::Receiver<bool>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

fn campaign(client: Client, ns: &str, identity: &str) -> Candidate {
    let elector = Elector::new(
        Api::<Lease>::namespaced(client, ns),
        "kvfleet-controller",
        identity,
        timing(),
    );
    let (leading_tx, leading) = watch::channel(false);
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(elector.run(leading_tx, stop_rx));
    Candidate { leading, stop, task }
}

/// Samples both candidates every 20 ms until `until` holds or `timeout` passes; fails when
/// both lead at once. Returns the time `until` took.
async fn watch_both(
    a: &Candidate,
    b: &Candidate,
    timeout: Duration,
    until: impl Fn(bool, bool) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let (la, lb) = (*a.leading.borrow(), *b.leading.borrow());
        assert!(!(la && lb), "two leaders at once after {:?}", start.elapsed());
        if until(la, lb) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "no change within {timeout:?} (a {la}, b {lb})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the control plane of ../shared/k8s (KUBECONFIG)"]
async fn a_killed_leader_is_replaced_within_the_lease_duration() {
    let client = Client::try_from(config().await).unwrap();
    let scratch = Scratch::new(client.clone(), "kill").await;
    let a = campaign(client.clone(), &scratch.name, "a");
    let mut a_leading = a.leading.clone();
    tokio::time::timeout(Duration::from_secs(10), a_leading.wait_for(|l| *l))
        .await
        .expect("a leads within 10 s")
        .unwrap();
    let b = campaign(client.clone(), &scratch.name, "b");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        *a.leading.borrow() && !*b.leading.borrow(),
        "b follows a live leader"
    );
    // a dies without releasing the Lease (a crashed pod).
    a.task.abort();
    let killed = Instant::now();
    let mut b_leading = b.leading.clone();
    tokio::time::timeout(Duration::from_secs(20), b_leading.wait_for(|l| *l))
        .await
        .expect("b takes over")
        .unwrap();
    let failover = killed.elapsed();
    eprintln!(
        "failover after a killed leader: {:.2} s (lease duration {:?})",
        failover.as_secs_f64(),
        timing().lease_duration
    );
    assert!(
        failover <= timing().lease_duration + timing().retry_period * 4,
        "took {failover:?}"
    );
    let _ = b.stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), b.task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the control plane of ../shared/k8s (KUBECONFIG)"]
async fn a_leader_whose_api_calls_hang_steps_down_before_the_standby_takes_over() {
    let direct = config().await;
    let upstream = direct
        .cluster_url
        .authority()
        .expect("API server URL with a host")
        .to_string();
    let client = Client::try_from(direct.clone()).unwrap();
    let scratch = Scratch::new(client.clone(), "hang").await;
    let proxy = Proxy::start(upstream).await;
    let mut through_proxy = direct.clone();
    through_proxy.cluster_url = format!("https://{}", proxy.addr).parse().unwrap();
    // The API server's certificate names 127.0.0.1; the proxy listens there too.
    let a_client = Client::try_from(through_proxy).unwrap();

    let a = campaign(a_client, &scratch.name, "a");
    let mut a_leading = a.leading.clone();
    tokio::time::timeout(Duration::from_secs(10), a_leading.wait_for(|l| *l))
        .await
        .expect("a leads within 10 s")
        .unwrap();
    let b = campaign(client.clone(), &scratch.name, "b");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // a's API server stalls: its renewals hang.
    proxy.frozen.store(true, Ordering::Release);
    let frozen = Instant::now();
    let stepped_down = watch_both(&a, &b, Duration::from_secs(20), |la, _| !la).await;
    let took_over = watch_both(&a, &b, Duration::from_secs(20), |_, lb| lb).await + stepped_down;
    eprintln!(
        "hung leader stepped down {:.2} s after the stall; the standby led {:.2} s after the stall (gap {:.2} s with no leader)",
        stepped_down.as_secs_f64(),
        took_over.as_secs_f64(),
        (took_over - stepped_down).as_secs_f64()
    );
    assert!(frozen.elapsed() >= took_over);
    assert!(
        stepped_down <= timing().renew_deadline + timing().retry_period,
        "the hung leader acted for {stepped_down:?} after the stall"
    );
    assert!(
        took_over > stepped_down,
        "the standby led before the old leader stepped down"
    );
    proxy.frozen.store(false, Ordering::Release);
    let _ = b.stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), b.task).await;
    a.task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the control plane of ../shared/k8s (KUBECONFIG)"]
async fn the_webhook_node_cache_turns_stale_while_the_api_server_is_unreachable_and_recovers() {
    use k8s_openapi::api::core::v1::Node;
    let direct = config().await;
    let upstream = direct
        .cluster_url
        .authority()
        .expect("API server URL with a host")
        .to_string();
    let proxy = Proxy::start(upstream).await;
    let mut through_proxy = direct.clone();
    through_proxy.cluster_url = format!("https://{}", proxy.addr).parse().unwrap();
    let client = Client::try_from(through_proxy).unwrap();
    let stale_after = Duration::from_secs(3);
    let (cache, writer) = kvfleet::webhook::cache::node_cache_stale_after(stale_after);
    let watch = tokio::spawn(writer.run(Api::<Node>::all(client.clone()), None));
    let probe = tokio::spawn(
        cache
            .clone()
            .probe(Api::<Node>::all(client), Duration::from_secs(1)),
    );
    let start = Instant::now();
    while !cache.synced() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the node cache did not sync"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        !cache.stale(),
        "a reachable API server keeps the cache fresh (age {:?})",
        cache.age()
    );

    proxy.frozen.store(true, Ordering::Release);
    let frozen = Instant::now();
    while !cache.stale() {
        assert!(
            frozen.elapsed() < stale_after + Duration::from_secs(3),
            "still fresh while unreachable"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let went_stale = frozen.elapsed();
    proxy.frozen.store(false, Ordering::Release);
    let thawed = Instant::now();
    while cache.stale() {
        assert!(
            thawed.elapsed() < Duration::from_secs(10),
            "did not recover after the API server came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "node cache stale {:.2} s after the API server became unreachable (bound {stale_after:?}); fresh again {:.2} s after it came back",
        went_stale.as_secs_f64(),
        thawed.elapsed().as_secs_f64()
    );
    watch.abort();
    probe.abort();
}

// === ownership (issue 22): the real controller binary against the real API server ===

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A GPU node made by `../shared/k8s/gpu-node`, deleted on drop.
struct ScratchNode {
    client: Client,
    name: String,
}

impl Drop for ScratchNode {
    fn drop(&mut self) {
        let client = self.client.clone();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            tokio::runtime::Runtime::new().unwrap().block_on(async move {
                let _ = Api::<k8s_openapi::api::core::v1::Node>::all(client)
                    .delete(&name, &DeleteParams::default())
                    .await;
            })
        })
        .join();
    }
}

async fn eventually<T, Fut: std::future::Future<Output = Option<T>>>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Fut,
) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the control plane of ../shared/k8s (KUBECONFIG)"]
async fn the_controller_never_takes_over_a_service_it_did_not_create() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Service;
    use kvfleet::api::InferenceDeployment;

    let client = Client::try_from(config().await).unwrap();
    let crd = TestCrd::apply(&client).await;
    let scratch = Scratch::new(client.clone(), "owner").await;
    let _node = gpu_node(&client, "gpu");

    // Someone's Service, of the name the InferenceDeployment will want.
    let services = Api::<Service>::namespaced(client.clone(), &scratch.name);
    let theirs: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "llm", "labels": {"team": "billing"}},
        "spec": {"ports": [{"name": "https", "port": 443}], "selector": {"app": "billing"}}
    }))
    .unwrap();
    services.create(&PostParams::default(), &theirs).await.unwrap();

    let _controller = start_controller();
    let ids = Api::<InferenceDeployment>::namespaced(client.clone(), &scratch.name);
    let obj = small_inference_deployment(1);
    ids.create(&PostParams::default(), &obj)
        .await
        .expect("create InferenceDeployment");

    let degraded = eventually("Degraded=OwnershipConflict", Duration::from_secs(60), || async {
        let s = ids.get("llm").await.ok()?.status?;
        s.conditions
            .into_iter()
            .find(|c| c.type_ == "Degraded" && c.reason == "OwnershipConflict")
    })
    .await;
    assert!(
        degraded
            .message
            .contains(&format!("Service {}/llm", scratch.name)),
        "{}",
        degraded.message
    );
    let svc = services.get("llm").await.unwrap();
    assert!(
        svc.metadata.owner_references.unwrap_or_default().is_empty(),
        "the Service was taken over"
    );
    assert_eq!(
        svc.spec.unwrap().ports.unwrap()[0].port,
        443,
        "the Service was changed"
    );
    assert!(
        Api::<Deployment>::namespaced(client.clone(), &scratch.name)
            .get_opt("llm")
            .await
            .unwrap()
            .is_none(),
        "nothing is applied while an object of its names is someone else's"
    );
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), &scratch.name);
    eventually(
        "a Warning Event OwnershipConflict",
        Duration::from_secs(30),
        || async {
            let list = events.list(&Default::default()).await.ok()?;
            list.items
                .iter()
                .any(|e| e.reason.as_deref() == Some("OwnershipConflict"))
                .then_some(())
        },
    )
    .await;

    // Once their Service is gone, the next look (every 60 s) applies ours.
    services.delete("llm", &DeleteParams::default()).await.unwrap();
    let removed = Instant::now();
    eventually("the controller's Service", Duration::from_secs(90), || async {
        let s = services.get_opt("llm").await.ok()??;
        (!s.metadata.owner_references.unwrap_or_default().is_empty()).then_some(())
    })
    .await;
    eprintln!(
        "applied {:.1} s after the conflicting Service was deleted",
        removed.elapsed().as_secs_f64()
    );
    let _ = ids.delete("llm", &DeleteParams::default()).await;
    crd.delete_if_created().await;
}

/// The CRD of this build, applied; deleted at the end only when this test made it (another
/// suite, or helm, may own it).
struct TestCrd {
    api: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>,
    created: bool,
}

const CRD_NAME: &str = "inferencedeployments.kvfleet.io";

impl TestCrd {
    async fn apply(client: &Client) -> TestCrd {
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        use kube::api::{Patch, PatchParams};
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfleet"))
            .arg("crd")
            .output()
            .expect("kvfleet crd");
        let crd: CustomResourceDefinition = serde_yaml::from_slice(&out.stdout).expect("CRD YAML");
        let api = Api::<CustomResourceDefinition>::all(client.clone());
        let created = api.get_opt(CRD_NAME).await.expect("read the CRD").is_none();
        api.patch(
            CRD_NAME,
            &PatchParams::apply("kvfleet-e2e-faults").force(),
            &Patch::Apply(&crd),
        )
        .await
        .expect("apply the CRD");
        eventually("the CRD established", Duration::from_secs(30), || async {
            let c = api.get(CRD_NAME).await.ok()?;
            c.status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
                .then_some(())
        })
        .await;
        TestCrd { api, created }
    }

    async fn delete_if_created(&self) {
        if !self.created {
            return;
        }
        let _ = self.api.delete(CRD_NAME, &DeleteParams::default()).await;
        eventually("the CRD deleted", Duration::from_secs(120), || async {
            self.api.get_opt(CRD_NAME).await.ok()?.is_none().then_some(())
        })
        .await;
    }
}

/// A GPU node of this test, made with `../shared/k8s/gpu-node`.
fn gpu_node(client: &Client, what: &str) -> ScratchNode {
    let name = format!("e2e-faults-{what}-{}", std::process::id());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/k8s/gpu-node");
    let made = std::process::Command::new(&script)
        .args([&name, "NVIDIA-H100-80GB-HBM3", "9", "0", "8", "81559"])
        .output()
        .expect("../shared/k8s/gpu-node");
    assert!(
        made.status.success(),
        "gpu-node: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    ScratchNode {
        client: client.clone(),
        name,
    }
}

/// A `kvfleet controller` process on this host (no leader election), killed on drop.
fn start_controller() -> KillOnDrop {
    start_controller_serving().0
}

/// [`start_controller`], and the address of its /metrics.
fn start_controller_serving() -> (KillOnDrop, std::net::SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http = listener.local_addr().unwrap();
    drop(listener);
    let child = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_kvfleet"))
            .args([
                "controller",
                "--leader-elect=false",
                "--http-addr",
                &http.to_string(),
            ])
            .spawn()
            .expect("start kvfleet controller"),
    );
    (child, http)
}

/// The value of the series `name` (exact, labels included) in the controller's /metrics; 0
/// when absent.
async fn metric(addr: std::net::SocketAddr, series: &str) -> f64 {
    let mut conn = TcpStream::connect(addr)
        .await
        .expect("the controller's HTTP port");
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: controller\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).await.unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// An InferenceDeployment small enough for any H100 node.
fn small_inference_deployment(replicas: i32) -> kvfleet::api::InferenceDeployment {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "llm"},
        "spec": {"replicas": replicas,
                 "model": {"name": "e2e", "geometry": {"layers": 2, "queryHeads": 4, "kvHeads": 2, "headDim": 64}, "weights": {"format": "dummy"}},
                 "engine": {"runtime": "vllm", "maxModelLen": 1024, "maxNumSeqs": 4, "maxNumBatchedTokens": 256},
                 "gpu": {"selector": {"products": ["NVIDIA-H100-80GB-HBM3"]}}}
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the control plane of ../shared/k8s (KUBECONFIG, KVFLEET_K8S_STATE): restarts it"]
async fn the_controller_survives_an_api_server_restart_and_reconciles_after_it() {
    use k8s_openapi::api::apps::v1::Deployment;
    use kube::api::{Patch, PatchParams};
    use kvfleet::api::InferenceDeployment;

    let state = std::env::var("KVFLEET_K8S_STATE").expect(
        "KVFLEET_K8S_STATE is not set: this test stops and restarts the API server of \
         ../shared/k8s (eval \"$(../shared/k8s/up)\" exports it)",
    );
    let client = Client::try_from(config().await).unwrap();
    let crd = TestCrd::apply(&client).await;
    let scratch = Scratch::new(client.clone(), "restart").await;
    let _node = gpu_node(&client, "restart");
    let mut controller = start_controller();
    let ids = Api::<InferenceDeployment>::namespaced(client.clone(), &scratch.name);
    ids.create(&PostParams::default(), &small_inference_deployment(1))
        .await
        .expect("create InferenceDeployment");
    let deployments = Api::<Deployment>::namespaced(client.clone(), &scratch.name);
    let replicas = |want: i32| {
        let deployments = deployments.clone();
        async move {
            let d = deployments.get_opt("llm").await.ok()??;
            (d.spec?.replicas == Some(want)).then_some(())
        }
    };
    eventually("the Deployment", Duration::from_secs(60), || replicas(1)).await;

    // The API server dies (SIGKILL, no goodbye to its watches) and stays away for 5 s.
    let pids = std::fs::read_to_string(format!("{state}/pids")).expect("the control plane's pids");
    let pid = pids
        .lines()
        .find_map(|l| l.strip_prefix("kube-apiserver "))
        .expect("kube-apiserver in pids")
        .trim()
        .to_string();
    assert!(std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .unwrap()
        .success());
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        controller.0.try_wait().unwrap().is_none(),
        "the controller exited while the API server was away"
    );
    // `up` finds it down and restarts the control plane on the same data.
    let up =
        std::process::Command::new(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/k8s/up"))
            .output()
            .expect("../shared/k8s/up");
    assert!(up.status.success(), "up: {}", String::from_utf8_lossy(&up.stderr));
    let back = Instant::now();
    eprintln!(
        "API server away {:.1} s (killed, then `up` restarted the control plane)",
        back.duration_since(killed).as_secs_f64()
    );

    // A change made after the restart is reconciled by the same controller process.
    let patched = eventually("the API server answering", Duration::from_secs(60), || async {
        ids.patch(
            "llm",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicas": 2}})),
        )
        .await
        .ok()
    })
    .await;
    assert_eq!(patched.spec.replicas, 2);
    let asked = Instant::now();
    eventually("the scaled Deployment", Duration::from_secs(60), || replicas(2)).await;
    eprintln!(
        "scale made {:.1} s after the API server was back reconciled in {:.1} s",
        asked.duration_since(back).as_secs_f64(),
        asked.elapsed().as_secs_f64()
    );
    assert!(
        controller.0.try_wait().unwrap().is_none(),
        "the controller exited after the restart"
    );
    let _ = ids.delete("llm", &DeleteParams::default()).await;
    crd.delete_if_created().await;
}

// === 409 conflicts on status (issue 22, deliver 4) ===

/// Conditions the controller owns and their settled values for a ready deployment.
const SETTLED: [(&str, &str, Option<&str>); 5] = [
    ("Compatible", "True", Some("CompatibleNodesFound")),
    // Present and of the current generation; its value depends on the planner.
    ("CapacityPlanned", "", None),
    ("Available", "True", Some("MinimumReplicasAvailable")),
    ("Progressing", "False", Some("RolloutComplete")),
    ("Degraded", "False", Some("AsExpected")),
];

/// Why `o`'s status is not (yet) the settled status of its generation with `replicas` ready,
/// with the rival's own condition kept; `None` once it is.
fn unsettled(o: &kvfleet::api::InferenceDeployment, replicas: i32) -> Option<String> {
    let generation = o.metadata.generation;
    let Some(s) = &o.status else {
        return Some("no status".into());
    };
    if s.observed_generation != generation {
        return Some(format!(
            "observedGeneration {:?} of {generation:?}",
            s.observed_generation
        ));
    }
    if s.ready_replicas != Some(replicas) || s.replicas != Some(replicas) {
        return Some(format!("replicas {:?} ready {:?}", s.replicas, s.ready_replicas));
    }
    for (t, status, reason) in SETTLED {
        let Some(c) = s.conditions.iter().find(|c| c.type_ == t) else {
            return Some(format!("condition {t} missing"));
        };
        if (!status.is_empty() && c.status != status)
            || reason.is_some_and(|r| c.reason != r)
            || c.observed_generation != generation
        {
            return Some(format!(
                "{t}={} {} (generation {:?})",
                c.status, c.reason, c.observed_generation
            ));
        }
    }
    if !s.conditions.iter().any(|c| c.type_ == RIVAL_CONDITION) {
        return Some(format!("the rival's {RIVAL_CONDITION} condition was lost"));
    }
    None
}

const RIVAL_CONDITION: &str = "ExternalCheck";

/// What the rival writes: the controller's Degraded condition dropped, Available flipped to
/// False, readyReplicas zeroed, and a condition of its own.
fn rival_status(o: &mut kvfleet::api::InferenceDeployment) {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let generation = o.metadata.generation;
    let s = o.status.get_or_insert_with(Default::default);
    s.conditions
        .retain(|c| c.type_ != "Degraded" && c.type_ != RIVAL_CONDITION);
    for c in s.conditions.iter_mut().filter(|c| c.type_ == "Available") {
        c.status = "False".into();
        c.reason = "RivalSaysNo".into();
        c.message = "written by the e2e rival".into();
    }
    s.conditions.push(Condition {
        type_: RIVAL_CONDITION.into(),
        status: "True".into(),
        reason: "Checked".into(),
        message: "a condition another controller owns".into(),
        observed_generation: generation,
        last_transition_time: now,
    });
    s.ready_replicas = Some(0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the control plane of ../shared/k8s (KUBECONFIG)"]
async fn status_races_with_other_writers_converge_with_no_condition_lost() {
    use kube::api::{Patch, PatchParams};
    use kvfleet::api::InferenceDeployment;
    use std::sync::atomic::AtomicU64;

    let client = Client::try_from(config().await).unwrap();
    let crd = TestCrd::apply(&client).await;
    let scratch = Scratch::new(client.clone(), "status").await;
    let _node = gpu_node(&client, "status");
    let (_controller, http) = start_controller_serving();
    let ids = Api::<InferenceDeployment>::namespaced(client.clone(), &scratch.name);
    ids.create(&PostParams::default(), &small_inference_deployment(1))
        .await
        .expect("create InferenceDeployment");
    eventually(
        "the settled status of generation 1",
        Duration::from_secs(60),
        || async {
            let o = ids.get("llm").await.ok()?;
            unsettled(&o, 1)
                .is_some_and(|why| why.contains(RIVAL_CONDITION))
                .then_some(())
        },
    )
    .await;

    // Two rivals for 20 s: one rewrites status with PUT (optimistic concurrency: the
    // resourceVersion of its GET), one churns metadata, so every write of each meets a moved
    // resourceVersion and the controller's reconciles see objects already stale.
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 4]> = Arc::new(Default::default()); // status ok, status 409, meta ok, meta 409
    let repairs: Arc<std::sync::Mutex<Vec<Duration>>> = Arc::default();
    let status_rival = {
        let (ids, stop, counts, repairs) = (ids.clone(), stop.clone(), counts.clone(), repairs.clone());
        tokio::spawn(async move {
            let pp = PostParams {
                field_manager: Some("kvfleet-e2e-rival".into()),
                ..PostParams::default()
            };
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut o) = ids.get("llm").await else {
                    continue;
                };
                rival_status(&mut o);
                match ids.replace_status("llm", &pp, &o).await {
                    Ok(_) => {
                        counts[0].fetch_add(1, Ordering::Relaxed);
                        // How long the rival's status stands before the controller repairs it.
                        let written = Instant::now();
                        while written.elapsed() < Duration::from_secs(10) {
                            let repaired =
                                ids.get("llm").await.ok().and_then(|o| o.status).is_some_and(|s| {
                                    s.conditions.iter().any(|c| c.type_ == "Degraded")
                                        && s.conditions
                                            .iter()
                                            .any(|c| c.type_ == "Available" && c.reason != "RivalSaysNo")
                                });
                            if repaired {
                                repairs.lock().unwrap().push(written.elapsed());
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        counts[1].fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("rival status write: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        })
    };
    let meta_rival = {
        let (ids, stop, counts) = (ids.clone(), stop.clone(), counts.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                if let Ok(mut o) = ids.get("llm").await {
                    o.metadata
                        .annotations
                        .get_or_insert_with(Default::default)
                        .insert("e2e.kvfleet.io/rival".into(), n.to_string());
                    match ids.replace("llm", &PostParams::default(), &o).await {
                        Ok(_) => counts[2].fetch_add(1, Ordering::Relaxed),
                        Err(kube::Error::Api(e)) if e.code == 409 => {
                            counts[3].fetch_add(1, Ordering::Relaxed)
                        }
                        Err(e) => panic!("rival metadata write: {e}"),
                    };
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        })
    };
    // A spec change in the middle: the converged status must describe generation 2.
    tokio::time::sleep(Duration::from_secs(5)).await;
    ids.patch(
        "llm",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"replicas": 2}})),
    )
    .await
    .expect("scale to 2");
    tokio::time::sleep(Duration::from_secs(15)).await;
    stop.store(true, Ordering::Relaxed);
    status_rival.await.expect("the status rival");
    meta_rival.await.expect("the metadata rival");
    let stopped = Instant::now();
    let last_why = std::sync::Mutex::new(String::new());
    eventually(
        "the settled status of generation 2",
        Duration::from_secs(30),
        || async {
            let o = ids.get("llm").await.ok()?;
            match unsettled(&o, 2) {
                None => Some(()),
                Some(why) => {
                    *last_why.lock().unwrap() = why;
                    None
                }
            }
        },
    )
    .await;
    let converged = stopped.elapsed();
    // And it stays settled: nobody flaps it back.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let o = ids.get("llm").await.unwrap();
        assert_eq!(unsettled(&o, 2), None, "settled, then changed again");
    }
    assert_eq!(ids.get("llm").await.unwrap().metadata.generation, Some(2));
    let [status_ok, status_409, meta_ok, meta_409] = [0, 1, 2, 3].map(|i| counts[i].load(Ordering::Relaxed));
    assert!(status_ok > 0 && meta_ok > 0, "the rivals wrote nothing");
    assert!(status_409 + meta_409 > 0, "no write met a moved resourceVersion");
    let mut repairs = repairs.lock().unwrap().clone();
    repairs.sort();
    assert_eq!(
        repairs.len() as u64,
        status_ok,
        "a rival status write stood for 10 s without the controller repairing it"
    );
    let at = |q: f64| repairs[((repairs.len() - 1) as f64 * q) as usize].as_secs_f64();
    let controller_conflicts = metric(
        http,
        r#"kvfleet_controller_reconcile_failures_total{category="conflict"}"#,
    )
    .await;
    let runs = metric(http, "kvfleet_controller_reconcile_runs_total").await;
    eprintln!(
        "20 s of rivals: status PUTs {status_ok} applied, {status_409} refused with 409; metadata PUTs {meta_ok} applied, {meta_409} refused with 409; each rival status repaired by the controller in p50 {:.3} / p90 {:.3} / max {:.3} s; controller: {runs} reconciles, {controller_conflicts} failed with 409; settled status of generation 2 (5 conditions, {RIVAL_CONDITION} kept) {:.2} s after the rivals stopped (last difference seen: {})",
        at(0.5),
        at(0.9),
        at(1.0),
        converged.as_secs_f64(),
        last_why.lock().unwrap()
    );
    assert_eq!(
        controller_conflicts, 0.0,
        "the status apply carries no resourceVersion"
    );
    let _ = ids.delete("llm", &DeleteParams::default()).await;
    crd.delete_if_created().await;
}

//! End-to-end: vLLM's measured KV capacity reaches the InferenceDeployment status. Against a
//! real control plane (`../shared/k8s`), the controller from this build renders a vLLM pod with
//! the capacity sidecar; since no container runs there, the test runs `kvfleet
//! capacity-sidecar` on the host for that pod (POD_NAME/POD_NAMESPACE, KUBECONFIG), fed by a
//! stub vLLM `/metrics` it serves itself, and waits for `measuredTokensPerReplica`; the stub's
//! pool differs from the planner's prediction, so `KvCapacityMatchesPlan` turns False.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_vllm -- --ignored --nocapture`

mod e2e_support;

use std::io::{Read, Write};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use e2e_support::{Namespace, Nodes, H100};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::Client;
use kvfleet::api::InferenceDeployment;
use serde_json::json;

const NS: &str = "kvfleet-e2e-vllm";
const NODE: &str = "kvfleet-e2e-vllm-h100";
const NAME: &str = "vllm-model";
/// The stub's pool: 12,345 blocks of 16 tokens.
const BLOCKS: u64 = 12_345;

struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Serves a vLLM-shaped `/metrics` page on 127.0.0.1 from a thread; returns its port.
fn stub_vllm_metrics() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            let mut buf = [0u8; 2048];
            let _ = s.read(&mut buf);
            let body = format!(
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
                 # TYPE vllm:cache_config_info gauge\n\
                 vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{BLOCKS}\",num_gpu_blocks_override=\"None\"}} 1.0\n\
                 vllm:num_requests_running{{engine=\"0\",model_name=\"e2e\"}} 0.0\n"
            );
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
async fn e2e_vllm_measured_capacity_from_the_sidecar_reaches_status() {
    e2e_support::require_cluster("e2e_vllm");
    let bin = env!("CARGO_BIN_EXE_kvfleet");
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    let crd_created = !e2e_support::crd_exists();
    let crd = Command::new(bin).arg("crd").output().expect("kvfleet crd");
    assert!(crd.status.success(), "kvfleet crd failed");
    e2e_support::ok(
        "apply CRD",
        e2e_support::kubectl_stdin(
            &["apply", "--server-side", "-f", "-"],
            &String::from_utf8_lossy(&crd.stdout),
        ),
    );
    e2e_support::wait_established("inferencedeployments.kvfleet.io");

    let ns = Namespace::create(NS);
    let mut nodes = Nodes::default();
    nodes.gpu(NODE, H100);

    let _controller = KillOnDrop(
        Command::new(bin)
            .args([
                "controller",
                "--leader-elect=false",
                "--http-addr",
                &format!("127.0.0.1:{}", e2e_support::free_port()),
            ])
            .spawn()
            .expect("start kvfleet controller"),
    );

    let ids: Api<InferenceDeployment> = Api::namespaced(client.clone(), NS);
    let obj: InferenceDeployment = serde_json::from_value(json!({
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME},
        "spec": {"replicas": 1,
                 "model": {"name": "e2e", "geometry": {"layers": 2, "queryHeads": 4, "kvHeads": 2, "headDim": 64},
                           "weights": {"format": "dummy"}},
                 "engine": {"runtime": "vllm", "maxModelLen": 1024, "maxNumSeqs": 4, "maxNumBatchedTokens": 256},
                 "gpu": {"selector": {"products": [H100.product]}}}
    }))
    .unwrap();
    ids.create(&PostParams::default(), &obj)
        .await
        .expect("create InferenceDeployment");

    // The controller renders the vLLM pod with the sidecar; the stand-in kubelet makes it Ready.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let lp = ListParams::default().labels(&format!("kvfleet.io/inference-deployment={NAME}"));
    let pod = eventually("a Ready vLLM pod", Duration::from_secs(90), || async {
        let list = pods.list(&lp).await.ok()?;
        list.items.into_iter().find(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
    })
    .await;
    let spec = pod.spec.clone().unwrap();
    let sidecar = spec
        .containers
        .iter()
        .find(|c| {
            c.args
                .as_ref()
                .is_some_and(|a| a.first().map(String::as_str) == Some("capacity-sidecar"))
        })
        .expect("the pod runs the capacity sidecar");
    assert_eq!(sidecar.command.as_deref(), Some(&["kvfleet".to_string()][..]));
    let pod_name = pod.metadata.name.clone().unwrap();

    // The sidecar, on the host, for that pod, fed by the stub.
    let port = stub_vllm_metrics();
    let started = Instant::now();
    let _sidecar = KillOnDrop(
        Command::new(bin)
            .args([
                "capacity-sidecar",
                "--metrics",
                &format!("127.0.0.1:{port}/metrics"),
                "--interval-seconds",
                "1",
            ])
            .env("POD_NAME", &pod_name)
            .env("POD_NAMESPACE", NS)
            .spawn()
            .expect("start kvfleet capacity-sidecar"),
    );
    let want = (BLOCKS * 16) as i64;
    let annotated = eventually("the pod annotation", Duration::from_secs(30), || async {
        let p = pods.get(&pod_name).await.ok()?;
        p.metadata
            .annotations?
            .get("kvfleet.io/measured-kv-tokens")
            .cloned()
    })
    .await;
    assert_eq!(annotated, want.to_string());
    let status = eventually(
        "measuredTokensPerReplica in status",
        Duration::from_secs(120),
        || async {
            let s = ids.get(NAME).await.ok()?.status?;
            (s.capacity.as_ref()?.measured_tokens_per_replica? == want).then_some(s)
        },
    )
    .await;
    eprintln!(
        "measured {want} tokens reached status {:.1} s after the sidecar started (predicted {:?})",
        started.elapsed().as_secs_f64(),
        status.capacity.as_ref().and_then(|c| c.tokens_per_replica)
    );

    // The stub's pool (197,520 tokens) is far from what the planner predicts for this tiny
    // model on an 80 GB H100: the mismatch is a condition with both figures and a cause.
    let predicted = status
        .capacity
        .as_ref()
        .and_then(|c| c.tokens_per_replica)
        .expect("a prediction");
    let c = status
        .conditions
        .iter()
        .find(|c| c.type_ == "KvCapacityMatchesPlan")
        .unwrap_or_else(|| panic!("no KvCapacityMatchesPlan in {:?}", status.conditions));
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "MeasuredDiffersFromPlan"),
        "{c:?}"
    );
    assert!(
        c.message.contains(&format!("measured {want}"))
            && c.message.contains(&format!("predicted {predicted}"))
            && c.message.contains("likely cause"),
        "{}",
        c.message
    );
    eprintln!("KvCapacityMatchesPlan=False: {}", c.message);

    ids.delete(NAME, &DeleteParams::foreground())
        .await
        .expect("delete");
    eventually("the object gone", Duration::from_secs(120), || async {
        ids.get_opt(NAME).await.ok()?.is_none().then_some(())
    })
    .await;
    drop(ns);
    drop(nodes);
    e2e_support::delete_crd_if_created(crd_created);
}

//! End to end, as a platform engineer meets kvfleet: against a real control plane
//! (`../shared/k8s`), the chart is installed with `helm install` (CRD, RBAC, webhook
//! configuration, the TLS Secret and leader Lease), and `kvfleet webhook` and `kvfleet
//! controller` from this build run on the host under the chart's ServiceAccounts (tokens
//! from `kubectl create token`, so the chart's RBAC is what they get). The API server reaches
//! the webhook through an ExternalName Service to 127.0.0.1, as ../shared/k8s/README.md
//! explains. Nothing runs in pods here (no kubelet): a worker that fails preflight is
//! simulated by patching its pod's status as a kubelet would report it. Everything else goes through `kubectl` as a user types it, on a mixed fleet of
//! GPU nodes this suite creates (H100, L4, RTX PRO 6000, B200, RTX 3090).
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_helm -- --ignored --nocapture`.

mod e2e_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use e2e_support::{
    get_json, helm, kubectl, kubectl_ok, kubectl_stdin, ok, text, wait_for, Namespace, Nodes, Proc, B200,
    H100, L4, RTX_3090, RTX_PRO_6000, T4,
};
use k8s_openapi::api::core::v1::Node;
use kvfleet::validate::{self, ClusterFacts, NodeFacts};

const RELEASE: &str = "kvfleet-e2e";
const SYSTEM: &str = "kvfleet-e2e-system";
const APPS: &str = "kvfleet-e2e-apps";
const VWC: &str = "kvfleet-e2e-webhook-kvfleet-e2e-system";
const TLS_SECRET: &str = "kvfleet-e2e-webhook-tls";
const LEASE: &str = "kvfleet-e2e-controller";
/// The test's own Service: ExternalName to 127.0.0.1, where the host webhook listens.
const HOST_SERVICE: &str = "kvfleet-e2e-host-webhook";
const WAIT: Duration = Duration::from_secs(60);

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn example(name: &str) -> String {
    repo().join("deploy/examples").join(name).display().to_string()
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvfleet-e2e-helm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A kubeconfig for ServiceAccount `sa` of the release namespace: the API server of
/// KUBECONFIG, a token from `kubectl create token`.
fn service_account_kubeconfig(sa: &str, dir: &Path) -> PathBuf {
    let token = kubectl_ok(&["create", "token", sa, "-n", SYSTEM, "--duration=2h"]);
    e2e_support::token_kubeconfig(sa, token.trim(), dir)
}

struct Webhook {
    port: u16,
    kubeconfig: PathBuf,
    dir: PathBuf,
}

impl Webhook {
    fn start(&self) -> Proc {
        let health = e2e_support::free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfleet"));
        cmd.args([
            "webhook",
            "--listen",
            &format!("127.0.0.1:{}", self.port),
            "--health-listen",
            &format!("127.0.0.1:{health}"),
            "--namespace",
            SYSTEM,
            "--service-name",
            HOST_SERVICE,
            "--tls-secret-name",
            TLS_SECRET,
            "--webhook-configuration",
            VWC,
            "--tls-reload-seconds",
            "2",
            "--node-selector",
            "nvidia.com/gpu.present=true",
        ])
        .env("KUBECONFIG", &self.kubeconfig)
        .env("RUST_LOG", "info");
        let mut p = Proc::spawn("kvfleet webhook", &mut cmd, self.dir.join("webhook.log"));
        wait_for("the webhook's /readyz", WAIT, || {
            if let Ok(Some(status)) = p.child.try_wait() {
                return Err(format!("kvfleet webhook exited ({status}):\n{}", p.log_tail()));
            }
            match http_get(health, "/readyz") {
                Some(200) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        });
        p
    }
}

struct Controller {
    kubeconfig: PathBuf,
    dir: PathBuf,
}

impl Controller {
    fn start(&self, run: usize) -> Proc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfleet"));
        cmd.args([
            "controller",
            "--leader-elect=true",
            "--lease-name",
            LEASE,
            "--lease-namespace",
            SYSTEM,
            // The same identity after a kill: the Lease is renewed at once, not waited out.
            "--identity",
            "kvfleet-e2e-host-controller",
            "--http-addr",
            &format!("127.0.0.1:{}", e2e_support::free_port()),
        ])
        .env("KUBECONFIG", &self.kubeconfig)
        .env("RUST_LOG", "info");
        Proc::spawn(
            "kvfleet controller",
            &mut cmd,
            self.dir.join(format!("controller-{run}.log")),
        )
    }
}

fn http_get(port: u16, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.split_whitespace().nth(1)?.parse().ok()
}

/// Points the chart's webhook configuration at the host webhook (helm upgrade puts the
/// chart's Service back).
fn route_webhook_to_host(port: u16) {
    kubectl_ok(&[
        "patch",
        "validatingwebhookconfiguration",
        VWC,
        "--type=json",
        "-p",
        &format!(
            r#"[{{"op":"replace","path":"/webhooks/0/clientConfig/service/name","value":"{HOST_SERVICE}"}},
                {{"op":"replace","path":"/webhooks/0/clientConfig/service/port","value":{port}}}]"#
        ),
    ]);
}

/// The cluster's GPU nodes as the webhook sees them, for the expected verdicts.
fn cluster_facts() -> ClusterFacts {
    let list = get_json(&["nodes", "-l", "nvidia.com/gpu.present=true"]).expect("nodes");
    ClusterFacts {
        nodes: list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| NodeFacts::from_node(&serde_json::from_value::<Node>(n.clone()).unwrap()))
            .collect(),
        ..ClusterFacts::default()
    }
}

/// What kubectl prints for a denial of `file`: the object, the field, the reason and fix.
fn expected_denial(file: &str) -> String {
    let doc: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let name = doc["metadata"]["name"].as_str().unwrap().to_string();
    let spec = serde_yaml::from_value(doc["spec"].clone()).unwrap();
    let verdict = validate::validate(&spec, &cluster_facts());
    assert_eq!(verdict.denials.len(), 1, "{file}: {verdict:#?}");
    let d = &verdict.denials[0];
    format!(
        "The InferenceDeployment \"{name}\" is invalid: {}: {}",
        d.field, d.message
    )
}

/// `kubectl apply -f FILE -n APPS`, expected to be refused; returns stderr. Retries while the
/// API server cannot reach the webhook yet (caBundle propagation).
fn apply_refused(file: &str) -> String {
    wait_for(&format!("a denial of {file}"), WAIT, || {
        let out = kubectl(&["apply", "-n", APPS, "-f", file]);
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{file} was admitted: {stdout}");
        if stderr.contains("failed calling webhook") {
            Err(stderr)
        } else {
            Ok(stderr)
        }
    })
}

fn apply(doc: &str) -> (String, String) {
    let out = kubectl_stdin(&["apply", "-n", APPS, "-f", "-"], doc);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "kubectl apply failed: {stderr}\n{doc}");
    (stdout, stderr)
}

fn condition(name: &str, type_: &str) -> Option<(String, String, String)> {
    let obj = get_json(&["inferencedeployment", name, "-n", APPS])?;
    let c = obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)?
        .clone();
    Some((
        c["status"].as_str()?.to_string(),
        c["reason"].as_str()?.to_string(),
        c["message"].as_str()?.to_string(),
    ))
}

fn wait_condition(name: &str, type_: &str, status: &str, reason: &str) -> String {
    wait_for(
        &format!("{name}: {type_}={status} ({reason})"),
        WAIT,
        || match condition(name, type_) {
            Some((s, r, m)) if s == status && r == reason => Ok(m),
            other => Err(format!("{other:?}")),
        },
    )
}

/// Pods of an InferenceDeployment: (name, node, phase).
fn pods(name: &str) -> Vec<(String, String, String)> {
    let list = get_json(&[
        "pods",
        "-n",
        APPS,
        "-l",
        &format!("kvfleet.io/inference-deployment={name}"),
    ])
    // `--ignore-not-found` prints nothing for an empty list.
    .unwrap_or_else(|| serde_json::json!({"items": []}));
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .map(|p| {
            (
                p["metadata"]["name"].as_str().unwrap_or_default().to_string(),
                p["spec"]["nodeName"].as_str().unwrap_or_default().to_string(),
                p["status"]["phase"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

fn count(kind: &str, selector: &str) -> usize {
    get_json(&[kind, "-n", APPS, "-l", selector])
        .and_then(|l| l["items"].as_array().map(Vec::len))
        .unwrap_or(0)
}

/// The release of this suite: uninstalled on drop (before its namespace goes, which holds
/// helm's record of it), also when an assertion failed.
struct Release;

impl Drop for Release {
    fn drop(&mut self) {
        let _ = helm(&["uninstall", RELEASE, "-n", SYSTEM, "--wait", "--ignore-not-found"]);
    }
}

/// What an interrupted run of this suite may have left: its release, and the cluster-scoped
/// objects of its release (labelled with its instance) once helm's record is gone.
fn remove_leftovers() {
    let _ = helm(&["uninstall", RELEASE, "-n", SYSTEM, "--wait", "--ignore-not-found"]);
    let _ = kubectl(&[
        "delete",
        "validatingwebhookconfiguration,clusterrole,clusterrolebinding",
        "-l",
        &format!("app.kubernetes.io/instance={RELEASE}"),
        "--ignore-not-found",
    ]);
}

/// Gives the fields `route_webhook_to_host` changed back to the chart's values, so that
/// helm's server-side apply meets no conflict.
fn route_webhook_to_chart() {
    kubectl_ok(&[
        "patch",
        "validatingwebhookconfiguration",
        VWC,
        "--type=json",
        "-p",
        r#"[{"op":"replace","path":"/webhooks/0/clientConfig/service/name","value":"kvfleet-e2e-webhook"},
            {"op":"replace","path":"/webhooks/0/clientConfig/service/port","value":443}]"#,
    ]);
}

fn step(start: &mut Instant, what: &str) {
    println!("e2e_helm: {what} ({:.1} s)", start.elapsed().as_secs_f64());
    *start = Instant::now();
}

#[test]
#[ignore = "needs a Kubernetes cluster (KUBECONFIG): ../shared/k8s/up, as make test does"]
fn helm_installed_kvfleet_on_a_mixed_fleet_admits_schedules_heals_and_uninstalls() {
    e2e_support::require_cluster("e2e_helm");
    let total = Instant::now();
    let mut t = Instant::now();
    let dir = scratch();
    // The CRD is cluster-wide. One that another release or suite left behind cannot be
    // adopted by `helm install`, so the chart's copy is then kept off (and the leftover is
    // named, so that the suite that leaked it can be found).
    let before = e2e_support::crd_settled();
    let crd_created = before.is_none();
    let foreign_crd = before
        .as_ref()
        .is_some_and(|crd| crd["metadata"]["annotations"]["meta.helm.sh/release-name"] != RELEASE);
    if let (true, Some(crd)) = (foreign_crd, &before) {
        eprintln!(
            "e2e_helm: {} exists and is not this release's ({}): installing with crds.enabled=false",
            e2e_support::CRD,
            e2e_support::crd_owners(crd)
        );
    }

    // --- the fleet: nodes of this suite only
    let mut nodes = Nodes::default();
    nodes.gpu("kvfleet-e2e-h100", H100);
    nodes.gpu("kvfleet-e2e-l4", L4);
    nodes.gpu("kvfleet-e2e-rtxpro", RTX_PRO_6000);
    nodes.gpu("kvfleet-e2e-b200", B200);
    nodes.gpu("kvfleet-e2e-3090", RTX_3090);
    step(&mut t, "GPU nodes created");

    // --- helm install: the chart's own CRD, RBAC, webhook configuration, Secret, Lease.
    // The operator runs on this host, so no controller pod; the one webhook pod the chart
    // insists on never runs a container here (and nothing routes to it).
    remove_leftovers();
    let system = Namespace::create(SYSTEM);
    let apps = Namespace::create(APPS);
    let release = Release;
    let chart = repo().join("charts/kvfleet");
    ok(
        "helm install",
        helm(&[
            "install",
            RELEASE,
            chart.to_str().unwrap(),
            "-n",
            SYSTEM,
            "--set",
            "controller.replicas=0",
            "--set",
            "webhook.replicas=1",
            "--set",
            if foreign_crd {
                "crds.enabled=false"
            } else {
                "crds.enabled=true"
            },
        ]),
    );
    e2e_support::wait_established("inferencedeployments.kvfleet.io");
    if !foreign_crd {
        let crd = get_json(&["crd", "inferencedeployments.kvfleet.io"]).unwrap();
        assert_eq!(
            crd["metadata"]["annotations"]["meta.helm.sh/release-name"], RELEASE,
            "the chart installed the CRD"
        );
    }
    let vwc = get_json(&["validatingwebhookconfiguration", VWC]).expect("the chart's webhook configuration");
    assert_eq!(vwc["webhooks"][0]["failurePolicy"], "Fail");
    step(&mut t, "helm install");

    // --- the operator on the host, with the chart's ServiceAccounts
    let port = e2e_support::free_port();
    let host_service = format!(
        r#"{{"apiVersion": "v1", "kind": "Service", "metadata": {{"name": "{HOST_SERVICE}", "namespace": "{SYSTEM}"}},
  "spec": {{"type": "ExternalName", "externalName": "127.0.0.1", "ports": [{{"port": {port}}}]}}}}"#
    );
    ok(
        "host Service",
        kubectl_stdin(&["apply", "-f", "-"], &host_service),
    );
    route_webhook_to_host(port);
    let webhook = Webhook {
        port,
        kubeconfig: service_account_kubeconfig("kvfleet-e2e-webhook", &dir),
        dir: dir.clone(),
    };
    let controller = Controller {
        kubeconfig: service_account_kubeconfig("kvfleet-e2e-controller", &dir),
        dir: dir.clone(),
    };
    let mut webhook_proc = webhook.start();
    let mut controller_proc = controller.start(0);
    // The webhook filled the chart's Secret and the caBundle.
    let secret = get_json(&["secret", TLS_SECRET, "-n", SYSTEM]).unwrap();
    let tls_crt = secret["data"]["tls.crt"].as_str().unwrap_or_default().to_string();
    assert!(!tls_crt.is_empty(), "the webhook did not fill {TLS_SECRET}");
    wait_for("the caBundle", WAIT, || {
        let vwc = get_json(&["validatingwebhookconfiguration", VWC]).unwrap();
        match vwc["webhooks"][0]["clientConfig"]["caBundle"].as_str() {
            Some(b) if !b.is_empty() => Ok(()),
            _ => Err("empty".into()),
        }
    });
    step(&mut t, "webhook and controller up");

    // --- denials with their exact text (seed cases)
    let cases = [
        (
            "nvfp4-rtx-pro-6000.yaml",
            &[
                "kvCacheDtype nvfp4 needs compute capability 10.0 or 10.3",
                "use fp8",
            ][..],
        ),
        ("fp8-e4m3-rtx-3090-vllm.yaml", &["fp8_e5m2"][..]),
        (
            "long-context-rtx-3090.yaml",
            &["maxModelLen 1048576", "lower maxModelLen to"][..],
        ),
    ];
    for (file, phrases) in cases {
        let file = example(file);
        let stderr = apply_refused(&file);
        println!("kubectl apply -f {file}:\n{stderr}");
        let expected = expected_denial(&file);
        assert!(stderr.contains(&expected), "expected\n{expected}\nin\n{stderr}");
        for p in phrases {
            assert!(stderr.contains(p), "{p:?} missing in {stderr}");
        }
    }
    // What the worker cannot run is refused too (runtime kvfleet shards nothing).
    let tp4 = r#"{"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "kvfleet-tp4"},
      "spec": {"model": {"name": "m", "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128}, "weightBytes": "16Gi"},
               "engine": {"runtime": "kvfleet", "tensorParallelSize": 4, "maxModelLen": 8192},
               "gpu": {"selector": {"products": ["NVIDIA-H100-80GB-HBM3"]}}}}"#;
    let out = kubectl_stdin(&["apply", "-n", APPS, "-f", "-"], tp4);
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains(r#"The InferenceDeployment "kvfleet-tp4" is invalid: spec.engine.tensorParallelSize: runtime kvfleet runs one GPU per replica"#), "{stderr}");
    step(&mut t, "denials");

    // --- admitted: the real scheduler binds pods only to compatible nodes.
    // fp8_e4m3 with vLLM on RTX 3090 (8.6) or H100 (9.0): only the H100 runs it.
    let mixed = r#"{"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "mixed-fp8"},
      "spec": {"replicas": 3,
               "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128}, "weightBytes": "16Gi", "weights": {"format": "dummy"}},
               "engine": {"runtime": "vllm", "kvCacheDtype": "fp8_e4m3", "maxModelLen": 16384, "gpuMemoryUtilization": 0.85},
               "gpu": {"selector": {"products": ["NVIDIA-GeForce-RTX-3090", "NVIDIA-H100-80GB-HBM3"]}}}}"#;
    let (_, warnings) = apply(mixed);
    assert!(
        warnings.contains("Warning:") && warnings.contains("1 of 2 selected GPU nodes can run this"),
        "{warnings}"
    );
    wait_condition("mixed-fp8", "Available", "True", "MinimumReplicasAvailable");
    let placed = wait_for("3 pods Running", WAIT, || {
        let p = pods("mixed-fp8");
        if p.len() == 3 && p.iter().all(|(_, _, phase)| phase == "Running") {
            Ok(p)
        } else {
            Err(format!("{p:?}"))
        }
    });
    assert!(
        placed.iter().all(|(_, node, _)| node == "kvfleet-e2e-h100"),
        "{placed:?}"
    );
    // Status, events and printer columns.
    let (s, r, m) = condition("mixed-fp8", "Compatible").unwrap();
    assert_eq!((s.as_str(), r.as_str()), ("True", "CompatibleNodesFound"), "{m}");
    let obj = get_json(&["inferencedeployment", "mixed-fp8", "-n", APPS]).unwrap();
    assert_eq!(obj["status"]["resolved"]["kvCacheDtype"], "fp8_e4m3");
    assert_eq!(
        obj["status"]["resolved"]["computeCapabilities"],
        serde_json::json!(["9.0"])
    );
    let tokens = obj["status"]["capacity"]["tokensPerReplica"]
        .as_i64()
        .expect("capacity in status");
    let row = kubectl_ok(&["get", "infdep", "mixed-fp8", "-n", APPS, "--no-headers"]);
    let cols: Vec<&str> = row.split_whitespace().collect();
    let header = kubectl_ok(&["get", "infdep", "mixed-fp8", "-n", APPS]);
    println!("{header}");
    assert_eq!(cols[0], "mixed-fp8");
    assert!(
        cols.contains(&"fp8_e4m3") && cols.contains(&tokens.to_string().as_str()),
        "{header}"
    );
    let events = kubectl_ok(&[
        "get",
        "events",
        "-n",
        APPS,
        "--field-selector",
        "involvedObject.name=mixed-fp8,involvedObject.kind=InferenceDeployment",
        "-o",
        "jsonpath={range .items[*]}{.reason}{\"\\n\"}{end}",
    ]);
    assert!(
        events.contains("SpecApplied") && events.contains("Available"),
        "{events}"
    );
    step(&mut t, "admitted, scheduled, status");

    // --- kubectl scale
    kubectl_ok(&["scale", "-n", APPS, "infdep", "mixed-fp8", "--replicas=5"]);
    wait_for("5 pods on the H100", WAIT, || {
        let p = pods("mixed-fp8");
        if p.len() == 5
            && p.iter()
                .all(|(_, n, ph)| n == "kvfleet-e2e-h100" && ph == "Running")
        {
            Ok(())
        } else {
            Err(format!("{p:?}"))
        }
    });
    let obj = get_json(&["inferencedeployment", "mixed-fp8", "-n", APPS]).unwrap();
    assert_eq!(obj["spec"]["replicas"], 5);
    wait_for("status.readyReplicas 5", WAIT, || {
        let o = get_json(&["inferencedeployment", "mixed-fp8", "-n", APPS]).unwrap();
        (o["status"]["readyReplicas"] == 5)
            .then_some(())
            .ok_or(o["status"].to_string())
    });
    step(&mut t, "kubectl scale");

    // --- node relabel: re-validated, and Degraded says the nodes changed
    let relabel = r#"{"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "on-l4"},
      "spec": {"replicas": 1,
               "model": {"name": "m", "geometry": {"layers": 2, "queryHeads": 4, "kvHeads": 2, "headDim": 64}},
               "engine": {"runtime": "kvfleet", "maxModelLen": 4096},
               "gpu": {"selector": {"products": ["NVIDIA-L4", "Tesla-T4"]}}}}"#;
    apply(relabel);
    wait_condition("on-l4", "Available", "True", "MinimumReplicasAvailable");
    nodes.gpu("kvfleet-e2e-l4", T4);
    let degraded = wait_condition("on-l4", "Degraded", "True", "NodesChanged");
    assert!(
        degraded.contains("was admitted on NVIDIA-L4 (8.9); the selected nodes now have Tesla-T4 (7.5)"),
        "{degraded}"
    );
    let (s, _, _) = condition("on-l4", "Compatible").unwrap();
    assert_eq!(s, "False");
    nodes.gpu("kvfleet-e2e-l4", L4);
    wait_condition("on-l4", "Compatible", "True", "CompatibleNodesFound");
    wait_condition("on-l4", "Degraded", "False", "AsExpected");
    step(&mut t, "node relabel");

    // --- scale from zero: no B300 node now; admitted against the declared product
    let b300 = r#"{"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "b300-pool"},
      "spec": {"replicas": 1,
               "model": {"name": "m", "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128}, "weightBytes": "16Gi", "weights": {"format": "dummy"}},
               "engine": {"runtime": "vllm", "kvCacheDtype": "nvfp4", "maxModelLen": 32768},
               "gpu": {"selector": {"products": ["NVIDIA-B300-SXM6-AC"]}}}}"#;
    let (_, warnings) = apply(b300);
    assert!(
        warnings.contains("pods stay Pending until such a node joins"),
        "{warnings}"
    );
    let declared = wait_condition("b300-pool", "Compatible", "True", "DeclaredProductsNoNodes");
    assert!(declared.contains("NVIDIA-B300-SXM6-AC"), "{declared}");
    step(&mut t, "scale from zero");

    // --- webhook down: failurePolicy Fail refuses; back up: admitted
    webhook_proc.kill();
    let small = |name: &str| {
        format!(
            r#"{{"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {{"name": "{name}"}},
          "spec": {{"replicas": 2,
                   "model": {{"name": "m", "geometry": {{"layers": 2, "queryHeads": 4, "kvHeads": 2, "headDim": 64}}}},
                   "engine": {{"runtime": "kvfleet", "maxModelLen": 4096}},
                   "gpu": {{"selector": {{"products": ["NVIDIA-H100-80GB-HBM3"]}}}}}}}}"#
        )
    };
    let out = kubectl_stdin(&["apply", "-n", APPS, "-f", "-"], &small("while-down"));
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "admitted while the webhook was down");
    assert!(stderr.contains("failed calling webhook"), "{stderr}");
    webhook_proc = webhook.start();
    wait_for("admission after the webhook restarted", WAIT, || {
        let out = kubectl_stdin(&["apply", "-n", APPS, "-f", "-"], &small("while-down"));
        out.status.success().then_some(()).ok_or_else(|| text(&out).1)
    });
    step(&mut t, "webhook down and back");

    // --- controller killed mid-reconcile converges without duplicates
    apply(&small("killed"));
    std::thread::sleep(Duration::from_millis(150));
    controller_proc.kill();
    controller_proc = controller.start(1);
    for name in ["killed", "while-down"] {
        let selector = format!("kvfleet.io/inference-deployment={name}");
        wait_condition(name, "Available", "True", "MinimumReplicasAvailable");
        wait_for(&format!("{name}: 2 pods, one of each object"), WAIT, || {
            let p = pods(name);
            let n = (
                count("deployments", &selector),
                count("replicasets", &selector),
                count("services", &selector),
                count("configmaps", &selector),
                p.len(),
            );
            (n == (1, 1, 1, 1, 2)).then_some(()).ok_or(format!("{n:?} {p:?}"))
        });
    }
    step(&mut t, "controller killed and restarted");

    // --- a worker that fails preflight: Degraded with the worker's reason, and an Event.
    // Nothing runs here, so the pod's status is patched the way a kubelet reports a
    // container that exits 3 at start (the stand-in leaves Running pods alone).
    let (pod, _, _) = pods("while-down").into_iter().next().expect("a pod");
    let crashed = serde_json::json!({"status": {
        "conditions": [{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "False"}],
        "containerStatuses": [{"name": "kvfleet", "ready": false, "started": false, "restartCount": 1,
            "image": "kvfleet", "imageID": "",
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 3, "reason": "Error",
                "message": "preflight failed: cannot run here: no CUDA device (driver not found)",
                "finishedAt": jiff::Timestamp::now().to_string()}}}]}});
    kubectl_ok(&[
        "patch",
        "pod",
        &pod,
        "-n",
        APPS,
        "--subresource=status",
        "--type=merge",
        "-p",
        &crashed.to_string(),
    ]);
    let degraded = wait_condition("while-down", "Degraded", "True", "PreflightFailed");
    assert!(
        degraded.starts_with(&format!(
            "worker pod {pod} exits with code 3 at start (the configuration cannot run on this GPU): preflight failed: cannot run here: no CUDA device"
        )),
        "{degraded}"
    );
    let events = kubectl_ok(&[
        "get",
        "events",
        "-n",
        APPS,
        "--field-selector",
        "involvedObject.name=while-down,reason=PreflightFailed",
        "-o",
        "jsonpath={.items[*].type}",
    ]);
    assert!(events.contains("Warning"), "no PreflightFailed event: {events:?}");
    step(&mut t, "preflight failure reported");

    // --- garbage collection on delete
    kubectl_ok(&["delete", "infdep", "killed", "-n", APPS, "--wait=true"]);
    wait_for("killed's objects collected", WAIT, || {
        let selector = "kvfleet.io/inference-deployment=killed";
        let n = (
            count("deployments", selector),
            count("services", selector),
            count("configmaps", selector),
            count("serviceaccounts", selector),
            count("rolebindings", selector),
            pods("killed").len(),
        );
        (n == (0, 0, 0, 0, 0, 0)).then_some(()).ok_or(format!("{n:?}"))
    });
    step(&mut t, "garbage collection");

    // --- helm upgrade: a changed value lands; the webhook's certificate and the Lease holder stay
    let holder = get_json(&["lease", LEASE, "-n", SYSTEM]).unwrap()["spec"]["holderIdentity"].clone();
    assert_eq!(holder, "kvfleet-e2e-host-controller");
    route_webhook_to_chart();
    ok(
        "helm upgrade",
        helm(&[
            "upgrade",
            RELEASE,
            chart.to_str().unwrap(),
            "-n",
            SYSTEM,
            "--reuse-values",
            "--set",
            "webhook.timeoutSeconds=7",
        ]),
    );
    let vwc = get_json(&["validatingwebhookconfiguration", VWC]).unwrap();
    assert_eq!(vwc["webhooks"][0]["timeoutSeconds"], 7);
    let secret = get_json(&["secret", TLS_SECRET, "-n", SYSTEM]).unwrap();
    assert_eq!(
        secret["data"]["tls.crt"].as_str().unwrap_or_default(),
        tls_crt,
        "helm upgrade reset the webhook certificate"
    );
    route_webhook_to_host(port);
    wait_for("admission after helm upgrade", WAIT, || {
        let out = kubectl_stdin(&["apply", "-n", APPS, "-f", "-"], &small("after-upgrade"));
        out.status.success().then_some(()).ok_or_else(|| text(&out).1)
    });
    let lease = get_json(&["lease", LEASE, "-n", SYSTEM]).unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], holder);
    step(&mut t, "helm upgrade");

    // --- helm uninstall: operator objects go, the worker ClusterRole and CRD stay, workloads run
    drop(webhook_proc);
    drop(controller_proc);
    std::mem::forget(release);
    ok(
        "helm uninstall",
        helm(&["uninstall", RELEASE, "-n", SYSTEM, "--wait"]),
    );
    assert!(get_json(&["validatingwebhookconfiguration", VWC]).is_none());
    assert!(
        get_json(&["secret", TLS_SECRET, "-n", SYSTEM]).is_none(),
        "the webhook Secret outlived the release"
    );
    assert!(
        get_json(&["lease", LEASE, "-n", SYSTEM]).is_none(),
        "the leader Lease outlived the release"
    );
    assert!(
        get_json(&["clusterrole", "kvfleet-worker"]).is_some(),
        "the kept workers' ClusterRole was deleted"
    );
    assert!(e2e_support::crd_exists(), "crds.keep: the CRD stays");
    assert_eq!(pods("mixed-fp8").len(), 5, "workloads keep running unmanaged");
    step(&mut t, "helm uninstall");

    // --- clean up what this suite made
    e2e_support::delete_namespaces(vec![apps, system]);
    let _ = kubectl(&["delete", "clusterrole", "kvfleet-worker", "--ignore-not-found"]);
    drop(nodes);
    e2e_support::delete_crd_if_created(crd_created);
    let _ = std::fs::remove_dir_all(&dir);
    step(&mut t, "cleanup");
    println!("e2e_helm: total {:.1} s", total.elapsed().as_secs_f64());
}

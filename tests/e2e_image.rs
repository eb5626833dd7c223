//! End-to-end: `helm install` of the chart on a real API server (../shared/k8s) into a namespace
//! that enforces the Pod Security "restricted" profile, so the API server itself refuses any pod
//! of the chart that runs as root, may escalate privileges, keeps capabilities or lacks the
//! RuntimeDefault seccomp profile. The pods must reference the image `make image` builds
//! (kvfleet:<version>) and carry a read-only root filesystem. A mistyped value must make
//! `helm install` fail on the values schema, naming the key.
//!
//! Run: `eval "$(../shared/k8s/up)"; cargo test --test e2e_image -- --ignored`
//! Creates (and removes) its own namespace, release and node; fails without KUBECONFIG.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

mod tools_support;
use tools_support::find_tool;

const NS: &str = "kvfleet-e2e-image";
const RELEASE: &str = "e2e-image";
const NODE: &str = "kvfleet-e2e-image-cpu-0";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tool(var: &str, name: &str) -> PathBuf {
    find_tool(var, name, "run `.ci/install-tools` and `source .tools/env`")
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn kubectl(args: &[&str]) -> Output {
    run(Command::new(tool("KVFLEET_KUBECTL", "kubectl")).args(args))
}

fn kubectl_ok(args: &[&str]) -> String {
    let out = kubectl(args);
    assert!(out.status.success(), "kubectl {}: {}", args.join(" "), text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn helm(args: &[&str]) -> Output {
    run(Command::new(tool("KVFLEET_HELM", "helm")).args(args))
}

/// Removes what the test created, also when it fails half-way.
/// What the test made, removed on drop; the CRD only when this test applied it first.
struct Cleanup {
    crd_created: bool,
    /// The chart keeps the kvfleet-worker ClusterRole on uninstall (workers' RoleBindings
    /// point at it); removed here when this test's install made it.
    worker_role_created: bool,
}
impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = helm(&["uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "60s"]);
        let _ = kubectl(&[
            "delete",
            "namespace",
            NS,
            "--ignore-not-found",
            "--wait=true",
            "--timeout=120s",
        ]);
        let _ = kubectl(&["delete", "node", NODE, "--ignore-not-found"]);
        if self.worker_role_created {
            let _ = kubectl(&["delete", "clusterrole", "kvfleet-worker", "--ignore-not-found"]);
        }
        if self.crd_created {
            let _ = kubectl(&[
                "delete",
                "crd",
                "inferencedeployments.kvfleet.io",
                "--ignore-not-found",
                "--wait=true",
                "--timeout=120s",
            ]);
        }
    }
}

#[test]
#[ignore = "needs the Kubernetes control plane of ../shared/k8s (KUBECONFIG)"]
fn e2e_chart_pods_run_the_built_image_under_the_restricted_pod_security_profile() {
    assert!(
        std::env::var_os("KUBECONFIG").is_some(),
        "KUBECONFIG is not set: start the test cluster with `eval \"$(../shared/k8s/up)\"`"
    );
    let chart = repo().join("charts/kvfleet");
    let chart = chart.to_str().expect("UTF-8 path");
    let image = format!("kvfleet:{}", env!("CARGO_PKG_VERSION"));
    let crd_created = kubectl_ok(&[
        "get",
        "crd",
        "inferencedeployments.kvfleet.io",
        "--ignore-not-found",
        "-o",
        "name",
    ])
    .trim()
    .is_empty();
    let worker_role_created = kubectl_ok(&[
        "get",
        "clusterrole",
        "kvfleet-worker",
        "--ignore-not-found",
        "-o",
        "name",
    ])
    .trim()
    .is_empty();
    let _cleanup = Cleanup {
        crd_created,
        worker_role_created,
    };
    let _ = helm(&["uninstall", RELEASE, "-n", NS, "--wait"]);

    let node = run(Command::new(repo().join("../shared/k8s/cpu-node")).arg(NODE));
    assert!(node.status.success(), "cpu-node {NODE}: {}", text(&node));
    // The CRD is cluster-wide and may already belong to another release or test: install it
    // outside Helm (server-side apply, the same content) and keep the chart's copy off.
    let crd = std::fs::read(repo().join("crds/inferencedeployments.kvfleet.io.yaml")).unwrap();
    let mut apply = Command::new(tool("KVFLEET_KUBECTL", "kubectl"))
        .args([
            "apply",
            "--server-side",
            "--field-manager=kvfleet-e2e-image",
            "-f",
            "-",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut apply.stdin.take().unwrap(), &crd).unwrap();
    let applied = apply.wait_with_output().unwrap();
    assert!(applied.status.success(), "apply CRD: {}", text(&applied));

    // A namespace left by an earlier run may still be terminating.
    kubectl_ok(&[
        "delete",
        "namespace",
        NS,
        "--ignore-not-found",
        "--wait=true",
        "--timeout=120s",
    ]);
    kubectl_ok(&["create", "namespace", NS]);
    kubectl_ok(&[
        "label",
        "namespace",
        NS,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    ]);
    // The profile is enforced: a pod running as root with privilege escalation is refused.
    let bad = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"rooty","namespace":"kvfleet-e2e-image"},
        "spec":{"containers":[{"name":"c","image":"kvfleet:0","securityContext":{"allowPrivilegeEscalation":true}}]}}"#;
    let bad_path = std::env::temp_dir().join("kvfleet-e2e-image-rooty.json");
    std::fs::write(&bad_path, bad).unwrap();
    let refused = kubectl(&["create", "--dry-run=server", "-f", bad_path.to_str().unwrap()]);
    assert!(
        !refused.status.success() && text(&refused).contains("violates PodSecurity"),
        "the API server does not enforce Pod Security in {NS}: {}",
        text(&refused)
    );

    // A mistyped value: helm install stops on the schema and names the key; nothing installed.
    let out = helm(&[
        "install",
        RELEASE,
        chart,
        "-n",
        NS,
        "--set",
        "crds.enabled=false",
        "--set",
        "image.pullPolicy=Sometimes",
    ]);
    assert!(
        !out.status.success(),
        "helm install accepted image.pullPolicy=Sometimes"
    );
    let err = text(&out);
    assert!(
        err.contains("schema") && err.contains("/image/pullPolicy") && err.contains("IfNotPresent"),
        "the schema error does not name the key and its allowed values: {err}"
    );
    let out = helm(&[
        "install",
        RELEASE,
        chart,
        "-n",
        NS,
        "--set",
        "crds.enabled=false",
        "--set",
        "controler.replicas=2",
    ]);
    assert!(
        !out.status.success(),
        "helm install accepted the misspelt key 'controler'"
    );
    assert!(text(&out).contains("controler"), "{}", text(&out));
    assert!(
        !String::from_utf8_lossy(&helm(&["list", "-n", NS, "-q"]).stdout).contains(RELEASE),
        "a release was installed despite the schema error"
    );

    // The real install, with defaults except: the CRD outside Helm, and a webhook that never
    // blocks other tests' namespaces while this release exists (its pods never run here).
    let out = helm(&[
        "install",
        RELEASE,
        chart,
        "-n",
        NS,
        "--set",
        "crds.enabled=false",
        "--set",
        "webhook.failurePolicy=Ignore",
        "--set",
        "webhook.timeoutSeconds=1",
        "--set",
        "imagePullSecrets[0].name=regcred",
        "--wait",
        "--timeout",
        "120s",
    ]);
    assert!(out.status.success(), "helm install: {}", text(&out));

    // Pods of the controller (1) and the webhook (2), created by the ReplicaSet controller and
    // admitted by Pod Security "restricted".
    let deadline = Instant::now() + Duration::from_secs(60);
    let pods = loop {
        let list: Value = serde_json::from_str(&kubectl_ok(&[
            "get",
            "pods",
            "-n",
            NS,
            "-l",
            &format!("app.kubernetes.io/instance={RELEASE}"),
            "-o",
            "json",
        ]))
        .unwrap();
        let items = list["items"].as_array().cloned().unwrap_or_default();
        if items.len() >= 3 {
            break items;
        }
        if Instant::now() > deadline {
            let events = kubectl(&["get", "events", "-n", NS]);
            panic!("{} pods of 3 after 60 s; events:\n{}", items.len(), text(&events));
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let mut components = Vec::new();
    for pod in &pods {
        let name = pod["metadata"]["name"].as_str().unwrap();
        components.push(
            pod["metadata"]["labels"]["app.kubernetes.io/component"]
                .as_str()
                .unwrap()
                .to_string(),
        );
        let spec = &pod["spec"];
        let psc = &spec["securityContext"];
        assert_eq!(psc["runAsNonRoot"], true, "{name}");
        assert_eq!(psc["runAsUser"], 65532, "{name}: the image's user");
        assert_eq!(psc["seccompProfile"]["type"], "RuntimeDefault", "{name}");
        assert_eq!(spec["imagePullSecrets"][0]["name"], "regcred", "{name}");
        for c in spec["containers"].as_array().unwrap() {
            assert_eq!(
                c["image"],
                image.as_str(),
                "{name}: not the image make image tags"
            );
            let sc = &c["securityContext"];
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}");
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
            assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]), "{name}");
            assert!(sc["privileged"].is_null() || sc["privileged"] == false, "{name}");
        }
        if components.last().map(String::as_str) == Some("controller") {
            let env = spec["containers"][0]["env"].as_array().unwrap();
            let worker = env
                .iter()
                .find(|e| e["name"] == "KVFLEET_WORKER_IMAGE")
                .expect("controller has KVFLEET_WORKER_IMAGE");
            assert_eq!(
                worker["value"],
                image.as_str(),
                "worker pods run the chart's image"
            );
        }
    }
    components.sort();
    assert_eq!(components, ["controller", "webhook", "webhook"]);
}

//! Shared by the e2e suites (tests/e2e_*.rs): they run against a real control plane
//! (`../shared/k8s/up`, or any cluster KUBECONFIG points at), through `kubectl` and `helm`
//! as a user types them.
//!
//! Rules every suite keeps: it FAILS with a message when KUBECONFIG is missing (it is
//! `#[ignore]`d only so that a plain `cargo test` needs no cluster); it works in namespaces
//! of its own and waits for their deletion; it creates the GPU nodes it needs (with
//! `../shared/k8s/gpu-node`) and deletes exactly those; it never changes a node or object
//! it did not create.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Fails the test (never skips it) when no cluster is configured.
pub fn require_cluster(suite: &str) {
    if std::env::var_os("KUBECONFIG").is_none_or(|k| k.is_empty()) {
        panic!(
            "{suite}: KUBECONFIG is not set, so there is no cluster to run against. Start the \
             loopback control plane with `eval \"$(../shared/k8s/up)\"` (or `make test`, which \
             does it), then `cargo test --test {suite} -- --ignored`"
        );
    }
    // kube-rs in this process needs a crypto provider for rustls.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

/// kubectl: $KVFLEET_KUBECTL (.tools/env), else $KUBECTL (`../shared/k8s/up`), else PATH.
pub fn kubectl_bin() -> String {
    std::env::var("KVFLEET_KUBECTL")
        .or_else(|_| std::env::var("KUBECTL"))
        .unwrap_or_else(|_| "kubectl".into())
}

/// helm: $KVFLEET_HELM (.tools/env), else PATH.
pub fn helm_bin() -> String {
    std::env::var("KVFLEET_HELM").unwrap_or_else(|_| "helm".into())
}

fn run(bin: &str, args: &[&str], input: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new(bin)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}; run .ci/install-tools and `source .tools/env`"));
    if let (Some(data), Some(mut pipe)) = (input, child.stdin.take()) {
        pipe.write_all(data.as_bytes()).expect("write stdin");
    }
    child.wait_with_output().expect("wait")
}

pub fn kubectl(args: &[&str]) -> Output {
    run(&kubectl_bin(), args, None)
}

pub fn kubectl_stdin(args: &[&str], input: &str) -> Output {
    run(&kubectl_bin(), args, Some(input))
}

pub fn helm(args: &[&str]) -> Output {
    run(&helm_bin(), args, None)
}

pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// stdout of a command that must succeed.
pub fn ok(what: &str, out: Output) -> String {
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{what} failed: {stderr}{stdout}");
    stdout
}

pub fn kubectl_ok(args: &[&str]) -> String {
    ok(&format!("kubectl {}", args.join(" ")), kubectl(args))
}

/// Polls `f` every 250 ms until it returns `Some`, failing after `timeout` with `what` and
/// the last value seen.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let start = Instant::now();
    loop {
        match f() {
            Ok(v) => return v,
            Err(last) => {
                assert!(
                    start.elapsed() < timeout,
                    "timed out after {timeout:?} waiting for {what}; last: {last}"
                );
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `kubectl get -o json`, parsed; `None` when it does not exist.
pub fn get_json(args: &[&str]) -> Option<serde_json::Value> {
    let mut all = vec!["get"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["-o", "json", "--ignore-not-found"]);
    let out = kubectl_ok(&all);
    (!out.trim().is_empty()).then(|| serde_json::from_str(&out).expect("kubectl JSON"))
}

// === namespaces ===

/// A namespace of the suite's own: a leftover from an interrupted run is deleted first;
/// on drop it is deleted and waited for, so that the next suite never meets
/// "namespace ... is being terminated".
pub struct Namespace {
    pub name: String,
}

impl Namespace {
    pub fn create(name: &str) -> Namespace {
        delete_namespace(name);
        kubectl_ok(&["create", "namespace", name]);
        Namespace { name: name.into() }
    }
}

/// Deletes several namespaces at once and waits for all of them (a namespace holding pods
/// takes about 10 s to go; one after the other that adds up).
pub fn delete_namespaces(namespaces: Vec<Namespace>) {
    let mut args = vec![
        "delete",
        "namespace",
        "--ignore-not-found",
        "--wait=true",
        "--timeout=180s",
    ];
    args.extend(namespaces.iter().map(|n| n.name.as_str()));
    let _ = kubectl(&args);
    drop(namespaces);
}

impl Drop for Namespace {
    fn drop(&mut self) {
        delete_namespace(&self.name);
    }
}

fn delete_namespace(name: &str) {
    let _ = kubectl(&[
        "delete",
        "namespace",
        name,
        "--ignore-not-found",
        "--wait=true",
        "--timeout=180s",
    ]);
}

// === nodes ===

/// One GPU node as GFD labels it.
#[derive(Clone, Copy, Debug)]
pub struct Gpu {
    pub product: &'static str,
    pub major: u32,
    pub minor: u32,
    pub count: u32,
    pub memory_mib: u64,
}

pub const H100: Gpu = Gpu {
    product: "NVIDIA-H100-80GB-HBM3",
    major: 9,
    minor: 0,
    count: 8,
    memory_mib: 81559,
};
pub const L4: Gpu = Gpu {
    product: "NVIDIA-L4",
    major: 8,
    minor: 9,
    count: 1,
    memory_mib: 23034,
};
pub const RTX_PRO_6000: Gpu = Gpu {
    product: "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
    major: 12,
    minor: 0,
    count: 4,
    memory_mib: 97887,
};
pub const B200: Gpu = Gpu {
    product: "NVIDIA-B200",
    major: 10,
    minor: 0,
    count: 8,
    memory_mib: 183359,
};
pub const RTX_3090: Gpu = Gpu {
    product: "NVIDIA-GeForce-RTX-3090",
    major: 8,
    minor: 6,
    count: 2,
    memory_mib: 24576,
};
pub const T4: Gpu = Gpu {
    product: "Tesla-T4",
    major: 7,
    minor: 5,
    count: 1,
    memory_mib: 15360,
};

/// Marks the nodes the e2e suites create, so that a suite never takes over a node of the
/// same name that it did not make.
pub const E2E_NODE_LABEL: &str = "kvfleet.io/e2e-node";

/// The GPU nodes a suite created; deleted (and only they) on drop. Made through the API of
/// the cluster KUBECONFIG points at (as `../shared/k8s/gpu-node` does for its own): a Node
/// labelled as GPU Feature Discovery labels one, with a Ready status and `nvidia.com/gpu`.
#[derive(Default)]
pub struct Nodes {
    pub names: Vec<String>,
}

impl Nodes {
    /// Creates (or, for a node of an e2e suite, relabels) a Ready GPU node; returns once it
    /// is schedulable (the node-lifecycle controller lifted its not-ready taint).
    pub fn gpu(&mut self, name: &str, gpu: Gpu) {
        let labels = serde_json::json!({
            E2E_NODE_LABEL: "true",
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": gpu.product,
            "nvidia.com/gpu.compute.major": gpu.major.to_string(),
            "nvidia.com/gpu.compute.minor": gpu.minor.to_string(),
            "nvidia.com/gpu.count": gpu.count.to_string(),
            "nvidia.com/gpu.memory": gpu.memory_mib.to_string(),
        });
        match get_json(&["node", name]) {
            Some(existing) => assert_eq!(
                existing["metadata"]["labels"][E2E_NODE_LABEL], "true",
                "node {name} exists and was not made by an e2e suite: not touching it"
            ),
            None => {
                let node = serde_json::json!({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": labels}});
                ok(
                    &format!("create node {name}"),
                    kubectl_stdin(&["create", "-f", "-"], &node.to_string()),
                );
            }
        }
        let patch = serde_json::json!({"metadata": {"labels": labels}});
        kubectl_ok(&["patch", "node", name, "--type=merge", "-p", &patch.to_string()]);
        let now = jiff::Timestamp::now().to_string();
        let resources = serde_json::json!({"cpu": "64", "memory": "512Gi", "pods": "110",
            "nvidia.com/gpu": gpu.count.to_string()});
        let status = serde_json::json!({"status": {
            "capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "node object of an e2e suite", "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
        }});
        kubectl_ok(&[
            "patch",
            "node",
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            &status.to_string(),
        ]);
        if !self.names.iter().any(|n| n == name) {
            self.names.push(name.into());
        }
        wait_for(
            &format!("node {name} schedulable"),
            Duration::from_secs(30),
            || {
                let node = get_json(&["node", name]).ok_or("gone")?;
                let tainted = node["spec"]["taints"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["key"] == "node.kubernetes.io/not-ready"));
                if tainted {
                    Err(node["spec"]["taints"].to_string())
                } else {
                    Ok(())
                }
            },
        );
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = kubectl(&["delete", "node", name, "--ignore-not-found", "--wait=true"]);
        }
    }
}

// === processes ===

/// A child process killed (SIGKILL) on drop; its output goes to a log file kept for failures.
pub struct Proc {
    pub child: std::process::Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(what: &str, cmd: &mut Command, log: PathBuf) -> Proc {
        let file = std::fs::File::create(&log).expect("log file");
        let child = cmd
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        Proc { child, log }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP port free on loopback right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A kubeconfig that authenticates with `token` (named `user`) to the API server of
/// KUBECONFIG, written into `dir`.
pub fn token_kubeconfig(user: &str, token: &str, dir: &std::path::Path) -> PathBuf {
    let admin: serde_json::Value = serde_json::from_str(&kubectl_ok(&[
        "config", "view", "--raw", "--minify", "-o", "json",
    ]))
    .expect("kubeconfig JSON");
    let cluster = &admin["clusters"][0]["cluster"];
    let ca = match cluster["certificate-authority-data"].as_str() {
        Some(data) => format!("certificate-authority-data: {data}"),
        None => format!(
            "certificate-authority: {}",
            cluster["certificate-authority"]
                .as_str()
                .expect("a CA in the kubeconfig")
        ),
    };
    let config = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {}\n    {ca}\n\
         users:\n- name: {user}\n  user:\n    token: {token}\ncontexts:\n- name: e2e\n  context: {{cluster: e2e, user: {user}}}\n\
         current-context: e2e\n",
        cluster["server"].as_str().expect("server"),
    );
    let path = dir.join(format!("{user}.kubeconfig"));
    std::fs::write(&path, config).expect("kubeconfig");
    path
}

/// Routes a ValidatingWebhookConfiguration for InferenceDeployments (failurePolicy Fail, only
/// in `namespace`) to a webhook this test serves on 127.0.0.1:`port`: an ExternalName Service
/// `service` to 127.0.0.1 (../shared/k8s/README.md), and the configuration `configuration`,
/// whose caBundle the webhook's certificate manager publishes.
pub fn route_webhook_to_host(namespace: &str, service: &str, configuration: &str, port: u16) {
    let svc = format!(
        r#"{{"apiVersion": "v1", "kind": "Service", "metadata": {{"name": "{service}", "namespace": "{namespace}"}},
  "spec": {{"type": "ExternalName", "externalName": "127.0.0.1", "ports": [{{"port": {port}}}]}}}}"#
    );
    ok(
        "the webhook's Service",
        kubectl_stdin(&["apply", "-f", "-"], &svc),
    );
    let vwc = format!(
        r#"{{"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
  "metadata": {{"name": "{configuration}"}},
  "webhooks": [{{"name": "validate.inferencedeployments.kvfleet.io",
    "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
    "matchPolicy": "Equivalent", "timeoutSeconds": 10,
    "clientConfig": {{"service": {{"name": "{service}", "namespace": "{namespace}", "port": {port}, "path": "/validate"}}}},
    "namespaceSelector": {{"matchLabels": {{"kubernetes.io/metadata.name": "{namespace}"}}}},
    "rules": [{{"apiGroups": ["kvfleet.io"], "apiVersions": ["v1alpha1"],
      "operations": ["CREATE", "UPDATE"], "resources": ["inferencedeployments"], "scope": "Namespaced"}}]}}]}}"#
    );
    ok(
        "the webhook configuration",
        kubectl_stdin(&["apply", "-f", "-"], &vwc),
    );
}

/// Whether the CRD exists now (a suite deletes it at the end only if it created it).
/// Applies kvfleet's CRD as this build prints it (`kvfleet crd`, server-side) and waits until
/// it is Established; true when it was absent before (then delete it at the end:
/// [`delete_crd_if_created`]).
pub fn install_crd(bin: &str) -> bool {
    let created = crd_settled().is_none();
    let crd = Command::new(bin).arg("crd").output().expect("kvfleet crd");
    assert!(crd.status.success(), "kvfleet crd failed");
    ok(
        "apply CRD",
        kubectl_stdin(
            &["apply", "--server-side", "-f", "-"],
            &String::from_utf8_lossy(&crd.stdout),
        ),
    );
    wait_established(CRD);
    created
}

/// Waits (up to 60 s) until CRD `name` is Established. Polled rather than `kubectl wait
/// --for=condition=Established`, which fails at once on a CRD the API server has created but
/// not yet given a status (`.status.conditions accessor error: <nil>`).
pub fn wait_established(name: &str) {
    wait_for(
        &format!("crd/{name} Established"),
        Duration::from_secs(60),
        || {
            let crd = get_json(&["crd", name]).ok_or_else(|| format!("no crd/{name}"))?;
            let established = crd["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Established" && c["status"] == "True");
            if established {
                Ok(())
            } else {
                Err(crd["status"].to_string())
            }
        },
    );
}

pub fn crd_exists() -> bool {
    get_json(&["crd", CRD]).is_some()
}

pub const CRD: &str = "inferencedeployments.kvfleet.io";

/// The CRD as it is now, waiting first (up to 120 s) for one that is being deleted to go:
/// a suite that starts while an earlier one's CRD is terminating must not count it as
/// someone else's.
pub fn crd_settled() -> Option<serde_json::Value> {
    wait_for(
        "a terminating CRD to go",
        Duration::from_secs(120),
        || match get_json(&["crd", CRD]) {
            Some(crd) if crd["metadata"]["deletionTimestamp"].is_string() => {
                Err(format!("{CRD} is terminating"))
            }
            found => Ok(found),
        },
    )
}

/// Who wrote the CRD (its field managers and creation time), for a message.
pub fn crd_owners(crd: &serde_json::Value) -> String {
    let managers: Vec<String> = crd["metadata"]["managedFields"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|f| {
                    format!(
                        "{} ({})",
                        f["manager"].as_str().unwrap_or("?"),
                        f["operation"].as_str().unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    format!(
        "created {}, field managers: {}",
        crd["metadata"]["creationTimestamp"].as_str().unwrap_or("?"),
        managers.join(", ")
    )
}

/// Deletes the CRD and waits until it is gone, when `created` says this suite made it. A
/// CRD that stays fails the suite that left it (the next suite's `helm install` would
/// refuse to adopt it).
pub fn delete_crd_if_created(created: bool) {
    if !created {
        return;
    }
    let out = kubectl(&[
        "delete",
        "crd",
        CRD,
        "--ignore-not-found",
        "--wait=true",
        "--timeout=180s",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "kubectl delete crd {CRD} failed: {stderr}{stdout}"
    );
    if let Some(left) = get_json(&["crd", CRD]) {
        panic!("{CRD} is still there after its deletion: {}", crd_owners(&left));
    }
}

// === HTTP ===

/// `GET path` on 127.0.0.1:`port` (plain HTTP/1.1, the connection closed after it): the
/// status code and the body, or `None` while nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// "Kind name" of every object of `kinds` in `namespace` matching the label `selector`, and
/// whether it carries an owner reference to the object of `uid` (the owned-set suites: what the
/// controller left behind). A kind whose API is not served has none.
pub async fn labelled(
    client: &kube::Client,
    namespace: &str,
    kinds: &[kube::api::ApiResource],
    selector: &str,
    uid: &str,
) -> Result<std::collections::BTreeSet<(String, bool)>, String> {
    use kube::api::{Api, DynamicObject, ListParams};
    let mut out = std::collections::BTreeSet::new();
    for kind in kinds {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, kind);
        let items = match api.list(&ListParams::default().labels(selector)).await {
            Ok(l) => l.items,
            Err(kube::Error::Api(s)) if s.code == 404 => continue,
            Err(e) => return Err(format!("list {}: {e}", kind.plural)),
        };
        for o in items {
            let ours = o.metadata.owner_references.iter().flatten().any(|r| r.uid == uid);
            let name = o.metadata.name.unwrap_or_default();
            out.insert((format!("{} {name}", kind.kind), ours));
        }
    }
    Ok(out)
}

/// The ClusterRole of deploy/rbac/controller.yaml under the name `name`, bound to a
/// ServiceAccount `name` of `namespace`, so that a suite runs the controller with exactly the
/// rights a user installs; the cluster-scoped objects are deleted on drop.
pub struct ControllerIdentity {
    name: String,
    namespace: String,
}

impl ControllerIdentity {
    pub fn create(name: &str, namespace: &str) -> ControllerIdentity {
        use serde::Deserialize;
        let path = format!("{}/deploy/rbac/controller.yaml", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).expect("deploy/rbac/controller.yaml");
        let rules = serde_yaml::Deserializer::from_str(&text)
            .map(|d| serde_json::Value::deserialize(d).expect("a YAML document"))
            .find(|o| o["kind"] == "ClusterRole")
            .expect("a ClusterRole in deploy/rbac/controller.yaml")["rules"]
            .clone();
        let objects = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": name, "namespace": namespace}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": name}, "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": name},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
        ]});
        ok(
            "the controller's identity",
            kubectl_stdin(&["apply", "-f", "-"], &objects.to_string()),
        );
        ControllerIdentity {
            name: name.into(),
            namespace: namespace.into(),
        }
    }

    /// `kvfleet controller` of this build on the host as this identity (its kubeconfig written
    /// under `scratch`, its log `scratch/controller.log`), without leader election, its
    /// metrics on a free loopback port, with `extra` arguments and `RUST_LOG=rust_log`.
    pub fn spawn_controller(
        &self,
        bin: &str,
        scratch: &std::path::Path,
        rust_log: &str,
        extra: &[&str],
    ) -> Proc {
        let http = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["controller", "--leader-elect=false", "--http-addr", &http];
        args.extend_from_slice(extra);
        Proc::spawn(
            "kvfleet controller",
            Command::new(bin)
                .env("KUBECONFIG", self.kubeconfig(scratch))
                .env("RUST_LOG", rust_log)
                .args(&args),
            scratch.join("controller.log"),
        )
    }

    /// A kubeconfig for the identity's ServiceAccount token, written under `dir`.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> PathBuf {
        let token = kubectl_ok(&[
            "create",
            "token",
            &self.name,
            "-n",
            &self.namespace,
            "--duration=1h",
        ]);
        token_kubeconfig(&self.name, token.trim(), dir)
    }
}

impl Drop for ControllerIdentity {
    fn drop(&mut self) {
        let _ = kubectl(&[
            "delete",
            "clusterrolebinding,clusterrole",
            &self.name,
            "--ignore-not-found",
        ]);
    }
}

// === CRD schemas ===

/// Checks `v` against an OpenAPI v3 schema of a CRD: every field is a property of its object
/// (or of `additionalProperties`), of the schema's type and enum, within its bounds, and every
/// required field is present. Returns the problems found.
pub fn schema_problems(v: &serde_json::Value, schema: &serde_json::Value, at: &str) -> Vec<String> {
    let mut out = Vec::new();
    let ty = schema["type"].as_str().unwrap_or("");
    let type_ok = match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64(),
        "boolean" => v.is_boolean(),
        _ => true,
    };
    if !type_ok {
        return vec![format!("{at}: {v} is not of type {ty}")];
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(v) {
            out.push(format!("{at}: {v} is not one of {allowed:?}"));
        }
    }
    if let (Some(n), Some(min)) = (v.as_i64(), schema["minimum"].as_f64()) {
        if (n as f64) < min {
            out.push(format!("{at}: {n} below {min}"));
        }
    }
    if let (Some(n), Some(max)) = (v.as_i64(), schema["maximum"].as_f64()) {
        if (n as f64) > max {
            out.push(format!("{at}: {n} above {max}"));
        }
    }
    if let Some(obj) = v.as_object() {
        for req in schema["required"].as_array().into_iter().flatten() {
            if !obj.contains_key(req.as_str().unwrap_or_default()) {
                out.push(format!("{at}: required {req} missing"));
            }
        }
        for (k, child) in obj {
            let sub = schema["properties"]
                .get(k)
                .or_else(|| schema.get("additionalProperties"));
            match sub {
                Some(sub) => out.extend(schema_problems(child, sub, &format!("{at}.{k}"))),
                None if schema.get("x-kubernetes-preserve-unknown-fields").is_some() => {}
                None => out.push(format!("{at}.{k}: not in the schema")),
            }
        }
    }
    if let Some(items) = v.as_array() {
        for (i, item) in items.iter().enumerate() {
            out.extend(schema_problems(item, &schema["items"], &format!("{at}[{i}]")));
        }
    }
    out
}

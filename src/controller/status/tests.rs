use k8s_openapi::api::apps::v1::DeploymentStatus;

use super::*;
use crate::api::{AttentionBackend, KvCacheDtype};
use crate::validate::Denial;

#[test]
fn another_writers_condition_is_not_part_of_what_the_controller_compares() {
    let t = Time(Timestamp::from_second(1_700_000_000).unwrap());
    let c = |type_: &str| Condition {
        type_: type_.into(),
        status: "True".into(),
        reason: "R".into(),
        message: String::new(),
        observed_generation: Some(1),
        last_transition_time: t.clone(),
    };
    let ours = InferenceDeploymentStatus {
        conditions: OWNED_CONDITIONS.iter().map(|t| c(t)).collect(),
        ..InferenceDeploymentStatus::default()
    };
    let mut stored = ours.clone();
    stored.conditions.insert(2, c("ExternalCheck"));
    assert_ne!(stored, ours);
    assert_eq!(owned_part(&stored), ours);
    // A condition of ours missing is still a difference.
    let mut lost = stored.clone();
    lost.conditions.retain(|c| c.type_ != DEGRADED);
    assert_ne!(owned_part(&lost), ours);
}

fn obj(generation: i64) -> InferenceDeployment {
    let mut o: InferenceDeployment = serde_yaml::from_str(
        "apiVersion: kvfleet.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: m, namespace: ns}\n\
         spec: {replicas: 2, model: {name: m, geometry: {layers: 2, queryHeads: 4, kvHeads: 2, headDim: 64}}}\n",
    )
    .unwrap();
    o.metadata.generation = Some(generation);
    o
}

fn allowed() -> Verdict {
    Verdict {
        resolved: Some(ResolvedConfig {
            kv_cache_dtype: KvCacheDtype::Fp8E5m2,
            attention_backend: AttentionBackend::KvfleetCuda,
            compute_capabilities: vec!["8.6".into()],
            products: vec![],
        }),
        compatible_nodes: vec!["n1".into(), "n2".into()],
        ..Verdict::default()
    }
}

fn dep(ready: i32, updated: i32) -> Deployment {
    let mut d = Deployment::default();
    d.metadata.generation = Some(1);
    d.status = Some(DeploymentStatus {
        observed_generation: Some(1),
        replicas: Some(2),
        ready_replicas: Some(ready),
        updated_replicas: Some(updated),
        ..DeploymentStatus::default()
    });
    d
}

fn get<'a>(s: &'a InferenceDeploymentStatus, t: &str) -> &'a Condition {
    find(s, t).unwrap()
}

/// What the controller saw: a verdict and the Deployment, nothing else.
fn seen<'a>(v: &'a Verdict, d: &'a Deployment) -> Observed<'a> {
    Observed {
        verdict: Some(v),
        deployment: Some(d),
        ..Observed::default()
    }
}

#[test]
fn a_rolled_out_compatible_deployment_is_available_and_not_progressing() {
    let v = allowed();
    let d = dep(2, 2);
    let s = compute(&obj(1), &seen(&v, &d), Timestamp::UNIX_EPOCH);
    assert_eq!(get(&s, COMPATIBLE).reason, "CompatibleNodesFound");
    assert!(get(&s, COMPATIBLE).message.contains("2 node(s)"));
    assert!(get(&s, COMPATIBLE).message.contains("fp8_e5m2"));
    assert_eq!(get(&s, AVAILABLE).status, "True");
    assert_eq!(get(&s, PROGRESSING).reason, "RolloutComplete");
    assert_eq!(get(&s, DEGRADED).status, "False");
    assert_eq!(s.ready_replicas, Some(2));
    assert_eq!(s.selector.as_deref(), Some("kvfleet.io/inference-deployment=m"));
    assert!(s.conditions.iter().all(|c| c.observed_generation == Some(1)));
}

#[test]
fn a_partial_rollout_is_progressing() {
    let v = allowed();
    let d = dep(1, 1);
    let s = compute(&obj(1), &seen(&v, &d), Timestamp::UNIX_EPOCH);
    assert_eq!(get(&s, PROGRESSING).reason, "RollingOut");
    assert_eq!(get(&s, AVAILABLE).status, "True");
}

#[test]
fn a_denial_names_its_reason_and_fix_in_the_compatible_condition() {
    let v = Verdict {
        denials: vec![Denial {
            field: "spec.engine.kvCacheDtype".into(),
            reason: "UnsupportedKvCacheDtype".into(),
            message: "nvfp4 needs sm_100; use fp8".into(),
        }],
        ..Verdict::default()
    };
    let seen = Observed {
        verdict: Some(&v),
        ..Observed::default()
    };
    let s = compute(&obj(1), &seen, Timestamp::UNIX_EPOCH);
    let c = get(&s, COMPATIBLE);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "UnsupportedKvCacheDtype")
    );
    assert!(c
        .message
        .contains("spec.engine.kvCacheDtype: nvfp4 needs sm_100; use fp8"));
    assert_eq!(get(&s, AVAILABLE).reason, "NotCompatible");
    let n = notices(None, &s, Some(&v));
    assert_eq!(n.len(), 1);
    assert!(n[0].warning && n[0].reason == "UnsupportedKvCacheDtype");
}

#[test]
fn transition_times_are_kept_while_a_condition_keeps_its_status() {
    let v = allowed();
    let d = dep(2, 2);
    let mut o = obj(1);
    let t0 = Timestamp::from_second(1_000).unwrap();
    o.status = Some(compute(&o, &seen(&v, &d), t0));
    let later = compute(&o, &seen(&v, &d), Timestamp::from_second(2_000).unwrap());
    assert!(later.conditions.iter().all(|c| c.last_transition_time.0 == t0));
    assert_eq!(
        Some(&later),
        o.status.as_ref(),
        "a settled object needs no status write"
    );
    assert!(
        notices(o.status.as_ref(), &later, Some(&v)).is_empty(),
        "no Events when nothing changed"
    );
}

#[test]
fn the_planners_prediction_and_the_workers_measurement_reach_status() {
    let v = allowed();
    let d = dep(2, 2);
    let p = CapacityPrediction {
        tokens_per_replica: 25_200,
        max_concurrency: 1.87,
        vllm_tokens_per_replica: Some(25_184),
    };
    let seen = Observed {
        verdict: Some(&v),
        prediction: Some(&p),
        deployment: Some(&d),
        measured_tokens: Some(25_100),
        preflight_failure: None,
        placement: None,
    };
    let s = compute(&obj(1), &seen, Timestamp::UNIX_EPOCH);
    let c = s.capacity.clone().unwrap();
    assert_eq!(c.tokens_per_replica, Some(25_200));
    assert_eq!(c.max_concurrency, Some(1.87));
    assert_eq!(c.measured_tokens_per_replica, Some(25_100));
    assert_eq!(get(&s, CAPACITY_PLANNED).reason, "CapacityPredicted");
    let n = notices(None, &s, Some(&v));
    assert!(n
        .iter()
        .any(|n| n.reason == "CapacityMeasured" && n.note.contains("predicted 25200")));
}

fn ts() -> Timestamp {
    "2026-11-24T05:00:00Z".parse().unwrap()
}

#[test]
fn pods_stuck_in_preflight_make_the_deployment_degraded_with_an_event() {
    let o = obj(1);
    let v = allowed();
    let d = dep(0, 2);
    let before = compute(&o, &seen(&v, &d), ts());
    assert_eq!(get(&before, DEGRADED).status, "False");
    let why = "worker pod m-0 exits with code 3 at start (the configuration cannot run on this GPU)";
    let after = compute(
        &o,
        &Observed {
            preflight_failure: Some(why),
            ..seen(&v, &d)
        },
        ts(),
    );
    let c = get(&after, DEGRADED);
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", PREFLIGHT_FAILED));
    assert_eq!(c.message, why);
    let events = notices(Some(&before), &after, Some(&v));
    assert!(
        events
            .iter()
            .any(|n| n.warning && n.reason == PREFLIGHT_FAILED && n.note == why),
        "{events:?}"
    );
}

#[test]
fn a_relabelled_node_says_the_nodes_changed_not_the_spec() {
    let mut o = obj(3);
    let v = allowed();
    let d = dep(2, 2);
    let admitted = compute(&o, &seen(&v, &d), ts());
    o.status = Some(admitted);
    // The node was relabelled from an RTX 3090 (8.6) to a T4 (7.5): same generation.
    let denied = Verdict {
        denials: vec![Denial {
            field: "spec.engine.kvCacheDtype".into(),
            reason: "UnsupportedKvCacheDtype".into(),
            message: "fp8_e5m2 needs 8.0; use float16".into(),
        }],
        architectures: vec![crate::validate::ArchReport {
            compute_capability: "7.5".parse().unwrap(),
            products: vec!["Tesla-T4".into()],
            nodes: 1,
            nodes_with_enough_gpus: 1,
            resolved: None,
            violations: vec![],
        }],
        ..Verdict::default()
    };
    let st = compute(&o, &seen(&denied, &d), ts());
    let c = get(&st, DEGRADED);
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "NodesChanged"));
    assert!(
        c.message.starts_with("the nodes changed, not the spec: generation 3 was admitted on compute capability 8.6; the selected nodes now have Tesla-T4 (7.5), where it cannot run (spec.engine.kvCacheDtype: fp8_e5m2 needs 8.0; use float16)"),
        "{}",
        c.message
    );
    assert!(!c.message.contains("fix the spec"), "{}", c.message);
    // Stays NodesChanged on the next pass (Compatible is False by then).
    o.status = Some(st);
    let again = compute(&o, &seen(&denied, &d), ts());
    assert_eq!(get(&again, DEGRADED).reason, "NodesChanged");
    // A new generation that is denied is the spec's fault.
    o.metadata.generation = Some(4);
    let next = compute(&o, &seen(&denied, &d), ts());
    assert_eq!(get(&next, DEGRADED).reason, "SpecNotApplied");
}

/// What `validate::` returns when no node matches and the declared products admit it.
fn admitted_on_declared_products() -> Verdict {
    Verdict {
        compatible_nodes: vec![],
        warnings: vec!["no schedulable GPU node matches the selectors (gpu.selector.products [NVIDIA-B200]) right now, so this was judged against the products they declare (NVIDIA-B200): pods stay Pending until such a node joins".into()],
        ..allowed()
    }
}

fn b200_obj(generation: i64) -> InferenceDeployment {
    let mut o = obj(generation);
    o.spec.gpu = Some(serde_yaml::from_str("{selector: {products: [NVIDIA-B200]}}").unwrap());
    o
}

#[test]
fn admitted_on_declared_products_with_no_node_the_reason_and_message_say_no_node_can_run_it() {
    let o = b200_obj(1);
    let v = admitted_on_declared_products();
    let s = compute(&o, &seen(&v, &dep(2, 2)), ts());
    let c = get(&s, COMPATIBLE);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", DECLARED_PRODUCTS_NO_NODES)
    );
    assert!(
        c.message.starts_with("no node in the cluster can run it now; it is admitted on the GPU products its selector declares (NVIDIA-B200), where it runs with kvCacheDtype fp8_e5m2"),
        "{}",
        c.message
    );
    assert!(!c.message.contains("0 node(s)"), "{}", c.message);
    // A new spec admitted this way (scale from zero) is told by SpecApplied and its
    // warnings, as before; no extra Event.
    let n = notices(None, &s, Some(&v));
    assert!(n.iter().all(|n| n.reason != DECLARED_PRODUCTS_NO_NODES), "{n:?}");
}

#[test]
fn the_nodes_that_ran_it_going_away_is_a_warning_event_and_their_return_a_normal_one() {
    let mut o = b200_obj(1);
    let on_nodes = allowed();
    let before = compute(&o, &seen(&on_nodes, &dep(2, 2)), ts());
    assert_eq!(get(&before, COMPATIBLE).reason, COMPATIBLE_NODES_FOUND);
    o.status = Some(before.clone());
    let none = admitted_on_declared_products();
    let after = compute(&o, &seen(&none, &dep(2, 2)), ts());
    let n = notices(Some(&before), &after, Some(&none));
    assert_eq!(
        n.iter()
            .map(|n| (n.warning, n.reason.as_str()))
            .collect::<Vec<_>>(),
        vec![(true, DECLARED_PRODUCTS_NO_NODES)]
    );
    o.status = Some(after.clone());
    let back = compute(&o, &seen(&on_nodes, &dep(2, 2)), ts());
    let n = notices(Some(&after), &back, Some(&on_nodes));
    assert_eq!(
        n.iter()
            .map(|n| (n.warning, n.reason.as_str()))
            .collect::<Vec<_>>(),
        vec![(false, COMPATIBLE_NODES_FOUND)]
    );
}

fn misplaced(pod: &str) -> crate::controller::placement::Misplaced {
    crate::controller::placement::Misplaced {
        pod: pod.into(),
        uid: None,
        node: "gpu-a".into(),
        gpu: "NVIDIA-H100-80GB-HBM3, compute capability 9.0".into(),
        why: "spec.engine.kvCacheDtype: nvfp4 needs compute capability 10.0".into(),
    }
}

#[test]
fn pods_on_incompatible_nodes_are_named_with_their_node_and_the_fix() {
    let o = b200_obj(1);
    let v = allowed();
    let d = dep(2, 2);
    let with = |p: &Placement| {
        compute(
            &o,
            &Observed {
                placement: Some(p),
                ..seen(&v, &d)
            },
            ts(),
        )
    };
    let checked = |m: Vec<crate::controller::placement::Misplaced>| Placement::Checked {
        bound: 7,
        kv_cache_dtype: crate::api::KvCacheDtype::Nvfp4,
        attention_backend: crate::api::AttentionBackend::FlashInfer,
        misplaced: m,
    };
    let s = with(&checked(vec![misplaced("m-1")]));
    let c = get(&s, PODS_ON_INCOMPATIBLE_NODES);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", NODE_NO_LONGER_COMPATIBLE)
    );
    assert!(
        c.message.starts_with("1 of 7 bound worker pod(s) run on a node that can no longer run kvCacheDtype nvfp4 with attentionBackend FLASHINFER (the node changed after the pod was scheduled): pod m-1 on node gpu-a (NVIDIA-H100-80GB-HBM3, compute capability 9.0): spec.engine.kvCacheDtype: nvfp4 needs compute capability 10.0. Delete each such pod")
            && c.message.contains("kubectl delete pod m-1 -n ns"),
        "{}",
        c.message
    );
    // Many: five named, the rest counted.
    let many: Vec<_> = (0..7).map(|i| misplaced(&format!("m-{i}"))).collect();
    let c = get(&with(&checked(many)), PODS_ON_INCOMPATIBLE_NODES).clone();
    assert!(
        c.message.contains("pod m-4 on") && !c.message.contains("pod m-5 on"),
        "{}",
        c.message
    );
    assert!(c.message.contains(" and 2 more."), "{}", c.message);
    // All well, no pods, not checked: False, each with its reason.
    let ok = get(&with(&checked(vec![])), PODS_ON_INCOMPATIBLE_NODES).clone();
    assert_eq!(
        (ok.status.as_str(), ok.reason.as_str()),
        ("False", "AllPodsOnCompatibleNodes")
    );
    let none = get(&with(&Placement::NoPods), PODS_ON_INCOMPATIBLE_NODES).clone();
    assert_eq!(none.reason, "NoBoundPods");
    let unknown = get(
        &with(&Placement::NotChecked("why".into())),
        PODS_ON_INCOMPATIBLE_NODES,
    )
    .clone();
    assert_eq!(
        (unknown.reason.as_str(), unknown.message.as_str()),
        ("NotChecked", "why")
    );
}

/// Issue 35: a running pod on a node that can no longer run it makes the deployment Degraded
/// (it was AsExpected while PodsOnIncompatibleNodes was True), naming the pod, its node, what
/// the node cannot run and the fix; resolved, Degraded is False again.
#[test]
fn pods_on_incompatible_nodes_make_the_deployment_degraded_until_they_are_gone() {
    let mut o = b200_obj(1);
    let v = allowed();
    let d = dep(2, 2);
    let checked = |m: Vec<crate::controller::placement::Misplaced>| Placement::Checked {
        bound: 2,
        kv_cache_dtype: crate::api::KvCacheDtype::Nvfp4,
        attention_backend: crate::api::AttentionBackend::FlashInfer,
        misplaced: m,
    };
    let with = |o: &InferenceDeployment, p: &Placement| {
        compute(
            o,
            &Observed {
                placement: Some(p),
                ..seen(&v, &d)
            },
            ts(),
        )
    };
    let well = with(&o, &checked(vec![]));
    assert_eq!(get(&well, DEGRADED).status, "False");
    o.status = Some(well.clone());

    let bad = with(&o, &checked(vec![misplaced("m-1")]));
    let c = get(&bad, DEGRADED);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", PODS_ON_INCOMPATIBLE_NODES),
        "{}",
        c.message
    );
    assert!(
        c.message.contains("pod m-1 on node gpu-a (NVIDIA-H100-80GB-HBM3, compute capability 9.0): spec.engine.kvCacheDtype: nvfp4 needs compute capability 10.0")
            && c.message.contains("kubectl delete pod m-1 -n ns"),
        "{}",
        c.message
    );
    assert_eq!(c.message, get(&bad, PODS_ON_INCOMPATIBLE_NODES).message);
    // No Event for the deployment: the reconcile publishes one per pod (PodOnIncompatibleNode).
    let events = notices(Some(&well), &bad, Some(&v));
    assert!(events.is_empty(), "{events:?}");
    o.status = Some(bad);

    // The pod rescheduled on a compatible node (or the node's labels corrected).
    let back = with(&o, &checked(vec![]));
    let c = get(&back, DEGRADED);
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "AsExpected"));
    let gone = with(&o, &Placement::NoPods);
    assert_eq!(get(&gone, DEGRADED).status, "False");
}

fn planned(available_kv_bytes: u64) -> Verdict {
    Verdict {
        capacity_basis: Some(crate::validate::CapacityBasis {
            product: "NVIDIA-H100-80GB-HBM3".into(),
            gpu_memory_bytes: 80 << 30,
            available_kv_bytes,
            bytes_per_request: 0,
            kvfleet_tokens: 0,
            vllm_tokens: 0,
            notes: vec![],
        }),
        ..allowed()
    }
}

#[test]
fn the_tolerance_is_the_tokens_of_the_logged_gib_rounding_plus_one_block() {
    // 1 GiB holds 100,000 tokens: 0.005 GiB holds 500; plus a block of 16.
    assert_eq!(capacity_tolerance_tokens(100_000, 1 << 30, 16), 516);
    assert_eq!(capacity_tolerance_tokens(0, 0, 16), 16);
}

#[test]
fn measured_and_predicted_within_the_rounding_match_and_beyond_it_raise_a_condition_with_both_figures() {
    let d = dep(2, 2);
    let p = CapacityPrediction {
        tokens_per_replica: 100_000,
        max_concurrency: 1.0,
        vllm_tokens_per_replica: Some(100_000),
    };
    let v = planned(1 << 30);
    let status_with = |measured: Option<i64>| {
        let seen = Observed {
            verdict: Some(&v),
            prediction: Some(&p),
            deployment: Some(&d),
            measured_tokens: measured,
            preflight_failure: None,
            placement: None,
        };
        compute(&obj(1), &seen, Timestamp::UNIX_EPOCH)
    };
    // No measurement yet: no condition.
    assert!(find(&status_with(None), KV_CAPACITY_MATCHES_PLAN).is_none());
    let s = status_with(Some(100_000 - 516));
    let c = get(&s, KV_CAPACITY_MATCHES_PLAN);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "MeasuredMatchesPlan")
    );
    let s = status_with(Some(100_000 - 517));
    let c = get(&s, KV_CAPACITY_MATCHES_PLAN);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "MeasuredDiffersFromPlan")
    );
    assert!(
        c.message.contains("measured 99483")
            && c.message.contains("predicted 100000")
            && c.message.contains("model.weightBytes"),
        "{}",
        c.message
    );
    let n = notices(None, &s, Some(&v));
    assert!(
        n.iter()
            .any(|n| n.warning && n.reason == "KvCapacityDiffersFromPlan"),
        "{n:?}"
    );
    let more = status_with(Some(150_000));
    assert!(get(&more, KV_CAPACITY_MATCHES_PLAN)
        .message
        .contains("more memory"));
}

use super::*;

fn pod(ready: bool, tokens: Option<&str>) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "p", "annotations": tokens.map(|t| json!({MEASURED_TOKENS_ANNOTATION: t})).unwrap_or(json!({}))},
        "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
    }))
    .unwrap()
}

#[test]
fn measured_capacity_is_the_smallest_over_ready_pods_and_ignores_garbage() {
    let pods = [
        pod(true, Some("25200")),
        pod(true, Some(" 24000 ")),
        pod(false, Some("100")),
        pod(true, Some("lots")),
        pod(true, Some("-5")),
        pod(true, None),
    ];
    assert_eq!(min_measured_tokens(&pods), Some(24000));
    assert_eq!(min_measured_tokens(&[pod(false, Some("1"))]), None);
}

// === preflight failures ===

fn crashed_pod(name: &str, code: i32, running_again: bool) -> Pod {
    let terminated = json!({"exitCode": code, "reason": "Error",
        "message": "preflight failed: the kvfleet engine runs one GPU per replica, but tensorParallelSize is 4; set it to 1 or use runtime vllm\n",
        "finishedAt": "2026-11-24T05:00:00Z"});
    let state = if running_again {
        json!({"running": {"startedAt": "2026-11-24T05:00:05Z"}})
    } else {
        json!({"waiting": {"reason": "CrashLoopBackOff"}})
    };
    serde_json::from_value(json!({
        "metadata": {"name": name, "uid": format!("uid-{name}")},
        "status": {"containerStatuses": [{"name": "kvfleet", "ready": false, "restartCount": 3,
            "image": "i", "imageID": "", "state": state, "lastState": {"terminated": terminated}}]}
    }))
    .unwrap()
}

#[test]
fn pods_stuck_in_preflight_are_described_with_the_workers_reason() {
    let msg = preflight_failure(&[crashed_pod("m-0", 3, false)]).expect("a failure");
    assert!(
        msg.starts_with("worker pod m-0 exits with code 3 at start (the configuration cannot run on this GPU): preflight failed: the kvfleet engine runs one GPU per replica"),
        "{msg}"
    );
    assert!(msg.contains("kubectl logs m-0 -c kvfleet --previous"), "{msg}");
    let two = preflight_failure(&[crashed_pod("m-0", 4, false), crashed_pod("m-1", 4, false)]).unwrap();
    assert!(
        two.starts_with("2 worker pods (e.g. m-0) exit with code 4"),
        "{two}"
    );
    // Running again, or a crash that is not a preflight exit: not stuck in preflight.
    assert_eq!(preflight_failure(&[crashed_pod("m-0", 3, true)]), None);
    assert_eq!(preflight_failure(&[crashed_pod("m-0", 1, false)]), None);
    assert_eq!(preflight_failure(&[]), None);
}

/// Controller start; every termination below finished after it unless a test says so.
fn since() -> Timestamp {
    Timestamp::from_second(1_700_000_000).unwrap()
}

/// A terminated state: exit code, container id (run number), seconds after `since()`.
fn terminated(code: i32, run: u32, at: i64) -> serde_json::Value {
    json!({"terminated": {"exitCode": code, "reason": "Error",
        "containerID": format!("containerd://run-{run}"),
        "finishedAt": Timestamp::from_second(1_700_000_000 + at).unwrap().to_string()}})
}

/// A worker pod `uid` whose `container` restarted `restarts` times.
fn worker_pod(
    uid: &str,
    container: &str,
    restarts: i32,
    state: serde_json::Value,
    last: serde_json::Value,
) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": format!("llama-{uid}"), "uid": uid},
        "status": {"containerStatuses": [{"name": container, "image": "kvfleet", "imageID": "",
            "ready": false, "restartCount": restarts, "state": state, "lastState": last}]}
    }))
    .unwrap()
}

fn waiting() -> serde_json::Value {
    json!({"waiting": {"reason": "CrashLoopBackOff"}})
}

#[test]
fn a_fresh_preflight_failure_counts_once() {
    let pods = [worker_pod("a", "kvfleet", 0, terminated(3, 0, 10), json!({}))];
    let (n, seen) = count_preflight_failures(&pods, &SeenTerminations::default(), since());
    assert_eq!(n, 1);
    let (n, _) = count_preflight_failures(&pods, &seen, since());
    assert_eq!(n, 0, "the same terminated state on the next pass");
}

#[test]
fn a_termination_seen_first_as_state_then_as_last_state_counts_once() {
    let first = [worker_pod("a", "kvfleet", 0, terminated(4, 0, 10), json!({}))];
    let (n, seen) = count_preflight_failures(&first, &SeenTerminations::default(), since());
    assert_eq!(n, 1);
    let backoff = [worker_pod("a", "kvfleet", 1, waiting(), terminated(4, 0, 10))];
    let (n, _) = count_preflight_failures(&backoff, &seen, since());
    assert_eq!(n, 0);
}

#[test]
fn a_restart_that_fails_preflight_again_counts_again() {
    let first = [worker_pod("a", "kvfleet", 1, waiting(), terminated(3, 0, 10))];
    let (n, seen) = count_preflight_failures(&first, &SeenTerminations::default(), since());
    assert_eq!(n, 1);
    let again = [worker_pod("a", "kvfleet", 2, waiting(), terminated(3, 1, 40))];
    let (n, seen) = count_preflight_failures(&again, &seen, since());
    assert_eq!(n, 1);
    // Caught while terminated, before the kubelet restarts it: both runs are visible.
    let both = [worker_pod(
        "a",
        "kvfleet",
        2,
        terminated(3, 2, 90),
        terminated(3, 1, 40),
    )];
    let (n, _) = count_preflight_failures(&both, &seen, since());
    assert_eq!(n, 1);
}

#[test]
fn config_incompatible_and_no_memory_exits_count_and_nothing_else_does() {
    for code in [2, 3, 4] {
        let pods = [worker_pod("a", "kvfleet", 0, terminated(code, 0, 10), json!({}))];
        assert_eq!(
            count_preflight_failures(&pods, &SeenTerminations::default(), since()).0,
            1
        );
    }
    for code in [0, 1, 137, 143, 255, -1] {
        let pods = [worker_pod("a", "kvfleet", 1, waiting(), terminated(code, 0, 10))];
        assert_eq!(
            count_preflight_failures(&pods, &SeenTerminations::default(), since()).0,
            0,
            "exit {code}"
        );
    }
}

#[test]
fn a_vllm_pod_exiting_3_does_not_count() {
    let pods = [worker_pod(
        "a",
        "vllm",
        1,
        terminated(3, 1, 20),
        terminated(3, 0, 10),
    )];
    let (n, _) = count_preflight_failures(&pods, &SeenTerminations::default(), since());
    assert_eq!(n, 0);
}

#[test]
fn a_failure_from_before_the_controller_started_is_remembered_not_counted() {
    let pods = [worker_pod(
        "a",
        "kvfleet",
        1,
        json!({"running": {}}),
        terminated(4, 0, -3600),
    )];
    let (n, seen) = count_preflight_failures(&pods, &SeenTerminations::default(), since());
    assert_eq!(n, 0);
    assert_eq!(seen.pods["a"].len(), 1);
}

#[test]
fn pods_that_are_gone_are_forgotten() {
    let pods = [
        worker_pod("a", "kvfleet", 1, waiting(), terminated(3, 0, 10)),
        worker_pod("b", "kvfleet", 1, waiting(), terminated(3, 0, 10)),
    ];
    let (n, seen) = count_preflight_failures(&pods, &SeenTerminations::default(), since());
    assert_eq!(n, 2);
    let (_, seen) = count_preflight_failures(&pods[1..], &seen, since());
    assert_eq!(seen.pods.keys().collect::<Vec<_>>(), ["b"]);
    let (_, seen) = count_preflight_failures(&[], &seen, since());
    assert_eq!(seen, SeenTerminations::default());
}

#[test]
fn a_malformed_or_missing_status_never_panics_nor_counts() {
    let empty = SeenTerminations::default();
    let pods: Vec<Pod> = [
        json!({"metadata": {"name": "no-uid"}, "status": {"containerStatuses": [
            {"name": "kvfleet", "image": "", "imageID": "", "ready": false, "restartCount": 0,
             "state": {"terminated": {"exitCode": 3}}}]}}),
        json!({"metadata": {"name": "no-status", "uid": "a"}}),
        json!({"metadata": {"name": "no-containers", "uid": "b"}, "status": {}}),
        json!({"metadata": {"name": "empty-state", "uid": "c"}, "status": {"containerStatuses": [
            {"name": "kvfleet", "image": "", "imageID": "", "ready": false, "restartCount": 0}]}}),
    ]
    .into_iter()
    .map(|v| serde_json::from_value(v).unwrap())
    .collect();
    assert_eq!(
        count_preflight_failures(&pods, &empty, since()),
        (0, empty.clone())
    );
    // Neither container id nor finish time: counted, and not again on the next pass.
    let bare = [worker_pod(
        "d",
        "kvfleet",
        0,
        json!({"terminated": {"exitCode": 3}}),
        json!({}),
    )];
    let (n, seen) = count_preflight_failures(&bare, &empty, since());
    assert_eq!(n, 1);
    assert_eq!(count_preflight_failures(&bare, &seen, since()).0, 0);
}

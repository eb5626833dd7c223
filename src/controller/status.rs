//! Observed state -> `status` and the Events worth telling an operator (pure).

use k8s_openapi::api::apps::v1::{Deployment, DeploymentCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::api::{CapacityStatus, InferenceDeployment, InferenceDeploymentStatus, ResolvedConfig};
use crate::validate::Verdict;

use super::desired::{resolved, selector_string};
use super::placement::Placement;

pub const COMPATIBLE: &str = "Compatible";
pub const CAPACITY_PLANNED: &str = "CapacityPlanned";
pub const AVAILABLE: &str = "Available";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";
/// Whether the KV pool the pods measured is the one the planner predicted (set once both are
/// known; see [`capacity_tolerance_tokens`]).
pub const KV_CAPACITY_MATCHES_PLAN: &str = "KvCapacityMatchesPlan";
/// vLLM logs the memory it leaves to the KV cache with two decimals ("Available KV cache
/// memory: 36.20 GiB", quoted in vllm#29431): a figure read from that log is known to
/// +-0.005 GiB, the bound below which measured and predicted cannot be told apart.
pub const LOGGED_GIB_ROUNDING_BYTES: f64 = 0.005 * (1u64 << 30) as f64;

/// Whether running worker pods sit on nodes that can no longer run their configuration
/// (True names them; see [`super::placement`]). Also the reason of Degraded=True while they
/// do: the deployment runs, but not where it can (with no Event of its own: each pod gets a
/// [`POD_ON_INCOMPATIBLE_NODE`] Event).
pub const PODS_ON_INCOMPATIBLE_NODES: &str = "PodsOnIncompatibleNodes";
/// Compatible=True: nodes in the cluster can run the spec (the message counts them).
pub const COMPATIBLE_NODES_FOUND: &str = "CompatibleNodesFound";
/// Compatible=True with no node that can run it now: admitted on the GPU products its selector
/// declares (scale from zero); new pods stay Pending until such a node joins.
pub const DECLARED_PRODUCTS_NO_NODES: &str = "DeclaredProductsNoNodes";
/// PodsOnIncompatibleNodes=True; also the reason of the Warning Event for each such pod.
pub const NODE_NO_LONGER_COMPATIBLE: &str = "NodeNoLongerCompatible";
/// The Event reason for one pod on a node that can no longer run it.
pub const POD_ON_INCOMPATIBLE_NODE: &str = "PodOnIncompatibleNode";
/// Pods listed in the PodsOnIncompatibleNodes message; the rest are counted.
const MISPLACED_LISTED: usize = 5;

/// The condition types this controller writes; other writers' conditions are theirs.
pub const OWNED_CONDITIONS: [&str; 6] = [
    COMPATIBLE,
    CAPACITY_PLANNED,
    AVAILABLE,
    PROGRESSING,
    DEGRADED,
    PODS_ON_INCOMPATIBLE_NODES,
];

/// `status` as far as the controller writes it: without other writers' conditions. Its
/// server-side apply leaves those alone (`conditions` is a list-map keyed by type), so only
/// this part decides whether a write is needed.
pub fn owned_part(status: &InferenceDeploymentStatus) -> InferenceDeploymentStatus {
    let mut s = status.clone();
    s.conditions
        .retain(|c| OWNED_CONDITIONS.contains(&c.type_.as_str()));
    s.autoscaling = None;
    s
}

/// KV capacity predicted by the planner for one replica.
#[derive(Clone, Debug, PartialEq)]
pub struct CapacityPrediction {
    pub tokens_per_replica: i64,
    /// Requests of maxModelLen tokens that fit at once.
    pub max_concurrency: f64,
    /// What vLLM would log as "GPU KV cache size" for the same configuration.
    pub vllm_tokens_per_replica: Option<i64>,
}

/// How far measured and predicted tokens may differ and still match: the tokens held by
/// the 0.005 GiB rounding of the logged KV memory (at the predicted bytes per token of one
/// GPU: `predicted / available_kv_bytes`), plus one block (a pool is whole blocks).
pub fn capacity_tolerance_tokens(predicted: i64, available_kv_bytes: u64, block_size: i32) -> i64 {
    let per_byte = if available_kv_bytes == 0 {
        0.0
    } else {
        predicted.max(0) as f64 / available_kv_bytes as f64
    };
    (LOGGED_GIB_ROUNDING_BYTES * per_byte).ceil() as i64 + i64::from(block_size.max(1))
}

/// The `KvCapacityMatchesPlan` condition, when a measurement, a prediction and the memory
/// it was planned from are all known.
fn capacity_match(obj: &InferenceDeployment, seen: &Observed<'_>) -> Option<Cond> {
    let measured = seen.measured_tokens?;
    let predicted = seen.prediction?.tokens_per_replica;
    let basis = seen.verdict?.capacity_basis.as_ref()?;
    let tolerance =
        capacity_tolerance_tokens(predicted, basis.available_kv_bytes, obj.spec.engine.block_size);
    let diff = measured - predicted;
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let bound = format!(
        "+-{tolerance} tokens: the 0.005 GiB rounding of the logged KV memory plus one block of {}",
        obj.spec.engine.block_size
    );
    if diff.abs() <= tolerance {
        return Some(cond(
            KV_CAPACITY_MATCHES_PLAN,
            true,
            "MeasuredMatchesPlan",
            format!("measured {measured} KV-cache tokens per replica, predicted {predicted} ({bound})"),
        ));
    }
    let planned = basis.available_kv_bytes as f64;
    let implied = if predicted > 0 {
        planned * measured as f64 / predicted as f64
    } else {
        0.0
    };
    let cause = if diff < 0 {
        "the pods have less memory for the KV cache than planned: weights larger than model.weightBytes (or weightBytes absent), activation and CUDA-graph memory above kvfleet's reserve, or other processes on the GPU; set model.weightBytes to the checkpoint's bytes (kvfleet divides them over the GPUs) so the plan matches what runs"
    } else {
        "the pods have more memory for the KV cache than planned: model.weightBytes above the real checkpoint, or a smaller activation peak than kvfleet's reserve; set model.weightBytes to the checkpoint's size"
    };
    Some(cond(
        KV_CAPACITY_MATCHES_PLAN,
        false,
        "MeasuredDiffersFromPlan",
        format!(
            "measured {measured} KV-cache tokens per replica, predicted {predicted} on {} ({:.2} GiB planned for the KV cache per GPU, about {:.2} GiB measured): {diff:+} tokens, beyond {bound}; likely cause: {cause}",
            basis.product,
            gib(planned),
            gib(implied)
        ),
    ))
}

/// What the reconcile pass saw, besides the object itself.
#[derive(Clone, Debug, Default)]
pub struct Observed<'a> {
    pub verdict: Option<&'a Verdict>,
    pub prediction: Option<&'a CapacityPrediction>,
    /// The Deployment as the API server returned it (apply response or GET); `None` if absent.
    pub deployment: Option<&'a Deployment>,
    /// Smallest `kvfleet.io/measured-kv-tokens` over ready pods.
    pub measured_tokens: Option<i64>,
    /// Why worker pods exit at start (a preflight exit code and their message), if they do.
    pub preflight_failure: Option<&'a str>,
    /// Whether the bound worker pods' nodes can still run them; `None` when no pods were
    /// listed (no workload, or no replicas).
    pub placement: Option<&'a Placement>,
}

/// An Event to publish: severity, PascalCase reason, human note.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    pub warning: bool,
    pub reason: String,
    pub note: String,
}

struct Cond {
    type_: &'static str,
    ok: bool,
    reason: String,
    message: String,
}

fn cond(type_: &'static str, ok: bool, reason: impl Into<String>, message: impl Into<String>) -> Cond {
    Cond {
        type_,
        ok,
        reason: reason.into(),
        message: message.into(),
    }
}

/// The status for `obj`, keeping `lastTransitionTime` of conditions whose status did not change.
pub fn compute(obj: &InferenceDeployment, seen: &Observed<'_>, now: Timestamp) -> InferenceDeploymentStatus {
    let generation = obj.metadata.generation;
    let name = obj.metadata.name.clone().unwrap_or_default();
    let old = obj.status.clone().unwrap_or_default();
    let compatible = seen.verdict.is_some_and(|v| v.allowed());
    let rollout = seen.deployment.map(Rollout::of);

    let mut conds = vec![
        compatible_condition(obj, seen.verdict),
        capacity_planned_condition(obj, compatible, seen.prediction),
        available_condition(obj, compatible, rollout.as_ref()),
        progressing_condition(obj, compatible, rollout.as_ref()),
        degraded_condition(obj, &old, seen, compatible, rollout.as_ref()),
        placement_condition(obj, seen.placement),
    ];
    if compatible {
        conds.extend(capacity_match(obj, seen));
    }
    let (current, ready, updated) = rollout
        .as_ref()
        .map_or((0, 0, 0), |r| (r.current, r.ready, r.updated));

    InferenceDeploymentStatus {
        observed_generation: generation,
        conditions: stamped(conds, &old, generation, now),
        resolved: resolved_config(obj, seen.verdict, &old),
        capacity: capacity_status(seen, compatible, &old),
        replicas: Some(current),
        ready_replicas: Some(ready),
        updated_replicas: Some(updated),
        selector: Some(selector_string(&name)),
        // status.autoscaling is the autoscaler's (controller::autoscale), written by it alone.
        autoscaling: None,
    }
}

/// The conditions as written: `observedGeneration` of this pass, and `lastTransitionTime`
/// kept from `old` while a condition keeps its status.
fn stamped(
    conds: Vec<Cond>,
    old: &InferenceDeploymentStatus,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let now_time = Time(now);
    conds
        .into_iter()
        .map(|c| {
            let status = if c.ok { "True" } else { "False" }.to_string();
            let last = old
                .conditions
                .iter()
                .find(|o| o.type_ == c.type_ && o.status == status)
                .map(|o| o.last_transition_time.clone())
                .unwrap_or_else(|| now_time.clone());
            Condition {
                type_: c.type_.into(),
                status,
                reason: c.reason,
                message: c.message,
                observed_generation: generation,
                last_transition_time: last,
            }
        })
        .collect()
}

/// What status reads from the Deployment (or a LeaderWorkerSet in its shape).
struct Rollout {
    ready: i32,
    updated: i32,
    current: i32,
    deadline_exceeded: bool,
    replica_failure: Option<DeploymentCondition>,
    /// The Deployment controller has seen the Deployment's current generation.
    current_generation: bool,
}

impl Rollout {
    fn of(d: &Deployment) -> Rollout {
        let st = d.status.clone().unwrap_or_default();
        let cond = |t: &str| {
            st.conditions
                .as_ref()
                .and_then(|cs| cs.iter().find(|c| c.type_ == t).cloned())
        };
        Rollout {
            ready: st.ready_replicas.unwrap_or(0),
            updated: st.updated_replicas.unwrap_or(0),
            current: st.replicas.unwrap_or(0),
            deadline_exceeded: cond("Progressing")
                .is_some_and(|c| c.reason.as_deref() == Some("ProgressDeadlineExceeded")),
            replica_failure: cond("ReplicaFailure").filter(|c| c.status == "True"),
            current_generation: st.observed_generation.is_some()
                && st.observed_generation >= d.metadata.generation,
        }
    }

    fn ready_message(&self, desired: i32) -> String {
        format!("{}/{desired} replicas ready", self.ready)
    }
}

/// The reason of Available and Progressing while no Deployment runs.
fn no_workload_reason(compatible: bool) -> &'static str {
    if compatible {
        "DeploymentPending"
    } else {
        "NotCompatible"
    }
}

fn compatible_condition(obj: &InferenceDeployment, verdict: Option<&Verdict>) -> Cond {
    match verdict {
        Some(v) if v.allowed() => {
            let (dtype, backend) = resolved(&obj.spec, v);
            // Admitted with no node to count: judged on the products the selector declares.
            let declared_only = v.compatible_nodes.is_empty();
            let (reason, mut msg) = if declared_only {
                let declared: Vec<&str> = crate::validate::declared_products(&obj.spec)
                    .iter()
                    .map(|p| p.label)
                    .collect();
                (
                    DECLARED_PRODUCTS_NO_NODES,
                    format!(
                        "no node in the cluster can run it now; it is admitted on the GPU products its selector declares ({}), where it runs with kvCacheDtype {dtype} and attentionBackend {backend}",
                        declared.join(", ")
                    ),
                )
            } else {
                (
                    COMPATIBLE_NODES_FOUND,
                    format!(
                        "{} node(s) can run it with kvCacheDtype {dtype} and attentionBackend {backend}",
                        v.compatible_nodes.len()
                    ),
                )
            };
            let ccs = v
                .resolved
                .as_ref()
                .map(|r| r.compute_capabilities.join(", "))
                .unwrap_or_default();
            if !ccs.is_empty() {
                msg.push_str(&format!(" (compute capability {ccs})"));
            }
            if declared_only {
                msg.push_str("; new pods stay Pending until such a node joins");
            }
            if !v.warnings.is_empty() {
                msg.push_str("; warnings: ");
                msg.push_str(&v.warnings.join("; "));
            }
            cond(COMPATIBLE, true, reason, msg)
        }
        Some(v) => {
            let reason = v.denials.first().map(|d| d.reason.clone()).unwrap_or_default();
            cond(COMPATIBLE, false, reason, denial_message(v))
        }
        None => cond(
            COMPATIBLE,
            false,
            "NotValidated",
            "the object could not be validated",
        ),
    }
}

fn capacity_planned_condition(
    obj: &InferenceDeployment,
    compatible: bool,
    prediction: Option<&CapacityPrediction>,
) -> Cond {
    match (compatible, prediction) {
        (false, _) => cond(
            CAPACITY_PLANNED,
            false,
            "NotCompatible",
            "no capacity plan for a configuration that cannot run",
        ),
        (true, Some(p)) => cond(
            CAPACITY_PLANNED,
            true,
            "CapacityPredicted",
            format!(
                "{} KV-cache tokens per replica; {:.2} requests of maxModelLen {} fit at once",
                p.tokens_per_replica, p.max_concurrency, obj.spec.engine.max_model_len
            ),
        ),
        (true, None) => cond(
            CAPACITY_PLANNED,
            false,
            "PlannerUnavailable",
            "this build has no KV-capacity planner for this model; capacity is reported once workers measure it",
        ),
    }
}

fn available_condition(obj: &InferenceDeployment, compatible: bool, rollout: Option<&Rollout>) -> Cond {
    let desired = obj.spec.replicas;
    let Some(r) = rollout else {
        return cond(
            AVAILABLE,
            false,
            no_workload_reason(compatible),
            "no Deployment runs this spec yet",
        );
    };
    if desired == 0 {
        cond(AVAILABLE, false, "ScaledToZero", "spec.replicas is 0")
    } else if r.ready >= 1 {
        cond(
            AVAILABLE,
            true,
            "MinimumReplicasAvailable",
            r.ready_message(desired),
        )
    } else {
        cond(AVAILABLE, false, "NoReplicasReady", r.ready_message(desired))
    }
}

fn progressing_condition(obj: &InferenceDeployment, compatible: bool, rollout: Option<&Rollout>) -> Cond {
    let desired = obj.spec.replicas;
    let Some(r) = rollout else {
        return cond(
            PROGRESSING,
            false,
            no_workload_reason(compatible),
            "nothing to roll out",
        );
    };
    if r.deadline_exceeded {
        cond(
            PROGRESSING,
            false,
            "ProgressDeadlineExceeded",
            "the rollout stalled; see `kubectl describe deployment` and the pods' events",
        )
    } else if !r.current_generation || r.updated < desired || r.current > desired {
        cond(
            PROGRESSING,
            true,
            "RollingOut",
            format!("{}/{desired} replicas run the current spec", r.updated),
        )
    } else if r.ready < desired {
        cond(PROGRESSING, true, "WaitingForReplicas", r.ready_message(desired))
    } else {
        cond(PROGRESSING, false, "RolloutComplete", r.ready_message(desired))
    }
}

fn degraded_condition(
    obj: &InferenceDeployment,
    old: &InferenceDeploymentStatus,
    seen: &Observed<'_>,
    compatible: bool,
    rollout: Option<&Rollout>,
) -> Cond {
    let Some(r) = rollout else {
        return cond(DEGRADED, false, "NoWorkload", "no pods to be degraded");
    };
    if let Some(p) = seen.preflight_failure.filter(|_| compatible) {
        // The most specific reason first: the worker said why it will not start.
        cond(DEGRADED, true, PREFLIGHT_FAILED, p.to_string())
    } else if r.deadline_exceeded {
        cond(
            DEGRADED,
            true,
            "ProgressDeadlineExceeded",
            "pods did not become ready in time (GPU capacity, image pull or worker preflight)",
        )
    } else if let Some(f) = r.replica_failure.clone() {
        cond(
            DEGRADED,
            true,
            "ReplicaFailure",
            f.message.unwrap_or_else(|| "pods could not be created".into()),
        )
    } else if !compatible {
        match nodes_changed(obj, old, seen.verdict) {
            Some(what) => cond(DEGRADED, true, "NodesChanged", what),
            None => cond(
                DEGRADED,
                true,
                "SpecNotApplied",
                "the running pods keep the last compatible configuration; fix the spec to roll out",
            ),
        }
    } else if let Some(what) = misplaced_message(obj, seen.placement) {
        // After NodesChanged: `generation_was_admitted` reads that reason on the next pass.
        cond(DEGRADED, true, PODS_ON_INCOMPATIBLE_NODES, what)
    } else {
        cond(DEGRADED, false, "AsExpected", r.ready_message(obj.spec.replicas))
    }
}

fn placement_condition(obj: &InferenceDeployment, placement: Option<&Placement>) -> Cond {
    match placement {
        None | Some(Placement::NoPods) => cond(
            PODS_ON_INCOMPATIBLE_NODES,
            false,
            "NoBoundPods",
            "no worker pod is bound to a node",
        ),
        Some(Placement::NotChecked(why)) => cond(PODS_ON_INCOMPATIBLE_NODES, false, "NotChecked", why.clone()),
        Some(Placement::Checked {
            bound,
            kv_cache_dtype,
            attention_backend,
            misplaced,
        }) if misplaced.is_empty() => cond(
            PODS_ON_INCOMPATIBLE_NODES,
            false,
            "AllPodsOnCompatibleNodes",
            format!("{bound} bound worker pod(s) run on nodes that can run kvCacheDtype {kv_cache_dtype} with attentionBackend {attention_backend}"),
        ),
        Some(Placement::Checked { .. }) => cond(
            PODS_ON_INCOMPATIBLE_NODES,
            true,
            NODE_NO_LONGER_COMPATIBLE,
            misplaced_message(obj, placement).unwrap_or_default(),
        ),
    }
}

/// The pods on nodes that can no longer run them: each with its node, what the node cannot run
/// and the fix (the message of PodsOnIncompatibleNodes=True and of Degraded with that reason);
/// `None` when no pod is misplaced or placement was not checked.
fn misplaced_message(obj: &InferenceDeployment, placement: Option<&Placement>) -> Option<String> {
    let Some(Placement::Checked {
        bound,
        kv_cache_dtype,
        attention_backend,
        misplaced,
    }) = placement
    else {
        return None;
    };
    let first = &misplaced.first()?.pod;
    let ns = obj.metadata.namespace.as_deref().unwrap_or_default();
    let listed: Vec<String> = misplaced
        .iter()
        .take(MISPLACED_LISTED)
        .map(|m| format!("pod {} on node {} ({}): {}", m.pod, m.node, m.gpu, m.why))
        .collect();
    let more = match misplaced.len().saturating_sub(MISPLACED_LISTED) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    Some(format!(
        "{} of {bound} bound worker pod(s) run on a node that can no longer run kvCacheDtype {kv_cache_dtype} with attentionBackend {attention_backend} (the node changed after the pod was scheduled): {}{more}. Delete each such pod so that it is rescheduled on a compatible node (e.g. kubectl delete pod {first} -n {ns}), or correct the node's labels if they are wrong",
        misplaced.len(),
        listed.join("; ")
    ))
}

/// Whether the generation of `obj` was admitted before (Compatible=True, or Degraded
/// NodesChanged, at this generation): then what its pods run is this spec's resolution in
/// `old.resolved`, whatever the nodes say now.
pub fn generation_was_admitted(obj: &InferenceDeployment, old: &InferenceDeploymentStatus) -> bool {
    let Some(generation) = obj.metadata.generation else {
        return false;
    };
    find(old, COMPATIBLE).is_some_and(|c| c.status == "True" && c.observed_generation == Some(generation))
        || find(old, DEGRADED)
            .is_some_and(|c| c.reason == "NodesChanged" && c.observed_generation == Some(generation))
}

/// `status.resolved`: the verdict's resolution; an incompatible spec keeps describing what
/// still runs.
fn resolved_config(
    obj: &InferenceDeployment,
    verdict: Option<&Verdict>,
    old: &InferenceDeploymentStatus,
) -> Option<ResolvedConfig> {
    match verdict {
        Some(v) if v.allowed() => Some(v.resolved.clone().unwrap_or_else(|| {
            let (kv_cache_dtype, attention_backend) = resolved(&obj.spec, v);
            ResolvedConfig {
                kv_cache_dtype,
                attention_backend,
                ..ResolvedConfig::default()
            }
        })),
        _ => old.resolved.clone(),
    }
}

/// `status.capacity`: the prediction of a compatible spec and the measurement; an
/// incompatible spec keeps the figures of what still runs.
fn capacity_status(
    seen: &Observed<'_>,
    compatible: bool,
    old: &InferenceDeploymentStatus,
) -> Option<CapacityStatus> {
    let mut c = if compatible {
        CapacityStatus::default()
    } else {
        old.capacity.clone().unwrap_or_default()
    };
    if let Some(p) = seen.prediction.filter(|_| compatible) {
        c.tokens_per_replica = Some(p.tokens_per_replica);
        c.max_concurrency = Some(p.max_concurrency);
        c.vllm_tokens_per_replica = p.vllm_tokens_per_replica;
    }
    c.measured_tokens_per_replica = seen
        .measured_tokens
        .or(c.measured_tokens_per_replica.filter(|_| !compatible));
    (c != CapacityStatus::default()).then_some(c)
}

/// Reason of the Degraded condition while worker pods exit with a preflight code.
pub const PREFLIGHT_FAILED: &str = "PreflightFailed";

/// When the generation that is denied now was admitted before, the spec did not change:
/// the nodes did. Says what they had and what they have now.
fn nodes_changed(
    obj: &InferenceDeployment,
    old: &InferenceDeploymentStatus,
    verdict: Option<&Verdict>,
) -> Option<String> {
    let generation = obj.metadata.generation?;
    if !generation_was_admitted(obj, old) {
        return None;
    }
    let v = verdict?;
    let before = old
        .resolved
        .as_ref()
        .map(|r| {
            let ccs = r.compute_capabilities.join(", ");
            match (r.products.is_empty(), ccs.is_empty()) {
                (false, false) => format!("{} ({ccs})", r.products.join(", ")),
                (false, true) => r.products.join(", "),
                (true, false) => format!("compute capability {ccs}"),
                (true, true) => "the nodes it was admitted on".to_string(),
            }
        })
        .unwrap_or_else(|| "the nodes it was admitted on".to_string());
    let now: Vec<String> = v
        .architectures
        .iter()
        .map(|a| format!("{} ({})", a.products.join(", "), a.compute_capability))
        .collect();
    let now = if now.is_empty() {
        "no schedulable GPU node matches the selectors any more".to_string()
    } else {
        format!("the selected nodes now have {}", now.join(", "))
    };
    Some(format!(
        "the nodes changed, not the spec: generation {generation} was admitted on {before}; {now}, where it cannot run ({}). The running pods keep the last compatible configuration; restore or add such nodes, or change the spec",
        denial_message(v)
    ))
}

fn denial_message(v: &Verdict) -> String {
    v.denials
        .iter()
        .map(|d| format!("{}: {}", d.field, d.message))
        .collect::<Vec<_>>()
        .join("; ")
}

fn find<'a>(s: &'a InferenceDeploymentStatus, t: &str) -> Option<&'a Condition> {
    s.conditions.iter().find(|c| c.type_ == t)
}

/// The Events for the step from `old` to `new` status: every decision an operator would want to see,
/// once (transitions and new generations, not every pass).
pub fn notices(
    old: Option<&InferenceDeploymentStatus>,
    new: &InferenceDeploymentStatus,
    verdict: Option<&Verdict>,
) -> Vec<Notice> {
    let empty = InferenceDeploymentStatus::default();
    let old = old.unwrap_or(&empty);
    let new_generation = old.observed_generation != new.observed_generation;
    let mut out = Vec::new();
    let was = |t: &str| find(old, t).map(|c| c.status.as_str());
    let is = |t: &str| find(new, t);

    if let Some(c) = is(COMPATIBLE) {
        if c.status == "False" {
            let changed = was(COMPATIBLE) != Some("False")
                || find(old, COMPATIBLE).is_some_and(|o| o.reason != c.reason || o.message != c.message);
            if changed || new_generation {
                out.push(Notice {
                    warning: true,
                    reason: c.reason.clone(),
                    note: format!("not applied: {}", c.message),
                });
            }
        } else {
            let no_nodes = c.reason == DECLARED_PRODUCTS_NO_NODES;
            let was_reason = find(old, COMPATIBLE).map(|o| o.reason.as_str());
            if was(COMPATIBLE) == Some("False") {
                out.push(Notice {
                    warning: no_nodes,
                    reason: c.reason.clone(),
                    note: c.message.clone(),
                });
            } else if no_nodes
                && was(COMPATIBLE) == Some("True")
                && was_reason != Some(DECLARED_PRODUCTS_NO_NODES)
            {
                // The nodes that could run it went (relabelled, deleted, cordoned).
                out.push(Notice {
                    warning: true,
                    reason: c.reason.clone(),
                    note: c.message.clone(),
                });
            } else if was_reason == Some(DECLARED_PRODUCTS_NO_NODES) && !no_nodes {
                out.push(Notice {
                    warning: false,
                    reason: c.reason.clone(),
                    note: c.message.clone(),
                });
            }
            if new_generation {
                let r = new.resolved.clone().unwrap_or_default();
                out.push(Notice {
                    warning: false,
                    reason: "SpecApplied".into(),
                    note: format!(
                        "applied generation {}: kvCacheDtype {}, attentionBackend {}",
                        new.observed_generation.unwrap_or_default(),
                        r.kv_cache_dtype,
                        r.attention_backend
                    ),
                });
                if let Some(v) = verdict.filter(|v| !v.warnings.is_empty()) {
                    out.push(Notice {
                        warning: true,
                        reason: "AdmittedWithWarnings".into(),
                        note: v.warnings.join("; "),
                    });
                }
            }
        }
    }
    if let Some(c) = is(AVAILABLE) {
        match (was(AVAILABLE), c.status.as_str()) {
            (Some("True"), "False") => out.push(Notice {
                warning: true,
                reason: "Unavailable".into(),
                note: c.message.clone(),
            }),
            (w, "True") if w != Some("True") => out.push(Notice {
                warning: false,
                reason: "Available".into(),
                note: c.message.clone(),
            }),
            _ => {}
        }
    }
    if let Some(c) = is(DEGRADED) {
        // Pods on incompatible nodes get an Event each (PodOnIncompatibleNode, naming the pod
        // and the fix): a second one for the deployment would say it twice.
        if c.status == "True"
            && c.reason != PODS_ON_INCOMPATIBLE_NODES
            && (was(DEGRADED) != Some("True") || find(old, DEGRADED).is_some_and(|o| o.reason != c.reason))
        {
            out.push(Notice {
                warning: true,
                reason: c.reason.clone(),
                note: c.message.clone(),
            });
        }
    }
    if let Some(c) = is(KV_CAPACITY_MATCHES_PLAN) {
        if c.status == "False" && (was(KV_CAPACITY_MATCHES_PLAN) != Some("False") || new_generation) {
            out.push(Notice {
                warning: true,
                reason: "KvCapacityDiffersFromPlan".into(),
                note: c.message.clone(),
            });
        }
    }
    let measured =
        |s: &InferenceDeploymentStatus| s.capacity.as_ref().and_then(|c| c.measured_tokens_per_replica);
    if let Some(m) = measured(new).filter(|m| Some(*m) != measured(old)) {
        let predicted = new.capacity.as_ref().and_then(|c| c.tokens_per_replica);
        out.push(Notice {
            warning: false,
            reason: "CapacityMeasured".into(),
            note: match predicted {
                Some(p) => format!("workers measured {m} KV-cache tokens per replica (predicted {p})"),
                None => format!("workers measured {m} KV-cache tokens per replica"),
            },
        });
    }
    out
}

#[cfg(test)]
mod tests;

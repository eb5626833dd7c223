//! Observed state -> `status` and the Events worth telling an operator (pure).

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::api::{CapacityStatus, InferenceDeployment, InferenceDeploymentStatus, ResolvedConfig};
use crate::validate::Verdict;

use super::desired::{resolved_strings, selector_string};

pub const COMPATIBLE: &str = "Compatible";
pub const CAPACITY_PLANNED: &str = "CapacityPlanned";
pub const AVAILABLE: &str = "Available";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";

/// KV capacity predicted by the planner for one replica.
#[derive(Clone, Debug, PartialEq)]
pub struct CapacityPrediction {
    pub tokens_per_replica: i64,
    /// Requests of maxModelLen tokens that fit at once.
    pub max_concurrency: f64,
    /// What vLLM would log as "GPU KV cache size" for the same configuration.
    pub vllm_tokens_per_replica: Option<i64>,
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
    let desired = obj.spec.replicas;
    let compatible = seen.verdict.is_some_and(|v| v.allowed());

    let mut conds = Vec::with_capacity(5);
    conds.push(match seen.verdict {
        Some(v) if v.allowed() => {
            let (dtype, backend) = resolved_strings(&obj.spec, v);
            let ccs = v
                .resolved
                .as_ref()
                .map(|r| r.compute_capabilities.join(", "))
                .unwrap_or_default();
            let mut msg = format!(
                "{} node(s) can run it with kvCacheDtype {dtype} and attentionBackend {backend}",
                v.compatible_nodes.len()
            );
            if !ccs.is_empty() {
                msg.push_str(&format!(" (compute capability {ccs})"));
            }
            if !v.warnings.is_empty() {
                msg.push_str("; warnings: ");
                msg.push_str(&v.warnings.join("; "));
            }
            cond(COMPATIBLE, true, "CompatibleNodesFound", msg)
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
    });

    conds.push(match (compatible, seen.prediction) {
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
    });

    let dep_status = seen.deployment.and_then(|d| d.status.clone()).unwrap_or_default();
    let ready = dep_status.ready_replicas.unwrap_or(0);
    let updated = dep_status.updated_replicas.unwrap_or(0);
    let current = dep_status.replicas.unwrap_or(0);
    let dep_cond = |t: &str| {
        dep_status
            .conditions
            .as_ref()
            .and_then(|cs| cs.iter().find(|c| c.type_ == t).cloned())
    };
    let deadline_exceeded =
        dep_cond("Progressing").is_some_and(|c| c.reason.as_deref() == Some("ProgressDeadlineExceeded"));
    let replica_failure = dep_cond("ReplicaFailure").filter(|c| c.status == "True");
    let dep_current_gen = seen.deployment.is_some_and(|d| {
        dep_status.observed_generation.is_some() && dep_status.observed_generation >= d.metadata.generation
    });

    match seen.deployment {
        None => {
            let why = if compatible {
                "DeploymentPending"
            } else {
                "NotCompatible"
            };
            conds.push(cond(AVAILABLE, false, why, "no Deployment runs this spec yet"));
            conds.push(cond(PROGRESSING, false, why, "nothing to roll out"));
            conds.push(cond(DEGRADED, false, "NoWorkload", "no pods to be degraded"));
        }
        Some(_) => {
            let ready_msg = format!("{ready}/{desired} replicas ready");
            conds.push(if desired == 0 {
                cond(AVAILABLE, false, "ScaledToZero", "spec.replicas is 0")
            } else if ready >= 1 {
                cond(AVAILABLE, true, "MinimumReplicasAvailable", ready_msg.clone())
            } else {
                cond(AVAILABLE, false, "NoReplicasReady", ready_msg.clone())
            });
            conds.push(if deadline_exceeded {
                cond(
                    PROGRESSING,
                    false,
                    "ProgressDeadlineExceeded",
                    "the rollout stalled; see `kubectl describe deployment` and the pods' events",
                )
            } else if !dep_current_gen || updated < desired || current > desired {
                cond(
                    PROGRESSING,
                    true,
                    "RollingOut",
                    format!("{updated}/{desired} replicas run the current spec"),
                )
            } else if ready < desired {
                cond(PROGRESSING, true, "WaitingForReplicas", ready_msg.clone())
            } else {
                cond(PROGRESSING, false, "RolloutComplete", ready_msg.clone())
            });
            conds.push(if deadline_exceeded {
                cond(
                    DEGRADED,
                    true,
                    "ProgressDeadlineExceeded",
                    "pods did not become ready in time (GPU capacity, image pull or worker preflight)",
                )
            } else if let Some(f) = replica_failure {
                cond(
                    DEGRADED,
                    true,
                    "ReplicaFailure",
                    f.message.unwrap_or_else(|| "pods could not be created".into()),
                )
            } else if !compatible {
                cond(
                    DEGRADED,
                    true,
                    "SpecNotApplied",
                    "the running pods keep the last compatible configuration; fix the spec to roll out",
                )
            } else {
                cond(DEGRADED, false, "AsExpected", ready_msg)
            });
        }
    }

    let now_time = Time(now);
    let conditions = conds
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
        .collect();

    let resolved = match seen.verdict {
        Some(v) if v.allowed() => Some(v.resolved.clone().unwrap_or_else(|| {
            let (kv_cache_dtype, attention_backend) = resolved_strings(&obj.spec, v);
            ResolvedConfig {
                kv_cache_dtype,
                attention_backend,
                ..ResolvedConfig::default()
            }
        })),
        // An incompatible spec keeps describing what still runs.
        _ => old.resolved.clone(),
    };
    let capacity = {
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
    };

    InferenceDeploymentStatus {
        observed_generation: generation,
        conditions,
        resolved,
        capacity,
        replicas: Some(current),
        ready_replicas: Some(ready),
        updated_replicas: Some(updated),
        selector: Some(selector_string(&name)),
    }
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
            if was(COMPATIBLE) == Some("False") {
                out.push(Notice {
                    warning: false,
                    reason: "CompatibleNodesFound".into(),
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
        if c.status == "True"
            && (was(DEGRADED) != Some("True") || find(old, DEGRADED).is_some_and(|o| o.reason != c.reason))
        {
            out.push(Notice {
                warning: true,
                reason: c.reason.clone(),
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

//! KV-driven autoscaling: how many replicas a deployment needs, from its replicas' KV demand
//! and capacity (pure: the controller feeds it observations and applies its decisions).
//!
//! The algorithm is the HorizontalPodAutoscaler's, with the same field names and meaning
//! (<https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/>), on one
//! metric: the deployment's KV demand over its KV capacity.
//!
//! 1. **Recommendation** = ceil(total demand / (target_demand_ratio x capacity of one
//!    replica)), clamped to [min_replicas, max_replicas]. Total demand is the ready replicas'
//!    demand plus the demand held outside them (the router's queue); capacity is the mean of
//!    the ready replicas' capacity, else a hint (status, the planner). Within `tolerance` of
//!    the target (|ratio / target - 1| <= tolerance) the current count is kept.
//! 2. **Stabilization**: scale-up takes the lowest recommendation of its window, scale-down
//!    the highest of its window (the HPA's `stabilizationWindowSeconds`).
//! 3. **Step limits**: the change per period is bounded by the policies of the direction
//!    (`Pods` or `Percent` per `periodSeconds`, `selectPolicy` Max, Min or Disabled),
//!    counting the changes already made within each policy's period.
//! 4. **Zero**: with min_replicas 0 a deployment goes to 0 only when its demand was 0 for
//!    the whole scale-down window (watched for all of it); from 0, demand held by the router
//!    brings at least one replica at once, without stabilization.
//!
//! Out-of-range counts (a `kubectl scale` above max_replicas or below min_replicas) are
//! brought back at once, as the HPA does. `docs/autoscaling.md` explains the policy.

use std::collections::VecDeque;
use std::fmt;

#[cfg(test)]
mod tests;

/// One ready replica's gauges, in full-layer-equivalent tokens
/// (`kvfleet_kv_demand_tokens`, `kvfleet_kv_capacity_tokens`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub demand_tokens: u64,
    pub capacity_tokens: u64,
}

/// How a step limit counts (the HPA's `HPAScalingPolicyType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    Pods,
    Percent,
}

/// At most `value` pods or percent of change per `period_seconds` (`HPAScalingPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub kind: StepKind,
    pub value: u32,
    pub period_seconds: u32,
}

impl Step {
    /// At most `value` percent of the current pods per `period_seconds`.
    pub const fn percent(value: u32, period_seconds: u32) -> Self {
        Step::new(StepKind::Percent, value, period_seconds)
    }

    /// At most `value` pods per `period_seconds`.
    pub const fn pods(value: u32, period_seconds: u32) -> Self {
        Step::new(StepKind::Pods, value, period_seconds)
    }

    const fn new(kind: StepKind, value: u32, period_seconds: u32) -> Self {
        Step {
            kind,
            value,
            period_seconds,
        }
    }
}

/// Which step limit applies when there are several (`selectPolicy`): Max allows the largest
/// change, Min the smallest, Disabled none in this direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Select {
    Max,
    Min,
    Disabled,
}

/// One direction's behaviour (`HPAScalingRules`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rules {
    pub stabilization_window_seconds: u32,
    pub select: Select,
    pub steps: Vec<Step>,
}

impl Rules {
    /// The HPA's default scale-up: no stabilization; at most double, or add 4 pods, per 15 s,
    /// whichever is more.
    pub fn default_up() -> Self {
        Rules {
            stabilization_window_seconds: 0,
            select: Select::Max,
            steps: vec![Step::percent(100, 15), Step::pods(4, 15)],
        }
    }

    /// The HPA's default scale-down: the highest recommendation of the last 300 s; any
    /// number of pods per 15 s.
    pub fn default_down() -> Self {
        Rules {
            stabilization_window_seconds: 300,
            select: Select::Max,
            steps: vec![Step::percent(100, 15)],
        }
    }

    fn longest_period(&self) -> u32 {
        self.steps.iter().map(|s| s.period_seconds).max().unwrap_or(0)
    }
}

/// What the autoscaler aims for (the CRD's `spec.autoscaling`).
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// Demand over capacity the fleet is sized for (0.8: a fifth of the KV is headroom).
    pub target_demand_ratio: f64,
    /// No change while |ratio / target - 1| <= tolerance (the HPA's 0.1).
    pub tolerance: f64,
    pub scale_up: Rules,
    pub scale_down: Rules,
}

/// A policy that cannot be applied; each message says what to change.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PolicyError {
    #[error("maxReplicas {max} is below minReplicas {min}; raise maxReplicas")]
    MaxBelowMin { min: u32, max: u32 },
    #[error("maxReplicas is 0; set it to at least 1 (minReplicas 0 allows scaling to zero)")]
    MaxZero,
    #[error("targetDemandRatio {0} must be in (0, 1]; 0.8 leaves a fifth of the KV cache as headroom")]
    Target(f64),
    #[error("tolerance {0} must be in [0, 1); the HPA uses 0.1")]
    Tolerance(f64),
    #[error("{direction} policy {index}: value and periodSeconds must be at least 1 and periodSeconds at most 1800 (as the HPA requires)")]
    Step { direction: &'static str, index: usize },
    #[error("{direction}: stabilizationWindowSeconds {seconds} is more than 3600 (the HPA's limit)")]
    Window { direction: &'static str, seconds: u32 },
    #[error("{direction}: selectPolicy {select:?} needs at least one policy; add one or use selectPolicy Disabled")]
    NoSteps { direction: &'static str, select: Select },
}

impl Policy {
    /// A policy between `min` and `max` replicas with the defaults: target 0.8, tolerance 0.1,
    /// the HPA's default behaviour.
    pub fn with_bounds(min_replicas: u32, max_replicas: u32) -> Self {
        Policy {
            min_replicas,
            max_replicas,
            target_demand_ratio: 0.8,
            tolerance: 0.1,
            scale_up: Rules::default_up(),
            scale_down: Rules::default_down(),
        }
    }

    /// Checks the bounds the HPA's API validation enforces, plus the ratio's.
    pub fn check(&self) -> Result<(), PolicyError> {
        if self.max_replicas == 0 {
            return Err(PolicyError::MaxZero);
        }
        if self.max_replicas < self.min_replicas {
            return Err(PolicyError::MaxBelowMin {
                min: self.min_replicas,
                max: self.max_replicas,
            });
        }
        if !(self.target_demand_ratio > 0.0 && self.target_demand_ratio <= 1.0) {
            return Err(PolicyError::Target(self.target_demand_ratio));
        }
        if !(self.tolerance >= 0.0 && self.tolerance < 1.0) {
            return Err(PolicyError::Tolerance(self.tolerance));
        }
        for (direction, rules) in [("scaleUp", &self.scale_up), ("scaleDown", &self.scale_down)] {
            if rules.stabilization_window_seconds > 3600 {
                return Err(PolicyError::Window {
                    direction,
                    seconds: rules.stabilization_window_seconds,
                });
            }
            if rules.steps.is_empty() && rules.select != Select::Disabled {
                return Err(PolicyError::NoSteps {
                    direction,
                    select: rules.select,
                });
            }
            if let Some(index) = rules
                .steps
                .iter()
                .position(|s| s.value == 0 || s.period_seconds == 0 || s.period_seconds > 1800)
            {
                return Err(PolicyError::Step { direction, index });
            }
        }
        Ok(())
    }
}

/// What the controller saw at one reconcile.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    pub now_seconds: f64,
    /// The Deployment's `spec.replicas`.
    pub current_replicas: u32,
    /// Replicas that answered.
    pub ready: Vec<Sample>,
    /// Demand held outside replicas (the router's queue while no replica is ready).
    pub pending_demand_tokens: u64,
    /// One replica's capacity when none is ready (from status or the planner).
    pub capacity_hint_tokens: Option<u64>,
}

/// Why a decision came out as it did; `Display` gives the Event/status reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    ScaleUp,
    ScaleDown,
    Stable,
    ScaleFromZero,
    ScaleToZero,
    LimitedByStep,
    HeldByStabilization,
    AtMaxReplicas,
    AtMinReplicas,
    NoSignal,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::ScaleUp => "ScaleUp",
            Reason::ScaleDown => "ScaleDown",
            Reason::Stable => "Stable",
            Reason::ScaleFromZero => "ScaleFromZero",
            Reason::ScaleToZero => "ScaleToZero",
            Reason::LimitedByStep => "LimitedByStep",
            Reason::HeldByStabilization => "HeldByStabilization",
            Reason::AtMaxReplicas => "AtMaxReplicas",
            Reason::AtMinReplicas => "AtMinReplicas",
            Reason::NoSignal => "NoSignal",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One decision: set the Deployment to `desired`.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Replicas to set now (stabilized and step-limited).
    pub desired: u32,
    /// What the demand alone asks for (clamped to the bounds, tolerance applied).
    pub recommendation: u32,
    /// Total demand over the capacity of `current_replicas` replicas; `None` without a
    /// capacity or with 0 replicas.
    pub demand_ratio: Option<f64>,
    pub reason: Reason,
    pub message: String,
}

/// The recommendation and scale-event history one deployment's decisions depend on.
#[derive(Clone, Debug, Default)]
pub struct Autoscaler {
    /// (time, recommendation), oldest first, as long as the longer window.
    recommendations: VecDeque<(f64, u32)>,
    /// (time, replicas added), as long as the longest scale-up period.
    up_events: VecDeque<(f64, u32)>,
    /// (time, replicas removed), as long as the longest scale-down period.
    down_events: VecDeque<(f64, u32)>,
    /// First observation: a scale-down window is only complete once watched whole.
    first_seen: Option<f64>,
    /// Last observation with demand (or without a signal, which may hide demand).
    last_demand: Option<f64>,
}

// === impl Autoscaler ===

impl Autoscaler {
    /// Decides the replica count for `obs` and records it as applied: call once per
    /// reconcile, in time order, and set the Deployment to `desired`.
    pub fn decide(&mut self, policy: &Policy, obs: &Observation) -> Decision {
        let now = obs.now_seconds;
        let current = obs.current_replicas;
        let (min, max) = (policy.min_replicas, policy.max_replicas.max(policy.min_replicas));
        self.first_seen.get_or_insert(now);
        let total: u64 = obs
            .ready
            .iter()
            .map(|s| s.demand_tokens)
            .fold(obs.pending_demand_tokens, u64::saturating_add);
        let measured: u64 = obs.ready.iter().map(|s| s.capacity_tokens).sum();
        let capacity = if !obs.ready.is_empty() && measured > 0 {
            Some(measured as f64 / obs.ready.len() as f64)
        } else {
            obs.capacity_hint_tokens.filter(|c| *c > 0).map(|c| c as f64)
        };
        if total > 0 || capacity.is_none() || (obs.ready.is_empty() && current > 0) {
            self.last_demand = Some(now);
        }

        // Counts outside the bounds come back at once (the HPA does the same).
        if current > max || (current < min && current > 0) {
            let desired = current.clamp(min, max);
            self.record(policy, now, desired, current);
            let (reason, bound) = if current > max {
                (Reason::AtMaxReplicas, "maxReplicas")
            } else {
                (Reason::AtMinReplicas, "minReplicas")
            };
            return Decision {
                desired,
                recommendation: desired,
                demand_ratio: capacity.map(|c| total as f64 / (f64::from(current) * c)),
                reason,
                message: format!("{current} replicas are outside [{min}, {max}]: set to {bound} {desired}"),
            };
        }

        let Some(capacity) = capacity else {
            // Without a capacity no ratio can be formed: only the floors apply.
            let desired = if current == 0 && total > 0 {
                min.max(1)
            } else {
                current.max(min)
            };
            self.record(policy, now, desired, current);
            let reason = if current == 0 && desired > 0 && total > 0 {
                Reason::ScaleFromZero
            } else if desired != current {
                Reason::AtMinReplicas
            } else {
                Reason::NoSignal
            };
            return Decision {
                desired,
                recommendation: desired,
                demand_ratio: None,
                reason,
                message: format!(
                    "no replica reported a KV capacity and no capacity hint is known ({} tokens pending): keep {desired} replicas",
                    obs.pending_demand_tokens
                ),
            };
        };
        if obs.ready.is_empty() && current > 0 && total == 0 {
            // Replicas exist but none answered: their demand is unknown, never scale down on it.
            self.record(policy, now, current, current);
            return Decision {
                desired: current,
                recommendation: current,
                demand_ratio: None,
                reason: Reason::NoSignal,
                message: format!("none of the {current} replicas reported its KV demand: keep {current}"),
            };
        }

        let per_replica = policy.target_demand_ratio * capacity;
        let wanted = (total as f64 / per_replica).ceil();
        let raw = if wanted >= f64::from(u32::MAX) {
            u32::MAX
        } else {
            wanted as u32
        };
        let demand_ratio = (current > 0).then(|| total as f64 / (f64::from(current) * capacity));
        let within_tolerance =
            demand_ratio.is_some_and(|r| (r / policy.target_demand_ratio - 1.0).abs() <= policy.tolerance);
        let recommendation = if within_tolerance { current } else { raw }.clamp(min, max);

        // Stabilization over the windows, the recommendation of now included.
        self.recommendations.push_back((now, recommendation));
        let up_cutoff = now - f64::from(policy.scale_up.stabilization_window_seconds);
        let down_cutoff = now - f64::from(policy.scale_down.stabilization_window_seconds);
        let (mut up_rec, mut down_rec) = (recommendation, recommendation);
        for &(t, r) in &self.recommendations {
            if t > up_cutoff {
                up_rec = up_rec.min(r);
            }
            if t > down_cutoff {
                down_rec = down_rec.max(r);
            }
        }
        let mut stabilized = current.max(up_rec).min(down_rec);
        let mut zero_held = false;
        if stabilized == 0 && current > 0 {
            let quiet_since = self
                .last_demand
                .unwrap_or(f64::NEG_INFINITY)
                .max(self.first_seen.unwrap_or(now));
            if now - quiet_since < f64::from(policy.scale_down.stabilization_window_seconds) {
                stabilized = 1;
                zero_held = true;
            }
        }

        let from_zero = current == 0 && total > 0;
        let desired = if from_zero {
            // Demand is waiting in the router: one replica at once, more as the steps allow.
            let target = recommendation.max(1);
            let limit = self.up_limit(policy, now, current).max(1);
            target.min(limit).min(max)
        } else if stabilized > current {
            stabilized.min(self.up_limit(policy, now, current))
        } else if stabilized < current {
            stabilized.max(self.down_limit(policy, now, current))
        } else {
            current
        };
        self.record(policy, now, desired, current);

        let reason = if from_zero {
            Reason::ScaleFromZero
        } else if desired > current {
            if desired < stabilized {
                Reason::LimitedByStep
            } else {
                Reason::ScaleUp
            }
        } else if desired < current {
            if desired == 0 {
                Reason::ScaleToZero
            } else if desired > stabilized {
                Reason::LimitedByStep
            } else {
                Reason::ScaleDown
            }
        } else if stabilized != current {
            Reason::LimitedByStep
        } else if recommendation != current || zero_held {
            Reason::HeldByStabilization
        } else if raw > max && current == max {
            Reason::AtMaxReplicas
        } else if raw < min && current == min && total > 0 {
            Reason::AtMinReplicas
        } else {
            Reason::Stable
        };
        let ratio_text = match demand_ratio {
            Some(r) => format!("ratio {r:.2}"),
            None => "no replicas".to_string(),
        };
        let detail = match reason {
            Reason::LimitedByStep => format!("; the step limits allow {desired} of {stabilized} now"),
            Reason::HeldByStabilization if zero_held => format!(
                "; demand must be 0 for the whole {} s scale-down window before scaling to zero",
                policy.scale_down.stabilization_window_seconds
            ),
            Reason::HeldByStabilization => format!(
                "; held by the stabilization windows (lowest recent {up_rec}, highest recent {down_rec})"
            ),
            Reason::AtMaxReplicas => format!("; {raw} wanted, capped at maxReplicas"),
            _ => String::new(),
        };
        Decision {
            desired,
            recommendation,
            demand_ratio,
            reason,
            message: format!(
                "demand {total} tokens, {capacity:.0} tokens per replica, {ratio_text} (target {:.2}): recommend {recommendation}, set {current} -> {desired}{detail}",
                policy.target_demand_ratio
            ),
        }
    }

    /// The most replicas the scale-up policies allow now (`calculateScalingUpLimit`).
    fn up_limit(&self, policy: &Policy, now: f64, current: u32) -> u32 {
        let rules = &policy.scale_up;
        if rules.select == Select::Disabled {
            return current;
        }
        let mut limit: Option<u64> = None;
        for step in &rules.steps {
            let added = changed_within(&self.up_events, now, step.period_seconds);
            let start = u64::from(current).saturating_sub(added);
            let proposed = match step.kind {
                StepKind::Pods => start + u64::from(step.value),
                StepKind::Percent => (start * (100 + u64::from(step.value))).div_ceil(100),
            };
            limit = Some(match (limit, rules.select) {
                (None, _) => proposed,
                (Some(l), Select::Min) => l.min(proposed),
                (Some(l), _) => l.max(proposed),
            });
        }
        let limit = limit.unwrap_or(u64::from(current)).max(u64::from(current));
        u32::try_from(limit).unwrap_or(u32::MAX)
    }

    /// The fewest replicas the scale-down policies allow now (`calculateScalingDownLimit`).
    fn down_limit(&self, policy: &Policy, now: f64, current: u32) -> u32 {
        let rules = &policy.scale_down;
        if rules.select == Select::Disabled {
            return current;
        }
        let mut limit: Option<u64> = None;
        for step in &rules.steps {
            let removed = changed_within(&self.down_events, now, step.period_seconds);
            let start = u64::from(current) + removed;
            let proposed = match step.kind {
                StepKind::Pods => start.saturating_sub(u64::from(step.value)),
                // Truncated, as the HPA does.
                StepKind::Percent => start * u64::from(100u32.saturating_sub(step.value)) / 100,
            };
            limit = Some(match (limit, rules.select) {
                (None, _) => proposed,
                (Some(l), Select::Min) => l.max(proposed),
                (Some(l), _) => l.min(proposed),
            });
        }
        let limit = limit.unwrap_or(u64::from(current)).min(u64::from(current));
        u32::try_from(limit).unwrap_or(u32::MAX)
    }

    /// Records a decision as applied and forgets what no window or period can see any more.
    fn record(&mut self, policy: &Policy, now: f64, desired: u32, current: u32) {
        if desired > current {
            self.up_events.push_back((now, desired - current));
        } else if desired < current {
            self.down_events.push_back((now, current - desired));
        }
        let keep = f64::from(
            policy
                .scale_up
                .stabilization_window_seconds
                .max(policy.scale_down.stabilization_window_seconds),
        );
        while self
            .recommendations
            .front()
            .is_some_and(|&(t, _)| t <= now - keep)
        {
            self.recommendations.pop_front();
        }
        let up = f64::from(policy.scale_up.longest_period());
        while self.up_events.front().is_some_and(|&(t, _)| t <= now - up) {
            self.up_events.pop_front();
        }
        let down = f64::from(policy.scale_down.longest_period());
        while self.down_events.front().is_some_and(|&(t, _)| t <= now - down) {
            self.down_events.pop_front();
        }
    }
}

/// Replicas changed by the events of the last `period` seconds (`getReplicasChangePerPeriod`).
fn changed_within(events: &VecDeque<(f64, u32)>, now: f64, period: u32) -> u64 {
    let cutoff = now - f64::from(period);
    events
        .iter()
        .filter(|(t, _)| *t > cutoff)
        .map(|(_, n)| u64::from(*n))
        .sum()
}

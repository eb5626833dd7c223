//! The bounds of a spec's numbers, sizes, counts and lengths, checked before anything is
//! planned or allocated, and the denial for a planner that cannot compute a capacity.
//!
//! The bounds are the CRD schema's own (`minimum`, `maximum`, `maxItems`, `maxProperties`,
//! `maxLength`; [`crate::api::limits`]), read from it by [`crate::api::bounded`]: one source
//! of truth for the API server, the webhook's reader and these checks, which are for what
//! did not pass through the API server's schema check (a namespace the webhook skips,
//! `kvfleet check`, an AdmissionReview sent directly). Only what a schema cannot say is
//! written out here: tensorParallelSize x pipelineParallelSize, and NetworkPolicy peers the
//! API server would refuse.

use super::{denial, Denial};
use crate::api::bounded::{self, Breach, Excess, Shape, Walk};
use crate::api::limits::*;
use crate::api::InferenceDeploymentSpec;
use crate::plan::PlanError;
use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Reason of every bound denial (events, conditions, metrics).
pub const REASON: &str = "ValueOutOfBounds";
/// Reason of a capacity the planner cannot compute.
pub const PLANNER_REASON: &str = "CapacityNotComputable";

/// Denials for every value of `spec` outside its bound (empty when all are within).
pub fn check(spec: &InferenceDeploymentSpec) -> Vec<Denial> {
    let mut denials: Vec<Denial> = schema_excess(spec).iter().map(excess_denial).collect();
    let e = &spec.engine;
    let gpus = i64::from(e.tensor_parallel_size) * i64::from(e.pipeline_parallel_size);
    if denials.is_empty() && gpus > i64::from(GPUS_PER_REPLICA_MAX) {
        denials.push(denial(
            "spec.engine.pipelineParallelSize",
            REASON,
            format!(
                "tensorParallelSize {} x pipelineParallelSize {} is {gpus} GPUs per replica, above the maximum {GPUS_PER_REPLICA_MAX}; lower one of them",
                e.tensor_parallel_size, e.pipeline_parallel_size
            ),
        ));
    }
    if let Some(net) = &spec.network {
        denials.extend(network_peers(&net.allow_from));
    }
    denials
}

/// Every value of `spec` outside the schema's bounds, in the order of the spec's fields.
fn schema_excess(spec: &InferenceDeploymentSpec) -> Vec<Excess> {
    // Serialising a spec cannot fail (string keys, finite numbers or null). Bytes rather than
    // a `Value`, whose maps would list the fields in alphabetical order.
    let Ok(json) = serde_json::to_vec(spec) else {
        return Vec::new();
    };
    bounded::read::<Walk, _>(
        &mut serde_json::Deserializer::from_slice(&json),
        Shape::spec(),
        "spec",
    )
    .map(|(_, excess)| excess)
    .unwrap_or_default()
}

/// The denial of one value outside its bound, naming the field, the bound and the fix.
pub fn excess_denial(e: &Excess) -> Denial {
    let field = e.field.as_str();
    let message = match e.breach {
        Breach::Entries { found, max } => {
            let what = if field.ends_with(".allowFrom") {
                "peers"
            } else {
                "entries"
            };
            format!("{field} has {found} {what}, more than the maximum {max}; remove some")
        }
        Breach::Length { found, max } => {
            format!("{field} is {found} characters long, more than the maximum {max}; shorten it")
        }
        Breach::AboveMaximum { ref value, max } => format!(
            "{field} {value} is above the maximum {}; {}",
            number(max),
            hint(field).unwrap_or("lower it")
        ),
        Breach::BelowMinimum {
            ref value,
            min,
            exclusive,
        } => format!(
            "{field} {value} is {} {}; {}",
            if exclusive {
                "not above"
            } else {
                "below the minimum"
            },
            number(min),
            hint(field).unwrap_or("raise it")
        ),
    };
    denial(field, REASON, message)
}

fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e18 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// What to set a numeric field to, where more can be said than "lower it" / "raise it".
fn hint(field: &str) -> Option<&'static str> {
    let name = field.rsplit('.').next().unwrap_or(field);
    Some(match name {
        "replicas" if field == "spec.replicas" => {
            "set it to the pods that serve the model (0 scales to zero)"
        }
        "replicas" => "a few router pods serve a large fleet",
        "maxModelLen" => "set it to the context length the model supports",
        "maxNumSeqs" => "set it to the sequences one replica runs at once (vLLM's default is 256)",
        "maxNumBatchedTokens" => "set it to the tokens one step schedules (8192 is the default)",
        "tensorParallelSize" => "set it to the GPUs one replica shards the model over",
        "pipelineParallelSize" => {
            "set it to the pipeline stages of one replica (1 for none; often its nodes)"
        }
        "count" => "set it to the GPUs of one replica",
        "gpuMemoryUtilization" => "0.85 is a safe value",
        "draftLayers" => "set it to the draft model's num_hidden_layers",
        "port" => "use a port between 1 and 65535",
        _ if field.starts_with("spec.model.geometry.") => "copy it from the model's config.json",
        _ => return None,
    })
}

/// Reason of a `network.allowFrom` peer the API server would refuse in a NetworkPolicy.
pub const PEER_REASON: &str = "InvalidNetworkPeer";

/// `network.allowFrom`: each peer one the NetworkPolicy API accepts, so an admitted spec
/// never fails at apply time (the counts are the schema's; a list over its bound is not
/// judged peer by peer).
fn network_peers(peers: &[NetworkPolicyPeer]) -> Vec<Denial> {
    let mut denials = Vec::new();
    if peers.len() > ALLOW_FROM_MAX {
        return denials;
    }
    for (i, p) in peers.iter().enumerate() {
        let at = format!("spec.network.allowFrom[{i}]");
        let mut deny = |message: String| denials.push(denial(&at, PEER_REASON, message));
        let selectors = p.pod_selector.is_some() || p.namespace_selector.is_some();
        match (&p.ip_block, selectors) {
            (None, false) => deny(
                "a peer needs a podSelector and/or namespaceSelector, or an ipBlock; `{}` would match nothing".into(),
            ),
            (Some(_), true) => deny(
                "an ipBlock cannot be combined with podSelector or namespaceSelector in one peer; list them as two peers".into(),
            ),
            (Some(ip), false) => match parse_cidr(&ip.cidr) {
                None => deny(format!(
                    "ipBlock.cidr {:?} is not a CIDR; write it as 10.0.0.0/8 or fd00::/8",
                    truncated(&ip.cidr)
                )),
                Some(net) => {
                    let except = ip.except.as_deref().unwrap_or_default();
                    if let Some(e) = except
                        .iter()
                        .find(|e| !parse_cidr(e).is_some_and(|x| net.strictly_contains(&x)))
                    {
                        deny(format!(
                            "ipBlock.except {:?} is not a CIDR strictly inside {}; remove it or fix it",
                            truncated(e),
                            ip.cidr
                        ));
                    }
                }
            },
            (None, true) => {
                for (which, sel) in [
                    ("podSelector", &p.pod_selector),
                    ("namespaceSelector", &p.namespace_selector),
                ] {
                    if let Some(message) = sel.as_ref().and_then(selector_problem) {
                        deny(format!("{which}: {message}"));
                    }
                }
            }
        }
    }
    denials
}

fn truncated(s: &str) -> &str {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// What the API server would refuse in a label selector (matchLabels and matchExpressions
/// together are bounded here: the schema bounds each alone).
fn selector_problem(sel: &LabelSelector) -> Option<String> {
    let labels = sel.match_labels.as_ref().map_or(0, |m| m.len());
    let exprs = sel.match_expressions.as_deref().unwrap_or_default();
    if labels + exprs.len() > PEER_TERMS_MAX {
        return Some(format!(
            "{} matchLabels and matchExpressions, more than the maximum {PEER_TERMS_MAX}; remove some",
            labels + exprs.len()
        ));
    }
    for e in exprs {
        let values = e.values.as_deref().unwrap_or_default();
        match (e.operator.as_str(), values.is_empty()) {
            ("In" | "NotIn", false) | ("Exists" | "DoesNotExist", true) => {}
            ("In" | "NotIn", true) => {
                return Some(format!(
                    "operator {} on key {:?} needs values",
                    e.operator,
                    truncated(&e.key)
                ))
            }
            ("Exists" | "DoesNotExist", false) => {
                return Some(format!(
                    "operator {} on key {:?} takes no values; remove them",
                    e.operator,
                    truncated(&e.key)
                ))
            }
            (op, _) => {
                return Some(format!(
                    "operator {:?} is not one of In, NotIn, Exists, DoesNotExist",
                    truncated(op)
                ))
            }
        }
    }
    None
}

/// An IPv4 or IPv6 network in CIDR notation, as bits in a u128 (IPv4 mapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cidr {
    v6: bool,
    addr: u128,
    prefix: u32,
}

impl Cidr {
    /// `other` lies inside this network and is smaller than it.
    fn strictly_contains(&self, other: &Cidr) -> bool {
        if self.v6 != other.v6 || other.prefix <= self.prefix {
            return false;
        }
        let width = if self.v6 { 128 } else { 32 };
        let shift = width - self.prefix;
        let mask = if shift >= 128 { 0 } else { u128::MAX << shift };
        other.addr & mask == self.addr & mask
    }
}

fn parse_cidr(s: &str) -> Option<Cidr> {
    let (ip, prefix) = s.split_once('/')?;
    let prefix: u32 = prefix.parse().ok()?;
    match ip.parse::<std::net::IpAddr>().ok()? {
        std::net::IpAddr::V4(a) if prefix <= 32 => Some(Cidr {
            v6: false,
            addr: u128::from(u32::from(a)),
            prefix,
        }),
        std::net::IpAddr::V6(a) if prefix <= 128 => Some(Cidr {
            v6: true,
            addr: u128::from(a),
            prefix,
        }),
        _ => None,
    }
}

/// The denial for a capacity the planner cannot compute: the spec cannot be served as
/// written, so it is denied (a warning would admit what the worker then fails on).
pub fn planner_denial(e: &PlanError) -> Denial {
    let field = match e {
        PlanError::InvalidQuantity { .. } => "spec.model.weightBytes",
        PlanError::TensorParallel { .. } => "spec.engine.tensorParallelSize",
        PlanError::UnsupportedDtype { .. } => "spec.engine.kvCacheDtype",
        _ => "spec.model.geometry",
    };
    denial(
        field,
        PLANNER_REASON,
        format!("the KV capacity cannot be computed: {e}; fix {field} so that it describes a model and engine that can run"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> InferenceDeploymentSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    const GEOMETRY: &str = "{layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128";

    #[test]
    fn a_spec_within_every_bound_has_no_bound_denial() {
        let s = spec(&format!(
            "model: {{name: m, geometry: {GEOMETRY}, draftLayers: 1024}}}}\nengine: {{maxModelLen: 33554432, tensorParallelSize: 64}}"
        ));
        assert_eq!(check(&s), vec![]);
    }

    #[test]
    fn each_value_over_its_bound_is_denied_naming_field_and_bound() {
        let cases = [
            ("model: {name: m, geometry: {layers: 1025, queryHeads: 32, kvHeads: 8, headDim: 128}}", "spec.model.geometry.layers", "1024"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, draftLayers: 2147483647}}", "spec.model.geometry.draftLayers", "1024"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, slidingWindow: 2147483647}}", "spec.model.geometry.slidingWindow", "33554432"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, kvLoraRank: 2147483647, qkRopeHeadDim: 64}}", "spec.model.geometry.kvLoraRank", "8192"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128, vocabSize: 2147483647}}", "spec.model.geometry.vocabSize", "4194304"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\nengine: {tensorParallelSize: 2147483647}", "spec.engine.tensorParallelSize", "64"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\nengine: {maxModelLen: 9223372036854775807}", "spec.engine.maxModelLen", "33554432"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\nengine: {maxNumSeqs: 2147483647}", "spec.engine.maxNumSeqs", "65536"),
            ("model: {name: m, geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}}\ngpu: {count: 100000}", "spec.gpu.count", "64"),
        ];
        for (yaml, field, bound) in cases {
            let d = check(&spec(yaml));
            assert_eq!(d.len(), 1, "{yaml}: {d:?}");
            assert_eq!(d[0].field, field);
            assert_eq!(d[0].reason, REASON);
            assert!(
                d[0].message.contains(field) && d[0].message.contains(bound),
                "{}",
                d[0].message
            );
        }
    }

    const MODEL: &str = "model: {name: m, geometry: {layers: 2, queryHeads: 2, kvHeads: 2, headDim: 64}}";

    fn with_peers(peers: &str) -> Vec<Denial> {
        check(&spec(&format!("{MODEL}\nnetwork: {{allowFrom: {peers}}}")))
    }

    #[test]
    fn network_peers_that_a_network_policy_accepts_pass() {
        assert_eq!(with_peers("[]"), vec![]);
        assert_eq!(
            with_peers(
                "[{podSelector: {matchLabels: {app: gateway}}},
                  {namespaceSelector: {matchExpressions: [{key: team, operator: In, values: [a, b]}]},
                   podSelector: {matchExpressions: [{key: tier, operator: Exists}]}},
                  {ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16, 10.2.3.4/32]}},
                  {ipBlock: {cidr: 'fd00::/8', except: ['fd00:1::/32']}}]"
            ),
            vec![]
        );
    }

    #[test]
    fn network_peers_the_api_server_would_refuse_are_denied_naming_the_peer() {
        let cases = [
            ("[{}]", "[0]", "needs a podSelector"),
            (
                "[{podSelector: {}}, {ipBlock: {cidr: 10.0.0.0/8}, podSelector: {}}]",
                "[1]",
                "cannot be combined",
            ),
            ("[{ipBlock: {cidr: 10.0.0.0}}]", "[0]", "is not a CIDR"),
            ("[{ipBlock: {cidr: 10.0.0.0/33}}]", "[0]", "is not a CIDR"),
            (
                "[{ipBlock: {cidr: 10.0.0.0/8, except: [192.168.0.0/16]}}]",
                "[0]",
                "strictly inside",
            ),
            (
                "[{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/8]}}]",
                "[0]",
                "strictly inside",
            ),
            (
                "[{ipBlock: {cidr: 10.0.0.0/8, except: ['fd00::/8']}}]",
                "[0]",
                "strictly inside",
            ),
            (
                "[{podSelector: {matchExpressions: [{key: a, operator: In}]}}]",
                "[0]",
                "needs values",
            ),
            (
                "[{namespaceSelector: {matchExpressions: [{key: a, operator: Exists, values: [x]}]}}]",
                "[0]",
                "takes no values",
            ),
            (
                "[{podSelector: {matchExpressions: [{key: a, operator: Gt, values: ['1']}]}}]",
                "[0]",
                "is not one of",
            ),
        ];
        for (peers, at, says) in cases {
            let d = with_peers(peers);
            assert_eq!(d.len(), 1, "{peers}: {d:?}");
            assert_eq!(d[0].field, format!("spec.network.allowFrom{at}"), "{peers}");
            assert_eq!(d[0].reason, PEER_REASON);
            assert!(d[0].message.contains(says), "{peers}: {}", d[0].message);
        }
    }

    #[test]
    fn network_lists_over_their_bounds_are_denied_with_the_bound() {
        let peer = "{podSelector: {matchLabels: {app: a}}}";
        let many = format!("[{}]", vec![peer; ALLOW_FROM_MAX + 1].join(", "));
        let d = with_peers(&many);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].field, "spec.network.allowFrom");
        assert_eq!(d[0].reason, REASON);
        assert!(
            d[0].message.contains(&ALLOW_FROM_MAX.to_string()),
            "{}",
            d[0].message
        );
        assert_eq!(
            with_peers(&format!("[{}]", vec![peer; ALLOW_FROM_MAX].join(", "))),
            vec![]
        );

        let labels: Vec<String> = (0..=PEER_TERMS_MAX).map(|i| format!("k{i}: v")).collect();
        let d = with_peers(&format!(
            "[{{podSelector: {{matchLabels: {{{}}}}}}}]",
            labels.join(", ")
        ));
        assert!(
            d[0].message.contains(&format!("maximum {PEER_TERMS_MAX}")),
            "{d:?}"
        );
        let except: Vec<String> = (0..=PEER_TERMS_MAX).map(|i| format!("10.0.{i}.0/24")).collect();
        let d = with_peers(&format!(
            "[{{ipBlock: {{cidr: 10.0.0.0/8, except: [{}]}}}}]",
            except.join(", ")
        ));
        assert!(
            d[0].message.contains(&format!("maximum {PEER_TERMS_MAX}")),
            "{d:?}"
        );
        let values: Vec<String> = (0..=PEER_TERMS_MAX).map(|i| format!("v{i}")).collect();
        let d = with_peers(&format!(
            "[{{podSelector: {{matchExpressions: [{{key: k, operator: In, values: [{}]}}]}}}}]",
            values.join(", ")
        ));
        assert!(
            d[0].message.contains(&format!("maximum {PEER_TERMS_MAX}")),
            "{d:?}"
        );
    }

    #[test]
    fn long_lists_and_strings_are_denied() {
        let mut s = spec("model: {name: m, geometry: {layers: 2, queryHeads: 2, kvHeads: 2, headDim: 64}}");
        s.engine.extra_args = vec!["--x".into(); EXTRA_ARGS_MAX + 1];
        s.engine.image = Some("i".repeat(IMAGE_LEN_MAX + 1));
        s.model.name = "n".repeat(254);
        let fields: Vec<String> = check(&s).into_iter().map(|d| d.field).collect();
        assert_eq!(
            fields,
            ["spec.model.name", "spec.engine.image", "spec.engine.extraArgs"]
        );
    }
}

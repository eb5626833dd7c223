//! Upper bounds of a spec's sizes, counts and lengths ([`crate::api::limits`]), checked
//! before anything is planned or allocated, and the denial for a planner that cannot
//! compute a capacity.
//!
//! The CRD schema holds the same bounds; these checks are for what did not pass through
//! it (a namespace the webhook skips, `kvfleet check`, an AdmissionReview sent directly).

use super::{denial, Denial};
use crate::api::limits::*;
use crate::api::{GpuSpec, InferenceDeploymentSpec, ModelGeometry, PodOverrides};
use crate::plan::PlanError;
use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Reason of every bound denial (events, conditions, metrics).
pub const REASON: &str = "ValueOutOfBounds";
/// Reason of a capacity the planner cannot compute.
pub const PLANNER_REASON: &str = "CapacityNotComputable";

/// Bytes of a `weightBytes` quantity string (`16Gi`, `17179869184`, `1.5e10`).
const QUANTITY_LEN_MAX: usize = 64;
/// Bytes of `model.name` (the CRD's maxLength).
const MODEL_NAME_LEN_MAX: usize = 253;

struct Bounds {
    denials: Vec<Denial>,
}

impl Bounds {
    fn int(&mut self, field: &str, value: Option<i64>, max: i64, hint: &str) {
        if let Some(v) = value.filter(|v| *v > max) {
            self.denials.push(denial(
                field,
                REASON,
                format!("{field} {v} is above the maximum {max}; {hint}"),
            ));
        }
    }

    fn count(&mut self, field: &str, n: usize, max: usize, what: &str) {
        if n > max {
            self.denials.push(denial(
                field,
                REASON,
                format!("{field} has {n} {what}, more than the maximum {max}; remove some"),
            ));
        }
    }

    fn len(&mut self, field: &str, s: Option<&str>, max: usize) {
        if let Some(n) = s.map(str::len).filter(|n| *n > max) {
            self.denials.push(denial(
                field,
                REASON,
                format!("{field} is {n} bytes long, more than the maximum {max}; shorten it"),
            ));
        }
    }
}

/// Denials for every value of `spec` above its bound (empty when all are within).
pub fn check(spec: &InferenceDeploymentSpec) -> Vec<Denial> {
    let mut b = Bounds { denials: Vec::new() };
    model_bounds(&mut b, spec);
    engine_bounds(&mut b, spec);
    if let Some(gpu) = &spec.gpu {
        gpu_bounds(&mut b, gpu);
    }
    if let Some(pod) = &spec.pod {
        pod_bounds(&mut b, pod);
    }
    if let Some(net) = &spec.network {
        network_peers(&mut b, &net.allow_from);
    }
    if let Some(routing) = &spec.routing {
        routing_bounds(&mut b, routing);
    }
    b.denials
}

/// `routing`: router replicas and the endpoint picker's name.
fn routing_bounds(b: &mut Bounds, routing: &crate::api::RoutingSpec) {
    if let Some(r) = &routing.router {
        b.int(
            "spec.routing.router.replicas",
            Some(i64::from(r.replicas)),
            i64::from(ROUTER_REPLICAS_MAX),
            "a few router pods serve a large fleet",
        );
    }
    if let Some(p) = &routing.endpoint_picker {
        b.len("spec.routing.endpointPicker.name", Some(&p.name), NAME_LEN_MAX);
        b.len("spec.routing.endpointPicker.kind", p.kind.as_deref(), 63);
        b.len(
            "spec.routing.endpointPicker.group",
            p.group.as_deref(),
            NAME_LEN_MAX,
        );
    }
}

/// `model`: its name, geometry, ConfigMap reference and weights.
fn model_bounds(b: &mut Bounds, spec: &InferenceDeploymentSpec) {
    b.len("spec.model.name", Some(&spec.model.name), MODEL_NAME_LEN_MAX);
    if let Some(g) = &spec.model.geometry {
        geometry_bounds(b, g);
    }
    if let Some(cfg) = &spec.model.config {
        b.len(
            "spec.model.config.configMapRef.name",
            Some(&cfg.config_map_ref.name),
            NAME_LEN_MAX,
        );
        b.len(
            "spec.model.config.configMapRef.key",
            Some(&cfg.config_map_ref.key),
            NAME_LEN_MAX,
        );
    }
    b.len(
        "spec.model.weightBytes",
        spec.model.weight_bytes.as_ref().map(|q| q.0.as_str()),
        QUANTITY_LEN_MAX,
    );
    if let Some(w) = &spec.model.weights {
        b.len("spec.model.weights.pvcName", w.pvc_name.as_deref(), NAME_LEN_MAX);
        b.len("spec.model.weights.path", w.path.as_deref(), PATH_LEN_MAX);
    }
}

/// `model.geometry`: every size as the model's config.json could have it.
fn geometry_bounds(b: &mut Bounds, g: &ModelGeometry) {
    let copy = "copy it from the model's config.json";
    let f = |name: &str| format!("spec.model.geometry.{name}");
    let i = |v: i32| Some(i64::from(v));
    let o = |v: Option<i32>| v.map(i64::from);
    b.int(&f("layers"), i(g.layers), LAYERS_MAX.into(), copy);
    b.int(&f("queryHeads"), i(g.query_heads), HEADS_MAX.into(), copy);
    b.int(&f("kvHeads"), i(g.kv_heads), HEADS_MAX.into(), copy);
    b.int(&f("headDim"), i(g.head_dim), HEAD_DIM_MAX.into(), copy);
    b.int(
        &f("slidingWindow"),
        o(g.sliding_window),
        SLIDING_WINDOW_MAX.into(),
        copy,
    );
    b.int(
        &f("globalHeadDim"),
        o(g.global_head_dim),
        HEAD_DIM_MAX.into(),
        copy,
    );
    b.int(&f("globalKvHeads"), o(g.global_kv_heads), HEADS_MAX.into(), copy);
    b.int(&f("kvLoraRank"), o(g.kv_lora_rank), KV_LORA_RANK_MAX.into(), copy);
    b.int(
        &f("qkRopeHeadDim"),
        o(g.qk_rope_head_dim),
        QK_ROPE_HEAD_DIM_MAX.into(),
        copy,
    );
    b.int(
        &f("draftLayers"),
        o(g.draft_layers),
        DRAFT_LAYERS_MAX.into(),
        "set it to the draft model's num_hidden_layers",
    );
    b.int(&f("hiddenSize"), o(g.hidden_size), HIDDEN_SIZE_MAX.into(), copy);
    b.int(&f("vocabSize"), o(g.vocab_size), VOCAB_SIZE_MAX.into(), copy);
    if let Some(types) = &g.layer_types {
        b.count(&f("layerTypes"), types.len(), LAYERS_MAX as usize, "entries");
    }
}

/// `engine`: lengths, parallelism (and the GPUs of a replica it makes) and extraArgs.
fn engine_bounds(b: &mut Bounds, spec: &InferenceDeploymentSpec) {
    let e = &spec.engine;
    b.len("spec.engine.image", e.image.as_deref(), IMAGE_LEN_MAX);
    b.int(
        "spec.engine.maxModelLen",
        Some(e.max_model_len),
        MAX_MODEL_LEN_MAX,
        "lower it to the context length the model supports",
    );
    b.int(
        "spec.engine.maxNumSeqs",
        Some(e.max_num_seqs.into()),
        MAX_NUM_SEQS_MAX.into(),
        "lower it (vLLM's default is 256)",
    );
    b.int(
        "spec.engine.maxNumBatchedTokens",
        Some(e.max_num_batched_tokens.into()),
        MAX_NUM_BATCHED_TOKENS_MAX.into(),
        "lower it (8192 is the default)",
    );
    b.int(
        "spec.engine.tensorParallelSize",
        Some(e.tensor_parallel_size.into()),
        GPUS_PER_REPLICA_MAX.into(),
        "set it to the GPUs one replica shards the model over",
    );
    b.int(
        "spec.engine.pipelineParallelSize",
        Some(e.pipeline_parallel_size.into()),
        PIPELINE_STAGES_MAX.into(),
        "set it to the pipeline stages of one replica (often its nodes)",
    );
    let gpus = i64::from(e.tensor_parallel_size) * i64::from(e.pipeline_parallel_size);
    if b.denials.is_empty() && gpus > i64::from(GPUS_PER_REPLICA_MAX) {
        b.denials.push(denial(
            "spec.engine.pipelineParallelSize",
            REASON,
            format!(
                "tensorParallelSize {} x pipelineParallelSize {} is {gpus} GPUs per replica, above the maximum {GPUS_PER_REPLICA_MAX}; lower one of them",
                e.tensor_parallel_size, e.pipeline_parallel_size
            ),
        ));
    }
    b.count(
        "spec.engine.extraArgs",
        e.extra_args.len(),
        EXTRA_ARGS_MAX,
        "entries",
    );
    if let Some((i, a)) = e
        .extra_args
        .iter()
        .enumerate()
        .find(|(_, a)| a.len() > EXTRA_ARG_LEN_MAX)
    {
        b.len(&format!("spec.engine.extraArgs[{i}]"), Some(a), EXTRA_ARG_LEN_MAX);
    }
}

/// `gpu`: count and selector.
fn gpu_bounds(b: &mut Bounds, gpu: &GpuSpec) {
    b.int(
        "spec.gpu.count",
        gpu.count.map(i64::from),
        GPUS_PER_REPLICA_MAX.into(),
        "set it to the GPUs of one replica",
    );
    if let Some(sel) = &gpu.selector {
        b.count(
            "spec.gpu.selector.products",
            sel.products.len(),
            PRODUCTS_MAX,
            "entries",
        );
        if let Some((i, p)) = sel
            .products
            .iter()
            .enumerate()
            .find(|(_, p)| p.len() > NAME_LEN_MAX)
        {
            b.len(&format!("spec.gpu.selector.products[{i}]"), Some(p), NAME_LEN_MAX);
        }
        b.len(
            "spec.gpu.selector.minComputeCapability",
            sel.min_compute_capability.as_deref(),
            5,
        );
    }
}

/// `pod`: the sizes of its maps and lists.
fn pod_bounds(b: &mut Bounds, pod: &PodOverrides) {
    b.count(
        "spec.pod.nodeSelector",
        pod.node_selector.len(),
        NODE_SELECTOR_MAX,
        "entries",
    );
    b.count(
        "spec.pod.tolerations",
        pod.tolerations.len(),
        TOLERATIONS_MAX,
        "entries",
    );
    b.count("spec.pod.env", pod.env.len(), ENV_MAX, "entries");
    b.count(
        "spec.pod.annotations",
        pod.annotations.len(),
        ANNOTATIONS_MAX,
        "entries",
    );
}

/// Reason of a `network.allowFrom` peer the API server would refuse in a NetworkPolicy.
pub const PEER_REASON: &str = "InvalidNetworkPeer";

/// `network.allowFrom`: bounded, and each peer one the NetworkPolicy API accepts, so an
/// admitted spec never fails at apply time.
fn network_peers(b: &mut Bounds, peers: &[NetworkPolicyPeer]) {
    let field = "spec.network.allowFrom";
    b.count(field, peers.len(), ALLOW_FROM_MAX, "peers");
    if peers.len() > ALLOW_FROM_MAX {
        return;
    }
    for (i, p) in peers.iter().enumerate() {
        let at = format!("{field}[{i}]");
        let mut deny = |message: String| {
            b.denials
                .push(denial(&at, PEER_REASON, format!("{at}: {message}")))
        };
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
                    if except.len() > PEER_TERMS_MAX {
                        deny(format!(
                            "ipBlock.except has {} entries, more than the maximum {PEER_TERMS_MAX}; remove some",
                            except.len()
                        ));
                    } else if let Some(e) = except
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
}

fn truncated(s: &str) -> &str {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// What the API server would refuse in a label selector, bounded first.
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
        if values.len() > PEER_TERMS_MAX {
            return Some(format!(
                "matchExpressions key {:?} has {} values, more than the maximum {PEER_TERMS_MAX}; remove some",
                truncated(&e.key),
                values.len()
            ));
        }
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

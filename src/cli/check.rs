//! `kvfleet check`: validate InferenceDeployment files offline against GPU nodes.
//!
//! Exit codes: 0 every deployment admitted, 1 at least one denied, 2 unusable input (the
//! message names the file, the document and the field).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

use crate::api::{InferenceDeploymentSpec, GROUP, KIND, VERSION};
use crate::compat::rules::{self, Rule, Severity, KVFLEET_RULES, PRIORITIES, VLLM_RULES};
use crate::compat::{products, Runtime};
use crate::validate::{self, ClusterFacts, NodeFacts, ValidateError, Verdict};

/// Check InferenceDeployments against the GPU nodes they could land on.
#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// YAML file with one or more InferenceDeployments (`-` reads stdin).
    #[arg(short = 'f', long = "filename")]
    pub file: Option<PathBuf>,
    /// Nodes as printed by `kubectl get nodes -o yaml` (a List, a NodeList or Node documents).
    #[arg(long)]
    pub nodes: Option<PathBuf>,
    /// A node with one GPU product label, e.g. NVIDIA-H100-80GB-HBM3 (repeatable). It gets
    /// the product's GFD labels and 8 GPUs. Without --nodes and --gpu, the products of each
    /// spec's gpu.selector.products stand for the nodes.
    #[arg(long = "gpu")]
    pub gpus: Vec<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
    /// Print the rule tables of both runtimes with their sources, and exit.
    #[arg(long)]
    pub explain: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

/// Input `kvfleet check` cannot use; each message names the file and what to fix.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("no input: pass -f FILE with InferenceDeployments (or --explain)")]
    NoFile,
    #[error("cannot read {file}: {source}")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: document {document}: not valid YAML: {source}")]
    Yaml {
        file: String,
        document: usize,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("{file}: document {document}: field {field}: {message}")]
    Field {
        file: String,
        document: usize,
        field: String,
        message: String,
    },
    #[error("{file}: document {document}: {message}")]
    Document {
        file: String,
        document: usize,
        message: String,
    },
    #[error(
        "{file}: no InferenceDeployment found; write one with apiVersion {GROUP}/{VERSION} and kind {KIND}"
    )]
    Empty { file: String },
    #[error("--gpu: {0}")]
    Gpu(#[from] ValidateError),
    #[error("{name} ({file}): no nodes to check against: pass --nodes NODES.yaml (kubectl get nodes -o yaml) or --gpu PRODUCT, or set gpu.selector.products")]
    NoNodes { name: String, file: String },
}

/// One InferenceDeployment read from a file.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedDeployment {
    pub name: String,
    /// 1-based document number in the file (items of a List count as documents).
    pub document: usize,
    pub spec: InferenceDeploymentSpec,
}

/// The verdict for one deployment, as printed.
#[derive(Debug, Serialize)]
pub struct Report {
    pub name: String,
    pub file: String,
    pub document: usize,
    pub allowed: bool,
    pub verdict: Verdict,
}

pub fn run(args: &CheckArgs) -> ExitCode {
    if args.explain {
        match args.output {
            OutputFormat::Text => print!("{}", explain_text()),
            OutputFormat::Json => println!("{}", explain_json()),
        }
        return ExitCode::SUCCESS;
    }
    match check(args) {
        Ok(reports) => {
            match args.output {
                OutputFormat::Text => print!("{}", render_text(&reports)),
                OutputFormat::Json => match serde_json::to_string_pretty(&reports) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("error: cannot encode the verdicts as JSON: {e}");
                        return ExitCode::from(2);
                    }
                },
            }
            if reports.iter().all(|r| r.allowed) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("error: {}", crate::error_chain(&e));
            ExitCode::from(2)
        }
    }
}

/// Reads the inputs and validates every deployment.
pub fn check(args: &CheckArgs) -> Result<Vec<Report>, CheckError> {
    let path = args.file.as_deref().ok_or(CheckError::NoFile)?;
    let (file, text) = read_input(path)?;
    let deployments = parse_deployments(&text, &file)?;
    let mut nodes = Vec::new();
    if let Some(p) = &args.nodes {
        let (nfile, ntext) = read_input(p)?;
        nodes.extend(parse_nodes(&ntext, &nfile)?);
    }
    let gpus: Vec<&str> = args.gpus.iter().map(String::as_str).collect();
    nodes.extend(validate::synthetic_cluster(&gpus)?.nodes);
    let given = args.nodes.is_some() || !args.gpus.is_empty();

    let mut reports = Vec::new();
    for d in deployments {
        let facts = if given {
            ClusterFacts {
                nodes: nodes.clone(),
                ..ClusterFacts::default()
            }
        } else {
            let selected: Vec<&str> = d
                .spec
                .gpu
                .as_ref()
                .and_then(|g| g.selector.as_ref())
                .map(|s| s.products.iter().map(String::as_str).collect())
                .unwrap_or_default();
            if selected.is_empty() {
                return Err(CheckError::NoNodes { name: d.name, file });
            }
            validate::synthetic_cluster(&selected)?
        };
        let verdict = validate::validate(&d.spec, &facts);
        reports.push(Report {
            name: d.name,
            file: file.clone(),
            document: d.document,
            allowed: verdict.allowed(),
            verdict,
        });
    }
    Ok(reports)
}

fn read_input(path: &Path) -> Result<(String, String), CheckError> {
    let file = path.display().to_string();
    let mut text = String::new();
    let result = if file == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::read_to_string(path).map(|t| text = t)
    };
    result.map_err(|source| CheckError::Read {
        file: file.clone(),
        source,
    })?;
    Ok((file, text))
}

/// The non-empty YAML documents of a file.
fn documents(text: &str, file: &str) -> Result<Vec<serde_yaml::Value>, CheckError> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc).map_err(|source| CheckError::Yaml {
            file: file.to_string(),
            document: i + 1,
            source,
        })?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

fn str_field<'a>(v: &'a serde_yaml::Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(|k| k.as_str())
}

/// Deserializes `value` as `T`, reporting the failing field as a path under `prefix`.
fn typed<T: serde::de::DeserializeOwned>(
    value: serde_yaml::Value,
    file: &str,
    document: usize,
    prefix: &str,
) -> Result<T, CheckError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let field = if inner == "." || inner.is_empty() {
            prefix.to_string()
        } else if inner.starts_with('[') {
            format!("{prefix}{inner}")
        } else {
            format!("{prefix}.{inner}")
        };
        CheckError::Field {
            file: file.to_string(),
            document,
            field,
            message: e.into_inner().to_string(),
        }
    })
}

/// Reads InferenceDeployments: one per document, or the items of a `List`.
pub fn parse_deployments(text: &str, file: &str) -> Result<Vec<ParsedDeployment>, CheckError> {
    let mut out = Vec::new();
    let mut document = 0;
    for value in documents(text, file)? {
        let items = match str_field(&value, "kind") {
            Some("List") | Some("InferenceDeploymentList") => match value.get("items") {
                Some(serde_yaml::Value::Sequence(items)) => items.clone(),
                _ => Vec::new(),
            },
            _ => vec![value],
        };
        for item in items {
            document += 1;
            out.push(parse_deployment(item, file, document)?);
        }
    }
    if out.is_empty() {
        return Err(CheckError::Empty {
            file: file.to_string(),
        });
    }
    Ok(out)
}

fn parse_deployment(
    value: serde_yaml::Value,
    file: &str,
    document: usize,
) -> Result<ParsedDeployment, CheckError> {
    let doc_err = |message: String| CheckError::Document {
        file: file.to_string(),
        document,
        message,
    };
    if !value.is_mapping() {
        return Err(doc_err(format!("expected an {KIND} object (a YAML mapping)")));
    }
    let api_version = format!("{GROUP}/{VERSION}");
    match (str_field(&value, "apiVersion"), str_field(&value, "kind")) {
        (Some(a), Some(KIND)) if a == api_version => {}
        (a, k) => {
            return Err(doc_err(format!(
                "apiVersion {} kind {} is not an {KIND}; write apiVersion: {api_version} and kind: {KIND}",
                a.unwrap_or("(missing)"),
                k.unwrap_or("(missing)")
            )))
        }
    }
    let name = value
        .get("metadata")
        .and_then(|m| str_field(m, "name"))
        .map(str::to_string)
        .ok_or_else(|| CheckError::Field {
            file: file.to_string(),
            document,
            field: "metadata.name".into(),
            message: "missing; every InferenceDeployment needs a name".into(),
        })?;
    let spec_value = value.get("spec").cloned().ok_or_else(|| CheckError::Field {
        file: file.to_string(),
        document,
        field: "spec".into(),
        message: "missing; an InferenceDeployment needs spec.model at least".into(),
    })?;
    let spec = typed::<InferenceDeploymentSpec>(spec_value, file, document, "spec")?;
    Ok(ParsedDeployment { name, document, spec })
}

/// Reads nodes from `kubectl get nodes -o yaml` output: a `List`/`NodeList`, or `Node`
/// documents.
pub fn parse_nodes(text: &str, file: &str) -> Result<Vec<NodeFacts>, CheckError> {
    let mut out = Vec::new();
    for (i, value) in documents(text, file)?.into_iter().enumerate() {
        let document = i + 1;
        match str_field(&value, "kind") {
            Some("List") | Some("NodeList") => {
                let items = match value.get("items") {
                    Some(serde_yaml::Value::Sequence(items)) => items.clone(),
                    None | Some(serde_yaml::Value::Null) => Vec::new(),
                    Some(_) => {
                        return Err(CheckError::Field {
                            file: file.to_string(),
                            document,
                            field: "items".into(),
                            message: "expected a list of Node objects".into(),
                        })
                    }
                };
                for (j, item) in items.into_iter().enumerate() {
                    if let Some(kind) = str_field(&item, "kind") {
                        if kind != "Node" {
                            return Err(CheckError::Field {
                                file: file.to_string(),
                                document,
                                field: format!("items[{j}].kind"),
                                message: format!("{kind} is not a Node; pass `kubectl get nodes -o yaml`"),
                            });
                        }
                    }
                    let node: Node = typed(item, file, document, &format!("items[{j}]"))?;
                    out.push(node_facts(&node, out.len()));
                }
            }
            Some("Node") => {
                let node: Node = typed(value, file, document, "").map_err(strip_leading_dot)?;
                out.push(node_facts(&node, out.len()));
            }
            other => {
                return Err(CheckError::Document {
                    file: file.to_string(),
                    document,
                    message: format!(
                        "kind {} is not a Node, NodeList or List; pass `kubectl get nodes -o yaml`",
                        other.unwrap_or("(missing)")
                    ),
                })
            }
        }
    }
    Ok(out)
}

fn strip_leading_dot(e: CheckError) -> CheckError {
    match e {
        CheckError::Field {
            file,
            document,
            field,
            message,
        } => CheckError::Field {
            file,
            document,
            field: field.trim_start_matches('.').to_string(),
            message,
        },
        other => other,
    }
}

fn node_facts(node: &Node, index: usize) -> NodeFacts {
    let mut facts = NodeFacts::from_node(node);
    if facts.name.is_empty() {
        facts.name = format!("node-{index}");
    }
    facts
}

// === output ===

fn render_affinity(v: &Verdict) -> Option<String> {
    let terms = v
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?;
    let rendered: Vec<String> = terms
        .node_selector_terms
        .iter()
        .map(|t| {
            t.match_expressions
                .iter()
                .flatten()
                .map(|e| {
                    format!(
                        "{} {} [{}]",
                        e.key,
                        e.operator,
                        e.values.clone().unwrap_or_default().join(", ")
                    )
                })
                .collect::<Vec<_>>()
                .join(" and ")
        })
        .collect();
    Some(rendered.join("\n    or "))
}

/// The human-readable verdicts.
pub fn render_text(reports: &[Report]) -> String {
    let mut out = String::new();
    for r in reports {
        let v = &r.verdict;
        let state = if r.allowed { "admitted" } else { "denied" };
        out.push_str(&format!(
            "{} ({}, document {}): {state}\n",
            r.name, r.file, r.document
        ));
        for d in &v.denials {
            out.push_str(&format!("  denied: {} [{}]: {}\n", d.field, d.reason, d.message));
        }
        if let Some(res) = &v.resolved {
            out.push_str(&format!(
                "  resolved: kvCacheDtype {}, attentionBackend {} on compute capability {}",
                res.kv_cache_dtype,
                res.attention_backend,
                res.compute_capabilities.join(", ")
            ));
            if !res.products.is_empty() {
                out.push_str(&format!(" ({})", res.products.join(", ")));
            }
            out.push('\n');
        }
        if r.allowed {
            out.push_str(&format!(
                "  nodes: {} can run it: {}\n",
                v.compatible_nodes.len(),
                v.compatible_nodes.join(", ")
            ));
        }
        if let (Some(c), Some(b)) = (&v.capacity, &v.capacity_basis) {
            out.push_str(&format!(
                "  capacity: {} KV-cache tokens per replica, {:.2} requests of maxModelLen at once (vLLM would log {} tokens); {} GiB of KV per GPU on {}\n",
                c.tokens_per_replica.unwrap_or_default(),
                c.max_concurrency.unwrap_or_default(),
                b.vllm_tokens,
                crate::plan::memory::fmt_gib(b.available_kv_bytes),
                b.product
            ));
            for n in &b.notes {
                out.push_str(&format!("    note: {n}\n"));
            }
        }
        if let Some(a) = render_affinity(v) {
            out.push_str(&format!("  node affinity: {a}\n"));
        }
        for w in &v.warnings {
            out.push_str(&format!("  warning: {w}\n"));
        }
    }
    out
}

fn backends(rule: &Rule) -> String {
    if rule.backends.is_empty() {
        "any backend".to_string()
    } else {
        rule.backends
            .iter()
            .map(|b| b.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `kvfleet check --explain`: both rule sets, `auto` orders and the spec checks, with sources.
pub fn explain_text() -> String {
    let mut out = String::new();
    for (runtime, title, set) in [
        (Runtime::Vllm, "vLLM runtime (facts from vLLM, FlashInfer and FlashAttention; COMPAT.md)", VLLM_RULES),
        (
            Runtime::Kvfleet,
            "kvfleet runtime (what our own kernels implement; software dequant runs fp8 and nvfp4 KV on sm_80+, including combinations vLLM refuses such as fp8_e4m3 on sm_86)",
            KVFLEET_RULES,
        ),
    ] {
        out.push_str(&format!("== {title}\n\nauto attention backend, best first:\n"));
        for p in PRIORITIES.iter().filter(|p| p.runtime == runtime) {
            let archs = match p.family {
                Some(f) => format!("family {f}"),
                None => "other architectures".to_string(),
            };
            let mla = if p.mla { ", MLA models" } else { "" };
            let order: Vec<&str> = p.order.iter().map(|b| b.as_str()).collect();
            out.push_str(&format!("  {archs}{mla}: {}  [{}]\n", order.join(" > "), p.source));
        }
        out.push_str("auto KV dtype: the model dtype (float16 below compute capability 8.0)\n\nrules:\n");
        for r in set {
            let sev = match r.severity {
                Severity::Deny => "deny",
                Severity::Warn => "warn",
            };
            out.push_str(&format!(
                "  {} ({sev}; {}; {})\n      {}\n      source: {}\n",
                r.id,
                backends(r),
                r.field,
                r.summary,
                r.source
            ));
        }
        out.push('\n');
    }
    out.push_str(&format!(
        "== spec checks (both runtimes)\n  tensorParallelSize must divide the query heads, and KV heads and tensorParallelSize must divide one another  [vllm config/model.py verify_with_parallel_config; QKVParallelLinear]\n  gpu.count >= tensorParallelSize, and a selected node must have that many allocatable nvidia.com/gpu\n  gpuMemoryUtilization above the default {} warns: the sampler warm-up can OOM at 0.90  [seed report]\n  runtime kvfleet: tensorParallelSize 1 and model.geometry inline (its engine runs one GPU per replica and does not read model.config)\n  nodes without GFD labels are never assumed compatible  [gfd]\n\n",
        validate::GPU_MEMORY_UTILIZATION_WARN
    ));
    out.push_str(
        "== GPU products (GFD nvidia.com/gpu.product -> compute capability, memory as GFD labels it)\n",
    );
    for p in products::PRODUCTS {
        out.push_str(&format!(
            "  {:<56} {:>5}  {:>7} MiB  {}\n",
            p.label,
            p.cc.to_string(),
            validate::product_memory_mib(p.label).unwrap_or(p.memory_mib),
            p.name
        ));
    }
    out
}

#[derive(Serialize)]
struct RuleJson {
    id: &'static str,
    runtime: Runtime,
    severity: Severity,
    backends: Vec<&'static str>,
    field: &'static str,
    reason: &'static str,
    summary: &'static str,
    source: &'static str,
}

fn explain_json() -> String {
    let rules: Vec<RuleJson> = rules::rules(Runtime::Vllm)
        .iter()
        .chain(rules::rules(Runtime::Kvfleet))
        .map(|r| RuleJson {
            id: r.id,
            runtime: r.runtime,
            severity: r.severity,
            backends: r.backends.iter().map(|b| b.as_str()).collect(),
            field: r.field,
            reason: r.reason,
            summary: r.summary,
            source: r.source,
        })
        .collect();
    serde_json::json!({ "rules": rules }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GOOD: &str = "apiVersion: kvfleet.io/v1alpha1
kind: InferenceDeployment
metadata: {name: a}
spec:
  model: {name: m, geometry: {layers: 1, queryHeads: 8, kvHeads: 8, headDim: 128}}
";

    #[test]
    fn unknown_dtype_names_the_field() {
        let text = format!("{GOOD}  engine: {{kvCacheDtype: fp9}}\n");
        let err = parse_deployments(&text, "x.yaml").unwrap_err().to_string();
        assert!(
            err.starts_with("x.yaml: document 1: field spec.engine.kvCacheDtype: unknown variant `fp9`"),
            "{err}"
        );
    }

    #[test]
    fn missing_field_names_its_parent() {
        let text = "apiVersion: kvfleet.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: a}\nspec:\n  model: {geometry: {layers: 1, queryHeads: 8, kvHeads: 8, headDim: 128}}\n";
        let err = parse_deployments(text, "x.yaml").unwrap_err().to_string();
        assert!(err.contains("field spec.model: missing field `name`"), "{err}");
    }

    #[test]
    fn second_document_errors_carry_its_number() {
        let text = format!("{GOOD}---\n{GOOD}  replicas: many\n");
        let err = parse_deployments(&text, "x.yaml").unwrap_err().to_string();
        assert!(err.contains("document 2: field spec.replicas"), "{err}");
    }

    #[test]
    fn lists_and_multi_documents_are_read() {
        let text = format!("{GOOD}---\n---\n{GOOD}");
        assert_eq!(parse_deployments(&text, "x").unwrap().len(), 2);
        let list = format!(
            "apiVersion: v1\nkind: List\nitems:\n{}",
            GOOD.lines()
                .enumerate()
                .map(|(i, l)| if i == 0 {
                    format!("- {l}\n")
                } else {
                    format!("  {l}\n")
                })
                .collect::<String>()
        );
        assert_eq!(parse_deployments(&list, "x").unwrap().len(), 1);
    }

    #[test]
    fn other_kinds_and_empty_files_are_unusable() {
        assert!(parse_deployments("apiVersion: v1\nkind: Pod\n", "x")
            .unwrap_err()
            .to_string()
            .contains("kind Pod is not an InferenceDeployment"));
        assert!(matches!(
            parse_deployments("", "x"),
            Err(CheckError::Empty { .. })
        ));
        assert!(matches!(
            parse_deployments("a: [", "x"),
            Err(CheckError::Yaml { .. })
        ));
    }

    #[test]
    fn node_lists_and_node_documents_are_read() {
        let node = "apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\n  labels: {nvidia.com/gpu.product: NVIDIA-L4}\nstatus:\n  allocatable: {nvidia.com/gpu: \"2\"}\n";
        let nodes = parse_nodes(&format!("{node}---\n{node}"), "n").unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].allocatable_gpus, Some(2));
        let list = "apiVersion: v1\nkind: NodeList\nitems:\n- metadata: {name: a}\n- metadata: {name: b, labels: {x: y}}\n";
        assert_eq!(parse_nodes(list, "n").unwrap().len(), 2);
        let bad = "apiVersion: v1\nkind: List\nitems:\n- metadata: {name: a, labels: [1]}\n";
        let err = parse_nodes(bad, "n").unwrap_err().to_string();
        assert!(err.contains("field items[0].metadata.labels"), "{err}");
    }

    #[test]
    fn explain_lists_every_rule_with_its_source() {
        let text = explain_text();
        for r in VLLM_RULES.iter().chain(KVFLEET_RULES) {
            assert!(text.contains(r.id) && text.contains(r.source), "{}", r.id);
        }
        assert!(text.contains("NVIDIA-GB10"));
        let json: serde_json::Value = serde_json::from_str(&explain_json()).unwrap();
        assert_eq!(
            json["rules"].as_array().unwrap().len(),
            VLLM_RULES.len() + KVFLEET_RULES.len()
        );
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics_the_parsers(text in "\\PC{0,200}") {
            let _ = parse_deployments(&text, "x");
            let _ = parse_nodes(&text, "x");
        }

        #[test]
        fn mutated_specs_parse_or_fail_cleanly(
            key in prop::sample::select(vec!["replicas", "engine", "model", "gpu", "pod", "bogus"]),
            value in prop::sample::select(vec!["1", "-3", "x", "[]", "{}", "{kvCacheDtype: fp9}", "{name: q}", "null", "{products: 3}"]),
        ) {
            let text = format!("{GOOD}  {key}: {value}\n");
            match parse_deployments(&text, "x") {
                Ok(d) => prop_assert_eq!(d.len(), 1),
                Err(e) => prop_assert!(e.to_string().starts_with("x: document"), "{}", e),
            }
        }
    }
}

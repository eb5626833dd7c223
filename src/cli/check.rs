//! `kvfleet check`: validate InferenceDeployment files offline against GPU nodes.
//!
//! Exit codes: 0 every deployment admitted, 1 at least one denied, 2 unusable input (the
//! message names the file, the document and the field).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use k8s_openapi::api::core::v1::Node;
use serde::Serialize;
use serde_json::Value;

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
    // The parser's message is part of this one (it names the line and column), not a
    // `source`: `error_chain` would print it twice.
    #[error("{file}: document {document}: not valid YAML: {error}")]
    Yaml {
        file: String,
        document: usize,
        error: Box<serde_saphyr::Error>,
    },
    #[error("{file}: larger than {limit} bytes, the most `kvfleet check` reads from one input; split it into smaller files (one per deployment, or nodes in batches)")]
    TooLarge { file: String, limit: u64 },
    #[error("{file}: document {document}{at}: nested deeper than {limit} levels of mappings and sequences, the most `kvfleet check` reads; an InferenceDeployment or a Node is nested about 10 deep, so this is not one")]
    TooDeep {
        file: String,
        document: usize,
        /// ", line L column C" where the parser knows it.
        at: String,
        limit: usize,
    },
    #[error("{file}: document {document}{at}: {what}, beyond what `kvfleet check` reads from one input; split the file")]
    OverBudget {
        file: String,
        document: usize,
        at: String,
        what: String,
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
    let read_err = |source| CheckError::Read {
        file: file.clone(),
        source,
    };
    let mut text = String::new();
    // One byte past the limit tells a file at the limit from a larger one, without reading
    // (or holding) more of it.
    if file == "-" {
        std::io::stdin()
            .take(MAX_INPUT_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(read_err)?;
    } else {
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_INPUT_BYTES + 1).read_to_string(&mut text))
            .map_err(read_err)?;
    }
    check_size(&text, &file, MAX_INPUT_BYTES)?;
    Ok((file, text))
}

// === YAML ===

/// The most bytes `check` reads from one input (a file or stdin): `kubectl get nodes -o
/// yaml` prints some 5 to 15 KiB per node (most of it the image list), so 16 MiB holds a
/// thousand nodes or more; the parser is linear, and this also bounds the memory of the
/// documents it builds.
pub const MAX_INPUT_BYTES: u64 = 16 << 20;
/// The deepest nesting of mappings and sequences `check` reads: an InferenceDeployment
/// is at most 8 deep, a Node (with `managedFields`) about 12.
pub const MAX_DEPTH: usize = 64;
/// YAML nodes (scalars, mappings, sequences) in one input: one per 16 bytes of the size
/// limit (a Node as kubectl prints it averages 30 to 40 bytes per YAML node), so that short
/// flow items (`[a,a,...]`, 2 bytes each) cannot build documents many times larger in
/// memory than the text.
pub const MAX_YAML_NODES: usize = (MAX_INPUT_BYTES / 16) as usize;

/// What `check` reads of one input: [`Limits::CHECK`] (tests use smaller ones).
#[derive(Clone, Copy, Debug)]
struct Limits {
    bytes: u64,
    depth: usize,
    nodes: usize,
}

impl Limits {
    const CHECK: Limits = Limits {
        bytes: MAX_INPUT_BYTES,
        depth: MAX_DEPTH,
        nodes: MAX_YAML_NODES,
    };

    /// Every node is one event, plus the end of each collection and of the document.
    fn events(&self) -> usize {
        2 * self.nodes + 2
    }
}

fn check_size(text: &str, file: &str, limit: u64) -> Result<(), CheckError> {
    if text.len() as u64 > limit {
        return Err(CheckError::TooLarge {
            file: file.to_string(),
            limit,
        });
    }
    Ok(())
}

fn yaml_options(limits: Limits) -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_depth = limits.depth;
    // The parser's own cap on flow nesting stays above the depth budget, so that deep flow
    // collections (`{a: {a: ...`) meet the same limit and message as deep blocks.
    budget.flow_nesting_limit = limits.depth + 1;
    budget.max_nodes = limits.nodes;
    budget.max_events = limits.events();
    budget.max_reader_input_bytes = Some(usize::try_from(limits.bytes).unwrap_or(usize::MAX));
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    // Scalars as YAML 1.2's core schema reads them (as serde_yaml did before): `y`, `on`,
    // `0755` and `1_000` stay strings, e.g. as label values.
    options.strict_booleans = true;
    options.leading_zero_numbers_as_strings = true;
    options.underscored_numbers_as_strings = true;
    // The message is one line with the line and column; the file and document are ours.
    options.with_snippet = false;
    options
}

fn yaml_error(file: &str, document: usize, limits: Limits, error: serde_saphyr::Error) -> CheckError {
    let inner = error.without_snippet();
    let at = inner
        .location()
        .filter(|l| l.line() > 0)
        .map(|l| format!(", line {} column {}", l.line(), l.column()))
        .unwrap_or_default();
    let file = file.to_string();
    match inner {
        serde_saphyr::Error::Budget {
            breach: serde_saphyr::budget::BudgetBreach::Depth { .. },
            ..
        } => CheckError::TooDeep {
            file,
            document,
            at,
            limit: limits.depth,
        },
        // The scanner runs ahead of the events: an unclosed run of flow collections meets
        // its nesting cap (MAX_DEPTH + 1) before the depth budget sees the event.
        serde_saphyr::Error::ExternalMessage { source, .. } if flow_nesting_exceeded(source) => {
            CheckError::TooDeep {
                file,
                document,
                at,
                limit: limits.depth,
            }
        }
        serde_saphyr::Error::IOError { cause } if cause.kind() == std::io::ErrorKind::FileTooLarge => {
            CheckError::TooLarge {
                file,
                limit: limits.bytes,
            }
        }
        serde_saphyr::Error::Budget { breach, .. } => CheckError::OverBudget {
            file,
            document,
            at,
            what: budget_breach(breach, limits),
        },
        _ => CheckError::Yaml {
            file,
            document,
            error: Box::new(error),
        },
    }
}

fn flow_nesting_exceeded(source: &serde_saphyr::ExternalMessageSource) -> bool {
    matches!(
        source,
        serde_saphyr::ExternalMessageSource::Parser(e)
            if matches!(e.kind(), serde_saphyr::granit_parser::ErrorKind::RecursionLimitExceeded)
    )
}

fn budget_breach(breach: &serde_saphyr::budget::BudgetBreach, limits: Limits) -> String {
    use serde_saphyr::budget::BudgetBreach as B;
    match breach {
        B::Nodes { .. } => format!("more than {} YAML nodes", limits.nodes),
        B::Events { .. } => format!("more than {} YAML parser events", limits.events()),
        other => format!("the YAML parser's budget is exceeded ({other:?})"),
    }
}

/// The non-empty YAML documents of a file, as JSON values (what the API server stores):
/// parsed in time linear in the text, within [`MAX_INPUT_BYTES`], [`MAX_DEPTH`] and
/// [`MAX_YAML_NODES`].
fn documents(text: &str, file: &str) -> Result<Vec<Value>, CheckError> {
    documents_within(text, file, Limits::CHECK)
}

fn documents_within(text: &str, file: &str, limits: Limits) -> Result<Vec<Value>, CheckError> {
    check_size(text, file, limits.bytes)?;
    let mut reader = text.as_bytes();
    let mut out = Vec::new();
    for doc in serde_saphyr::read_with_options::<_, Value>(&mut reader, yaml_options(limits)) {
        match doc {
            Ok(Value::Null) => {}
            Ok(value) => out.push(value),
            Err(e) => return Err(yaml_error(file, out.len() + 1, limits, e)),
        }
    }
    Ok(out)
}

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(|k| k.as_str())
}

/// Deserializes `value` as `T`, reporting the failing field as a path under `prefix`.
fn typed<T: serde::de::DeserializeOwned>(
    value: Value,
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
                Some(Value::Array(items)) => items.clone(),
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

fn parse_deployment(value: Value, file: &str, document: usize) -> Result<ParsedDeployment, CheckError> {
    let doc_err = |message: String| CheckError::Document {
        file: file.to_string(),
        document,
        message,
    };
    if !value.is_object() {
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
                    Some(Value::Array(items)) => items.clone(),
                    None | Some(Value::Null) => Vec::new(),
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
        // YAML 1.2 scalars: these label values are strings, not a boolean and numbers.
        let list = "apiVersion: v1\nkind: NodeList\nitems:\n- metadata: {name: a, labels: {a: y, b: on, c: '1', d: 0755, e: 1_0}}\n";
        let labels = &parse_nodes(list, "n").unwrap()[0].labels;
        assert_eq!(
            [
                &labels["a"],
                &labels["b"],
                &labels["c"],
                &labels["d"],
                &labels["e"]
            ],
            ["y", "on", "1", "0755", "1_0"]
        );
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

    // === YAML limits (issue 35) ===

    /// `depth` mappings nested as flow (`{a: {a: 1}}`) or as block YAML.
    fn nested(depth: usize, flow: bool) -> String {
        if flow {
            format!("{}1{}", "{a: ".repeat(depth), "}".repeat(depth))
        } else {
            let mut s: String = (0..depth).map(|i| format!("{}a:\n", "  ".repeat(i))).collect();
            s.push_str(&format!("{}1\n", "  ".repeat(depth)));
            s
        }
    }

    #[test]
    fn a_megabyte_of_open_flow_mappings_is_refused_at_the_depth_limit_at_once() {
        // serde_yaml 0.9 (libyaml) took 192 s on this in a release build (64 KiB: 0.5 s,
        // 256 KiB: 11 s): its simple-key scan is quadratic. The bound is only a guard; the
        // parser stops at the 65th level, after some 260 bytes.
        let text = "{a: ".repeat(256 * 1024);
        assert_eq!(text.len(), 1 << 20);
        let started = std::time::Instant::now();
        let err = parse_deployments(&text, "deep.yaml").unwrap_err();
        let elapsed = started.elapsed();
        assert!(matches!(err, CheckError::TooDeep { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.starts_with("deep.yaml: document 1, line 1 column ")
                && msg.contains("nested deeper than 64 levels"),
            "{msg}"
        );
        assert!(elapsed < std::time::Duration::from_secs(10), "{elapsed:?}");
        // The nodes parser reads the same way.
        assert!(matches!(
            parse_nodes(&text, "n.yaml"),
            Err(CheckError::TooDeep { .. })
        ));
    }

    #[test]
    fn nesting_up_to_the_depth_limit_is_read_and_one_level_more_is_refused_naming_file_and_limit() {
        for flow in [true, false] {
            assert!(documents(&nested(MAX_DEPTH, flow), "x").is_ok(), "flow {flow}");
            let err = documents(&nested(MAX_DEPTH + 1, flow), "x.yaml").unwrap_err();
            assert!(matches!(err, CheckError::TooDeep { .. }), "flow {flow}: {err:?}");
            let msg = err.to_string();
            assert!(
                msg.starts_with("x.yaml: document 1, line ") && msg.contains("deeper than 64 levels"),
                "{msg}"
            );
        }
        // A deep second document is named as the second.
        let err = documents(&format!("a: 1\n---\n{}", nested(MAX_DEPTH + 1, false)), "x.yaml")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("x.yaml: document 2, line "), "{err}");
    }

    /// The limits of `check` with `bytes` and `nodes` scaled down: the parser's dependencies
    /// are unoptimised in test builds, where a full 16 MiB input takes some 10 s.
    fn small(bytes: u64, nodes: usize) -> Limits {
        Limits {
            bytes,
            nodes,
            ..Limits::CHECK
        }
    }

    #[test]
    fn input_over_the_size_limit_is_refused_naming_file_and_limit() {
        let limit = 4096;
        let mut text = format!("{GOOD}# ");
        text.push_str(&"x".repeat(limit - text.len()));
        assert_eq!(text.len(), limit);
        assert_eq!(
            documents_within(&text, "big.yaml", small(limit as u64, 100))
                .unwrap()
                .len(),
            1,
            "at the limit"
        );
        text.push('x');
        let err = documents_within(&text, "big.yaml", small(limit as u64, 100)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "big.yaml: larger than 4096 bytes, the most `kvfleet check` reads from one input; split it into smaller files (one per deployment, or nodes in batches)"
        );
        // A file one byte over the real limit is refused as read (reading stops there),
        // before any parsing.
        let dir = std::env::temp_dir().join(format!("kvfleet-check-size-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("big.yaml");
        let mut big = GOOD.to_string();
        big.push_str(&"#".repeat(MAX_INPUT_BYTES as usize + 1 - big.len()));
        std::fs::write(&path, &big).unwrap();
        let err = read_input(&path).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            matches!(err, CheckError::TooLarge { ref file, limit } if file.ends_with("big.yaml") && limit == 16 << 20),
            "{err:?}"
        );
        assert!(err.to_string().contains("larger than 16777216 bytes"), "{err}");
    }

    #[test]
    fn many_tiny_yaml_nodes_meet_the_node_budget_not_the_memory() {
        let limits = small(MAX_INPUT_BYTES, 1000);
        assert!(documents_within(&format!("[{}]", "a,".repeat(999)), "n.yaml", limits).is_ok());
        let err = documents_within(&format!("[{}]", "a,".repeat(1000)), "n.yaml", limits).unwrap_err();
        assert!(matches!(err, CheckError::OverBudget { .. }), "{err:?}");
        assert!(
            err.to_string().starts_with("n.yaml: document 1, line 1 column "),
            "{err}"
        );
        assert!(err.to_string().contains("more than 1000 YAML nodes"), "{err}");
        // The real budget: one YAML node per 16 bytes of the size limit.
        assert_eq!(Limits::CHECK.nodes as u64 * 16, MAX_INPUT_BYTES);
    }

    #[test]
    fn yaml_errors_name_the_line_and_column_once() {
        let err = parse_deployments("a: 1\n---\nb: [\n", "x.yaml").unwrap_err();
        assert_eq!(
            crate::error_chain(&err),
            "x.yaml: document 2: not valid YAML: unclosed bracket '[' at line 3, column 4"
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

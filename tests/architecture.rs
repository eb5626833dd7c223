//! The architecture of docs/architecture.md, kept true by the build: the core crates depend on
//! no Kubernetes client, async runtime, HTTP server or GPU library; the crates depend downwards
//! only; the modules of each crate import only the layers below them; `unsafe` stays where it
//! is listed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What a pure crate may never reach, directly or through another crate.
const FORBIDDEN_IN_CORE: &[&str] = &[
    "kube",
    "kube-client",
    "kube-runtime",
    "tokio",
    "axum",
    "axum-server",
    "hyper",
    "cudarc",
    "nvml-wrapper",
    "prometheus",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The packages in `cargo tree` of `package` (normal and build dependencies, this platform).
fn dependency_closure(package: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root())
        .args([
            "tree",
            "--locked",
            "-p",
            package,
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree -p {package} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_core_crates_reach_no_kubernetes_client_async_runtime_http_server_or_gpu_library() {
    for core in ["kvfleet-core", "kvfleet-engine"] {
        let deps = dependency_closure(core);
        assert!(deps.contains(core), "cargo tree of {core} lists {deps:?}");
        let bad: Vec<&&str> = FORBIDDEN_IN_CORE.iter().filter(|f| deps.contains(**f)).collect();
        assert!(
            bad.is_empty(),
            "{core} depends on {bad:?} (directly or through another crate); the core crates stay \
             pure: move the code that needs it to an edge crate (docs/architecture.md)"
        );
    }
}

#[test]
fn the_crates_depend_downwards_only() {
    let order = ["kvfleet-core", "kvfleet-engine", "kvfleet-cuda", "kvfleet"];
    for (i, krate) in order.iter().enumerate() {
        let deps = dependency_closure(krate);
        for above in &order[i + 1..] {
            assert!(
                !deps.contains(*above),
                "{krate} depends on {above}, a crate above it"
            );
        }
    }
    // The edge needs the core crates; a path that bypasses them would be a second home.
    let edge = dependency_closure("kvfleet");
    for below in &order[..3] {
        assert!(edge.contains(*below), "kvfleet does not depend on {below}");
    }
}

/// The first path segment after `crate::` for every `crate::x` in a file's code (comments
/// skipped).
fn crate_imports(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let before = rest[..i].chars().last();
            rest = &rest[i + "crate::".len()..];
            // `kvfleet_crate::` or `$crate::` are not this crate.
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
                continue;
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Module -> the modules of the same crate it imports, for the top-level modules of `src`.
fn module_edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let first = rel
            .iter()
            .next()
            .unwrap()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if first == "lib" || first == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let entry = edges.entry(first.clone()).or_default();
        for m in crate_imports(&text) {
            if m != first {
                entry.insert(m);
            }
        }
    }
    edges
}

/// Checks every import of `src`'s modules against `allowed` (module -> what it may import);
/// names in `anywhere` (re-exports of lower crates, shared helpers) may be imported by all.
fn check_layers(src: &Path, allowed: &[(&str, &[&str])], anywhere: &[&str]) {
    let allowed: BTreeMap<&str, BTreeSet<&str>> = allowed
        .iter()
        .map(|(m, a)| (*m, a.iter().copied().collect()))
        .collect();
    let mut errors = Vec::new();
    for (module, imports) in module_edges(src) {
        let Some(ok) = allowed.get(module.as_str()) else {
            errors.push(format!(
                "{}: module `{module}` has no layer in tests/architecture.rs (add it, and to docs/architecture.md)",
                src.display()
            ));
            continue;
        };
        for m in imports {
            if !ok.contains(m.as_str()) && !anywhere.contains(&m.as_str()) {
                errors.push(format!("{}: `{module}` imports `crate::{m}`", src.display()));
            }
        }
    }
    assert!(
        errors.is_empty(),
        "imports against the layers of docs/architecture.md:\n{}",
        errors.join("\n")
    );
}

#[test]
fn the_core_modules_import_only_the_layers_below_them() {
    check_layers(
        &root().join("crates/kvfleet-core/src"),
        &[
            ("compat", &[]),
            ("api", &["compat"]),
            ("plan", &["api", "compat"]),
            ("contract", &["api", "compat"]),
            ("validate", &["api", "compat", "plan"]),
        ],
        &[],
    );
    check_layers(
        &root().join("crates/kvfleet-engine/src"),
        &[("engine", &[]), ("model", &["engine"])],
        &[],
    );
}

#[test]
fn the_edge_modes_do_not_import_each_other() {
    // The controller and the worker meet only in `contract` (kvfleet-core); the sidecar and the
    // worker share `publish`; `serving` and `telemetry` are for every long-lived mode.
    let shared: &[&str] = &[
        "api",
        "compat",
        "plan",
        "validate",
        "contract",
        "error_chain",
        "serving",
        "telemetry",
    ];
    check_layers(
        &root().join("src"),
        &[
            ("serving", &[]),
            ("telemetry", &[]),
            ("publish", &[]),
            ("model", &[]),
            ("controller", &[]),
            ("webhook", &[]),
            ("sidecar", &["publish"]),
            ("worker", &["model", "publish"]),
            ("cli", &["controller", "webhook", "worker", "sidecar", "model"]),
        ],
        shared,
    );
}

/// The files that may hold `unsafe`, and why.
const UNSAFE_ALLOWED: &[(&str, &str)] = &[
    ("crates/kvfleet-cuda/src/", "kernel launches and device memory"),
    (
        "crates/kvfleet-engine/src/model/gguf.rs",
        "memory-mapping a weight file",
    ),
    (
        "crates/kvfleet-engine/src/model/hf.rs",
        "memory-mapping a safetensors file",
    ),
    (
        "crates/kvfleet-engine/src/model/llama.rs",
        "disjoint rows of one buffer written from rayon threads",
    ),
];

#[test]
fn unsafe_code_stays_where_it_is_listed() {
    let mut files = Vec::new();
    for dir in [
        "src",
        "crates/kvfleet-core/src",
        "crates/kvfleet-engine/src",
        "crates/kvfleet-cuda/src",
    ] {
        rust_files(&root().join(dir), &mut files);
    }
    let mut found = Vec::new();
    for f in files {
        let rel = f.strip_prefix(root()).unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(&f).unwrap();
        let uses_unsafe = text.lines().any(|l| {
            let code = l.split("//").next().unwrap_or("");
            code.split(|c: char| !c.is_alphanumeric() && c != '_')
                .any(|w| w == "unsafe")
        });
        if uses_unsafe && !UNSAFE_ALLOWED.iter().any(|(p, _)| rel.starts_with(p)) {
            found.push(rel);
        }
    }
    assert!(
        found.is_empty(),
        "`unsafe` outside the places tests/architecture.rs lists: {found:?}; move it behind a safe \
         API in kvfleet-cuda, or list the file with the reason"
    );
}

#[test]
fn the_layer_check_sees_an_import_that_breaks_a_layer() {
    // The checker itself: a `crate::` path in code counts, one in a comment or another crate's
    // path does not.
    let text =
        "use crate::worker::x;\n// crate::controller::y\nuse kvfleet_core::plan;\nlet a = crate::model::z;";
    let got = crate_imports(text);
    assert_eq!(got, ["model", "worker"].iter().map(|s| s.to_string()).collect());
}

//! The architecture of docs/architecture.md, kept true by the build: the core crates depend on
//! no Kubernetes client, async runtime, HTTP server or GPU library; the crates depend downwards
//! only; the modules of each crate import only the layers below them, and no modules of one
//! parent import each other in a cycle; `unsafe` stays where it is listed; no product source
//! file is over 1,000 lines unless it is listed with the reason.

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
    for core in ["kvfleet-gemm", "kvfleet-core", "kvfleet-engine"] {
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
    let order = [
        "kvfleet-gemm",
        "kvfleet-core",
        "kvfleet-engine",
        "kvfleet-cuda",
        "kvfleet",
    ];
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
    for below in &order[..4] {
        assert!(edge.contains(*below), "kvfleet does not depend on {below}");
    }
}

/// The first path segment after `crate::` for every `crate::x` in a file's code (comments and
/// string literals skipped; `crate::{a, b::c}` names `a` and `b`).
fn crate_imports(text: &str) -> BTreeSet<String> {
    module_refs(&strip_comments_and_strings(text))
        .into_iter()
        .filter(|r| r.supers == 0)
        .filter_map(|r| r.path.into_iter().next())
        .collect()
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
            ("autoscale", &[]),
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
            // The router tokenizes as the worker does: it reads the model's prompt code.
            ("router", &["model"]),
            (
                "cli",
                &["controller", "webhook", "worker", "sidecar", "router", "model"],
            ),
        ],
        shared,
    );
}

/// The files that may hold `unsafe`, and why.
const UNSAFE_ALLOWED: &[(&str, &str)] = &[
    (
        "src/serving/connections.rs",
        "getrlimit(RLIMIT_NOFILE): the file limit the connection cap stays below",
    ),
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
        "crates/kvfleet-gemm/src/lib.rs",
        "the AVX2 + FMA matrix kernel (intrinsics), and disjoint columns of one output written \
         from rayon threads",
    ),
];

#[test]
fn unsafe_code_stays_where_it_is_listed() {
    let mut files = Vec::new();
    for dir in [
        "src",
        "crates/kvfleet-gemm/src",
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

// === Reading module paths from source text ===
//
// A static approximation, no compiler involved: comments and string literals are dropped,
// `#[cfg(test)]` items skipped (tests may reach anywhere), and every `crate::` and `super::`
// path in the rest is read, groups included (`crate::a::{b, c::d}`). A path names the longest
// prefix of it that is a module file of the crate (`a/b.rs` or `a/b/mod.rs`); the rest is an
// item in it. Not seen: paths through `self::` or a bare child name (a module's own children),
// `#[path]` attributes, macros that build paths. `super::` inside an inline module other than
// a test module is read as if it were at the file's level.

/// The code of `text` without comments and with every string and char literal emptied.
fn strip_comments_and_strings(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        match c[i] {
            '/' if next == Some('/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '/' if next == Some('*') => {
                let mut depth = 0;
                while i < c.len() {
                    if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                        depth += 1;
                        i += 2;
                    } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            'r' if (next == Some('"') || next == Some('#'))
                && !c[..i].last().is_some_and(|p| p.is_alphanumeric() || *p == '_') =>
            {
                // A raw string: r"..." or r#"..."#; `r#ident` is a raw identifier.
                let hashes = c[i + 1..].iter().take_while(|x| **x == '#').count();
                if c.get(i + 1 + hashes) != Some(&'"') {
                    out.push(c[i]);
                    i += 1;
                    continue;
                }
                let close: Vec<char> = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                i += 2 + hashes;
                while i < c.len() && !c[i..].starts_with(&close) {
                    i += 1;
                }
                i += close.len();
                out.push_str("\"\"");
            }
            '"' => {
                i += 1;
                while i < c.len() && c[i] != '"' {
                    i += if c[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            '\'' if next == Some('\\') => {
                // '\n', '\'', '\u{..}': past the escaped character, to the closing quote.
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
                out.push_str("' '");
            }
            '\'' if c.get(i + 2) == Some(&'\'') => {
                i += 3;
                out.push_str("' '");
            }
            ch => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out
}

/// `code` (from [`strip_comments_and_strings`]) without its `#[cfg(test)]` items: each runs to
/// its first `;` outside braces or to the brace that closes its first `{`.
fn without_test_items(code: &str) -> String {
    const ATTR: &str = "#[cfg(test)]";
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find(ATTR) {
        out.push_str(&rest[..at]);
        let item = &rest[at + ATTR.len()..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (i, ch) in item.char_indices() {
            match ch {
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// A path the code names: `supers` levels up from the file's module (0: from the crate root),
/// then `path`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct ModuleRef {
    supers: usize,
    path: Vec<String>,
}

fn is_ident(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

/// The paths of a use tree from `c[*i]`: `a::b`, `a::{b, c::d}`, `*`; `as x` and generics end
/// a path.
fn use_tree(c: &[char], i: &mut usize) -> Vec<Vec<String>> {
    let skip_ws = |i: &mut usize| {
        while *i < c.len() && c[*i].is_whitespace() {
            *i += 1;
        }
    };
    skip_ws(i);
    if c.get(*i) == Some(&'{') {
        *i += 1;
        let mut out = Vec::new();
        loop {
            skip_ws(i);
            match c.get(*i) {
                None => break,
                Some('}') => {
                    *i += 1;
                    break;
                }
                Some(',') => *i += 1,
                Some(_) => {
                    let before = *i;
                    out.extend(use_tree(c, i));
                    // Skip what a path does not take (`as x`, `*`) up to the next item.
                    while *i < c.len() && !matches!(c[*i], ',' | '}') {
                        *i += 1;
                    }
                    if *i == before {
                        *i += 1;
                    }
                }
            }
        }
        return out;
    }
    let start = *i;
    while *i < c.len() && is_ident(c[*i]) {
        *i += 1;
    }
    if start == *i {
        return vec![Vec::new()];
    }
    let ident: String = c[start..*i].iter().collect();
    let mut j = *i;
    while j < c.len() && c[j].is_whitespace() {
        j += 1;
    }
    if c.get(j) == Some(&':') && c.get(j + 1) == Some(&':') {
        *i = j + 2;
        let mut subs = use_tree(c, i);
        for p in &mut subs {
            p.insert(0, ident.clone());
        }
        subs
    } else {
        vec![vec![ident]]
    }
}

/// Every `crate::` and `super::` path in `code`.
fn module_refs(code: &str) -> Vec<ModuleRef> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let anchor = ["crate::", "super::"]
            .into_iter()
            .find(|a| c[i..].starts_with(&a.chars().collect::<Vec<_>>()));
        // `kvfleet_crate::`, `$crate::` or `pub(crate)` are not paths of this crate.
        let after_ident = i > 0 && (is_ident(c[i - 1]) || c[i - 1] == '$');
        let Some(anchor) = anchor.filter(|_| !after_ident) else {
            i += 1;
            continue;
        };
        i += anchor.len();
        for mut path in use_tree(&c, &mut i) {
            let mut supers = usize::from(anchor == "super::");
            while path.first().is_some_and(|s| s == "super") {
                path.remove(0);
                supers += 1;
            }
            path.retain(|s| s != "self");
            out.push(ModuleRef { supers, path });
        }
    }
    out
}

/// The module a file of `src` defines, as a path from the crate root (`validate/nodes.rs` ->
/// `["validate", "nodes"]`, `validate/mod.rs` -> `["validate"]`, `lib.rs` -> `[]`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut path: Vec<String> = rel.iter().map(|s| s.to_string_lossy().to_string()).collect();
    if matches!(path.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        path.pop();
    }
    path
}

/// The product files of a crate's `src` (its `#[cfg(test)] mod x;` files left out), each with
/// its module path.
fn product_modules(src: &Path) -> Vec<(PathBuf, Vec<String>)> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut modules: Vec<(PathBuf, Vec<String>)> = files
        .into_iter()
        .map(|f| {
            let m = module_of(src, &f);
            (f, m)
        })
        .collect();
    let mut test_modules = BTreeSet::new();
    for (f, m) in &modules {
        let code = strip_comments_and_strings(&std::fs::read_to_string(f).unwrap());
        for part in code.split("#[cfg(test)]").skip(1) {
            let decl = part.trim_start();
            let decl = decl
                .strip_prefix("pub(crate) ")
                .or_else(|| decl.strip_prefix("pub "))
                .unwrap_or(decl);
            if let Some((name, _)) = decl.strip_prefix("mod ").and_then(|d| d.split_once(';')) {
                let mut child = m.clone();
                child.push(name.trim().to_string());
                test_modules.insert(child);
            }
        }
    }
    // A test module's own children are test code too.
    modules.retain(|(_, m)| !test_modules.iter().any(|t| m.starts_with(t)));
    modules
}

// === Module cycles ===

/// Module cycles that exist and are being removed, with the reason they stay for now: the
/// modules of the cycle (paths from the crate root, `::`-joined, sorted) per crate `src`.
/// Cycles allowed for now, each with its reason (none: the last, `controller::desired`'s
/// constants in `pod.rs`, went when they moved to `container.rs`).
const CYCLE_EXCEPTIONS: &[(&str, &[&str], &str)] = &[];

/// For each parent module of `src`: its children and which child imports which. An import
/// from a file counts for the two children of the deepest module the importer and the
/// imported share (`validate::nodes` using `crate::validate::signatures::X` is
/// `nodes -> signatures` under `validate`); a module's use of its own parent or children is
/// not an edge.
fn sibling_edges(src: &Path) -> BTreeMap<(Vec<String>, Vec<String>), BTreeSet<String>> {
    let modules = product_modules(src);
    let known: BTreeSet<Vec<String>> = modules.iter().map(|(_, m)| m.clone()).collect();
    let mut edges: BTreeMap<(Vec<String>, Vec<String>), BTreeSet<String>> = BTreeMap::new();
    for (file, from) in &modules {
        let code = without_test_items(&strip_comments_and_strings(
            &std::fs::read_to_string(file).unwrap(),
        ));
        for r in module_refs(&code) {
            if r.supers > from.len() {
                continue;
            }
            let base = &from[..from.len() - r.supers];
            let mut to = base.to_vec();
            for seg in &r.path {
                to.push(seg.clone());
                if !known.contains(&to) {
                    to.pop();
                    break;
                }
            }
            let shared = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if shared == from.len() || shared == to.len() {
                continue;
            }
            let (a, b) = (from[..=shared].to_vec(), to[..=shared].to_vec());
            let rel = file.strip_prefix(src).unwrap().display().to_string();
            edges
                .entry((a, b))
                .or_default()
                .insert(format!("{rel} uses {}", r.path.join("::")));
        }
    }
    edges
}

/// The strongly connected components of more than one module (Tarjan's algorithm).
fn cycles(edges: &BTreeMap<(Vec<String>, Vec<String>), BTreeSet<String>>) -> Vec<Vec<Vec<String>>> {
    struct Tarjan<'a> {
        next: BTreeMap<&'a Vec<String>, Vec<&'a Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, (usize, usize)>,
        stack: Vec<&'a Vec<String>>,
        found: Vec<Vec<Vec<String>>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a Vec<String>) {
            let n = self.index.len();
            self.index.insert(v, (n, n));
            self.stack.push(v);
            for w in self.next.get(v).cloned().unwrap_or_default() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.index[w].1.min(self.index[v].1);
                    self.index.get_mut(v).unwrap().1 = low;
                } else if self.stack.contains(&w) {
                    let low = self.index[w].0.min(self.index[v].1);
                    self.index.get_mut(v).unwrap().1 = low;
                }
            }
            if self.index[v].0 == self.index[v].1 {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    scc.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.found.push(scc);
                }
            }
        }
    }
    let mut t = Tarjan {
        next: BTreeMap::new(),
        index: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for (a, b) in edges.keys() {
        t.next.entry(a).or_default().push(b);
        t.next.entry(b).or_default();
    }
    let nodes: Vec<&Vec<String>> = t.next.keys().copied().collect();
    for v in nodes {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.found
}

const CRATE_SOURCES: [&str; 5] = [
    "src",
    "crates/kvfleet-gemm/src",
    "crates/kvfleet-core/src",
    "crates/kvfleet-engine/src",
    "crates/kvfleet-cuda/src",
];

#[test]
fn no_modules_of_one_parent_import_each_other_in_a_cycle() {
    let mut errors = Vec::new();
    let mut seen = BTreeSet::new();
    for dir in CRATE_SOURCES {
        let edges = sibling_edges(&root().join(dir));
        for scc in cycles(&edges) {
            let names: Vec<String> = scc.iter().map(|m| m.join("::")).collect();
            seen.insert((dir, names.clone()));
            if CYCLE_EXCEPTIONS
                .iter()
                .any(|(d, ms, _)| *d == dir && *ms == names.as_slice())
            {
                continue;
            }
            let evidence: Vec<String> = edges
                .iter()
                .filter(|((a, b), _)| scc.contains(a) && scc.contains(b))
                .flat_map(|(_, why)| why.iter().cloned())
                .collect();
            errors.push(format!(
                "{dir}: {} import each other:\n    {}",
                names.join(", "),
                evidence.join("\n    ")
            ));
        }
    }
    for (dir, names, _) in CYCLE_EXCEPTIONS {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        if !seen.contains(&(*dir, names.clone())) {
            errors.push(format!(
                "{dir}: the listed cycle {names:?} is gone: remove it from CYCLE_EXCEPTIONS"
            ));
        }
    }
    assert!(
        errors.is_empty(),
        "module cycles (move what both need into a module below them, or merge them):\n{}",
        errors.join("\n")
    );
}

#[test]
fn the_cycle_check_reads_groups_supers_and_skips_tests_comments_and_strings() {
    let text = r#"
use crate::{a::{b, c::D}, e};
use super::super::f::G;
// crate::commented
let s = "crate::in_a_string";
#[cfg(test)]
mod tests {
    use crate::tested::X;
}
fn g() -> crate::h::I { todo!() }
"#;
    let refs = module_refs(&without_test_items(&strip_comments_and_strings(text)));
    let paths: Vec<(usize, String)> = refs.iter().map(|r| (r.supers, r.path.join("::"))).collect();
    assert_eq!(
        paths,
        [(0, "a::b"), (0, "a::c::D"), (0, "e"), (2, "f::G"), (0, "h::I")].map(|(n, p)| (n, p.to_string()))
    );
    let mut edges = BTreeMap::new();
    let m = |p: &str| p.split("::").map(str::to_string).collect::<Vec<_>>();
    edges.insert((m("v::a"), m("v::b")), BTreeSet::new());
    edges.insert((m("v::b"), m("v::c")), BTreeSet::new());
    edges.insert((m("v::c"), m("v::a")), BTreeSet::new());
    edges.insert((m("v::c"), m("v::d")), BTreeSet::new());
    assert_eq!(cycles(&edges), vec![vec![m("v::a"), m("v::b"), m("v::c")]]);
}

// === File size ===

/// Lines a product source file may hold.
const MAX_FILE_LINES: usize = 1000;

/// Product source files over [`MAX_FILE_LINES`], and why.
const LONG_FILES: &[(&str, &str)] = &[
    (
        "crates/kvfleet-engine/src/engine/scheduler.rs",
        "600 lines of code and 620 of unit tests, which drive the scheduler through one set of \
         helpers; the code alone is well under the limit",
    ),
    (
        "crates/kvfleet-engine/src/model/tokenizer.rs",
        "830 lines of code (two tokenizers that share the vocabulary and the detokenizer) and 220 \
         of unit tests",
    ),
];

#[test]
fn no_product_source_file_is_over_a_thousand_lines_unless_listed() {
    let mut errors = Vec::new();
    let mut long = BTreeSet::new();
    for dir in CRATE_SOURCES {
        for (file, _) in product_modules(&root().join(dir)) {
            let rel = file.strip_prefix(root()).unwrap().to_string_lossy().to_string();
            let lines = std::fs::read_to_string(&file).unwrap().lines().count();
            if lines <= MAX_FILE_LINES {
                continue;
            }
            long.insert(rel.clone());
            if !LONG_FILES.iter().any(|(f, _)| *f == rel) {
                errors.push(format!(
                    "{rel}: {lines} lines (at most {MAX_FILE_LINES}): split it by concern, or list it \
                     in LONG_FILES with the reason"
                ));
            }
        }
    }
    for (f, _) in LONG_FILES {
        if !long.contains(*f) {
            errors.push(format!(
                "{f} is listed in LONG_FILES but is not over {MAX_FILE_LINES} lines: remove it"
            ));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

// === Layers inside kvfleet-cuda's GPU model, and where the environment is read ===

/// What a GPU model family's file (one that has `impl Family for`) may not import: the kernel
/// launchers and GEMM wrappers a weight format chooses between, reached through
/// `gpu::linear::Linear` instead (module paths from kvfleet-cuda's root).
const FAMILY_FORBIDDEN_MODULES: &[&[&str]] = &[
    &["gpu", "blas"],
    &["gpu", "lt"],
    &["gpu", "gemv"],
    &["gpu", "fp8"],
    &["launch"],
];

/// What a family file may take from `gpu::kernels`: the arguments of the model math it asks
/// for (norms, the Q/K/V split, the gated activation), not the launchers' owner.
const FAMILY_KERNEL_ARGUMENTS: &[&str] = &["QkvPost", "QkvOut", "Norm", "Glu"];

/// Names that in a family file would mean it picks a kernel or a GEMM itself.
const FAMILY_FORBIDDEN_NAMES: &[&str] = &[
    "ModelKernels",
    "Fp8Kernels",
    "Gemv",
    "Blas",
    "Lt",
    "Gemm",
    "Launch",
    "cublas",
    "cublaslt",
];

/// The imports and names of a family file's `code` (module `module`) that break
/// [`FAMILY_FORBIDDEN_MODULES`], [`FAMILY_KERNEL_ARGUMENTS`] or [`FAMILY_FORBIDDEN_NAMES`].
fn family_violations(module: &[String], code: &str) -> Vec<String> {
    let code = without_test_items(&strip_comments_and_strings(code));
    let mut out = Vec::new();
    for r in module_refs(&code) {
        // `crate::` paths (no `super`) start at the crate's root.
        let base = match r.supers {
            0 => 0,
            n => match module.len().checked_sub(n) {
                Some(b) => b,
                None => continue,
            },
        };
        let mut abs: Vec<String> = module[..base].to_vec();
        abs.extend(r.path.iter().cloned());
        let forbidden = FAMILY_FORBIDDEN_MODULES
            .iter()
            .any(|m| abs.len() >= m.len() && abs.iter().zip(m.iter()).all(|(a, b)| a == b));
        let kernels = abs.len() >= 2 && abs[0] == "gpu" && abs[1] == "kernels";
        let argument = abs.len() == 3 && FAMILY_KERNEL_ARGUMENTS.contains(&abs[2].as_str());
        if forbidden || (kernels && !argument) {
            out.push(abs.join("::"));
        }
    }
    let words: BTreeSet<&str> = code.split(|c: char| !is_ident(c)).collect();
    for name in FAMILY_FORBIDDEN_NAMES {
        if words.contains(name) {
            out.push((*name).to_string());
        }
    }
    for field in [".blas", ".gemv", ".fp8."] {
        if code.contains(field) {
            out.push(field.to_string());
        }
    }
    out
}

#[test]
fn gpu_family_files_import_no_kernel_launcher_or_gemm_wrapper() {
    let src = root().join("crates/kvfleet-cuda/src");
    let mut families = Vec::new();
    let mut found = BTreeMap::new();
    for (file, module) in product_modules(&src) {
        let text = std::fs::read_to_string(&file).unwrap();
        if !without_test_items(&strip_comments_and_strings(&text)).contains("impl Family for") {
            continue;
        }
        families.push(module.join("::"));
        let bad = family_violations(&module, &text);
        if !bad.is_empty() {
            found.insert(module.join("::"), bad);
        }
    }
    assert!(
        families.len() >= 2,
        "the check found the family files {families:?}: expected gpu::llama and gpu::gemma3 at least"
    );
    assert!(
        found.is_empty(),
        "GPU family files that pick kernels themselves: {found:?}; project through the layer's \
         `Linear` (gpu/linear.rs: `project`, `project_add`, `norm_input`), which picks the kernel \
         from the weight's format and the step's shape"
    );
}

#[test]
fn the_family_check_sees_a_gemm_wrapper_a_launcher_and_a_kernels_owner() {
    let module = vec!["gpu".to_string(), "llama".to_string()];
    let ok = "use super::kernels::{QkvOut, Norm};\nuse super::linear::Ops;\n// super::blas::Gemm\n\
              #[cfg(test)]\nmod tests { use super::super::fp8::Fusion; }";
    assert_eq!(family_violations(&module, ok), Vec::<String>::new());
    let bad = "use super::blas::Gemm;\nuse crate::launch::Launch;\nuse super::kernels::ModelKernels;\n\
               fn f(st: &Step) { st.k.gemv.run(); }";
    let got = family_violations(&module, bad);
    for want in [
        "gpu::blas::Gemm",
        "launch::Launch",
        "gpu::kernels::ModelKernels",
        "Gemm",
        ".gemv",
    ] {
        assert!(got.iter().any(|g| g == want), "{want} not in {got:?}");
    }
}

/// Product files that read environment variables, each with the reason it is an edge.
const ENV_READS_ALLOWED: &[(&str, &str)] = &[
    (
        "crates/kvfleet-cuda/src/gpu/tuning.rs",
        "the GPU model's lab knobs (`GpuTuning::from_env`), read once at start by the worker, the \
         bench binaries and the GPU tests, and logged",
    ),
    (
        "crates/kvfleet-cuda/src/nvrtc.rs",
        "where NVRTC's library and the CUDA headers are: the location of the toolchain, as \
         `CUDA_HOME` is to nvcc",
    ),
    (
        "crates/kvfleet-core/src/contract/model.rs",
        "the embedded SmolLM2's install location (`KVFLEET_SMOLLM2_GGUF`), set by `.tools/env`",
    ),
    (
        "src/serving/serve.rs",
        "names `KVFLEET_SMOLLM2_GGUF` in the error that says the embedded model is missing",
    ),
    (
        "src/sidecar.rs",
        "the pod's namespace and name from the downward API",
    ),
    (
        "src/publish.rs",
        "the pod's namespace and name from the downward API",
    ),
    (
        "src/worker/mod.rs",
        "the termination log path Kubernetes reads (`KVFLEET_TERMINATION_LOG`), and the GPU \
         tuning's one call",
    ),
    (
        "src/controller/mod.rs",
        "the pod's HOSTNAME as the leader-election identity",
    ),
];

/// Whether `code` (stripped, tests left out) reads an environment variable at run time.
fn reads_env(code: &str) -> bool {
    code.contains("env::var")
}

#[test]
fn no_product_code_reads_the_environment_outside_the_edge() {
    let root = root();
    let mut found = Vec::new();
    for src in CRATE_SOURCES {
        for (file, _) in product_modules(&root.join(src)) {
            let rel = file
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let code = without_test_items(&strip_comments_and_strings(
                &std::fs::read_to_string(&file).unwrap(),
            ));
            if reads_env(&code) && !ENV_READS_ALLOWED.iter().any(|(f, _)| *f == rel) {
                found.push(rel);
            }
        }
    }
    assert!(
        found.is_empty(),
        "environment reads outside the edge: {found:?}; add the knob to `GpuTuning` (gpu/tuning.rs) \
         or the worker's config and pass it down, or list the file in ENV_READS_ALLOWED with the \
         reason it is an edge"
    );
    assert!(reads_env("let v = std::env::var_os(\"X\");") && reads_env("env::vars()"));
    assert!(!reads_env(&strip_comments_and_strings(
        "// std::env::var\nlet s = \"env::var\";"
    )));
}

//! Locating the external tools (helm, promtool, prometheus) that `.ci/install-tools` installs.

use std::path::{Path, PathBuf};

/// A tool from `env_var`, `PATH` or `.tools/bin/`; panics with how to install it.
pub fn find_tool(env_var: &str, name: &str, install: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env_var) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{env_var}={} does not exist; {install}",
            path.display()
        );
        return path;
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/bin"));
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("`{name}` not found (set {env_var}, put it on PATH or in .tools/bin/): {install}")
        })
}

//! A real Prometheus on loopback for the monitoring suites: started with a given config,
//! queried through its HTTP API, plus the PromQL name extraction the suites check metric
//! contracts with.

#![allow(dead_code)] // each suite uses its own subset

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Metric names a PromQL expression reads: identifiers outside strings, label matchers,
/// range brackets and grouping lists, that are not function calls or keywords.
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &[
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "sum",
        "avg",
        "min",
        "max",
        "count",
        "group",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
    ];
    const GROUPING: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];
    let bytes = expr.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut out = BTreeSet::new();
    let mut i = 0;
    let mut skip_group = false;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'{' | b'[' => {
                let close = if bytes[i] == b'{' { b'}' } else { b']' };
                while i < bytes.len() && bytes[i] != close {
                    if bytes[i] == b'"' {
                        i += 1;
                        while i < bytes.len() && bytes[i] != b'"' {
                            i += 1;
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            b'(' if skip_group => {
                while i < bytes.len() && bytes[i] != b')' {
                    i += 1;
                }
                i += 1;
                skip_group = false;
            }
            b if b.is_ascii_alphabetic() || b == b'_' => {
                let start = i;
                while i < bytes.len() && is_ident(bytes[i]) {
                    i += 1;
                }
                let word = &expr[start..i];
                let call = expr[i..].trim_start().starts_with('(');
                if GROUPING.contains(&word) {
                    skip_group = true;
                } else if !call && !KEYWORDS.contains(&word) {
                    out.insert(word.to_owned());
                }
            }
            b if b.is_ascii_digit() => {
                // A number (0.99, 1e3) is not a name.
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'.') {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// Kills the child on drop, so a failing test leaves no process behind.
pub struct Proc(pub Child, pub &'static str);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// One HTTP/1.1 exchange over loopback: (status, body).
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    // The completions queue behind each other on a CPU worker of a debug build: on a loaded
    // 2-core machine one waited more than 30 s for its first byte.
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    Ok((status, if chunked { dechunk(rest) } else { rest.to_owned() }))
}

pub fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || tail.len() < size {
            break;
        }
        out.push_str(&tail[..size]);
        rest = tail[size..].trim_start_matches("\r\n");
    }
    out
}

pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> Result<(), String>) {
    let start = Instant::now();
    loop {
        match ready() {
            Ok(()) => return,
            Err(why) if start.elapsed() > timeout => panic!("{what} not ready after {timeout:?}: {why}"),
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

pub fn check_alive(proc: &mut Proc) -> Result<(), String> {
    match proc.0.try_wait() {
        Ok(Some(status)) => panic!("{} exited early with {status}", proc.1),
        _ => Ok(()),
    }
}

pub fn prom_query(port: u16, expr: &str) -> Result<Vec<Value>, String> {
    prom_query_at(port, expr, None)
}

/// An instant query evaluated at `time` (Unix seconds; now when `None`), as `/api/v1/query`
/// takes it.
pub fn prom_query_at(port: u16, expr: &str, time: Option<f64>) -> Result<Vec<Value>, String> {
    let mut path = format!("/api/v1/query?query={}", percent_encode(expr));
    if let Some(t) = time {
        path.push_str(&format!("&time={t:.3}"));
    }
    let (status, body) = http(port, "GET", &path, None).map_err(|e| e.to_string())?;
    let json: Value =
        serde_json::from_str(&body).map_err(|e| format!("HTTP {status}, not JSON: {e}: {body}"))?;
    if json["status"] != "success" {
        return Err(format!("HTTP {status}: {} {}", json["errorType"], json["error"]));
    }
    Ok(json["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// Starts a real Prometheus on a free loopback port with `config` (YAML), its TSDB under
/// `scratch/data`, and waits for `/-/ready`.
pub fn start_prometheus(bin: &Path, scratch: &Path, config: &str) -> (Proc, u16) {
    std::fs::create_dir_all(scratch.join("data")).expect("scratch directory");
    let config_path = scratch.join("prometheus.yml");
    std::fs::write(&config_path, config).expect("prometheus.yml");
    let port = free_port();
    let mut prom = Proc(
        Command::new(bin)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", scratch.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start prometheus"),
        "prometheus",
    );
    wait_for("prometheus /-/ready", Duration::from_secs(60), || {
        check_alive(&mut prom)?;
        match http(port, "GET", "/-/ready", None) {
            Ok((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    (prom, port)
}

/// The first sample's value of an instant query's result, as a number.
pub fn first_value(result: &[Value]) -> Option<f64> {
    result.first()?["value"][1].as_str()?.parse().ok()
}

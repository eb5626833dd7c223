//! Running the real `kvfleet` binary on loopback for the worker and router suites: the embedded
//! model's path, free ports, a spawned mode killed on drop with its log, and a plain HTTP/1.1
//! exchange (chunked bodies decoded) that shows exactly what a client receives.

#![allow(dead_code)] // each suite uses its own subset

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The embedded SmolLM2 (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`); panics with how to
/// install it.
pub fn smollm2() -> PathBuf {
    let p = std::env::var_os("KVFLEET_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        p.exists(),
        "the embedded SmolLM2 is not installed at {} (run .ci/install-tools)",
        p.display()
    );
    p
}

/// The embedded Gemma 3 270M (`.ci/install-tools`; env `KVFLEET_GEMMA3_GGUF`); panics with how
/// to install it.
pub fn gemma3() -> PathBuf {
    let p = std::env::var_os("KVFLEET_GEMMA3_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/gemma-3-270m-q4_k_m.gguf")
        });
    assert!(
        p.exists(),
        "Gemma 3 270M is not installed at {} (run .ci/install-tools, or set KVFLEET_GEMMA3_GGUF)",
        p.display()
    );
    p
}

/// A loopback port free now and never handed out before in this test process. The child it is
/// for binds it a moment later; meanwhile the kernel may give the same port to another test's
/// `bind(0)`, and two children of concurrent tests would race for it: the loser exits and its
/// test talks to the winner (a router test once scored a replica by another test's load).
pub fn free_port() -> u16 {
    static HANDED: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !handed.contains(&port) {
            handed.push(port);
            return port;
        }
    }
}

/// A `kvfleet` mode listening on a free loopback port, killed when dropped.
pub struct Spawned {
    pub child: Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Spawned {
    /// `kvfleet MODE --listen 127.0.0.1:PORT ARGS...`, stderr to a log named after `suite` and
    /// `name`, the embedded model's path in the environment.
    pub fn start(suite: &str, mode: &str, name: &str, args: &[&str]) -> Spawned {
        let port = free_port();
        let log = std::env::temp_dir().join(format!("kvfleet-{suite}-{}-{name}.log", std::process::id()));
        let child = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
            .arg(mode)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(args)
            .env("KVFLEET_SMOLLM2_GGUF", smollm2())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Spawned { child, port, log }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `GET path` answers 200; panics with the log if the process exits first or
    /// `within` passes.
    pub fn wait_http(&mut self, path: &str, within: Duration) {
        let t0 = Instant::now();
        while t0.elapsed() < within {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("exited during start-up: {status}\n{}", self.log());
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && http(self.port, "GET", path, "", &[]).0 == 200
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("{path} not 200 within {within:?}\n{}", self.log());
    }
}

/// (status, head, body) of one HTTP/1.1 exchange with `Connection: close`; decodes chunked
/// bodies.
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    // One write, as real clients send a small request (`write!` writes each piece apart).
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut rest = rest;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = &after[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (status, head.to_string(), body)
}

/// The value of a response header (names are case-insensitive).
pub fn header(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
    })
}

/// The binary under test: this build's, or the one `KVFLEET_TEST_BIN` names (to see a finding
/// on an older build with the same test).
pub fn kvfleet_bin() -> String {
    std::env::var("KVFLEET_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvfleet").to_string())
}

/// [`kvfleet_bin`], under `prlimit --nofile=N:N` when `nofile` is given.
pub fn kvfleet_command(nofile: Option<usize>) -> Command {
    match nofile {
        Some(n) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--nofile={n}:{n}")).arg(kvfleet_bin());
            c
        }
        None => Command::new(kvfleet_bin()),
    }
}

/// Raises this process's soft file limit to `want` (within the hard limit): the client side of
/// an idle-socket test holds more sockets than a default 1,024 allows.
pub fn raise_file_limit(want: u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write one rlimit through a pointer to a local.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        if r.rlim_cur < want {
            r.rlim_cur = want.min(r.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
        }
    }
}

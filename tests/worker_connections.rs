//! Connections that ask for nothing against the real `kvfleet worker` (issue 35, item 2): its
//! own test binary, so that no other worker of the suite shares the cores while `/healthz` is
//! timed against its 100 ms bound (cargo runs test binaries one after another).
//!
//! Needs the embedded model (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`) and `prlimit`
//! (util-linux).

mod h2_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod worker_support;
use worker_support::{free_port, http, smollm2};

/// Starts the worker (under `prlimit --nofile=N:N` when `nofile` is given) and waits until it
/// is ready; returns it and a reader of its log.
fn start_worker(name: &str, nofile: Option<usize>) -> (Worker, u16, std::path::PathBuf) {
    let port = free_port();
    let log = std::env::temp_dir().join(format!(
        "kvfleet-worker-connections-{}-{name}.log",
        std::process::id()
    ));
    let mut cmd = match nofile {
        Some(n) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--nofile={n}:{n}")).arg(kvfleet_bin());
            c
        }
        None => Command::new(kvfleet_bin()),
    };
    let child = cmd
        .args(["worker", "--listen", &format!("127.0.0.1:{port}")])
        .env("KVFLEET_SMOLLM2_GGUF", smollm2())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut w = Worker(child);
    let t0 = Instant::now();
    loop {
        if let Some(status) = w.0.try_wait().unwrap() {
            panic!(
                "worker exited during start-up: {status}\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() && http(port, "GET", "/readyz", "", &[]).0 == 200 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "not ready\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    (w, port, log)
}

/// The binary under test: this build's, or `KVFLEET_TEST_BIN` (to measure another build).
fn kvfleet_bin() -> String {
    std::env::var("KVFLEET_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvfleet").to_string())
}

/// The worker, killed when dropped.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Raises this process's soft file limit to `want` (within the hard limit): the client side
/// of the idle-socket test holds more sockets than a default 1,024 allows.
fn raise_file_limit(want: u64) {
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

/// Item 2: 1,100 connections that ask for nothing (plain TCP, an HTTP/2 preface and SETTINGS,
/// a kept-alive HTTP/1.1 connection after one request) against a worker limited to 256 files:
/// it holds no more than its file limit allows (the longest idle make room), `/healthz` answers
/// within 100 ms throughout, and the connections that never sent a request are closed after the
/// first-request timeout (10 s). Before, the sockets were held forever and probes timed out.
#[test]
fn idle_connections_past_the_file_limit_never_keep_a_health_probe_out() {
    const IDLE: usize = 1100;
    const NOFILE: usize = 256;
    raise_file_limit(4 * IDLE as u64);
    let (w, port, log) = start_worker("idle", Some(NOFILE));
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let pid = w.0.id();
    let fds = move || std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());

    let done = Arc::new(AtomicBool::new(false));
    let prober = {
        let done = done.clone();
        std::thread::spawn(move || {
            let (mut worst, mut probes, mut failures, mut most_fds) = (Duration::ZERO, 0, Vec::new(), 0);
            while !done.load(Ordering::SeqCst) {
                let t0 = Instant::now();
                let probe = std::panic::catch_unwind(|| http(port, "GET", "/healthz", "", &[]).0);
                let took = t0.elapsed();
                probes += 1;
                worst = worst.max(took);
                if probe.as_ref().ok() != Some(&200) || took > Duration::from_millis(100) {
                    failures.push((probes, probe.ok(), took));
                }
                most_fds = most_fds.max(fds());
                std::thread::sleep(Duration::from_millis(20));
            }
            (worst, probes, failures, most_fds)
        })
    };
    let h2_preface: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
    let mut never_asked = Vec::new();
    let mut kept_alive = Vec::new();
    for i in 0..IDLE {
        // Held, not flooded: a client that opens sockets to hold them, 25 at a time (a burst of
        // connects queues the probe's behind them in the kernel's accept queue).
        if i % 25 == 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        match i % 3 {
            0 => never_asked.push(s),
            1 => {
                s.write_all(h2_preface).unwrap();
                never_asked.push(s);
            }
            _ => {
                let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
                kept_alive.push(s);
            }
        }
    }
    let opened = Instant::now();
    // Past the first-request timeout, every connection that never asked is closed.
    std::thread::sleep(Duration::from_secs(12));
    done.store(true, Ordering::SeqCst);
    let (worst, probes, failures, most_fds) = prober.join().unwrap();
    let open_fds = fds();
    eprintln!(
        "{IDLE} idle sockets against nofile {NOFILE}: {probes} probes, worst {worst:?}, \
         most files open {most_fds}, open now {open_fds}"
    );
    assert!(
        failures.is_empty(),
        "probes failed or slow: {failures:?}\n{}",
        read_log()
    );
    assert!(
        most_fds < NOFILE,
        "the worker reached its file limit ({most_fds})"
    );
    let mut still_open = 0;
    for s in &mut never_asked {
        s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
        let mut buf = [0u8; 256];
        let closed = loop {
            match s.read(&mut buf) {
                Ok(0) => break true,
                // An HTTP/2 server's SETTINGS (and GOAWAY) come before the close.
                Ok(_) => continue,
                Err(e) => {
                    break !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    )
                }
            }
        };
        still_open += usize::from(!closed);
    }
    assert_eq!(
        still_open,
        0,
        "{still_open} connections that never sent a request were open {:?} after they opened",
        opened.elapsed()
    );
    // The worker still serves completions.
    let (st, _, b) = http(
        port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"Hi","max_tokens":2}"#,
        &[],
    );
    assert_eq!(st, 200, "{b}");
    drop(kept_alive);
}

/// An h2c client's connection, read until the server closes it or `until` passes: (when it
/// closed, PINGs the server sent, whether a GOAWAY came). Never answers a PING.
fn read_until_closed(s: &mut TcpStream, until: Instant) -> (Option<Instant>, usize, bool) {
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let (mut buf, mut pings, mut goaway) = (Vec::new(), 0, false);
    let mut chunk = [0u8; 4096];
    while Instant::now() < until {
        match s.read(&mut chunk) {
            Ok(0) => return (Some(Instant::now()), pings, goaway),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                for f in h2_support::take_frames(&mut buf) {
                    pings += usize::from(h2_support::is_ping(&f));
                    goaway |= f.0 == h2_support::GOAWAY;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return (Some(Instant::now()), pings, goaway),
        }
    }
    (None, pings, goaway)
}

/// An h2c client past the preface: the server's SETTINGS read and acknowledged.
fn h2c_connect(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(&h2_support::preface()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !h2_support::take_frames(&mut buf)
        .iter()
        .any(h2_support::is_settings)
    {
        let n = s.read(&mut chunk).expect("the server's SETTINGS");
        assert!(n > 0, "closed before its SETTINGS");
        buf.extend_from_slice(&chunk[..n]);
    }
    s.write_all(&h2_support::settings_ack()).unwrap();
    s
}

/// Issue 35 (residual): an HTTP/2 peer that vanished without a FIN (a dead node) while its
/// request is in flight (here a body that never ends, which the body timeout answers with 408
/// at 30 s) stops answering PINGs: the worker pings it after the keep-alive interval (20 s of
/// silence) and closes it when the PING goes unanswered (20 s more). Before, nothing pinged it:
/// the connection was held through the body timeout and then the 75 s idle time (105 s), and
/// with a stream kept busy, for as long as the stream ran. A peer that opens no stream is closed
/// by the first-request timeout (10 s). `/healthz` answers throughout.
#[test]
fn an_h2c_peer_that_never_answers_pings_is_closed_within_the_keep_alive_bound() {
    let ka = kvfleet::serving::HTTP2_KEEP_ALIVE;
    let bound = ka.interval + ka.timeout + Duration::from_secs(10);
    let (w, port, log) = start_worker("h2-keep-alive", None);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();

    let done = Arc::new(AtomicBool::new(false));
    let prober = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut failures = Vec::new();
            while !done.load(Ordering::SeqCst) {
                let t0 = Instant::now();
                let probe = std::panic::catch_unwind(|| http(port, "GET", "/healthz", "", &[]).0);
                if probe.as_ref().ok() != Some(&200) || t0.elapsed() > Duration::from_secs(1) {
                    failures.push((probe.ok(), t0.elapsed()));
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            failures
        })
    };

    // A stream in flight: a completion whose body never ends.
    let mut in_flight = h2c_connect(port);
    in_flight
        .write_all(&h2_support::post_headers(1, "/v1/completions"))
        .unwrap();
    in_flight
        .write_all(&h2_support::data(1, br#"{"prompt":"#, false))
        .unwrap();
    let silent_from = Instant::now();
    // No stream at all.
    let no_stream = std::thread::spawn(move || {
        let mut s = h2c_connect(port);
        let opened = Instant::now();
        let (closed, _, _) = read_until_closed(&mut s, opened + bound);
        closed.map(|t| t - opened)
    });

    let (closed, pings, goaway) = read_until_closed(&mut in_flight, silent_from + bound);
    done.store(true, Ordering::SeqCst);
    let failures = prober.join().unwrap();
    let no_stream = no_stream.join().unwrap();
    let held = closed.map(|t| t - silent_from);
    eprintln!("in flight: closed after {held:?}, {pings} PING(s), GOAWAY {goaway}; no stream: closed after {no_stream:?}");
    let Some(held) = held else {
        panic!(
            "an h2c connection that answered no PING ({pings} sent) was open {bound:?} after its last frame\n{}",
            read_log()
        );
    };
    assert!(pings >= 1, "closed after {held:?} without a PING");
    assert!(
        held >= ka.interval + ka.timeout - Duration::from_secs(2),
        "closed after {held:?}, before the keep-alive interval and timeout ({:?})",
        ka.interval + ka.timeout
    );
    assert!(
        no_stream.is_some_and(|t| t < kvfleet::serving::FIRST_REQUEST_TIMEOUT + Duration::from_secs(5)),
        "an h2c connection with no stream was closed after {no_stream:?}"
    );
    assert!(
        failures.is_empty(),
        "probes failed or slow: {failures:?}\n{}",
        read_log()
    );
    drop(w);
}

//! Connections that ask for nothing against the real `kvfleet worker` (issue 35, item 2): its
//! own test binary, so that no other worker of the suite shares the cores while `/healthz` is
//! timed against its 100 ms bound (cargo runs test binaries one after another).
//!
//! Needs the embedded model (`.ci/install-tools`; env `KVFLEET_SMOLLM2_GGUF`) and `prlimit`
//! (util-linux).

mod h2_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod worker_support;
use worker_support::{free_port, http, kvfleet_command, raise_file_limit, smollm2};

/// Starts the worker (under `prlimit --nofile=N:N` when `nofile` is given) and waits until it
/// is ready; returns it and a reader of its log.
fn start_worker(name: &str, nofile: Option<usize>) -> (Worker, u16, std::path::PathBuf) {
    let port = free_port();
    let log = std::env::temp_dir().join(format!(
        "kvfleet-worker-connections-{}-{name}.log",
        std::process::id()
    ));
    let mut cmd = kvfleet_command(nofile);
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

/// The worker, killed when dropped.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
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

/// `VmRSS` of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

const MIB: u64 = 1024 * 1024;

/// What [`probe_and_sample`] saw: (probes, the failed or slow ones, the worst time, the
/// largest RSS).
type Probed = (usize, Vec<(Option<u16>, Duration)>, Duration, u64);

/// Probes `/healthz` every 20 ms until `done`, also sampling the worker's RSS: (probes, the
/// failed or slower than `bound` ones, the worst time, the largest RSS seen).
fn probe_and_sample(
    port: u16,
    pid: u32,
    bound: Duration,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Probed> {
    std::thread::spawn(move || {
        let (mut probes, mut failures, mut worst, mut most) = (0, Vec::new(), Duration::ZERO, 0);
        while !done.load(Ordering::SeqCst) {
            let t0 = Instant::now();
            let probe = std::panic::catch_unwind(|| http(port, "GET", "/healthz", "", &[]).0);
            let took = t0.elapsed();
            probes += 1;
            worst = worst.max(took);
            if probe.as_ref().ok() != Some(&200) || took > bound {
                failures.push((probe.ok(), took));
            }
            most = most.max(rss(pid));
            std::thread::sleep(Duration::from_millis(20));
        }
        (probes, failures, worst, most)
    })
}

/// The status line and `Retry-After` of what a client that sent part of a body got back.
fn read_answer(s: &mut TcpStream, within: Duration) -> Option<(u16, Option<String>)> {
    s.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
    let head = String::from_utf8_lossy(&got).into_owned();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, worker_support::header(&head, "retry-after")))
}

/// Issue 62: 100 clients each declaring a body of the largest size (4 MiB) and sending all of
/// it but 64 KiB. The worker takes as many as its budget of bodies in flight holds (64 MiB),
/// answers the rest 503 with `Retry-After` without reading them, its RSS grows by less than the
/// budget plus the connections' buffers, and `/healthz` answers within 1 s throughout. Before, every body
/// was buffered: 40 such bodies took +160 MB, 100 would take +400 MB.
#[test]
fn a_hundred_clients_each_sending_most_of_the_largest_body_stay_within_the_body_budget() {
    const CLIENTS: usize = 100;
    let max = kvfleet::serving::openai::ApiLimits::default().max_body_bytes;
    let budget = kvfleet::serving::openai::DEFAULT_BODIES_IN_FLIGHT_BYTES as u64;
    let (w, port, log) = start_worker("bodies", None);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let pid = w.0.id();
    let before = rss(pid);
    let t0 = Instant::now();

    let done = Arc::new(AtomicBool::new(false));
    // Within the kubelet's default probe timeout (1 s): 100 clients pushing 400 MB at a debug
    // build on a shared CI core slow a probe to some 0.2-0.5 s, never near it.
    let prober = probe_and_sample(port, pid, Duration::from_secs(1), done.clone());
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                let head = format!(
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {max}\r\n\r\n{{\"prompt\":\""
                );
                s.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
                let _ = s.write_all(head.as_bytes());
                let piece = vec![b'a'; 64 * 1024];
                for _ in 0..(max / piece.len() - 1) {
                    // A write that blocks: the worker is not reading this body (no room).
                    if s.write_all(&piece).is_err() {
                        break;
                    }
                }
                let answer = read_answer(&mut s, Duration::from_secs(5));
                (s, answer)
            })
        })
        .collect();
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let sent = t0.elapsed();
    done.store(true, Ordering::SeqCst);
    let (probes, failures, worst, most) = prober.join().unwrap();
    let growth = most.saturating_sub(before);
    let refused: Vec<_> = answers
        .iter()
        .filter_map(|(_, a)| a.clone())
        .filter(|(s, _)| *s == 503)
        .collect();
    eprintln!(
        "{CLIENTS} partial {} MiB bodies: RSS {} MiB before, {} MiB at most (+{} MiB); {} refused 503; \
         {probes} probes, worst {worst:?}; {sent:?}",
        max as u64 / MIB,
        before / MIB,
        most / MIB,
        growth / MIB,
        refused.len()
    );
    assert!(
        failures.is_empty(),
        "probes failed or slow: {failures:?}\n{}",
        read_log()
    );
    assert!(
        growth < budget + 32 * MIB,
        "the worker grew by {} MiB with {CLIENTS} partial bodies in flight (budget {} MiB)",
        growth / MIB,
        budget / MIB
    );
    let admitted = (budget / max as u64) as usize;
    assert!(
        refused.len() >= CLIENTS - admitted,
        "{} of {CLIENTS} refused, {admitted} fit the budget: {:?}",
        refused.len(),
        answers.iter().map(|(_, a)| a.clone()).collect::<Vec<_>>()
    );
    assert!(
        refused.iter().all(|(_, after)| after.as_deref() == Some("1")),
        "a 503 without Retry-After: {refused:?}"
    );
    // The clients gone, their bytes are back: a completion is served.
    drop(answers);
    let (st, _, b) = http(
        port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"Hi","max_tokens":2}"#,
        &[],
    );
    assert_eq!(st, 200, "{b}");
}

/// Issue 62: 1,000 connections each in the middle of a request body that it trickles (a byte
/// every 2 s, each reopened when the worker closes it) against a worker limited to 1,024 files:
/// when every connection it may hold is receiving a body, the one receiving longest makes room
/// for a new one, so `/healthz` answers within 100 ms throughout. Before, only idle connections
/// made room: 93 of 132 probes failed.
#[test]
fn a_thousand_connections_trickling_bodies_at_the_file_limit_never_keep_a_health_probe_out() {
    const TRICKLING: usize = 1000;
    const NOFILE: usize = 1024;
    raise_file_limit(4 * TRICKLING as u64);
    let (w, port, log) = start_worker("trickling", Some(NOFILE));
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let pid = w.0.id();
    let fds = move || std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    let open = |port: u16| -> Option<TcpStream> {
        let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_nonblocking(true).ok()?;
        s.write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n{\"prompt\":\"",
        )
        .ok()?;
        Some(s)
    };

    let mut conns: Vec<Option<TcpStream>> = Vec::with_capacity(TRICKLING);
    for i in 0..TRICKLING {
        if i % 25 == 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
        conns.push(open(port));
    }
    let done = Arc::new(AtomicBool::new(false));
    let prober = probe_and_sample(port, pid, Duration::from_millis(100), done.clone());
    let (mut most_fds, mut reopened) = (0, 0);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        for c in &mut conns {
            let alive = c.as_mut().is_some_and(|s| match s.write(b"a") {
                Ok(_) => true,
                Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
            });
            if !alive {
                *c = open(port);
                reopened += 1;
            }
        }
        most_fds = most_fds.max(fds());
        std::thread::sleep(Duration::from_secs(2));
    }
    done.store(true, Ordering::SeqCst);
    let (probes, failures, worst, _) = prober.join().unwrap();
    let held = conns.iter().filter(|c| c.is_some()).count();
    eprintln!(
        "{TRICKLING} trickling bodies against nofile {NOFILE}: {probes} probes, worst {worst:?}, \
         {} failed; most files open {most_fds}; {reopened} reopened, {held} open at the end",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {probes} probes failed or were slow: {failures:?}\n{}",
        failures.len(),
        read_log()
    );
    assert!(
        most_fds < NOFILE,
        "the worker reached its file limit ({most_fds})"
    );
    drop(conns);
    let (st, _, b) = http(
        port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"Hi","max_tokens":2}"#,
        &[],
    );
    assert_eq!(st, 200, "{b}");
}

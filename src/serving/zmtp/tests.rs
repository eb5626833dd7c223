//! The framing against hand-written ZMTP bytes, and 100,000 fuzzed inputs against both
//! sockets over in-memory pipes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::publisher::{Counters, Publisher, LIMITS as PUB_LIMITS, MAX_SUBSCRIPTIONS, MAX_TOPIC_BYTES};
use super::subscriber::{Subscription, MAX_MESSAGE_BYTES};
use super::*;

fn ready_of(socket_type: &[u8]) -> Vec<u8> {
    let mut props = vec![11u8];
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    props.extend_from_slice(socket_type);
    let mut out = Vec::new();
    put_command(&mut out, "READY", &props);
    out
}

/// A peer's greeting and READY, as libzmq sends them.
fn hello(socket_type: &[u8]) -> Vec<u8> {
    let mut out = greeting().to_vec();
    out.extend(ready_of(socket_type));
    out
}

fn long_header(len: u64) -> Vec<u8> {
    let mut out = vec![FLAG_LONG];
    out.extend_from_slice(&len.to_be_bytes());
    out
}

/// Runs `serve` on one end of a pipe while `input` is written to the other, which then stops
/// writing and reads whatever comes back until the serving end closes.
async fn against<F, Fut>(input: &[u8], serve: F) -> (Vec<u8>, Fut::Output)
where
    F: FnOnce(tokio::io::DuplexStream) -> Fut,
    Fut: std::future::Future,
{
    let (client, server) = tokio::io::duplex(1 << 16);
    let (mut rx, mut tx) = tokio::io::split(client);
    let peer = async {
        let _ = tx.write_all(input).await;
        let _ = tx.shutdown().await;
        let mut back = Vec::new();
        let _ = rx.read_to_end(&mut back).await;
        back
    };
    let (back, out) = tokio::join!(peer, serve(server));
    (back, out)
}

fn rejected(c: &Counters, reason: &str) -> u64 {
    c.rejected.with_label_values(&[reason]).get()
}

#[tokio::test]
async fn a_subscriber_gets_the_messages_of_its_topic_and_not_the_others() {
    let counters = Counters::detached();
    let publisher = Publisher::new(counters.clone());
    let (mut client, server) = tokio::io::duplex(1 << 16);
    let p = Arc::clone(&publisher);
    let serving = tokio::spawn(async move { p.serve_connection(server).await });
    let mut input = hello(b"SUB");
    input.extend(encode_message(&[b"\x01kv@"]));
    client.write_all(&input).await.unwrap();
    let mut their = [0u8; 64];
    client.read_exact(&mut their).await.unwrap();
    assert_eq!(their, greeting());
    let mut ready = vec![0u8; ready_of(b"PUB").len()];
    client.read_exact(&mut ready).await.unwrap();
    assert_eq!(ready, ready_of(b"PUB"));
    // The subscription is read on the serving task: send until it takes effect.
    let want = encode_message(&[b"kv@pod@m", &7u64.to_be_bytes(), b"payload"]);
    let t0 = Instant::now();
    let mut got = Vec::new();
    while got.len() < want.len() {
        publisher.send(&[b"other", &[0; 8], b"x"]);
        publisher.send(&[b"kv@pod@m", &7u64.to_be_bytes(), b"payload"]);
        let mut buf = [0u8; 256];
        if let Ok(n) = tokio::time::timeout(Duration::from_millis(50), client.read(&mut buf)).await {
            got.extend_from_slice(&buf[..n.unwrap()]);
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "nothing delivered");
    }
    got.truncate(want.len());
    assert_eq!(got, want, "the other topic is not delivered");
    drop(client);
    assert!(serving.await.unwrap().is_ok());
    assert_eq!(publisher.connections(), 0);
}

#[tokio::test]
async fn a_frame_announcing_two_to_the_62_bytes_is_refused_before_allocating() {
    // The 73 bytes of issue 62: a greeting and one LONG frame header.
    let counters = Counters::detached();
    let publisher = Publisher::new(counters.clone());
    let mut input = greeting().to_vec();
    input.extend(long_header(1 << 62));
    assert_eq!(input.len(), 73);
    // The READY the header stands in place of is the frame it announces.
    let (_, out) = against(&input, |s| publisher.serve_connection(s)).await;
    let e = out.unwrap_err();
    assert!(
        matches!(e, ZmtpError::FrameTooLarge { len, .. } if len == 1 << 62),
        "{e}"
    );
    assert_eq!(rejected(&counters, "frame_too_large"), 1);
    // After a proper handshake, the same header as a message.
    let mut input = hello(b"SUB");
    input.extend(long_header(1 << 62));
    let (_, out) = against(&input, |s| publisher.serve_connection(s)).await;
    assert!(matches!(out, Err(ZmtpError::FrameTooLarge { .. })));
    // And to a subscriber, from a publisher.
    let mut input = hello(b"PUB");
    input.extend(long_header(1 << 62));
    let (_, out) = against(&input, |s| async move {
        Subscription::start(s, b"").await?.recv().await
    })
    .await;
    assert!(
        matches!(out, Err(ZmtpError::FrameTooLarge { len, limit }) if len == 1 << 62 && limit == MAX_MESSAGE_BYTES)
    );
}

#[tokio::test]
async fn garbage_a_wrong_peer_and_truncations_end_the_connection_with_a_reason() {
    let counters = Counters::detached();
    let publisher = Publisher::new(counters.clone());
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"GET / HTTP/1.1\r\n\r\n".repeat(8), "greeting"),
        ([&greeting()[..], b"\xff\xfe\xfd garbage"].concat(), "flags"),
        (hello(b"PUB"), "socket_type"),
        (hello(b"ROUTER"), "socket_type"),
        (greeting()[..40].to_vec(), "truncated"),
        ([&hello(b"SUB")[..], &[0x00, 0x10, 0x01]].concat(), "truncated"),
        (
            [&hello(b"SUB")[..], &encode_message(&[b"\x01a", b"b"])].concat(),
            "too_many_frames",
        ),
        ([&hello(b"SUB")[..], &[0x04, 0x00]].concat(), "command"),
    ];
    for (input, reason) in cases {
        let (_, out) = against(&input, |s| publisher.serve_connection(s)).await;
        let e = out.expect_err(reason);
        assert_eq!(e.reason(), Some(reason), "{e}");
    }
    assert_eq!(rejected(&counters, "socket_type"), 2);
}

#[tokio::test]
async fn subscriptions_are_bounded_in_number_and_length_and_repeats_cost_nothing() {
    let publisher = Publisher::new(Counters::detached());
    // 200,000 repeats of one subscription, then a cancel each way (3.0 message, 3.1 command).
    let mut input = hello(b"SUB");
    for _ in 0..200_000 {
        input.extend(encode_message(&[b"\x01kv@"]));
    }
    put_command(&mut input, "SUBSCRIBE", b"other");
    put_command(&mut input, "CANCEL", b"other");
    let (_, out) = against(&input, |s| publisher.serve_connection(s)).await;
    assert!(out.is_ok(), "{out:?}");
    // Distinct topics past the limit end the connection.
    let mut input = hello(b"SUB");
    for i in 0..=MAX_SUBSCRIPTIONS {
        input.extend(encode_message(&[format!("\x01t{i}").as_bytes()]));
    }
    let (_, out) = against(&input, |s| publisher.serve_connection(s)).await;
    assert!(matches!(out, Err(ZmtpError::Subscriptions(..))), "{out:?}");
    let mut input = hello(b"SUB");
    input.extend(encode_message(&[&[1u8; MAX_TOPIC_BYTES + 2]]));
    let (_, out) = against(&input, |s| publisher.serve_connection(s)).await;
    assert!(matches!(out, Err(ZmtpError::Subscriptions(..))), "{out:?}");
    let mut s = publisher::Subscriptions::default();
    s.subscribe(b"a").unwrap();
    s.subscribe(b"a").unwrap();
    s.cancel(b"a");
    assert!(s.matches(b"abc"), "one of two subscriptions cancelled");
    s.cancel(b"a");
    assert!(s.is_empty());
}

#[tokio::test]
async fn a_ping_is_answered_with_its_context_on_both_sides() {
    let publisher = Publisher::new(Counters::detached());
    let (mut client, server) = tokio::io::duplex(1 << 16);
    let p = Arc::clone(&publisher);
    let serving = tokio::spawn(async move { p.serve_connection(server).await });
    let mut input = hello(b"SUB");
    put_command(&mut input, "PING", b"\x00\x0actx");
    client.write_all(&input).await.unwrap();
    let mut pong = Vec::new();
    put_command(&mut pong, "PONG", b"ctx");
    let mut back = vec![0u8; hello(b"PUB").len() + pong.len()];
    tokio::time::timeout(Duration::from_secs(5), client.read_exact(&mut back))
        .await
        .expect("a PONG within 5 s")
        .unwrap();
    assert!(back.ends_with(&pong), "{back:?}");
    drop(client);
    assert!(serving.await.unwrap().is_ok());
    let mut input = hello(b"XPUB");
    put_command(&mut input, "PING", b"\x00\x0actx");
    input.extend(encode_message(&[b"t", &1u64.to_be_bytes(), b"\x90"]));
    let (back, out) = against(&input, |s| async move {
        Subscription::start(s, b"").await?.recv().await
    })
    .await;
    assert_eq!(
        out.unwrap(),
        vec![b"t".to_vec(), 1u64.to_be_bytes().to_vec(), b"\x90".to_vec()]
    );
    assert!(back.ends_with(&pong), "{back:?}");
}

/// xorshift64*: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One hostile input: a greeting (valid or broken), maybe a READY, then frames whose lengths
/// sit at every boundary the limits draw, then maybe a truncation or a flipped byte.
fn fuzz_input(rng: &mut Rng, peer: &[u8], limits: &Limits) -> Vec<u8> {
    let mut out = Vec::new();
    match rng.below(8) {
        0 => out.extend((0..rng.below(80)).map(|_| rng.next() as u8)),
        1 => {
            let mut g = greeting();
            let i = rng.below(64);
            g[i] = rng.next() as u8;
            out.extend(g);
        }
        _ => out.extend(greeting()),
    }
    match rng.below(6) {
        0 => {}
        1 => {
            let types: [&[u8]; 6] = [b"SUB", b"PUB", b"XSUB", b"XPUB", b"DEALER", b""];
            out.extend(ready_of(types[rng.below(6)]))
        }
        _ => out.extend(ready_of(peer)),
    }
    let m = limits.max_frame as u64;
    let lengths = [
        0,
        1,
        2,
        254,
        255,
        256,
        m - 1,
        m,
        m + 1,
        1 << 32,
        1 << 62,
        u64::MAX,
    ];
    for _ in 0..rng.below(6) {
        let flags = match rng.below(10) {
            0 => rng.next() as u8,
            1 => FLAG_COMMAND,
            2 => FLAG_MORE,
            _ => 0,
        };
        let len = if rng.below(3) == 0 {
            lengths[rng.below(lengths.len())]
        } else {
            rng.below(40) as u64
        };
        if len > 255 || rng.below(4) == 0 {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&len.to_be_bytes());
        } else {
            out.push(flags & !FLAG_LONG);
            out.push(len as u8);
        }
        // The body: as announced when small, else a part of it.
        let body = (len as usize).min(300 + rng.below(2000));
        let first = [1u8, 0, 5, b'P'][rng.below(4)];
        out.extend((0..body).map(|i| if i == 0 { first } else { rng.next() as u8 }));
    }
    match rng.below(4) {
        0 if !out.is_empty() => out.truncate(rng.below(out.len())),
        1 if !out.is_empty() => {
            let i = rng.below(out.len());
            out[i] ^= 1 << rng.below(8);
        }
        _ => {}
    }
    out
}

/// Subscribes over `stream` and reads until the subscription ends.
async fn read_until_an_error(stream: tokio::io::DuplexStream) -> Result<(), ZmtpError> {
    let mut sub = Subscription::start(stream, b"").await?;
    loop {
        sub.recv().await?;
    }
}

/// The acceptance of issue 62, in process: 100,000 hostile inputs against each socket's
/// state machine end every connection cleanly (no panic, no abort, no hang), each within the
/// time a read of what was sent takes.
#[tokio::test]
async fn a_hundred_thousand_fuzzed_inputs_end_cleanly_on_both_sides() {
    let counters = Counters::detached();
    let publisher = Publisher::new(counters.clone());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let t0 = Instant::now();
    let (mut ok, mut refused) = (0, 0);
    for i in 0..100_000 {
        let input = fuzz_input(&mut rng, b"SUB", &PUB_LIMITS);
        let run = against(&input, |s| publisher.serve_connection(s));
        let (_, out) = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .unwrap_or_else(|_| panic!("PUB side hung on input {i}: {input:02x?}"));
        match out {
            Ok(()) => ok += 1,
            Err(e) => {
                assert!(
                    !matches!(e, ZmtpError::HandshakeTimeout(_) | ZmtpError::Stalled(_)),
                    "{i}: {e}"
                );
                refused += 1;
            }
        }
        let input = fuzz_input(&mut rng, b"PUB", &subscriber::LIMITS);
        let run = against(&input, read_until_an_error);
        let (_, out) = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .unwrap_or_else(|_| panic!("SUB side hung on input {i}: {input:02x?}"));
        assert!(out.is_err(), "a subscription ends when its publisher does");
    }
    assert_eq!(publisher.connections(), 0);
    assert!(ok > 0 && refused > 0, "{ok} served, {refused} refused");
    let counted: u64 = ZmtpError::REASONS.iter().map(|r| rejected(&counters, r)).sum();
    assert!(
        counted > 0 && counted <= refused,
        "{counted} counted of {refused} refused"
    );
    eprintln!(
        "100,000 x 2 inputs in {:?}: {ok} PUB connections served, {refused} refused",
        t0.elapsed()
    );
}

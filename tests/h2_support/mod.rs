//! HTTP/2 frames written by hand (RFC 9113), for clients that behave as no library lets one: a
//! peer that completes the preface and SETTINGS, opens a stream or not, and then never answers a
//! PING (a vanished node). Pure bytes: the worker suite sends them over a blocking socket, the
//! webhook suite over TLS.

#![allow(dead_code)] // each suite uses its own subset

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;

const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend((stream & 0x7fff_ffff).to_be_bytes());
    f.extend(payload);
    f
}

/// The client connection preface and an empty SETTINGS frame.
pub fn preface() -> Vec<u8> {
    let mut v = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    v.extend(frame(SETTINGS, 0, 0, &[]));
    v
}

/// The acknowledgement of the server's SETTINGS.
pub fn settings_ack() -> Vec<u8> {
    frame(SETTINGS, ACK, 0, &[])
}

/// HPACK: a literal header field without indexing, its name from the static table (index
/// `name`, RFC 7541 appendix A), its value a raw string.
fn literal(name: u8, value: &str) -> Vec<u8> {
    let mut v = if name < 15 {
        vec![name]
    } else {
        vec![15, name - 15]
    };
    assert!(value.len() < 127);
    v.push(value.len() as u8);
    v.extend(value.as_bytes());
    v
}

/// HEADERS of `POST path` (content-type application/json) on `stream`, its body to follow.
pub fn post_headers(stream: u32, path: &str) -> Vec<u8> {
    // :method POST (3), :scheme http (6), then :authority (1), :path (4), content-type (31).
    let mut block = vec![0x83, 0x86];
    block.extend(literal(1, "127.0.0.1"));
    block.extend(literal(4, path));
    block.extend(literal(31, "application/json"));
    frame(HEADERS, END_HEADERS, stream, &block)
}

/// DATA on `stream`; the stream stays open unless `end`.
pub fn data(stream: u32, bytes: &[u8], end: bool) -> Vec<u8> {
    frame(DATA, if end { END_STREAM } else { 0 }, stream, bytes)
}

/// Frames read so far, as (type, flags, stream, payload); consumes the complete ones.
pub fn take_frames(buf: &mut Vec<u8>) -> Vec<(u8, u8, u32, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        if buf.len() < 9 {
            return out;
        }
        let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
        if buf.len() < 9 + len {
            return out;
        }
        let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
        out.push((buf[3], buf[4], stream, buf[9..9 + len].to_vec()));
        buf.drain(..9 + len);
    }
}

/// Whether a frame is a PING the server asks the client to acknowledge (not an ACK).
pub fn is_ping(frame: &(u8, u8, u32, Vec<u8>)) -> bool {
    frame.0 == PING && frame.1 & ACK == 0
}

/// Whether a frame is the server's SETTINGS (not an ACK).
pub fn is_settings(frame: &(u8, u8, u32, Vec<u8>)) -> bool {
    frame.0 == SETTINGS && frame.1 & ACK == 0
}

//! A worker's response on its way to the client, watched: a response that stalls between two
//! chunks past the inter-chunk timeout, breaks off (the worker killed), or whose replica is
//! marked down ([`super::fleet`]) is ended for the client. A stream (`text/event-stream`) ends
//! as a worker ends one that fails, with an OpenAI error event and `data: [DONE]`
//! (vLLM's `serving_chat.py` does the same on a failure mid-stream), so that a client reading
//! events sees why; another body is cut, so that the client sees a broken response rather
//! than a short one it could take for whole.

use std::time::Duration;

use axum::body::{Body, Bytes};
use futures::stream::BoxStream;
use futures::StreamExt;
use serde_json::json;
use tokio::sync::watch;

/// Why a started response was ended by the router; the `kind` label of
/// `kvfleet_router_upstream_errors_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    ChunkTimeout,
    ReplicaDown,
    Broken,
}

impl Cut {
    pub fn metric_label(self) -> &'static str {
        match self {
            Cut::ChunkTimeout => "chunk_timeout",
            Cut::ReplicaDown => "replica_down",
            Cut::Broken => "stream",
        }
    }

    fn message(self, replica: &str, chunk_timeout: Duration) -> String {
        match self {
            Cut::ChunkTimeout => format!(
                "replica {replica} sent nothing for {} s in the middle of the response; retry the request",
                chunk_timeout.as_secs()
            ),
            Cut::ReplicaDown => {
                format!(
                    "replica {replica} stopped answering in the middle of the response; retry the request"
                )
            }
            Cut::Broken => format!(
                "the connection to replica {replica} broke in the middle of the response; retry the request"
            ),
        }
    }
}

/// Resolves when `down` is bumped (its replica marked down); never when its sender is gone.
pub async fn marked_down(down: &mut watch::Receiver<u64>) {
    if down.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The OpenAI error event and the end of a stream, as a worker sends them on a failure.
pub fn error_events(code: &str, message: &str, after_partial_line: bool) -> Bytes {
    let error = json!({"error": {
        "message": message,
        "type": "server_error",
        "param": null,
        "code": code,
    }});
    // An event cut mid-line is closed first, so that the error is an event of its own.
    let lead = if after_partial_line { "\n\n" } else { "" };
    Bytes::from(format!("{lead}data: {error}\n\ndata: [DONE]\n\n"))
}

/// What the watch needs besides the body.
pub struct Watch {
    pub replica: String,
    pub chunk_timeout: Duration,
    pub down: watch::Receiver<u64>,
    /// The response is a stream of server-sent events.
    pub events: bool,
}

struct State<F> {
    body: BoxStream<'static, Result<Bytes, axum::Error>>,
    watch: Watch,
    on_chunk: F,
    on_cut: Box<dyn FnMut(Cut) + Send>,
    /// The last bytes sent, to tell whether the stream ended an event, or ended with `[DONE]`.
    tail: Vec<u8>,
    done: bool,
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// The response body the client gets: `body` chunk by chunk, each passed to `on_chunk`, ended
/// as the module says (`on_cut` hears why).
pub fn watched<F>(
    body: BoxStream<'static, Result<Bytes, axum::Error>>,
    watch: Watch,
    on_chunk: F,
    on_cut: Box<dyn FnMut(Cut) + Send>,
) -> Body
where
    F: FnMut(&Bytes) + Send + 'static,
{
    let state = State {
        body,
        watch,
        on_chunk,
        on_cut,
        tail: Vec::new(),
        done: false,
    };
    let stream = futures::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        let next = tokio::select! {
            next = tokio::time::timeout(s.watch.chunk_timeout, s.body.next()) => match next {
                Ok(Some(Ok(bytes))) => Ok(Some(bytes)),
                Ok(Some(Err(_))) => Err(Cut::Broken),
                Ok(None) => Ok(None),
                Err(_) => Err(Cut::ChunkTimeout),
            },
            () = marked_down(&mut s.watch.down) => Err(Cut::ReplicaDown),
        };
        match next {
            Ok(Some(bytes)) => {
                (s.on_chunk)(&bytes);
                s.tail.extend_from_slice(&bytes);
                let keep = s.tail.len().saturating_sub(DONE.len());
                s.tail.drain(..keep);
                Some((Ok(bytes), s))
            }
            Ok(None) => None,
            Err(cut) => {
                s.done = true;
                (s.on_cut)(cut);
                let finished = s.tail.ends_with(DONE);
                if s.watch.events && !finished {
                    let partial = !s.tail.is_empty() && !s.tail.ends_with(b"\n\n");
                    let message = cut.message(&s.watch.replica, s.watch.chunk_timeout);
                    Some((Ok(error_events(cut.metric_label(), &message, partial)), s))
                } else {
                    let e = std::io::Error::other(cut.message(&s.watch.replica, s.watch.chunk_timeout));
                    Some((Err(axum::Error::new(e)), s))
                }
            }
        }
    });
    Body::from_stream(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn chunks(
        parts: Vec<Result<&'static [u8], ()>>,
        then_stall: bool,
    ) -> BoxStream<'static, Result<Bytes, axum::Error>> {
        let s = futures::stream::iter(parts.into_iter().map(|p| {
            p.map(Bytes::from_static)
                .map_err(|()| axum::Error::new(std::io::Error::other("reset")))
        }));
        if then_stall {
            s.chain(futures::stream::pending()).boxed()
        } else {
            s.boxed()
        }
    }

    fn watch(events: bool, down: watch::Receiver<u64>) -> Watch {
        Watch {
            replica: "w-0".into(),
            chunk_timeout: Duration::from_millis(100),
            down,
            events,
        }
    }

    async fn text(body: Body) -> (String, bool) {
        let mut out = Vec::new();
        let mut body = body;
        while let Some(f) = body.frame().await {
            match f {
                Ok(f) => out.extend_from_slice(&f.into_data().unwrap_or_default()),
                Err(_) => return (String::from_utf8_lossy(&out).into(), false),
            }
        }
        (String::from_utf8_lossy(&out).into(), true)
    }

    #[tokio::test]
    async fn a_stalled_stream_ends_with_an_error_event_and_done() {
        let (_tx, rx) = watch::channel(0);
        let body = chunks(vec![Ok(b"data: {\"a\":1}\n\n"), Ok(b"data: {\"b\"")], true);
        let cuts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = cuts.clone();
        let out = watched(
            body,
            watch(true, rx),
            |_| {},
            Box::new(move |c| seen.lock().unwrap().push(c)),
        );
        let (t, whole) = text(out).await;
        assert!(whole, "the client gets a well-ended stream");
        assert!(
            t.starts_with("data: {\"a\":1}\n\ndata: {\"b\"\n\ndata: {\"error\""),
            "{t}"
        );
        assert!(t.contains("\"code\":\"chunk_timeout\""), "{t}");
        assert!(t.ends_with("\n\ndata: [DONE]\n\n"), "{t}");
        assert_eq!(*cuts.lock().unwrap(), [Cut::ChunkTimeout]);
    }

    #[tokio::test]
    async fn a_broken_stream_ends_with_an_error_event_and_a_finished_one_is_left_alone() {
        let (_tx, rx) = watch::channel(0);
        let body = chunks(vec![Ok(b"data: {}\n\n"), Err(())], false);
        let (t, _) = text(watched(body, watch(true, rx), |_| {}, Box::new(|_| {}))).await;
        assert!(t.starts_with("data: {}\n\ndata: {\"error\""), "{t}");
        assert!(t.contains("\"code\":\"stream\""), "{t}");
        let (_tx, rx) = watch::channel(0);
        let body = chunks(vec![Ok(b"data: {}\n\ndata: [DONE]\n\n"), Err(())], false);
        let (t, _) = text(watched(body, watch(true, rx), |_| {}, Box::new(|_| {}))).await;
        assert_eq!(t, "data: {}\n\ndata: [DONE]\n\n");
    }

    #[tokio::test]
    async fn a_replica_marked_down_ends_its_streams_and_cuts_its_other_bodies() {
        let (tx, rx) = watch::channel(0);
        let body = chunks(vec![Ok(b"data: {}\n\n")], true);
        let mut w = watch(true, rx);
        w.chunk_timeout = Duration::from_secs(60);
        let out = watched(body, w, |_| {}, Box::new(|_| {}));
        let reader = tokio::spawn(text(out));
        tokio::time::sleep(Duration::from_millis(50)).await;
        tx.send_modify(|d| *d += 1);
        let (t, whole) = tokio::time::timeout(Duration::from_secs(2), reader)
            .await
            .unwrap()
            .unwrap();
        assert!(
            whole && t.contains("\"code\":\"replica_down\"") && t.ends_with("data: [DONE]\n\n"),
            "{t}"
        );
        // Not a stream: the body is cut, not completed.
        let (_tx, rx) = watch::channel(0);
        let body = chunks(vec![Ok(b"{\"id\":")], true);
        let (t, whole) = text(watched(body, watch(false, rx), |_| {}, Box::new(|_| {}))).await;
        assert_eq!((t.as_str(), whole), ("{\"id\":", false));
    }
}

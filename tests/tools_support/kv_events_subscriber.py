"""A KV events subscriber as vLLM's example (examples/online_serving/kv_events_subscriber.py)
and the routers modelled on it subscribe: a pyzmq SUB socket connected to the publisher,
subscribed to a topic prefix, reading [topic, 8-byte big-endian sequence, msgpack payload].

It decodes with plain msgpack, not vLLM's msgspec types, and names the fields itself in vLLM's
declaration order, so it reads both layouts: events as tagged arrays (vLLM up to v0.23,
msgspec array_like=True) and as maps with the tag under "type" (vLLM from PR #42892 on,
e.g. v0.26).

It prints one JSON line per event and exits 0 after --batches batches, or 2 on --timeout.
Used by the tests in src/serving/kv_events.rs; needs pyzmq and msgpack (.ci/install-tools).
"""

import argparse
import json
import sys
import time

import msgpack
import zmq

# vLLM's fields in declaration order (vllm/distributed/kv_events.py); those after the first
# seven of BlockStored and the first two of BlockRemoved have defaults.
FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def fail(message):
    print(message, file=sys.stderr, flush=True)
    sys.exit(1)


def decode_event(raw):
    """(tag, fields, encoding, number of fields on the wire) of one event."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = {k: v for k, v in raw.items() if k != "type"}
        encoding = "map"
        if tag in FIELDS:
            unknown = set(fields) - set(FIELDS[tag])
            if unknown:
                fail(f"{tag} has fields vLLM does not: {sorted(unknown)}")
    elif isinstance(raw, list) and raw:
        tag, values = raw[0], raw[1:]
        if tag in FIELDS and len(values) > len(FIELDS[tag]):
            fail(f"{tag} has {len(values)} fields, vLLM at most {len(FIELDS[tag])}: {raw}")
        fields = dict(zip(FIELDS.get(tag, ()), values))
        encoding = "array"
    else:
        fail(f"an event is neither an array nor a map: {raw!r}")
    if tag not in FIELDS:
        fail(f"unknown event tag {tag!r}: {raw!r}")
    return tag, fields, encoding, len(fields)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True, help="e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to")
    parser.add_argument("--batches", type=int, default=1, help="exit after this many batches")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds")
    args = parser.parse_args()

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(args.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, args.topic)

    deadline = time.monotonic() + args.timeout
    received = 0
    while received < args.batches:
        left = deadline - time.monotonic()
        if left <= 0:
            print(
                f"timed out after {args.timeout}s with {received} of {args.batches} batches",
                file=sys.stderr,
            )
            sys.exit(2)
        if not sub.poll(int(min(left, 0.1) * 1000) + 1):
            continue
        frames = sub.recv_multipart()
        if len(frames) != 3:
            fail(f"expected [topic, seq, payload], got {len(frames)} frames")
        topic, seq_bytes, payload = frames
        if len(seq_bytes) != 8:
            fail(f"the sequence frame has {len(seq_bytes)} bytes, not 8")
        seq = int.from_bytes(seq_bytes, "big")
        batch = msgpack.unpackb(payload, raw=False)
        # EventBatch is array_like: [ts, events] or, since vLLM added it, [ts, events, rank].
        if not isinstance(batch, list) or len(batch) not in (2, 3):
            fail(f"the batch is not [ts, events, data_parallel_rank]: {batch!r}")
        ts, events = batch[0], batch[1]
        rank = batch[2] if len(batch) == 3 else None
        if not isinstance(ts, float):
            fail(f"ts is {type(ts).__name__}, not a float")
        for raw in events:
            tag, fields, encoding, n_fields = decode_event(raw)
            line = {
                "seq": seq,
                "topic": topic.decode("utf-8"),
                "ts": ts,
                "data_parallel_rank": rank,
                "type": tag,
                "encoding": encoding,
                "n_fields": n_fields,
            }
            line.update(fields)
            print(json.dumps(line), flush=True)
        received += 1

    sub.close(linger=0)
    context.term()


if __name__ == "__main__":
    main()

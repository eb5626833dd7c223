"""A KV events publisher as vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py) sends:
a pyzmq PUB socket bound to --endpoint, each batch one message [topic, 8-byte big-endian
sequence, msgpack EventBatch], the batch [ts, events, data_parallel_rank] with events as tagged
arrays (vLLM up to v0.23).

It publishes a batch every 20 ms until --seconds pass: one BlockStored of blocks 1 and 2 (8
tokens, block size 4) and one BlockRemoved of block 2, the sequence counting from 0. Used by
tests/kv_events_hostile.rs to check that the router's subscriber reads a libzmq publisher;
needs pyzmq and msgpack (.ci/install-tools).
"""

import argparse
import time

import msgpack
import zmq


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True, help="e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--topic", default="kv@pod@model")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(args.endpoint)
    print("bound", flush=True)
    events = [
        ["BlockStored", [1, 2], None, [10, 11, 12, 13, 14, 15, 16, 17], 4, None, "GPU", None],
        ["BlockRemoved", [2], "GPU"],
    ]
    deadline = time.monotonic() + args.seconds
    seq = 0
    while time.monotonic() < deadline:
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        pub.send_multipart([args.topic.encode(), seq.to_bytes(8, "big"), payload])
        seq += 1
        time.sleep(0.02)
    pub.close(linger=0)
    context.term()


if __name__ == "__main__":
    main()

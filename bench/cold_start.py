#!/usr/bin/env python3
"""Cold start of a `kvfleet worker` (issue 31): from the moment its process is started to its
readiness (`/readyz` 200) and to the first streamed token of a request that was waiting for it.

The worker command comes after `--`; it must listen on --port. A client sends one streamed
completion (prompt token ids) as soon as anything answers on the port, retrying every 10 ms on a
refused connection or a non-200 answer, as the router's hold does once a replica answers its
capacity scrape. Each run starts a fresh process and stops it after the first token; the page
cache is left as it is (say in the record whether the weights were read cold).

    python3 bench/cold_start.py --port 8000 --runs 3 -- target/release/kvfleet worker --listen 127.0.0.1:8000

Prints one JSON object per run and a summary line with the medians.
"""

import argparse
import http.client
import json
import statistics
import subprocess
import threading
import time


def ready_at(port, t0, stop, out):
    while not stop.is_set():
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/readyz")
            if c.getresponse().status == 200:
                out["ready_s"] = time.monotonic() - t0
                return
        except OSError:
            pass
        time.sleep(0.01)


def first_token(port, t0, prompt_tokens, model):
    body = {"prompt": list(range(1000, 1000 + prompt_tokens)), "max_tokens": 4,
            "temperature": 0, "stream": True}
    if model:
        body["model"] = model
    data = json.dumps(body)
    tries = 0
    while True:
        tries += 1
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                r.read()
                time.sleep(0.01)
                continue
            while True:
                line = r.readline()
                if not line:
                    raise RuntimeError("stream ended before a token")
                if line.startswith(b"data: {"):
                    return time.monotonic() - t0, tries
        except (ConnectionError, OSError):
            time.sleep(0.01)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--model", default="", help="the served model name (default: the worker's only one)")
    ap.add_argument("--label", default="")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    assert cmd, "give the worker command after --"
    runs = []
    for i in range(a.runs):
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop, rd = threading.Event(), {}
        th = threading.Thread(target=ready_at, args=(a.port, t0, stop, rd), daemon=True)
        th.start()
        first_s, tries = first_token(a.port, t0, a.prompt_tokens, a.model)
        th.join(timeout=5)
        stop.set()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        run = {"label": a.label, "run": i, "ready_s": rd.get("ready_s"), "first_token_s": first_s,
               "client_tries": tries}
        runs.append(run)
        print(json.dumps(run), flush=True)
        time.sleep(1)
    med = lambda k: statistics.median(r[k] for r in runs if r[k] is not None)
    print(json.dumps({"label": a.label, "runs": len(runs), "median_ready_s": round(med("ready_s"), 3),
                      "median_first_token_s": round(med("first_token_s"), 3)}), flush=True)


if __name__ == "__main__":
    main()

"""Key figures of one bench/clients/run.sh run: inference-perf's client-side report and its
server-side (Prometheus) report, summary and per stage, and guidellm's benchmark.
Usage: python3 summarize.py OUT_DIR   (plain Python, no packages)"""
import glob
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def g(d, *keys, default=float("nan")):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def ms(x):
    return f"{1000 * x:.0f} ms" if isinstance(x, (int, float)) else "-"


def inference_perf(out):
    ip = os.path.join(out, "inference-perf")
    names = ["summary"] + sorted(
        os.path.basename(p)[: -len("_lifecycle_metrics.json")] for p in glob.glob(f"{ip}/stage_*_lifecycle_metrics.json")
    )
    for name in names:
        life = load(f"{ip}/{name}_lifecycle_metrics.json")
        prom = load(f"{ip}/{name}_prometheus_metrics.json")
        if life:
            s, lat = life["successes"], life["successes"]["latency"]
            print(f"inference-perf {name}: {s['count']} ok, {g(life, 'failures', 'count', default=0)} failed, "
                  f"{g(s, 'throughput', 'requests_per_sec'):.2f} req/s, "
                  f"{g(s, 'throughput', 'output_tokens_per_sec'):.1f} output tok/s; "
                  f"TTFT p50 {ms(g(lat, 'time_to_first_token', 'median'))} p90 {ms(g(lat, 'time_to_first_token', 'p90'))}; "
                  f"ITL p50 {ms(g(lat, 'inter_token_latency', 'median'))} p90 {ms(g(lat, 'inter_token_latency', 'p90'))}; "
                  f"TPOT mean {ms(g(lat, 'time_per_output_token', 'mean'))}")
        if prom:
            s = prom["successes"]
            print(f"  server-side (Prometheus): {g(s, 'rate'):.3f} req/s, {g(s, 'output_len', 'rate'):.1f} output tok/s; "
                  f"TTFT mean {ms(g(s, 'time_to_first_token', 'mean'))} p50 {ms(g(s, 'time_to_first_token', 'median'))} "
                  f"p90 {ms(g(s, 'time_to_first_token', 'p90'))}; ITL mean {ms(g(s, 'inter_token_latency', 'mean'))} "
                  f"p50 {ms(g(s, 'inter_token_latency', 'median'))}; KV usage mean "
                  f"{100 * g(s, 'kv_cache_usage_percentage', 'mean'):.1f}% p90 {100 * g(s, 'kv_cache_usage_percentage', 'p90'):.1f}%; "
                  f"running mean {g(s, 'num_requests_running', 'mean'):.2f}")


def guidellm(out):
    d = load(os.path.join(out, "guidellm", "benchmarks.json"))
    for b in (d or {}).get("benchmarks", []):
        m = b["metrics"]
        ok = lambda k, *p: g(m, k, "successful", *p)  # noqa: E731
        t = m["request_totals"]
        print(f"guidellm {g(b, 'config', 'strategy', 'type_', default='')} over {b['duration']:.0f} s: "
              f"{t['successful']} ok, {t['errored']} errored, {t['incomplete']} incomplete; "
              f"{ok('requests_per_second', 'mean'):.2f} req/s, {ok('output_tokens_per_second', 'mean'):.1f} output tok/s; "
              f"TTFT p50 {ok('time_to_first_token_ms', 'median'):.0f} ms p90 {ok('time_to_first_token_ms', 'percentiles', 'p90'):.0f} ms; "
              f"ITL p50 {ok('inter_token_latency_ms', 'median'):.0f} ms p90 {ok('inter_token_latency_ms', 'percentiles', 'p90'):.0f} ms")


if __name__ == "__main__":
    inference_perf(sys.argv[1])
    guidellm(sys.argv[1])

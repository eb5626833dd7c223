"""Writes the PromQL that inference-perf's vLLM client issues for its server-side report.

The queries come from inference-perf's own code, not a transcription: vLLMModelServerClient
builds its label filters (`model_name='...'` plus any additional filters) and its metric set
(inference_perf/client/modelserver/vllm_client.py), and each Counter/Gauge/HistogramMetric
renders its queries (inference_perf/client/modelserver/metrics/{counter,gauge,histogram}/base.py).
tests/inference_perf_report.rs evaluates the result against a real Prometheus scraping the worker.

Needs inference-perf installed (Python >= 3.12; bench/clients.md):
    python bench/clients/inference_perf_queries.py > tests/fixtures/inference_perf_vllm_queries.json
"""
import json
import sys
from importlib.metadata import version
from unittest import mock

from inference_perf.client.modelserver.openai_client import openAIModelServerClient
from inference_perf.client.modelserver.vllm_client import vLLMModelServerClient

# Placeholders the test substitutes: the window is rendered with `{duration:.0f}s`, so a
# sentinel number stands for it.
MODEL = "__MODEL__"
WINDOW = 987654321


def main() -> None:
    # The base client's constructor talks to the server (GET /v1/models) and loads a tokenizer;
    # only the vLLM client's own filter line and metric set are wanted here.
    with mock.patch.object(openAIModelServerClient, "__init__", lambda self, *a, **k: None):
        client = vLLMModelServerClient(
            None, None, "http://unused", MODEL, None, 1, additional_filters=[]
        )
    metadata = client.get_prometheus_metric_metadata()
    metrics = []
    for field, metric in metadata:
        queries = [
            q.replace(f"{WINDOW}s", "${window}").replace(MODEL, "${model}")
            for q in metric.get_queries(WINDOW, metadata.filters)
        ]
        metrics.append(
            {"field": field, "kind": type(metric).__name__, "metric": metric.metric_name, "queries": queries}
        )
    json.dump(
        {
            "source": f"inference-perf {version('inference-perf')}, vLLMModelServerClient",
            "filters": metadata.filters.replace(MODEL, "${model}"),
            "metrics": metrics,
        },
        sys.stdout,
        indent=1,
    )
    print()


if __name__ == "__main__":
    main()

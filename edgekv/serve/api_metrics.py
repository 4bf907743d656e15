"""The server's Prometheus metrics, read from the engines' and the pool's counters at scrape time."""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from edgekv.summary import percentile


class EngineCollector:
    """Prometheus metrics read from the engines' counters at scrape time."""

    def __init__(self, app: FastAPI):
        self.app = app

    def collect(self):
        pool = self.app.state.pool
        served = pool.loaded()
        counters = {"requests": "Requests accepted", "finished": "Requests finished", "cancelled":
                    "Requests cancelled (client gone)", "errors": "Engine steps that failed", "prompt_tokens":
                    "User-prompt tokens prefilled", "completion_tokens": "Tokens generated", "steps":
                    "Engine steps", "batched_tokens": "Tokens processed by engine forwards"}
        for key, doc in counters.items():
            c = CounterMetricFamily(f"edgekv_{key}", doc, labels=["model"])
            for name, engine in served.items():
                c.add_metric([name], engine.stats[key])
            yield c
        for key in ("waiting", "running"):
            g = GaugeMetricFamily(f"edgekv_requests_{key}", f"Requests {key}", labels=["model"])
            for name, engine in served.items():
                g.add_metric([name], engine.load()[key])
            yield g
        g = GaugeMetricFamily("edgekv_ttft_seconds", "Time to first token, recent requests", labels=["model",
                                                                                                  "quantile"])
        for name, engine in served.items():
            ttfts = list(engine.stats["ttft_s"])
            for q in (0.5, 0.9, 0.99):
                if ttfts:
                    g.add_metric([name, str(q)], percentile(ttfts, q))
        yield g
        yield CounterMetricFamily("edgekv_http_errors", "Requests answered with an error",
                                  value=self.app.state.http_errors)
        for key in ("loads", "unloads"):
            yield CounterMetricFamily(f"edgekv_export_{key}", f"Export {key} (memory budget)", value=pool.stats[key])
        yield GaugeMetricFamily("edgekv_system_kv_bytes", "System KV held by loaded exports", value=pool.held_bytes())

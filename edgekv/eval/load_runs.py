"""Latency under load (the paper's Fig. 7): Poisson arrivals at given rates against a loopback `serve-edge`.

Each strategy gets one server: the edge strategies hold one system prompt's KV (from their export) and answer
every request's user prompt on it; `edge-only` / `cloud-only` hold no system KV and prefill each request's whole
prompt. Arrivals are seeded; a run stops admitting after `seconds` and waits (bounded) for what is in flight.
"""

from __future__ import annotations

import csv
import json
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from edgekv.eval.artefacts import Artefacts
from edgekv.eval.datasets import Request
from edgekv.eval.strategies import parse_strategy
from edgekv.progress import Tasks
from edgekv.serve.http_server import EdgeServer
from edgekv.serve.session import EdgeSession
from edgekv.summary import mean, percentile


def post_json(url: str, body: bytes, timeout: float) -> tuple[int, dict]:
    """POST a JSON body; (HTTP status, parsed answer), with status -1 and {} when the server is unreachable."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return -1, {}


def poisson_run(session: EdgeSession, prompts: list[str], rate: float, seconds: float, max_tokens: int,
                seed: int = 0, timeout: float = 300.0) -> list[dict]:
    """Serve `session` on loopback; send prompts (cycled) at Poisson rate `rate`/s for `seconds`; one row per
    request: arrival offset, latency, tokens, status."""
    server = EdgeServer(session, "127.0.0.1", 0, max_tokens_limit=max(max_tokens, 1))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    rng = random.Random(seed)
    rows: list[dict] = []
    workers = []
    start = time.perf_counter()

    def one(k: int, offset: float) -> None:
        body = json.dumps({"prompt": prompts[k % len(prompts)], "max_tokens": max_tokens}).encode()
        sent = time.perf_counter()
        status, answer = post_json(url, body, timeout)
        latency = time.perf_counter() - sent
        tokens = answer.get("usage", {}).get("completion_tokens", 0) if status == 200 else 0
        rows.append({"arrival_s": offset, "latency_s": latency, "tokens": tokens, "status": status})

    k, t = 0, rng.expovariate(rate)
    try:
        while t < seconds:
            delay = start + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            w = threading.Thread(target=one, args=(k, t), daemon=True)
            w.start()
            workers.append(w)
            k += 1
            t += rng.expovariate(rate)
        for w in workers:
            w.join(timeout)
    finally:
        server.shutdown()
        server.server_close()
    return rows


def summarize_load(strategy: str, rate: float, rows: list[dict]) -> dict:
    """Average latency and normalized latency (s per output token, the paper's measure) of one run."""
    ok = [r for r in rows if r["status"] == 200]
    lat = sorted(r["latency_s"] for r in ok)
    norm = [r["latency_s"] / max(1, r["tokens"]) for r in ok]
    return {"strategy": strategy, "rate": rate, "requests": len(rows), "errors": len(rows) - len(ok),
            "latency_mean_s": mean(lat), "latency_p90_s": percentile(lat, 0.9),
            "normalized_latency_s_per_token": mean(norm)}


LOAD_KEYS = ("load_seconds", "load_dataset", "load_max_tokens", "seed")


def reusable_load(out: Path, cfg) -> list[dict]:
    """Load-run rows of an earlier run in `out` made with the same load settings (so adding a strategy does not
    rerun the others' load runs); [] when there are none or the settings differ."""
    try:
        before = json.loads((out / "config.json").read_text(encoding="utf-8"))
        with (out / "load.csv").open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, json.JSONDecodeError):
        return []
    if any(before.get(k) != getattr(cfg, k) for k in LOAD_KEYS):
        return []
    number = lambda v: None if v in ("", None) else float(v)  # noqa: E731
    return [{"strategy": r["strategy"], "rate": float(r["rate"]), "requests": int(r["requests"]),
             "errors": int(r["errors"]), "latency_mean_s": number(r["latency_mean_s"]),
             "latency_p90_s": number(r["latency_p90_s"]),
             "normalized_latency_s_per_token": number(r["normalized_latency_s_per_token"])} for r in rows]


def load_curves(artefacts: Artefacts, requests: list[Request], tasks: Tasks, earlier: list[dict] | None = None
                ) -> list[dict]:
    """Poisson load runs per strategy and rate (see load_runs.py); (strategy, rate) pairs in `earlier` are kept."""
    cfg = artefacts.cfg
    kept = {(r["strategy"], r["rate"]): r for r in earlier or [] if r["strategy"] in cfg.strategies
            and r["rate"] in cfg.load_rates}
    advance = tasks.task("load runs", len(cfg.strategies) * len(cfg.load_rates) - len(kept))
    system = requests[0].system
    out = []
    for strategy in cfg.strategies:
        if all((strategy, rate) in kept for rate in cfg.load_rates):
            out += [kept[(strategy, rate)] for rate in cfg.load_rates]
            continue
        session, reuses = parse_strategy(strategy).load_session(artefacts, system)
        prompts = [r.user if reuses else system + r.user for r in requests]
        session.wait_loaded()
        for rate in cfg.load_rates:
            if (strategy, rate) in kept:
                out.append(kept[(strategy, rate)])
                continue
            rows = poisson_run(session, prompts, rate, cfg.load_seconds, cfg.load_max_tokens, cfg.seed)
            out.append(summarize_load(strategy, rate, rows))
            advance()
    return out

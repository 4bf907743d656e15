"""Loopback load test of `serve-edge` on the default edge model: C concurrent clients for T seconds, then stop.

    python -m bench.load [--kv runs/kv-default] [--clients 20] [--seconds 30] [--max-tokens 8]

Prints requests served, errors, latency percentiles, and process RSS before (after warm-up) and after.
Without --kv a same-model export of data/prompts/system_prompt.txt (m = 12) is made first.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from edgekv.eval.load_runs import post_json
from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.models.loading import load_model
from edgekv.serve.http_server import EdgeServer, percentile
from edgekv.serve.session import EdgeSession

ROOT = Path(__file__).resolve().parents[1]


def post(url: str, body: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    status, _ = post_json(url, body, timeout=120)
    return status, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default=None)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    kv = args.kv
    if kv is None:
        kv = "runs/bench-load/kv"
        run_compress(CompressConfig(out=kv, cloud="default-edge", edge="default-edge", start_layer=12,
                                    system_prompt=f"@{ROOT / 'data/prompts/system_prompt.txt'}", quant="bf16"))
    session = EdgeSession(load_model("default-edge"), kv, cache_dir="runs/bench-load/cache")
    server = EdgeServer(session, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    prompts = [f"User: give me tip number {k} for writing a clear bug report.\nAssistant:" for k in range(50)]
    body = lambda k: json.dumps({"prompt": prompts[k % 50], "max_tokens": args.max_tokens}).encode()  # noqa: E731
    for k in range(5):  # warm-up
        post(url, body(k))
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    stop = time.time() + args.seconds
    results: list[tuple[int, float]] = []

    def client(c: int) -> None:
        k = c
        while time.time() < stop:
            results.append(post(url, body(k)))
            k += args.clients

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    rss_after = proc.memory_info().rss
    with urllib.request.urlopen(url.replace("/v1/completions", "/metrics")) as r:
        metrics = json.loads(r.read())
    server.shutdown()
    ok = [lat for status, lat in results if status == 200]
    errors = len(results) - len(ok)
    print(f"{args.clients} clients × {args.seconds:.0f} s (ran {wall:.1f} s): {len(results)} requests, "
          f"{errors} errors, {len(ok) / wall:.2f} req/s, {args.max_tokens} tokens each")
    print(f"latency p50 {percentile(ok, 0.5):.2f} s, p90 {percentile(ok, 0.9):.2f} s, max {max(ok):.2f} s; "
          f"server TTFT p50 {metrics['ttft_s']['p50'] * 1e3:.0f} ms, p99 {metrics['ttft_s']['p99'] * 1e3:.0f} ms")
    print(f"RSS before {rss_before / 2**20:.0f} MiB, after {rss_after / 2**20:.0f} MiB "
          f"({(rss_after - rss_before) / rss_before * 100:+.1f} %)")


if __name__ == "__main__":
    main()

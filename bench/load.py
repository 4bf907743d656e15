"""Loopback soak of `serve-edge` on the default edge model: C clients for T seconds, valid requests mixed with
abuse (malformed JSON, oversized bodies, wrong API keys, streams the client drops after the first chunk).

    python -m bench.load [--kv runs/kv-default] [--clients 64] [--seconds 300] [--warmup 30] [--max-tokens 8]
                         [--abuse 0.25] [--json OUT]

Each client loops: with probability --abuse it sends one of the four bad kinds, else a valid completion (a
quarter of them streamed to the end). Prints and writes: valid requests served and failed (a valid request
fails if it gets anything but 200 or its stream lacks [DONE]), bad requests answered with the expected 4xx,
latency percentiles, requests/s, whether the server still answers, and the server process's RSS after warm-up
vs at the end (the clients run in a process of their own). Without --kv a same-model export of
data/prompts/system_prompt.txt (m = 12) is made first.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import random
import threading
import time
from pathlib import Path

import psutil

from edgekv.atomic import write_text_atomic
from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.models.loading import load_model
from edgekv.models.prepack import prepack_linears
from edgekv.runtime import limit_onednn_cache, on_fresh_thread
from edgekv.serve.http_server import EdgeServer
from edgekv.serve.session import EdgeSession
from edgekv.summary import percentile

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-soak"


def request(port: int, body: bytes, key: str | None = KEY, stream_drop: bool = False,
            timeout: float = 300) -> tuple[int, bytes]:
    """POST /v1/completions; (status, body). `stream_drop`: read one chunk of a stream, then hang up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        resp = conn.getresponse()
        if stream_drop:
            return resp.status, resp.read1(64)
        return resp.status, resp.read()
    except OSError:
        return -1, b""
    finally:
        conn.close()


def client(port: int, prompts: list[str], stop_at: float, abuse: float, max_tokens: int, seed: int,
           rows: list[dict], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    while time.time() < stop_at:
        prompt = prompts[rng.randrange(len(prompts))]
        kind = rng.choice(["malformed", "oversized", "wrong-key", "drop-stream"]) if rng.random() < abuse else (
            "valid-stream" if rng.random() < 0.25 else "valid")
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": "stream" in kind}).encode()
        start = time.perf_counter()
        if kind == "malformed":
            status, out = request(port, b'{"prompt": "unterminated')
            ok = status == 400
        elif kind == "oversized":
            status, out = request(port, json.dumps({"prompt": "x" * (2 << 20)}).encode())
            ok = status == 413
        elif kind == "wrong-key":
            status, out = request(port, body, key="sk-wrong")
            ok = status == 401
        elif kind == "drop-stream":
            status, out = request(port, body, stream_drop=True)
            ok = status == 200
        else:
            status, out = request(port, body)
            ok = status == 200 and (kind == "valid" or out.rstrip().endswith(b"data: [DONE]"))
        with lock:
            rows.append({"kind": kind, "status": status, "ok": ok, "latency_s": time.perf_counter() - start})


def run_clients(port: int, prompts: list[str], stop_at: float, abuse: float, max_tokens: int, n: int) -> list[dict]:
    """The soak's clients, as threads of a process of their own."""
    rows: list[dict] = []
    lock = threading.Lock()
    threads = [threading.Thread(target=client, args=(port, prompts, stop_at, abuse, max_tokens, c + 1, rows, lock))
               for c in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default=None)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of the same load before the RSS baseline")
    ap.add_argument("--abuse", type=float, default=0.25, help="share of requests that are bad on purpose")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-prepack", action="store_true", help="keep nn.Linear (serve-edge prepacks by default)")
    args = ap.parse_args(argv)
    limit_onednn_cache()  # as serve-edge does, before this process's first matmul
    def setup() -> EdgeSession:
        kv = args.kv
        if kv is None:
            kv = "runs/bench-load/kv"
            run_compress(CompressConfig(out=kv, cloud="default-edge", edge="default-edge", start_layer=12,
                                        system_prompt=f"@{ROOT / 'data/prompts/system_prompt.txt'}", quant="bf16"))
        edge = load_model("default-edge")
        if not args.no_prepack:
            prepack_linears(edge.model)  # as serve-edge does
        return EdgeSession(edge, kv, cache_dir="runs/bench-load/cache")

    session = on_fresh_thread(setup)  # as serve-edge does: the engine's thread keeps the only OpenMP pool
    server = EdgeServer(session, "127.0.0.1", 0, api_key=KEY, max_batch=64, max_queue=256)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    prompts = [f"User: give me tip number {k} for writing a clear bug report.\nAssistant:" for k in range(50)]
    ctx = multiprocessing.get_context("spawn")  # the clients' own buffers must not count in the server's RSS
    proc = psutil.Process()
    with ctx.Pool(1) as clients:
        # warm-up at full concurrency: the allocator reaches the working set of full batches before the baseline
        clients.apply(run_clients, (port, prompts, time.time() + args.warmup, args.abuse, args.max_tokens,
                                    args.clients))
        rss_before = proc.memory_info().rss
        start = time.perf_counter()
        timeline: list[tuple[float, float]] = []  # (s, MiB) every 10 s: a plateau is a cache, a slope a leak
        done = threading.Event()

        def sample():
            while not done.wait(10.0):
                timeline.append((time.perf_counter() - start, proc.memory_info().rss / 2**20))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rows = clients.apply(run_clients, (port, prompts, time.time() + args.seconds, args.abuse, args.max_tokens,
                                           args.clients))
        done.set()
    wall = time.perf_counter() - start
    rss_after = proc.memory_info().rss
    alive = request(port, json.dumps({"prompt": prompts[0], "max_tokens": 2}).encode())[0] == 200
    stats = dict(server.engine.stats)
    server.shutdown()
    server.server_close()
    valid = [r for r in rows if r["kind"].startswith("valid")]
    bad = [r for r in rows if not r["kind"].startswith("valid")]
    lat = [r["latency_s"] for r in valid if r["ok"]]
    out = {"clients": args.clients, "seconds": wall, "max_tokens": args.max_tokens, "abuse": args.abuse,
           "prepacked": not args.no_prepack,
           "valid": len(valid), "valid_failed": sum(not r["ok"] for r in valid),
           "bad": {k: {"n": sum(r["kind"] == k for r in bad), "as_expected": sum(r["kind"] == k and r["ok"]
                                                                                 for r in bad)}
                   for k in ("malformed", "oversized", "wrong-key", "drop-stream")},
           "valid_per_s": len(lat) / wall, "latency_p50_s": percentile(lat, 0.5),
           "latency_p99_s": percentile(lat, 0.99), "server_alive": alive, "cancelled": stats["cancelled"],
           "rss_before_mb": rss_before / 2**20, "rss_after_mb": rss_after / 2**20,
           "rss_growth": (rss_after - rss_before) / rss_before, "rss_timeline_mib": timeline}
    print(f"{args.clients} clients × {wall:.0f} s: {out['valid']} valid requests, {out['valid_failed']} failed; "
          f"{out['valid_per_s']:.2f} valid req/s, latency p50 {out['latency_p50_s']:.2f} s p99 "
          f"{out['latency_p99_s']:.2f} s; bad requests {json.dumps(out['bad'])}; server alive {alive}; "
          f"{stats['cancelled']} cancelled; RSS {out['rss_before_mb']:.0f} → {out['rss_after_mb']:.0f} MiB "
          f"({out['rss_growth'] * 100:+.1f} %); RSS every 10 s: {', '.join(f'{m:.0f}' for _, m in timeline)} MiB")
    if args.json:
        write_text_atomic(args.json, json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

"""Serving throughput on the default edge: the engine (batched relay decoding over one shared system KV) against
the engine at batch size 1 (one at a time) and transformers' continuous batching (`generate_batch` on the full
prompts), side by side in one run.

    python -m bench.serve_throughput [--system 1024] [--answer 32] [--clients 1,4,16,64] [--json OUT]

One system prompt of S tokens (a local-prefill session: the same KV an export gives), short ShareGPT questions
as user prompts, A generated tokens each (EOS ignored so every answer has A tokens), after a warm-up. For C
clients, C requests arrive together: requests/s, generated tokens/s, TTFT and latency p50/p99, and peak RSS
above the warm baseline per client (sampled every 20 ms). transformers' `generate_batch` gets the same C
requests as full prompts (system + user) at once; it has no per-request TTFT, so its latency is the batch's.
The engine's conditions run first for every C, transformers' after them, each on a compute thread of its own
that ends with it, the main thread computing nothing: on this 2-core machine two live OpenMP pools throttle each
other (see `edgekv.serve.engine.Engine`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import psutil
import torch
from transformers import GenerationConfig

from edgekv.atomic import write_text_atomic
from edgekv.models.loading import load_model
from edgekv.models.prepack import prepack_linears
from edgekv.runtime import on_fresh_thread
from edgekv.serve.requests import GenRequest
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession
from edgekv.summary import percentile
from edgekv.texts import iter_sharegpt, sharegpt_texts


class PeakRSS:
    """The process's peak RSS while inside the block, sampled every 20 ms."""

    def __enter__(self):
        self.proc, self.peak, self.done = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.done.wait(0.02)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def user_prompts(tokenizer, n: int) -> list[torch.Tensor]:
    """Short first questions of ShareGPT conversations (8..64 tokens), as token ids."""
    out = []
    for record in iter_sharegpt():
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            ids = tokenizer(f"\nUser: {turns[0]['value'].strip()}\nAssistant:", add_special_tokens=False)["input_ids"]
            if 8 <= len(ids) <= 64:
                out.append(torch.tensor(ids))
                if len(out) == n:
                    return out
    raise SystemExit("not enough short ShareGPT questions")


def run_engine(session: EdgeSession, prompts: list[torch.Tensor], answer: int, max_batch: int) -> dict:
    """C requests submitted together to an engine; per-request TTFT and latency."""
    engine = session.engine(max_batch=max_batch, max_queue=max(len(prompts), 1))
    try:
        engine.generate(GenRequest(prompts[0], SamplingParams(max_new_tokens=4)))  # warm-up
        base = psutil.Process().memory_info().rss
        with PeakRSS() as rss:
            start = time.perf_counter()
            results = engine.generate_all([GenRequest(p, SamplingParams(max_new_tokens=answer)) for p in prompts])
            wall = time.perf_counter() - start
    finally:
        engine.close()
    tokens = sum(len(r.token_ids) for r in results)
    return summarize(wall, tokens, [r.ttft_s for r in results], [r.total_s for r in results], rss.peak - base,
                     len(prompts))


def run_transformers(model, system: torch.Tensor, prompts: list[torch.Tensor], answer: int) -> dict:
    """transformers' continuous batching on the full prompts (system + user), all submitted at once."""
    inputs = [torch.cat([system, p]).tolist() for p in prompts]
    model.set_attn_implementation("sdpa")  # the engine selected edgekv's attention; CB wants a stock one
    config = GenerationConfig(max_new_tokens=answer, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=inputs[:1], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0), progress_bar=False)  # warm-up
    base = psutil.Process().memory_info().rss
    with PeakRSS() as rss:
        start = time.perf_counter()
        out = model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
        wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return summarize(wall, tokens, [], [wall] * len(prompts), rss.peak - base, len(prompts))


def summarize(wall: float, tokens: int, ttfts: list[float], latencies: list[float], rss_delta: int,
              clients: int) -> dict:
    return {"wall_s": wall, "requests_per_s": clients / wall, "tokens_per_s": tokens / wall, "tokens": tokens,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "latency_p50_s": percentile(latencies, 0.5), "latency_p99_s": percentile(latencies, 0.99),
            "rss_per_client_mb": rss_delta / clients / 2**20}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edge", default="default-edge")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--system", type=int, default=1024, help="system-prompt tokens")
    ap.add_argument("--answer", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--skip-transformers-above", type=int, default=64,
                    help="run transformers' generate_batch only up to this many clients (it prefills every prompt)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-prepack", action="store_true", help="keep nn.Linear (serve-edge prepacks by default)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    def setup() -> EdgeSession:
        edge = load_model(args.edge, args.dtype)
        if not args.no_prepack:  # as serve-edge does; transformers' generate_batch runs on the same prepacked model
            prepack_linears(edge.model)
        text = " ".join(sharegpt_texts(40).texts)
        system = torch.tensor(edge.tokenizer(text)["input_ids"][:args.system])
        return EdgeSession(edge, None, edge.tokenizer.decode(system), cache_dir=None)

    # as serve-edge does: the main thread never computes, each condition's compute thread ends with it, so one
    # OpenMP pool is alive at a time (two throttle each other's spin-waits on this 2-core machine; see Engine)
    session = on_fresh_thread(setup)
    edge = session.edge
    session.eos_ids.clear()  # every answer has --answer tokens
    system = session.system.system_ids
    levels = [int(c) for c in args.clients.split(",")]
    pool = user_prompts(edge.tokenizer, max(levels))
    rows = []
    for clients in levels:  # the engine's conditions first: transformers' manager may outlive its call
        prompts = pool[:clients]
        rows.append({"clients": clients, "system_tokens": int(system.numel()), "answer_tokens": args.answer,
                     "engine": run_engine(session, prompts, args.answer, max_batch=max(levels)),
                     "one_at_a_time": run_engine(session, prompts, args.answer, max_batch=1)})
        print(f"{clients:>3} clients: engine {rows[-1]['engine']['tokens_per_s']:.1f} tok/s, one at a time "
              f"{rows[-1]['one_at_a_time']['tokens_per_s']:.1f} tok/s", flush=True)
    for row in rows:
        clients = row["clients"]
        if clients <= args.skip_transformers_above:
            row["transformers_cb"] = on_fresh_thread(run_transformers, edge.model, system, pool[:clients],
                                                     args.answer)
            row["threads_alive_after_transformers"] = threading.active_count()
        e, o, t = row["engine"], row["one_at_a_time"], row.get("transformers_cb")
        row["engine_over_one_at_a_time"] = e["tokens_per_s"] / o["tokens_per_s"]
        row["engine_over_transformers"] = e["tokens_per_s"] / t["tokens_per_s"] if t else None
        print(f"{clients:>3} clients: tokens/s engine {e['tokens_per_s']:.1f}, one-at-a-time {o['tokens_per_s']:.1f}"
              f" ({row['engine_over_one_at_a_time']:.2f}×)"
              + (f", transformers CB {t['tokens_per_s']:.1f} ({row['engine_over_transformers']:.2f}×)" if t else "")
              + f"; TTFT p50 engine {e['ttft_p50_s'] * 1e3:.0f} ms vs one-at-a-time {o['ttft_p50_s'] * 1e3:.0f} ms;"
              f" latency p50/p99 engine {e['latency_p50_s']:.2f}/{e['latency_p99_s']:.2f} s; "
              f"RSS/client engine {e['rss_per_client_mb']:.1f} MB", flush=True)
    out = {"edge": args.edge, "dtype": args.dtype, "threads": torch.get_num_threads(), "prepacked": not args.no_prepack,
           "rows": rows,
           "median_ratio_over_one_at_a_time": statistics.median(r["engine_over_one_at_a_time"] for r in rows)}
    if args.json:
        write_text_atomic(args.json, json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

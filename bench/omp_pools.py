"""Bench what a second OpenMP pool costs the serving engine: serve-edge's session opened on the main thread (which
then keeps a libgomp pool beside the engine thread's) against opened on a thread that ends (`open_session`,
what serve-edge does), each in a fresh process, alternated.

    python -m bench.omp_pools [--rounds 2] [--requests 9]

The default edge in bf16, prepacked, on a same-model export (m = 12) of a 1,024-token XSum system prompt; the
engine on its own thread (as serve-edge runs it): warm TTFT of 64-token ShareGPT prompts (median of
--requests) and decode ms/token (median of 3 answers of 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WORK = Path("runs/bench-omp-pools")


def measure(mode: str, requests: int) -> dict:
    """One process's figures; `mode` is main or fresh."""
    import torch

    from edgekv.serve.requests import GenRequest
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.serve_job import ServeConfig, _open, open_session
    from edgekv.texts import sharegpt_texts

    cfg = ServeConfig(kv=str(WORK / "kv-same"), cache_dir=str(WORK / "cache"))
    # open_session works on a thread that ends; `_open` is the same work on this thread (the two-pool case)
    session = open_session(cfg) if mode == "fresh" else _open(cfg)
    session.wait_loaded()
    tok = session.edge.tokenizer
    users = [torch.tensor(ids[:64]) for ids in (tok(t, add_special_tokens=False)["input_ids"]
                                                for t in sharegpt_texts(200, offset=3000).texts) if len(ids) >= 64][:3]
    engine = session.engine(max_batch=1)
    try:
        for u in users:  # warm-up
            engine.generate(GenRequest(u, SamplingParams(max_new_tokens=1)))
        ttft = [engine.generate(GenRequest(users[r % 3], SamplingParams(max_new_tokens=1))).ttft_s
                for r in range(requests)]
        decode = []
        for r in range(3):
            res = engine.generate(GenRequest(users[r], SamplingParams(max_new_tokens=33)))
            decode.append((res.total_s - res.ttft_s) / 32)
    finally:
        engine.close()
    return {"mode": mode, "ttft_ms": statistics.median(ttft) * 1e3,
            "decode_ms_per_token": statistics.median(decode) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--one", choices=("main", "fresh"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.requests)))
        return
    if not (WORK / "kv-same" / "manifest.json").exists():
        from bench.compress import xsum_prompt
        from edgekv.kv.compress_job import CompressConfig, run_compress
        from edgekv.models.loading import load_model

        tok = load_model("default-edge", "bfloat16").tokenizer
        run_compress(CompressConfig(out=str(WORK / "kv-same"), cloud="default-edge", edge="default-edge",
                                    system_prompt=tok.decode(xsum_prompt(tok, 1024)), quant="bf16", start_layer=12))
    rows = []
    for _ in range(args.rounds):
        for mode in ("main", "fresh"):
            out = subprocess.run([sys.executable, "-m", "bench.omp_pools", "--one", mode, "--requests",
                                  str(args.requests)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{mode:>5}: warm TTFT {rows[-1]['ttft_ms']:.1f} ms, decode {rows[-1]['decode_ms_per_token']:.1f} "
                  "ms/token", flush=True)
    for mode, label in (("main", "session opened on the main thread (two pools)"),
                        ("fresh", "session opened on a thread that ends (one pool)")):
        r = [x for x in rows if x["mode"] == mode]
        print(f"{label}: TTFT {statistics.median(x['ttft_ms'] for x in r):.1f} ms, decode "
              f"{statistics.median(x['decode_ms_per_token'] for x in r):.1f} ms/token")


if __name__ == "__main__":
    main()

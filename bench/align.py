"""Bench `edgekv align` on the default pair: forward-pass time vs similarity time, measured in one run.

    python bench/align.py [--num-texts 32] [--max-tokens 256] [--repeats 3] [--json OUT.json]

Prints the median over repeats of each stage and the share of wall time spent on similarity, at full
token count and at seeded subsamples (with the largest change in any matrix entry the subsample causes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from edgekv.align.align_job import AlignConfig, calibration_source, drop_massive_tokens, similarity_all
from edgekv.models.capture import capture
from edgekv.models.loading import load_model
from edgekv.progress import Tasks
from edgekv.texts import tokenize


def _median_time(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-texts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--subsamples", default="4096,2048,1024")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-outliers", action="store_true", help="do not leave out massive-activation tokens")
    args = ap.parse_args()

    cfg = AlignConfig(out="unused", num_texts=args.num_texts, max_tokens=args.max_tokens)
    source = calibration_source(cfg)
    cloud, edge = load_model(cfg.cloud, cfg.dtype), load_model(cfg.edge, cfg.dtype)
    seqs = tokenize(edge.tokenizer, source.texts, cfg.max_tokens, min_tokens=cfg.skip_first + 2)
    select = lambda t, n: torch.arange(cfg.skip_first, n)  # noqa: E731
    tasks = Tasks(None)
    t_cloud, cloud_acts = _median_time(lambda: capture(cloud.model, seqs, ["hidden"], select), args.repeats)
    t_edge, edge_acts = _median_time(lambda: capture(edge.model, seqs, ["hidden"], select), args.repeats)
    forward = t_cloud + t_edge
    dropped = drop_massive_tokens(cloud_acts, edge_acts, None if args.keep_outliers else cfg.outlier_ratio,
                                  edge.tokenizer)
    print(f"left out {len(dropped)} massive-activation tokens: {dropped}")
    xs, ys = cloud_acts.layers["hidden"], edge_acts.layers["hidden"]
    n = xs[0].shape[0]
    print(f"{source.description}; {len(seqs)} texts, {n} tokens; torch threads {torch.get_num_threads()}")
    print(f"forward (median of {args.repeats}): cloud {t_cloud:.2f} s + edge {t_edge:.2f} s = {forward:.2f} s")

    rows = []
    t_full, full = _median_time(lambda: similarity_all(xs, ys, cfg, tasks, "hidden"), args.repeats)
    rows.append({"tokens": n, "similarity_s": t_full, "max_abs_change": 0.0})
    for size in [int(s) for s in args.subsamples.split(",") if int(s) < n]:
        keep = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:size].sort().values
        sub_x, sub_y = [x[keep] for x in xs], [y[keep] for y in ys]
        t_sub, sub = _median_time(lambda: similarity_all(sub_x, sub_y, cfg, tasks, "hidden"), args.repeats)
        change = max(float((sub[k] - full[k]).abs().max()) for k in ("linear_cka", "debiased_cka"))
        rows.append({"tokens": size, "similarity_s": t_sub, "max_abs_change": change})

    print(f"{'CKA tokens':>10} {'similarity s':>13} {'forward s':>10} {'sim/(fwd+sim)':>14} {'max |ΔCKA|':>11}")
    for r in rows:
        r["forward_s"] = forward
        r["similarity_share"] = r["similarity_s"] / (forward + r["similarity_s"])
        print(f"{r['tokens']:>10} {r['similarity_s']:>13.2f} {forward:>10.2f} {r['similarity_share']:>14.1%} "
              f"{r['max_abs_change']:>11.4f}")
    print("(RSA always on a seeded 2048-token subsample; similarity = linear CKA + debiased CKA + RSA, float64)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"texts": len(seqs), "tokens": n, "forward_cloud_s": t_cloud, "forward_edge_s": t_edge,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

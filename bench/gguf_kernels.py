"""The edge's linears on each `--weights`, side by side in one run: every projection and the head of the default
edge at M rows (1 = a decode step, 16 = sixteen clients, 64 = a prompt block), and one tensor of each GGUF block
type alone. The choice of the gguf routes rests on these ratios (models/gguf_linear.py): `gguf` (bf16 activations,
exact) is compute-bound; `gguf-q8` (int8 activations, llama.cpp's arithmetic) streams the blocks near the memory
bandwidth at a decode step.

    python -m bench.gguf_kernels [--rows 1,16,64] [--threads 2] [--reps 5] [--json reports/serve/gguf_kernels.json]

Medians of `--reps` passes over all 169 linears with fresh inputs; bf16 is prepacked as serve-edge runs it. The
whole model's weights (0.4–1 GB) do not stay in cache between passes; one tensor alone does (a compute figure).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.peer_llamacpp import _median
from edgekv.atomic import write_text_atomic

WEIGHTS = ("gguf", "gguf-q8", "bf16", "int4")


def _median_ms(fn, reps: int) -> float:
    return _median(fn, reps) * 1e3  # peer_llamacpp's: a warm-up, then the median of `reps`


def main() -> None:
    from edgekv.models.gguf_linear import BLOCKS, GGUFLinear
    from edgekv.models.loading import load_model
    from edgekv.models.prepack import prepack_linears

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    out: dict = {"setup": {"rows": rows, "threads": a.threads, "reps": a.reps,
                           "machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}"},
                 "all_linears_ms": {}, "one_tensor_ms": {}}
    per_type = {}
    for weights in WEIGHTS:
        edge = load_model("default-edge", "bfloat16", weights=weights)
        if weights == "bf16":
            prepack_linears(edge.model)
        linears = [m for n, m in edge.model.named_modules() if n.endswith(("_proj", "lm_head"))]
        if weights.startswith("gguf"):
            per_type = {BLOCKS[m.ggml_type][0]: n for n, m in edge.model.named_modules()
                        if isinstance(m, GGUFLinear) and n != "lm_head"}
        for m_rows in rows:
            xs = {m.in_features: torch.randn(m_rows, m.in_features).bfloat16() for m in linears}
            with torch.no_grad():
                ms = _median_ms(lambda: [m(xs[m.in_features]) for m in linears], a.reps)
                out["all_linears_ms"].setdefault(str(m_rows), {})[weights] = ms
                for kind, name in per_type.items():
                    m = edge.model.get_submodule(name)
                    x = torch.randn(m_rows, m.in_features).bfloat16()
                    out["one_tensor_ms"].setdefault(f"{kind} {name} M={m_rows}", {})[weights] = \
                        _median_ms(lambda: m(x), a.reps * 4)
            print(f"{weights:7} M={m_rows:3}: all linears {ms:8.1f} ms", flush=True)
        del edge
    out["ratios_vs_int4"] = {r: {w: v[w] / v["int4"] for w in WEIGHTS} for r, v in out["all_linears_ms"].items()}
    out["ratios_vs_bf16"] = {r: {w: v[w] / v["bf16"] for w in WEIGHTS} for r, v in out["all_linears_ms"].items()}
    for r, v in out["all_linears_ms"].items():
        print(f"M={r:>3}: " + ", ".join(f"{w}/bf16 {v[w] / v['bf16']:.2f}× /int4 {v[w] / v['int4']:.2f}×"
                                        for w in ("gguf", "gguf-q8")))
    if a.json:
        write_text_atomic(a.json, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

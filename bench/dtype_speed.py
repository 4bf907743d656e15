"""Bench the default pair's compute dtypes on this machine, side by side in one run (medians): what `--dtype auto`
chooses and why.

    python -m bench.dtype_speed [--system 256] [--reps 3] [--out reports/dtype-speed/NAME.json]

Each model (the cloud, the edge, and the edge on its GGUF blocks as a bf16 run computes it) in bfloat16, float32 and
mixed (float32 with bf16-held linear weights, models/mixed.py): an S-token prefill (the last row's logits) and one
decode step on that S-token cache. On a CPU with native bf16 (AVX-512 and later) bf16 is the faster one; on an
AVX2-only CPU torch computes bf16 matmuls on a slow path.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
from pathlib import Path

import torch

from bench.peer_llamacpp import _median  # a warm-up, then the median of `reps` calls
from edgekv.atomic import write_text_atomic
from edgekv.models.loading import load_model, native_bf16, resolve_dtype

CONDITIONS = (("cloud", "default-cloud", "bfloat16", "bf16"), ("cloud", "default-cloud", "float32", "bf16"),
              ("cloud", "default-cloud", "mixed", "bf16"),
              ("edge", "default-edge", "bfloat16", "bf16"), ("edge", "default-edge", "float32", "bf16"),
              ("edge", "default-edge", "mixed", "bf16"),
              ("edge, gguf-q8 linears", "default-edge", "bfloat16", "gguf-q8"))


def measure(spec: str, dtype: str, weights: str, system: int, reps: int) -> dict:
    """Prefill and decode-step medians (seconds) of one model in one dtype."""
    model = load_model(spec, dtype, weights=weights).model
    ids = torch.randint(0, model.config.vocab_size - 1000, (1, system + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids[:, :system], use_cache=True).cache

        def prefill():
            model(ids[:, :system], logits_to_keep=1)

        def step():
            model(ids[:, system:], cache=copy.deepcopy(cache), position_ids=torch.tensor([[system]]), logits_to_keep=1)

        return {"prefill_s": _median(prefill, reps), "decode_step_s": _median(step, reps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON of the medians (written atomically)")
    args = ap.parse_args()
    rows = []
    for label, spec, dtype, weights in CONDITIONS:
        rows.append({"model": label, "dtype": dtype, "weights": weights,
                     **measure(spec, dtype, weights, args.system, args.reps)})
        gc.collect()  # the model measured goes before the next one loads
        print(f"{label:24s} {dtype:9s} prefill {rows[-1]['prefill_s']:8.2f} s   "
              f"decode step {1000 * rows[-1]['decode_step_s']:9.1f} ms", flush=True)
    machine = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16("cpu"),
               "auto": resolve_dtype("auto", "cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__}
    ratios: dict[str, dict] = {}
    for label in ("cloud", "edge"):
        fp = next(r for r in rows if r["model"] == label and r["dtype"] == "float32")
        for dtype in ("bfloat16", "mixed"):
            other = next(r for r in rows if r["model"] == label and r["dtype"] == dtype)
            ratios.setdefault(dtype, {})[label] = {k: other[k] / fp[k] for k in ("prefill_s", "decode_step_s")}
            print(f"{label}: {dtype} / float32 = {ratios[dtype][label]['prefill_s']:.2f}× prefill, "
                  f"{ratios[dtype][label]['decode_step_s']:.2f}× decode step")
    print(f"this CPU: {machine['cpu_capability']}, native bf16 {machine['native_bf16']}, auto → {machine['auto']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.out), json.dumps({"machine": machine, "system_tokens": args.system,
                                                      "reps": args.reps, "rows": rows, "over_float32": ratios},
                                                     indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Bench `--dtype mixed`'s float32 path against float32 itself and the upcast rule it replaced, side by side in one
run (medians of 3): a 256-token prefill (the last row's logits) and a 64-token continuation scored on a 448-token
cache (every row's logits, as the eval's reference NLL).

    python -m bench.mixed_upcast

`mixed-tiled` is models/mixed.py as it is (the bf16 weight upcast CHUNK output rows at a time into a per-thread
tile); `mixed-whole` upcasts the whole weight into one float32 work copy per shape (the rule before, 2026-12-02).
"""

from __future__ import annotations

import copy
import gc

import torch
import torch.nn.functional as F

import edgekv.models.mixed as mixed
from bench.peer_llamacpp import _median  # a warm-up, then the median of `reps` calls
from edgekv.models.loading import load_model

_WORK: dict[tuple, torch.Tensor] = {}


def whole(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The control: the whole weight upcast into one work copy per shape, then one float32 linear."""
    key = tuple(weight.shape)
    if key not in _WORK:
        _WORK[key] = torch.empty(key)
    return F.linear(x, _WORK[key].copy_(weight), bias)


def measure(spec: str, dtype: str) -> tuple[float, float]:
    """Prefill and scoring medians (seconds) of one model in one dtype."""
    model = load_model(spec, dtype).model
    ids = torch.randint(0, 150000, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids[:, :448], use_cache=True).cache
        prefill = _median(lambda: model(ids[:, :256], logits_to_keep=1), 3)
        score = _median(lambda: model(ids[:, 448:], cache=copy.deepcopy(cache),
                                      position_ids=torch.arange(448, 512)[None]), 3)
    return prefill, score


def main() -> None:
    tiled = mixed._chunked_linear
    for spec in ("default-edge", "default-cloud"):
        for name, dtype, rule in (("float32", "float32", tiled), ("mixed-whole", "mixed", whole),
                                  ("mixed-tiled", "mixed", tiled)):
            mixed._chunked_linear = rule
            prefill, score = measure(spec, dtype)
            print(f"{spec:14s} {name:12s} prefill 256: {prefill:6.2f} s   score 64 on 448: {score:6.2f} s", flush=True)
            _WORK.clear()
            gc.collect()
    mixed._chunked_linear = tiled


if __name__ == "__main__":
    main()

"""Seeded bootstrap intervals over requests: plain (a cell of Table II) and paired (a difference to a baseline on
the same requests, so that request difficulty cancels)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 4000
STATS = {"mean": lambda a: a.mean(axis=-1), "median": lambda a: np.median(a, axis=-1)}


def cell_seed(seed: int, *names: str) -> int:
    """A seed per cell that does not depend on the order cells are computed in (nor on Python's hash salt), so a
    merged report reproduces an unsharded one."""
    digest = hashlib.sha256("\x1f".join([str(seed), *names]).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def bootstrap_ci(values: Sequence[float], stat: str = "mean", seed: int = 0, level: float = 0.95,
                 samples: int = BOOTSTRAP_SAMPLES) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval of `stat` over the values (resampled with replacement); (None, None) for
    fewer than two values, where resampling says nothing."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if x.size < 2:
        return None, None
    rng = np.random.default_rng(seed)
    draws = STATS[stat](x[rng.integers(0, x.size, size=(samples, x.size))])
    alpha = (1 - level) / 2
    lo, hi = np.quantile(draws, [alpha, 1 - alpha])
    return float(lo), float(hi)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], seed: int = 0,
                     level: float = 0.95) -> dict[str, float | int | bool | None]:
    """Mean of a − b over pairs (same request), its bootstrap interval, and whether the interval excludes 0."""
    d = [x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    lo, hi = bootstrap_ci(d, "mean", seed, level)
    return {"n": len(d), "delta_mean": sum(d) / len(d) if d else None, "ci95_lo": lo, "ci95_hi": hi,
            "excludes_zero": lo is not None and (lo > 0 or hi < 0)}


def paired_to_edge(rows: list[dict], key: str = "ref_nll", reference: str = "edge-only", seed: int = 0) -> list[dict]:
    """Per (dataset, strategy): mean difference of `key` to the reference strategy on the same requests, with a
    seeded 95 % bootstrap interval over requests (paired, so request difficulty cancels)."""
    ref = {(r["dataset"], r["id"]): r.get(key) for r in rows if r["strategy"] == reference}
    groups: dict[tuple[str, str], tuple[list, list]] = {}
    for r in rows:
        base = ref.get((r["dataset"], r["id"]))
        if r["strategy"] != reference and r.get(key) is not None and base is not None:
            a, b = groups.setdefault((r["dataset"], r["strategy"]), ([], []))
            a.append(r[key])
            b.append(base)
    return [{"dataset": d, "strategy": s, "metric": key,
             **paired_bootstrap(a, b, cell_seed(seed, d, s, key, "paired", reference))}
            for (d, s), (a, b) in groups.items()]

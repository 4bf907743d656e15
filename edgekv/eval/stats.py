"""Seeded bootstrap intervals over requests: plain (a cell of Table II) and paired (a difference to a baseline on
the same requests, so that request difficulty cancels), over requests or over the system prompts they share."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from edgekv.summary import BOOTSTRAP_SAMPLES, bootstrap_ci, percentile_interval  # noqa: F401 (re-exported)


def cell_seed(seed: int, *names: str) -> int:
    """A seed per cell that does not depend on the order cells are computed in (nor on Python's hash salt), so a
    merged report reproduces an unsharded one."""
    digest = hashlib.sha256("\x1f".join([str(seed), *names]).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def clustered_mean_ci(values: Sequence[float], clusters: Sequence[str], seed: int = 0, level: float = 0.95,
                      samples: int = BOOTSTRAP_SAMPLES) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval of the mean, resampling whole clusters (one label per value) with replacement;
    each draw's mean weighs every value of its clusters once. With one value per cluster it is `bootstrap_ci`'s
    interval; (None, None) for fewer than two clusters."""
    rank: dict[str, int] = {}
    which = np.asarray([rank.setdefault(c, len(rank)) for c in clusters], dtype=np.int64)
    if len(rank) < 2:
        return None, None
    sums = np.bincount(which, weights=np.asarray(values, dtype=np.float64), minlength=len(rank))
    counts = np.bincount(which, minlength=len(rank)).astype(np.float64)
    pick = np.random.default_rng(seed).integers(0, len(rank), size=(samples, len(rank)))
    return percentile_interval(sums[pick].sum(axis=1) / counts[pick].sum(axis=1), level)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], seed: int = 0, level: float = 0.95,
                     clusters: Sequence[str] | None = None) -> dict[str, float | int | bool | None]:
    """Mean of a − b over pairs (same request), its bootstrap interval, and whether the interval excludes 0. With
    `clusters` (a label per pair), whole clusters are resampled: requests that share a system prompt (an MMLU
    subject's questions, one per-prompt export) are not independent draws."""
    labels = clusters if clusters is not None else [""] * len(a)
    kept = [(x - y, c) for x, y, c in zip(a, b, labels, strict=True) if x is not None and y is not None]
    d = [v for v, _ in kept]
    lo, hi = (bootstrap_ci(d, "mean", seed, level) if clusters is None
              else clustered_mean_ci(d, [c for _, c in kept], seed, level))
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


def gap_closed(edge: Sequence[float], method: Sequence[float], ceiling: Sequence[float], seed: int = 0,
               level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES) -> dict[str, float | int | None]:
    """The share of the edge → ceiling gap a method closes, (mean edge − mean method) / (mean edge − mean
    ceiling), over the same requests, with a paired percentile bootstrap interval (requests resampled together)."""
    rows = [(e, m, c) for e, m, c in zip(edge, method, ceiling, strict=True) if None not in (e, m, c)]
    if not rows:
        return {"n": 0, "fraction": None, "ci95_lo": None, "ci95_hi": None}
    x = np.asarray(rows, dtype=np.float64)

    def frac(a: np.ndarray) -> np.ndarray:
        e, m, c = a[..., 0].mean(-1), a[..., 1].mean(-1), a[..., 2].mean(-1)
        return (e - m) / np.where(np.abs(e - c) < 1e-12, np.nan, e - c)

    point = float(frac(x))
    if len(rows) < 2:
        return {"n": 1, "fraction": point, "ci95_lo": None, "ci95_hi": None}
    rng = np.random.default_rng(seed)
    draws = frac(x[rng.integers(0, len(rows), size=(samples, len(rows)))])
    finite = draws[~np.isnan(draws)]
    if finite.size == 0:  # no resample has a gap: the interval is as undefined as the point, without numpy's warning
        return {"n": len(rows), "fraction": point, "ci95_lo": float("nan"), "ci95_hi": float("nan")}
    lo, hi = percentile_interval(finite, level)
    return {"n": len(rows), "fraction": point, "ci95_lo": float(lo), "ci95_hi": float(hi)}

"""One definition of each summary number the project reports: mean, median, percentile and the seeded bootstrap
interval (None for no values; None entries are left out, so a column with gaps summarises what it has)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 4000
STATS = {"mean": lambda a: a.mean(axis=-1), "median": lambda a: np.median(a, axis=-1)}


def _present(values) -> list[float]:
    return [v for v in values if v is not None]


def mean(values) -> float | None:
    """Arithmetic mean of the values that exist."""
    xs = _present(values)
    return sum(xs) / len(xs) if xs else None


def median(values) -> float | None:
    """Median of the values that exist (the mean of the middle two for an even count)."""
    xs = _present(values)
    return statistics.median(xs) if xs else None


def percentile(values, q: float) -> float | None:
    """The q-quantile (0 ≤ q ≤ 1) by linear interpolation between closest ranks — numpy's default ("linear",
    Hyndman–Fan type 7): q = 0.5 is the median, q = 1 the maximum."""
    xs = sorted(_present(values))
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bootstrap_ci(values: Sequence[float], stat: str = "mean", seed: int = 0, level: float = 0.95,
                 samples: int = BOOTSTRAP_SAMPLES) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval of `stat` over the values (resampled with replacement); (None, None) for
    fewer than two values, where resampling says nothing."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if x.size < 2:
        return None, None
    rng = np.random.default_rng(seed)
    return percentile_interval(STATS[stat](x[rng.integers(0, x.size, size=(samples, x.size))]), level)


def percentile_interval(draws: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap draws (their percentiles)."""
    alpha = (1 - level) / 2
    lo, hi = np.quantile(draws, [alpha, 1 - alpha])
    return float(lo), float(hi)

"""One definition of each summary number the project reports: mean, median and percentile (None for no values;
None entries are left out, so a column with gaps summarises what it has)."""

from __future__ import annotations

import statistics


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

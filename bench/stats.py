"""Latency statistics shared by the bench and the capacity simulator."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default method)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(values: Sequence[float], qs: Iterable[float]) -> dict[str, float]:
    xs = sorted(values)
    return {f"p{q:g}": percentile(xs, q) for q in qs}


# The percentiles every bench summary reports, and the names vLLM's benchmark gives them.
SUMMARY_PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def percentile_word(q: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (the spelling of vLLM's `p99.9_ttft_ms` keys)."""
    return f"{q:g}"


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count, mean, std and the summary percentiles of `values` (NaN where empty).

    Keys: "count", "mean", "std", "p50", "p90", "p99", "p99.9".
    """
    xs = sorted(values)
    n = len(xs)
    mean = math.fsum(xs) / n if n else math.nan
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / n) if n else math.nan
    out: dict[str, float] = {"count": n, "mean": mean, "std": std}
    for q in SUMMARY_PERCENTILES:
        out[f"p{percentile_word(q)}"] = percentile(xs, q)
    return out


def ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF: sorted values and the fraction of samples at or below each."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx

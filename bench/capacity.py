"""Capacity search: the highest arrival rate at which every class meets its SLO at the stated attainment.

The workload's mix of open-loop streams keeps its proportions; only the total
rate moves. The search doubles (or halves) the rate until it brackets the
answer, then bisects until the bracket is within `tolerance`. A run stops
early, as a failure, once its outcome is settled: when a class has already
lost more requests than its attainment allows (counting those still waiting
past their TTFT bound), or when the backlog is clearly growing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tokenline.bench.records import CANCELLED, UNFINISHED
from tokenline.bench.report import meets_slo
from tokenline.bench.runner import RunState
from tokenline.bench.stats import slope
from tokenline.bench.workload import PlannedRequest, Slo


@dataclass
class CapacityPoint:
    rate: float
    passed: bool
    attainment: dict[str, float]  # goodput per class
    stopped_early: str | None = None
    results: dict[str, Any] = field(default_factory=dict)


@dataclass
class CapacityResult:
    rate: float | None  # highest passing rate found (None: even the lowest tried failed)
    points: list[CapacityPoint]
    bracket: tuple[float, float] | None  # (passed, failed) when both were found


def passes(results: dict[str, Any], attainment: float) -> tuple[bool, dict[str, float]]:
    """Every class's goodput is at least `attainment`."""
    per_class = {c: g["goodput"] for c, g in results["classes"].items() if g["offered"]}
    ok = bool(per_class) and all(not math.isnan(v) and v >= attainment for v in per_class.values())
    return ok, per_class


async def search(evaluate: Callable[[float], Awaitable[CapacityPoint]], *, start_rate: float, attainment: float,
                 tolerance: float = 0.05, max_runs: int = 12, min_rate: float | None = None,
                 max_rate: float | None = None) -> CapacityResult:
    """Bracket by doubling or halving from `start_rate`, then bisect; at most `max_runs` runs."""
    min_rate = min_rate if min_rate is not None else start_rate / 64
    points: list[CapacityPoint] = []

    async def run(rate: float) -> bool:
        point = await evaluate(rate)
        points.append(point)
        return point.passed

    lo: float | None = None
    hi: float | None = None
    rate = start_rate
    if await run(rate):
        lo = rate
        while len(points) < max_runs and (max_rate is None or rate < max_rate):
            rate = rate * 2 if max_rate is None else min(rate * 2, max_rate)
            if not await run(rate):
                hi = rate
                break
            lo = rate
    else:
        hi = rate
        while len(points) < max_runs and rate / 2 >= min_rate:
            rate /= 2
            if await run(rate):
                lo = rate
                break
            hi = rate
    if lo is not None and hi is not None:
        while len(points) < max_runs and (hi - lo) / lo > tolerance:
            mid = (lo + hi) / 2
            if await run(mid):
                lo = mid
            else:
                hi = mid
    return CapacityResult(lo, points, (lo, hi) if lo is not None and hi is not None else None)


class EarlyStop:
    """A run's stop check: settled as a failure once any class cannot reach `attainment` any more."""

    def __init__(self, plan: list[PlannedRequest], slos: dict[str, Slo], attainment: float, *,
                 duration_s: float | None, rate: float, min_fraction: float = 0.3):
        self.slos, self.attainment, self.rate = slos, attainment, rate
        self.duration_s, self.min_fraction = duration_s, min_fraction
        self.offered: dict[str, int] = {}
        for request in plan:
            self.offered[request.traffic_class] = self.offered.get(request.traffic_class, 0) + 1

    def __call__(self, state: RunState) -> str | None:
        now = state.elapsed()
        lost: dict[str, int] = {}
        for record in state.records:
            if record.status == CANCELLED:
                continue
            slo = self.slos.get(record.stream, Slo())
            if record.end is not None and record.status != UNFINISHED:
                bad = not meets_slo(record, slo)
            else:  # still running: already lost if it has waited past its TTFT bound or deadline
                waited = now - record.scheduled
                bad = ((slo.ttft_ms is not None and not record.chunk_times and waited * 1000 > slo.ttft_ms)
                       or (record.deadline_s is not None and waited > record.deadline_s)
                       or (slo.e2e_ms is not None and waited * 1000 > slo.e2e_ms))
            if bad:
                lost[record.traffic_class] = lost.get(record.traffic_class, 0) + 1
        for cls, n in lost.items():
            allowed = (1 - self.attainment) * self.offered.get(cls, 0)
            if n > allowed:
                return f"settled: {n} {cls} requests already missed their SLO (at most {allowed:.0f} may)"
        return self._backlog_growing(state, now)

    def _backlog_growing(self, state: RunState, now: float) -> str | None:
        if not self.duration_s or now < self.min_fraction * self.duration_s:
            return None
        samples = [(t, n) for t, n in state.backlog if t >= 0.1 * self.duration_s]
        if len(samples) < 8:
            return None
        growth = slope([t for t, _ in samples], [n for _, n in samples])
        first_half = [n for t, n in samples if t < samples[0][0] + (now - samples[0][0]) / 2]
        early = sum(first_half) / len(first_half) if first_half else 0.0
        if growth > max(0.05 * self.rate, 1.0) and state.in_flight > 2 * early + 4:
            return f"settled: the backlog is growing by {growth:.1f} requests/s ({state.in_flight} in flight)"
        return None


async def pause(seconds: float) -> None:
    """Let the server finish what an early stop cancelled before the next run starts."""
    await asyncio.sleep(seconds)


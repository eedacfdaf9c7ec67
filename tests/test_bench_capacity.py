"""The capacity search: bracketing and bisection, and stopping runs whose outcome is settled."""

from __future__ import annotations

import asyncio
import time

import pytest
from tokenline.bench.capacity import CapacityPoint, EarlyStop, passes, search
from tokenline.bench.records import OK, RequestRecord
from tokenline.bench.runner import RunState
from tokenline.bench.workload import PlannedRequest, Slo


def run_search(capacity: float, **kwargs):
    tried = []

    async def evaluate(rate):
        tried.append(rate)
        return CapacityPoint(rate, rate <= capacity, {"interactive": 1.0 if rate <= capacity else 0.5})

    return asyncio.run(search(evaluate, attainment=0.99, **kwargs)), tried


def test_search_doubles_until_it_fails_then_bisects_to_the_tolerance():
    result, tried = run_search(7.3, start_rate=1.0, tolerance=0.05, max_runs=20)
    assert tried[:4] == [1.0, 2.0, 4.0, 8.0]
    lo, hi = result.bracket
    assert lo <= 7.3 < hi and (hi - lo) / lo <= 0.05
    assert result.rate == lo


def test_search_halves_when_the_first_rate_already_fails():
    result, tried = run_search(0.7, start_rate=4.0, tolerance=0.1, max_runs=20)
    assert tried[:4] == [4.0, 2.0, 1.0, 0.5]
    assert 0.7 / 1.1 <= result.rate <= 0.7


def test_search_respects_its_run_budget_and_reports_no_rate_when_nothing_passes():
    result, tried = run_search(0.001, start_rate=1.0, max_runs=3)
    assert len(tried) == 3 and result.rate is None and result.bracket is None


def test_a_rate_passes_only_when_every_class_reaches_the_attainment():
    results = {"classes": {"interactive": {"goodput": 0.995, "offered": 200}, "bulk": {"goodput": 0.97, "offered": 50}}}
    ok, per_class = passes(results, 0.99)
    assert not ok and per_class == {"interactive": 0.995, "bulk": 0.97}
    assert passes(results, 0.95)[0]


def planned(n, cls="interactive"):
    return [PlannedRequest(f"r{i}", "chat", cls, i * 0.01, (1,), None, 4, True, None, None) for i in range(n)]


def state_with(records, elapsed):
    state = RunState(t0=time.monotonic() - elapsed, planned=None, duration_s=10.0)
    state.records = records
    return state


def test_a_run_is_settled_once_more_requests_missed_the_slo_than_the_attainment_allows():
    stop = EarlyStop(planned(100), {"chat": Slo(ttft_ms=100)}, 0.95, duration_s=10.0, rate=10.0)
    # Still waiting for a first token long past the TTFT bound: already lost.
    waiting = [RequestRecord(f"w{i}", "chat", "interactive", 0.0, 1, 4) for i in range(6)]
    assert stop(state_with(waiting[:5], elapsed=1.0)) is None  # 5 of 100 may miss
    assert "settled" in stop(state_with(waiting, elapsed=1.0))


def test_requests_that_met_the_slo_do_not_settle_a_run():
    records = []
    for i in range(50):
        r = RequestRecord(f"r{i}", "chat", "interactive", 0.0, 1, 4)
        r.chunk_times, r.chunk_tokens, r.end, r.status = [0.05], [1], 0.05, OK
        records.append(r)
    stop = EarlyStop(planned(100), {"chat": Slo(ttft_ms=100)}, 0.99, duration_s=10.0, rate=10.0)
    assert stop(state_with(records, elapsed=1.0)) is None


def test_a_clearly_growing_backlog_settles_a_run():
    stop = EarlyStop(planned(100), {}, 0.9, duration_s=10.0, rate=10.0)
    state = state_with([], elapsed=5.0)
    state.backlog = [(t / 4, int(3 * t)) for t in range(4, 20)]  # +12 requests in flight per second
    state.sent = 60
    assert "backlog" in stop(state)
    steady = state_with([], elapsed=5.0)
    steady.backlog = [(t / 4, 5) for t in range(4, 20)]
    steady.sent = 5
    assert stop(steady) is None


@pytest.mark.parametrize("attainment", [0.5, 0.9])
def test_early_stop_counts_lost_requests_per_class(attainment):
    plan = planned(10, "interactive") + planned(10, "bulk")
    stop = EarlyStop(plan, {"chat": Slo(ttft_ms=10)}, attainment, duration_s=10.0, rate=2.0)
    lost_bulk = [RequestRecord(f"b{i}", "chat", "bulk", 0.0, 1, 4) for i in range(6)]
    verdict = stop(state_with(lost_bulk, elapsed=1.0))
    assert (verdict is not None) == (6 > (1 - attainment) * 10)

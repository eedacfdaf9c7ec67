"""The load generator: one asyncio loop that sends a precomputed plan on time and records every chunk.

Open-loop requests are sent at their scheduled times whatever the server does;
closed-loop streams keep a fixed number of requests in flight. A monitor task
samples the backlog, drives the progress display, runs the caller's early-stop
check, and stops the run with `LoadGeneratorBehind` when the generator itself
cannot keep to the schedule (then the numbers would measure the bench, not the server).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenline.bench.progress import Progress
from tokenline.bench.records import STATUSES, UNFINISHED, RequestRecord
from tokenline.bench.stats import percentile, summarize
from tokenline.bench.targets import Target
from tokenline.bench.workload import PlannedRequest, RequestFactory


class LoadGeneratorBehind(RuntimeError):
    """The load generator could not send requests on schedule; its results would be wrong."""


@dataclass
class RunOptions:
    duration_s: float | None = None  # closed loops stop starting requests after this
    num_requests: int | None = None  # closed loops: requests per stream
    drain_s: float = 120.0  # after the last request is sent, wait this long for the rest
    max_lag_ms: float = 50.0  # a send later than this (median over `lag_window_s`) is falling behind
    lag_window_s: float = 1.0
    behind_checks: int = 4  # consecutive checks over `max_lag_ms` before stopping
    check_interval_s: float = 0.25
    progress: Progress | None = None
    stop_check: Callable[[RunState], str | None] | None = None  # a reason to stop early, or None


@dataclass
class RunState:
    """Live counters of a run, for the progress display and early-stop checks."""

    t0: float
    planned: int | None
    duration_s: float | None
    records: list[RequestRecord] = field(default_factory=list)
    sent: int = 0
    finished: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    output_tokens: int = 0
    backlog: list[tuple[float, int]] = field(default_factory=list)  # (elapsed s, requests in flight)
    next_due: float | None = None  # scheduled time of the next open-loop request not yet sent

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    @property
    def in_flight(self) -> int:
        return self.sent - self.finished


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # run start until the last request ended
    started_unix: float
    stopped: str | None  # why the run stopped early, or None
    loadgen: dict[str, Any]  # the load generator's own figures: CPU, loop lag, send lag
    backlog: list[tuple[float, int]]


async def run_load(target: Target, plan: Sequence[PlannedRequest], closed: Sequence[RequestFactory] = (),
                   options: RunOptions | None = None) -> RunResult:
    """Send `plan` (open loop, sorted by `at`) and run the `closed` streams; return every record."""
    options = options or RunOptions()
    loop = asyncio.get_running_loop()
    state = RunState(t0=time.monotonic() + 0.05, planned=len(plan) if not closed else None, duration_s=options.duration_s)
    started_unix = time.time() + 0.05
    tasks: set[asyncio.Task] = set()
    stop = asyncio.Event()
    stopped: list[str] = []
    loop_lags: list[float] = []
    cpu0 = time.process_time()

    def halt(reason: str) -> None:
        if not stopped:
            stopped.append(reason)
        stop.set()

    async def execute(request: PlannedRequest, record: RequestRecord) -> None:
        state.sent += 1
        try:
            await target.send(request, record, state.t0)
        finally:
            if record.end is None:
                record.end = time.monotonic() - state.t0
            state.finished += 1
            state.by_status[record.status] += 1
            state.output_tokens += record.output_tokens

    def new_record(request: PlannedRequest, scheduled: float) -> RequestRecord:
        record = RequestRecord(request.request_id, request.stream, request.traffic_class, scheduled,
                               len(request.prompt_ids), request.max_tokens, request.deadline_s)
        state.records.append(record)
        return record

    async def dispatch_open() -> None:
        t0 = state.t0
        for request in plan:
            state.next_due = request.at
            wait = t0 + request.at - time.monotonic()
            # Sleeping (or yielding, when late) lets the sends started so far run.
            await asyncio.sleep(wait if wait > 0 else 0)
            task = loop.create_task(execute(request, new_record(request, request.at)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        state.next_due = None

    async def run_closed(factory: RequestFactory, counter: itertools.count) -> None:
        while True:
            i = next(counter)
            now = time.monotonic() - state.t0
            if options.num_requests is not None and i >= options.num_requests:
                return
            if options.duration_s is not None and now >= options.duration_s:
                return
            request = factory.make(i, None)
            await execute(request, new_record(request, now))

    async def monitor() -> None:
        behind = 0
        interval = options.check_interval_s
        while True:
            wake = time.monotonic() + interval
            await asyncio.sleep(interval)
            loop_lags.append(time.monotonic() - wake)
            now = state.elapsed()
            state.backlog.append((now, state.in_flight))
            if options.progress is not None:
                options.progress.update(state)
            lag = _current_lag(state, now, options.lag_window_s)
            behind = behind + 1 if lag * 1000 > options.max_lag_ms else 0
            if behind >= options.behind_checks:
                halt(f"load generator fell behind: requests are going out {lag * 1000:.0f} ms after their "
                     f"scheduled time (limit {options.max_lag_ms:g} ms). This machine cannot drive this load; "
                     "lower the rate, or run the bench on another machine")
                return
            if options.stop_check is not None:
                reason = options.stop_check(state)
                if reason:
                    halt(reason)
                    return

    await asyncio.sleep(max(0.0, state.t0 - time.monotonic()))
    producers = [loop.create_task(dispatch_open())] if plan else []
    for factory in closed:  # a stream's workers share one counter: request i is sent once
        counter = itertools.count()
        producers += [loop.create_task(run_closed(factory, counter)) for _ in range(factory.stream.concurrency or 0)]
    monitor_task = loop.create_task(monitor())
    stop_waiter = loop.create_task(stop.wait())
    try:
        if producers:
            # Wait on the producers still running only: a finished one would end every wait at
            # once, and the loop would spin (it took a sixth of a core beside a saturation run).
            running = [p for p in producers if not p.done()]
            while running and not stop.is_set():
                await asyncio.wait([*running, stop_waiter], return_when=asyncio.FIRST_COMPLETED)
                running = [p for p in running if not p.done()]
        drain_until = time.monotonic() + options.drain_s
        while tasks and not stop.is_set():
            if time.monotonic() >= drain_until:
                halt(f"{len(tasks)} requests still running {options.drain_s:g} s after the last was sent")
                break
            await asyncio.wait([stop_waiter], timeout=0.05)
    finally:
        for task in [*producers, *tasks, monitor_task, stop_waiter]:
            task.cancel()
        await asyncio.gather(*producers, *tasks, monitor_task, stop_waiter, return_exceptions=True)
        if options.progress is not None:
            options.progress.update(state, final=True)
    for p in producers:
        if p.done() and not p.cancelled() and p.exception() is not None:
            raise p.exception()
    if stopped and stopped[0].startswith("load generator fell behind"):
        raise LoadGeneratorBehind(stopped[0])
    cpu_s = time.process_time() - cpu0
    ends = [r.end for r in state.records if r.end is not None]
    duration = max(ends) if ends else state.elapsed()
    lags = [r.send_lag for r in state.records if r.send_lag is not None]
    loadgen = {
        "cpu_s": cpu_s, "wall_s": duration, "cpu_share": cpu_s / duration if duration > 0 else 0.0,
        "loop_lag_ms": {k: v * 1000 if k != "count" else v for k, v in summarize(loop_lags).items()},
        "send_lag_ms": {k: v * 1000 if k != "count" else v for k, v in summarize(lags).items()},
        "peak_in_flight": max((n for _, n in state.backlog), default=0),
    }  # fmt: skip
    unfinished = sum(1 for r in state.records if r.status == UNFINISHED)
    assert set(state.by_status) <= set(STATUSES)
    return RunResult(state.records, duration, started_unix, stopped[0] if stopped else None,
                     {**loadgen, "unfinished": unfinished}, state.backlog)


def _current_lag(state: RunState, now: float, window_s: float) -> float:
    """How late sends are now: the overdue time of the next unsent request, or the median recent send lag."""
    overdue = now - state.next_due if state.next_due is not None else 0.0
    recent = []
    for record in reversed(state.records):
        if record.scheduled < now - window_s:
            break
        if record.sent is not None:
            recent.append(record.sent - record.scheduled)
    return max(overdue, percentile(recent, 50) if recent else 0.0)


def run(coro: Any) -> Any:
    """Run a coroutine on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)

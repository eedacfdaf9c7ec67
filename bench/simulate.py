"""Capacity simulator: the real scheduler in virtual time against fixed-cost batch workers.

Answers "how many workers does this arrival rate need, and what does the
admission window cost?" without running a model: a batch of up to `max_batch`
requests takes `batch_cost_s` whatever its size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenline.bench.stats import percentiles
from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.simulation import SimRequest, Simulation, fixed_cost, worker_spec


@dataclass(frozen=True)
class CapacityResult:
    workers: int
    window_ms: float
    rate: float
    offered: int
    completed: int
    utilisation: float  # busy time / (workers × duration)
    mean_batch: float
    slot_use: float  # mean batch / max batch: the share of batch capacity used
    wait_ms: dict[str, float]  # p50, p99, p99.9 of arrival → departure
    e2e_ms: dict[str, float]  # p50, p99, p99.9 of arrival → completion
    backlog_end: int  # requests still queued when arrivals stopped
    stable: bool


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


def simulate_capacity(*, workers: int, rate: float, window_ms: float = 10.0, max_batch: int = 32,
                      batch_cost_ms: float = 100.0, duration_s: float = 30.0, seed: int = 1) -> CapacityResult:
    window = ClassConfig(admission_window_s=window_ms / 1000, max_queued_requests=10**9, max_queued_tokens=10**12)
    config = SchedulerConfig(interactive=window, bulk=window, bulk_floor=0.0, step_time_prior_s=batch_cost_ms / 1000)
    sim = Simulation(config, [(worker_spec(i, max_seqs=max_batch, continuous=False), fixed_cost(batch_cost_ms / 1000))
                              for i in range(workers)])
    arrivals = poisson_arrivals(rate, duration_s, seed)
    requests = [SimRequest(f"r{i}", t, prompt_tokens=1, max_tokens=1) for i, t in enumerate(arrivals)]
    sim.run(requests, until=duration_s)
    backlog = sum(len(q) for m in sim.scheduler.models.values() for q in m.queues.values())
    done = [o for o in sim.outcomes.values() if o.completed is not None and o.status == "finished"]
    # Discard the first 10% as warm-up.
    warm = duration_s * 0.1
    steady = [o for o in done if o.arrival >= warm]
    waits = [1000 * o.waited for o in steady]
    e2e = [1000 * o.end_to_end for o in steady]
    busy = sum(w.busy_time for w in sim.workers.values())
    batches = [b for w in sim.workers.values() for b in w.batch_sizes]
    # Stable: the queue does not grow: what is left at the end is under one second's worth of service.
    capacity_per_s = workers * max_batch / (batch_cost_ms / 1000)
    stable = backlog < max(capacity_per_s * 1.0, max_batch) and rate < capacity_per_s
    return CapacityResult(
        workers=workers, window_ms=window_ms, rate=rate, offered=len(requests), completed=len(done),
        utilisation=min(busy / (workers * duration_s), 1.0),
        mean_batch=sum(batches) / len(batches) if batches else 0.0,
        slot_use=(sum(batches) / len(batches) / max_batch) if batches else 0.0,
        wait_ms=percentiles(waits, (50, 99, 99.9)), e2e_ms=percentiles(e2e, (50, 99, 99.9)),
        backlog_end=backlog, stable=stable,
    )


def format_table(results: list[CapacityResult]) -> str:
    head = ("workers", "window ms", "busy", "slot use", "mean batch", "wait p50", "wait p99", "wait p99.9",
            "e2e p50", "e2e p99", "e2e p99.9", "backlog", "stable")
    rows = [head]
    for r in results:
        rows.append((str(r.workers), f"{r.window_ms:g}", f"{r.utilisation:.2f}", f"{r.slot_use:.2f}", f"{r.mean_batch:.1f}",
                     *(f"{r.wait_ms[p]:.0f}" for p in ("p50", "p99", "p99.9")),
                     *(f"{r.e2e_ms[p]:.0f}" for p in ("p50", "p99", "p99.9")),
                     str(r.backlog_end), "yes" if r.stable else "NO (queue grows)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)

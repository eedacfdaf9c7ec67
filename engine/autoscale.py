"""Capacity that follows backlog and deadline pressure, not utilisation: the autoscaler's decisions.

A pure state machine with an injected clock, like the scheduler: `decide(now,
pressure)` reads what the queue looks like for one model and returns what to
do (add a worker, remove one, nothing), each with its reason. The supervisor
carries the decisions out (a local process, or a Ray actor that Ray places) and
reports back when a worker becomes ready or is gone.

Why backlog and deadlines and not utilisation: a CPU worker at 100 % may be
meeting every promise, and one at 60 % may be holding a queue whose oldest
request is about to miss its deadline. So a worker is added when

- the oldest queued request has waited longer than `max_queue_age_s` and the
  queue is not already shrinking (a draining queue needs no more workers,
  however old its head: adding then only overshoots), or
- some queued request is predicted to miss its deadline (its predicted start
  plus its remaining work is past the deadline), or
- fewer warm workers are idle than `warm_standby` asks for: a worker that is
  ready only after the deadline saves nothing, so spare capacity is started
  *before* it is needed (the measured start-up time says how long before),

and removed only when it has been idle for `cooldown_s` and the model has more
than `min_workers` (and more than the warm reserve needs). With `min_workers`
0 the last idle worker goes too; the scheduler then queues the model's
requests (it is told the model starts on demand) and the first one queued
starts a worker at once. Workers still
starting count as capacity already asked for, so one burst does not start a
worker per check; and after a change nothing more happens for
`settle_s`, so the queue can show what the change did (no flapping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenline.engine.flagspec import flag


@dataclass(frozen=True)
class AutoscaleConfig:
    """Limits and thresholds of the autoscaler for one model."""

    min_workers: int = flag(1, "--autoscale-min-workers", "the autoscaler never goes below this many workers",
                            type=int)
    max_workers: int = flag(4, "--autoscale-max-workers",
                            "let the autoscaler add workers, up to this many per model, when the queue ages or "
                            "deadlines are predicted to be missed, and remove idle ones after --autoscale-cooldown-s")
    max_queue_age_s: float = flag(2.0, "--autoscale-queue-age-s", "add a worker when the oldest queued request has "
                                  "waited this long and the queue is not shrinking")
    warm_standby: int = flag(0, "--warm-workers", "with the autoscaler: idle, loaded workers kept ahead of the load, "
                             "since a worker that is ready after the deadline saves nothing")
    cooldown_s: float = flag(30.0, "--autoscale-cooldown-s", "remove a worker idle this long")
    settle_s: float = flag(5.0, "--autoscale-settle-s",
                           "after adding or removing a worker, wait this long before the next change")

    def __post_init__(self) -> None:
        if self.min_workers < 0:
            raise ValueError(f"min_workers={self.min_workers} is negative: give 0 or more")
        if self.max_workers < max(1, self.min_workers):
            raise ValueError(f"max_workers={self.max_workers} must be at least max(1, min_workers={self.min_workers})")
        for name in ("max_queue_age_s", "cooldown_s", "settle_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value} must be a finite number of seconds, 0 or more")
        if self.warm_standby < 0:
            raise ValueError(f"warm_standby={self.warm_standby} is negative: give 0 or more")


@dataclass(frozen=True)
class WorkerLoad:
    """One ready worker as the autoscaler sees it."""

    worker_id: int
    running: int  # sequences it runs now
    idle_since: float | None  # when it last became idle (no sequences); None while busy


@dataclass(frozen=True)
class Pressure:
    """What the queue of one model looks like now (the supervisor reads it off the scheduler)."""

    queued: int  # requests waiting for a worker
    oldest_queued_age_s: float  # 0 when none waits
    predicted_misses: int  # queued requests predicted to miss their deadline with the workers there are
    workers: tuple[WorkerLoad, ...]  # ready workers
    starting: int  # workers asked for and not ready yet


@dataclass(frozen=True)
class AddWorker:
    reason: str


@dataclass(frozen=True)
class RemoveWorker:
    worker_id: int
    reason: str


Decision = AddWorker | RemoveWorker


@dataclass
class Autoscaler:
    """Decides, for one model, when to add and remove workers. Call `decide` on a timer and after each step."""

    config: AutoscaleConfig
    last_add: float = -math.inf
    last_remove: float = -math.inf
    decisions: list[tuple[float, Decision]] = field(default_factory=list)  # what it decided, when (most recent last)
    _last_queued: int | None = None


    def decide(self, now: float, p: Pressure) -> list[Decision]:
        cfg = self.config
        total = len(p.workers) + p.starting
        out: list[Decision] = []
        idle = [w for w in p.workers if w.running == 0 and w.idle_since is not None]
        add_reason = self._add_reason(p, len(idle))
        self._last_queued = p.queued
        if total < cfg.min_workers:
            out = [AddWorker(f"{total} workers, fewer than the minimum {cfg.min_workers}")
                   for _ in range(cfg.min_workers - total)]
        elif total == 0 and p.queued:  # scaled to zero and work came: at once, whatever the settle time
            out = [AddWorker(f"{p.queued} queued requests and no worker")]
        elif add_reason and total < cfg.max_workers and p.starting == 0 and now - self.last_add >= cfg.settle_s:
            out = [AddWorker(add_reason)]
        elif not add_reason and p.queued == 0 and now - self.last_add >= cfg.settle_s:
            out = self._removals(now, p, idle, total)
        for d in out:
            if isinstance(d, AddWorker):
                self.last_add = now
            else:
                self.last_remove = now
            self.decisions.append((now, d))
        return out

    def _add_reason(self, p: Pressure, idle: int) -> str | None:
        cfg = self.config
        if p.predicted_misses > 0:
            return f"{p.predicted_misses} queued requests predicted to miss their deadline"
        draining = self._last_queued is not None and p.queued < self._last_queued
        if p.queued and p.oldest_queued_age_s > cfg.max_queue_age_s and not draining:
            return f"oldest queued request waited {p.oldest_queued_age_s:.1f} s (limit {cfg.max_queue_age_s:.1f} s)"
        if cfg.warm_standby and idle < cfg.warm_standby and p.starting == 0:
            return f"{idle} idle warm workers, fewer than the {cfg.warm_standby} kept ready"
        return None

    def _removals(self, now: float, p: Pressure, idle: list[WorkerLoad], total: int) -> list[Decision]:
        cfg = self.config
        if now - self.last_remove < cfg.settle_s:
            return []
        keep = max(cfg.min_workers, sum(1 for w in p.workers if w.running) + cfg.warm_standby)
        if total <= keep:
            return []
        # The longest idle first; one per settle period, so a returning load finds capacity.
        for w in sorted(idle, key=lambda w: w.idle_since or now):
            idle_s = now - (w.idle_since or now)
            if idle_s >= cfg.cooldown_s:
                return [RemoveWorker(w.worker_id, f"idle {idle_s:.0f} s (cool-down {cfg.cooldown_s:.0f} s)")]
        return []


@dataclass(frozen=True)
class GiveBack:
    """Retire a worker a model borrowed: it takes no new work and stops once its streams end (no stream dropped);
    the model it was lent by starts one in its place when it has gone."""

    worker_id: int
    reason: str


@dataclass(frozen=True)
class Share:
    """Several models under one worker budget (the machine's plan): each model's own count, and how long a worker
    must have been idle before it is lent to a model that needs one."""

    budget: int  # worker processes of all models together (active, starting, finishing their runs)
    own: dict[str, int]  # model -> the workers the plan gave it
    lend_after_s: float = 5.0


def share_workers(decisions: dict[str, list[Decision]], pressures: dict[str, Pressure], minimum: dict[str, int],
                  share: Share, now: float, *, in_use: int) -> list[tuple[str, Decision | GiveBack]]:
    """Each model's autoscaler decided alone; this keeps them to the budget, lending and giving back (issue 34).

    - Removals pass.
    - An addition within the budget passes.
    - At the budget, a model that needs a worker borrows one: another model's worker idle at least `lend_after_s`,
      above that model's minimum (models holding borrowed workers lend first, then the longest idle), is removed,
      and the addition takes its place.
    - At the budget with none idle, a model below its own count takes one back: a worker of a model above its own
      count, the one running least, is retired (it finishes its streams); the addition waits until it has gone.
    - Otherwise the addition waits (the model's queue shows it).

    `in_use`: worker processes now, all models (active, starting, retiring). Pure: what to do, never doing it."""
    out: list[tuple[str, Decision | GiveBack]] = []
    held = {m: len(p.workers) + p.starting for m, p in pressures.items()}
    lent: set[int] = set()
    for model, ds in decisions.items():
        for d in ds:
            if isinstance(d, RemoveWorker):
                out.append((model, d))
                held[model] -= 1
                in_use -= 1
                lent.add(d.worker_id)
    wanting = [(m, d) for m, ds in decisions.items() for d in ds if isinstance(d, AddWorker)]
    # The most pressed first: predicted misses, then the oldest queued request.
    wanting.sort(key=lambda md: (-pressures[md[0]].predicted_misses, -pressures[md[0]].oldest_queued_age_s))
    giving_back = False
    for model, add in wanting:
        if in_use < share.budget:
            out.append((model, add))
            held[model] += 1
            in_use += 1
            continue
        lender = _idle_lender(model, pressures, held, minimum, share, now, lent)
        if lender is not None:
            other, w = lender
            idle_s = now - (w.idle_since or now)
            out.append((other, RemoveWorker(w.worker_id, f"lent to {model} (idle {idle_s:.0f} s)")))
            out.append((model, AddWorker(f"{add.reason}; in place of worker {w.worker_id} of {other}, idle")))
            lent.add(w.worker_id)
            held[other] -= 1
            held[model] += 1
            continue
        if not giving_back and held[model] < share.own.get(model, 0):
            borrower = _borrowed(model, pressures, held, share, lent)
            if borrower is not None:
                other, w = borrower
                out.append((other, GiveBack(w.worker_id, f"given back to {model} ({held[model]} of its own "
                                                           f"{share.own[model]} workers; {add.reason})")))
                lent.add(w.worker_id)
                held[other] -= 1
                giving_back = True  # one at a time: the next waits for this one's streams to end
    return out


def _idle_lender(model: str, pressures: dict[str, Pressure], held: dict[str, int], minimum: dict[str, int],
                 share: Share, now: float, taken: set[int]) -> tuple[str, WorkerLoad] | None:
    best: tuple[tuple, str, WorkerLoad] | None = None
    for other, p in pressures.items():
        if other == model or held[other] <= minimum.get(other, 0) or p.queued:
            continue
        for w in p.workers:
            if w.worker_id in taken or w.running or w.idle_since is None or now - w.idle_since < share.lend_after_s:
                continue
            rank = (held[other] <= share.own.get(other, 0), w.idle_since)  # borrowers first, then the longest idle
            if best is None or rank < best[0]:
                best = (rank, other, w)
    return (best[1], best[2]) if best is not None else None


def _borrowed(model: str, pressures: dict[str, Pressure], held: dict[str, int], share: Share,
              taken: set[int]) -> tuple[str, WorkerLoad] | None:
    best: tuple[int, str, WorkerLoad] | None = None
    for other, p in pressures.items():
        if other == model or held[other] <= share.own.get(other, 0):
            continue
        for w in p.workers:
            if w.worker_id not in taken and (best is None or w.running < best[0]):
                best = (w.running, other, w)
    return (best[1], best[2]) if best is not None else None


def read_pressure(scheduler, model_name: str, now: float, *, starting: int,
                  idle_since: dict[int, float]) -> Pressure:
    """The queue of one model as the autoscaler sees it, read off the scheduler."""
    model = scheduler.models.get(model_name)
    if model is None:
        return Pressure(0, 0.0, 0, (), starting)
    queued = sum(queue.requests for queue in model.queues.values())
    heads = [head for queue in model.queues.values() if (head := queue.oldest()) is not None]
    oldest_age = max((now - head.arrival for head in heads), default=0.0)
    loads = []
    for wid in model.workers:
        running = scheduler.running(wid)
        loads.append(WorkerLoad(wid, running, None if running else idle_since.get(wid, now)))
    return Pressure(queued, oldest_age, scheduler.predicted_misses(model_name, now), tuple(loads), starting)

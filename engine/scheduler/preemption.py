"""Preemption: when running bulk gives way.

Two reasons stop a bulk run. Interactive work whose dispatch rule fired fits on no worker: the newest bulk
runs beyond bulk's floor make room for it, if that is enough (`for_interactive`). Sequences grew past a
worker's KV (Scheduler.on_step recounts each run's blocks per report): bulk is stopped, newest first, until the rest fits,
never an interactive stream nor a run whose deadline promise a restart could break (`relieve_kv_pressure`).
A preempted run goes back to the front of its queue with its arrival time and the tokens it produced, and
later continues from them; a run preempted `max_preemptions` times keeps its place, so bulk progresses.

The Scheduler holds one Preemption, built over its state and given the scheduler's own steps it needs
(release a run from its worker, queue a request again); core.py applies it at every event.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.scheduler.planner import StepPlanner
from tokenline.engine.scheduler.records import Abort, Action, Counters, Entry
from tokenline.engine.scheduler.rules import DispatchRules
from tokenline.engine.scheduler.state import ModelState, WorkerView
from tokenline.engine.scheduler.status import Status, transition
from tokenline.engine.types import TrafficClass


class Preemption:
    """Who gives way, over the Scheduler's state, given explicitly."""

    def __init__(self, config: SchedulerConfig, workers: dict[int, WorkerView], counters: Counters,
                 rules: DispatchRules, planner: StepPlanner, *,
                 release: Callable[[Entry], None], enqueue: Callable[..., None]):
        self.config = config
        self.workers = workers
        self.counters = counters
        self.rules = rules  # when a queue is released, and what a worker can take (rules.py)
        self.planner = planner  # whether one more interactive stream keeps the ITL target (planner.py)
        self.release = release  # free a run's slot and KV on its worker (Scheduler._release)
        self.enqueue = enqueue  # queue a request again: (entry, now, *, front) (Scheduler._enqueue)

    def for_interactive(self, model_name: str, model: ModelState, now: float) -> list[Action]:
        """Interactive work that fits nowhere takes KV blocks and slots from running bulk.

        The newest bulk runs go first; bulk keeps its floor, so it never starves.
        A preempted run goes back to the front of the bulk queue with its
        arrival time and the tokens it produced, and later continues from them.
        """
        head = model.queues[TrafficClass.INTERACTIVE].peek()
        fires_at = self.rules.fires_at(model_name, model, TrafficClass.INTERACTIVE)
        if head is None or fires_at is None or fires_at > now:
            return []
        for wid in model.workers:
            w = self.workers[wid]
            if not w.spec.continuous or not self.planner.keeps_itl_target(head, w, model, now) \
                    or (self.rules.late_refused(head) and not self.rules.in_time(head, w, model, now)):
                continue  # preempting bulk would not let it in
            floor = self.rules.bulk_floor_seqs(w)  # the slots bulk keeps: preempting one would not let `head` in
            bulk = sorted((e for e in w.running.values() if e.cls == TrafficClass.BULK), key=lambda e: e.arrival)
            # Newest first; a run preempted too often keeps its place, so bulk always progresses.
            victims = [v for v in reversed(bulk[floor:]) if v.preemptions < self.config.max_preemptions]
            budget = self.rules.budget(w)
            chosen: list[Entry] = []
            for v in victims:
                if budget.fits(head):
                    break
                chosen.append(v)
                budget.slots += 1
                budget.blocks += v.blocks
            if not chosen or not budget.fits(head):
                continue
            return [self.preempt(v, now) for v in chosen]
        return []

    def relieve_kv_pressure(self, w: WorkerView, now: float) -> list[Action]:
        """Sequences grew past the worker's KV: preempt bulk, newest first, until the rest fits.

        Never an interactive stream, never a run whose deadline promise a restart could break
        (it must complete by its deadline, or its first token is still owed). If only such runs
        are left, vLLM preempts by priority itself (bulk is its lowest) and recomputes later.
        """
        capacity = w.spec.kv_blocks_total - self.config.kv_watermark_blocks
        if w.reserved_blocks <= capacity:
            return []
        victims = sorted((e for e in w.running.values() if self.may_preempt_for_kv(e)), key=lambda e: e.arrival, reverse=True)
        actions: list[Action] = []
        for v in victims:
            if w.reserved_blocks <= capacity:
                break
            actions.append(self.preempt(v, now))
            self.counters.kv_preemptions += 1
        return actions

    def may_preempt_for_kv(self, e: Entry) -> bool:
        if e.cls != TrafficClass.BULK or e.preemptions >= self.config.max_preemptions:
            return False
        return e.deadline is None or not (e.must_complete_by_deadline or not e.prefilled)

    def preempt(self, v: Entry, now: float) -> Action:
        """Stop a running bulk run; it goes back to the front of its queue and later continues."""
        action = Abort(v.key, v.worker_id, v.run_key, preempted=True)
        self.release(v)
        transition(v, Status.QUEUED)
        v.preemptions += 1
        self.enqueue(v, now, front=True)
        return action

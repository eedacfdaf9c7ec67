"""The dispatch rule (core.py applies it at every event): what a worker can take now (its step budget, and
whether it would admit a given request), when a class's queue is released to it (the budget would be filled,
the oldest request has waited its admission window, or waiting longer would threaten a deadline), and the
slots interactive leaves to waiting bulk. Reads the scheduler's state, given explicitly; changes none of it.
"""

from __future__ import annotations

import math

from tokenline.engine.scheduler.admission import AdmissionControl
from tokenline.engine.scheduler.budget import StepBudget
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.scheduler.crashes import isolated
from tokenline.engine.scheduler.placement import SiblingPlacement
from tokenline.engine.scheduler.planner import StepPlanner
from tokenline.engine.scheduler.records import Admission, Entry
from tokenline.engine.scheduler.state import ModelState, WorkerView
from tokenline.engine.types import TrafficClass


class DispatchRules:
    def __init__(self, config: SchedulerConfig, models: dict[str, ModelState], admission: AdmissionControl,
                 planner: StepPlanner, siblings: SiblingPlacement):
        self.config = config
        self.models = models
        self.admission = admission
        self.planner = planner
        self.siblings = siblings  # where a call's samples are, and what of their prompt a worker holds (placement.py)

    def budget(self, w: WorkerView, *, at_boundary: bool = False) -> StepBudget:
        """What `w` can take now. Prompts admitted but not yet applied (`pending_prefill`) go into its
        next step. A worker starts its next step as soon as it has reported, before this frontend has
        read the report, so what is admitted on its report (`at_boundary`) lands in the step after
        next: only pending prompts beyond one step's budget spill into that one. (Counting them all,
        a worker at saturation took a step's prompts every other step: one 256-token prompt a step
        where its budget holds two, and its batch filled at half speed.) An interactive request counts
        only the interactive prompts pending: the worker computes it before bulk prompts it has not begun
        (budget.py); counting those, it waited a report, and on a worker that runs ahead a step more.
        Not until the worker's steps have shown what a sequence costs: before, the ITL target's rule
        (planner.py `keeps_itl_target`) would take any number of streams as free, and the pending bulk prompts
        are what spaces interactive admissions out. A call's sample is charged its prompt less the full blocks a
        sibling on `w` holds (placement.py `cached_on`)."""
        free_blocks = w.spec.kv_blocks_total - self.config.kv_watermark_blocks - w.reserved_blocks
        budget = w.spec.prefill_token_budget
        pending = sum(n for n, _ in w.pending_prefill.values())
        interactive = sum(n for _, n in w.pending_prefill.values()) if w.pace.cadence.knows_sequence_cost else pending
        if at_boundary and w.spec.runs_ahead:
            pending, interactive = max(pending - budget, 0), max(interactive - budget, 0)
        pending, interactive = pending + w.stalled_prefill, interactive + w.stalled_prefill
        return StepBudget(
            slots=w.slots_free(),
            blocks=free_blocks,
            prefill_tokens=max(budget - pending, 0),
            block_size=w.spec.block_size,
            fresh_step=pending == 0,
            margin_tokens=self.config.kv_margin_tokens,
            interactive_prefill_tokens=max(budget - interactive, 0),
            interactive_fresh=interactive == 0,
            cached=self.siblings.cached_on(w.spec.worker_id, w.spec.block_size),
        )

    def fires(self, model_name: str, cls: TrafficClass, budget: StepBudget, now: float) -> bool:
        """Admit now if the budget would be filled, the window ran out, or a deadline is threatened."""
        if budget.exhausted_for(cls):
            return False
        fires_at = self.fires_at(model_name, self.models[model_name], cls)
        if fires_at is not None and fires_at <= now:
            return True
        trial = budget.copy()
        for e in self.models[model_name].queues[cls]:
            if not trial.try_admit(e):
                return True
            if trial.exhausted_for(cls):
                return True
        return False

    def fires_at(self, model_name: str, model: ModelState, cls: TrafficClass) -> float | None:
        oldest = model.queues[cls].oldest()
        if oldest is None:
            return None
        at = oldest.arrival + self.config.for_class(cls).admission_window_s
        if model.queues[cls].with_deadline:
            for e in model.queues[cls]:
                if e.deadline is not None:
                    at = min(at, e.deadline - self.admission.service_estimate(model_name, e))
        return at

    def bulk_floor_seqs(self, w: WorkerView) -> int:
        """Bulk runs `w` keeps for bulk (config.bulk_floor of its slots, at least one when bulk has a floor at all):
        interactive does not take these slots while bulk waits (`bulk_reserve`), nor preempts these runs
        (preemption.py), so a run is never stopped for a slot that bulk's floor then keeps."""
        if self.config.bulk_floor == 0:
            return 0
        return max(1, math.floor(w.spec.engine_seqs * self.config.bulk_floor))

    def bulk_reserve(self, w: WorkerView, model: ModelState) -> int:
        """Slots interactive may not take from this worker while bulk waits below its floor."""
        if not model.queues[TrafficClass.BULK]:
            return 0
        floor = self.bulk_floor_seqs(w)
        return max(floor - w.bulk_running, 0)

    def late_refused(self, e: Entry) -> bool:
        """Is `e` refused rather than served late (config.late_interactive)? Only on its first attempt with nothing
        delivered: not a stream under way (never cut), not one a worker's crash sent back (accepted, it is owed an
        answer), not one of n samples (their call stands or falls together)."""
        return (self.config.late_interactive == "refuse" and e.cls == TrafficClass.INTERACTIVE and not e.generated
                and e.attempt == 1 and e.group is None)

    def lateness(self, e: Entry, w: WorkerView, model: ModelState, now: float) -> float | None:
        """How far past its deadline (planner.first_token_deadline) `e`'s first token would come, were it admitted to
        `w` now (negative: time to spare); None without one. The later of two forecasts: the pace's, with the prompts
        `w` still owes (admission.first_token_at), and, beside interactive streams, the one with the interactive
        prompts owed computed in the chunks the streams' ITL target leaves (planner.chunked_first_token_at)."""
        deadline = self.planner.first_token_deadline(e, w, model)
        if deadline is None:
            return None
        first_token = self.admission.first_token_at(e, w, now)[0]
        owed = sum(x.prefill_tokens for x in w.running.values() if x.cls == TrafficClass.INTERACTIVE and not x.prefilled)
        chunked = self.planner.chunked_first_token_at(w, now, owed + e.prompt_tokens + e.generated)
        return max(first_token, chunked if chunked is not None else first_token) - deadline

    def in_time(self, e: Entry, w: WorkerView, model: ModelState, now: float) -> bool:
        """Would `e`, admitted to `w` now, get its first token by its deadline?"""
        late = self.lateness(e, w, model, now)
        return late is None or late <= 0

    def can_take(self, e: Entry, w: WorkerView, budget: StepBudget, model: ModelState, admitted: list[Admission],
                 now: float) -> bool:
        """Would this worker admit `e` now: budget, bulk's floor, a suspect's isolation, running deadlines?"""
        if isolated(e, self.config) and (w.running or admitted):
            return False  # a suspect waits for an idle worker (crashes.py)
        # Interactive leaves bulk its floor; bulk leaves interactive its held slots.
        reserve = self.bulk_reserve(w, model) if e.cls == TrafficClass.INTERACTIVE else w.held_for_interactive()
        if budget.slots - 1 < reserve or not budget.fits(e):
            return False
        if e.cls == TrafficClass.INTERACTIVE and not self.planner.keeps_itl_target(e, w, model, now):
            return False
        if self.late_refused(e) and not self.in_time(e, w, model, now):
            return False  # its first token would come past its TTFT target: refused instead (Scheduler._refused_late)
        # One more sequence must not slow running requests past their deadlines.
        return self.admission.keeps_deadlines(w, len(w.running) + 1, now, e.prompt_tokens + e.generated)

"""What the scheduler knows of each worker and each model, and what one admission round has given out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenline.engine.scheduler.budget import StepBudget
from tokenline.engine.scheduler.pace import WorkerPace
from tokenline.engine.scheduler.queues import ClassQueue
from tokenline.engine.scheduler.records import Admission, Entry
from tokenline.engine.types import StepPlan, TrafficClass, WorkerSpec


@dataclass
class WorkerView:
    """What the scheduler knows of one worker."""

    spec: WorkerSpec
    pace: WorkerPace  # what its speed is learnt from and predicts (engine/scheduler/pace.py)
    running: dict[str, Entry] = field(default_factory=dict)  # by run key
    reserved_blocks: int = 0
    seq: int = 0  # last admission batch sent
    applied_seq: int = 0  # last admission batch the worker applied
    # seq -> (prompt tokens not yet applied, of which interactive requests')
    pending_prefill: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Prompt tokens applied but not schedulable yet (their structured-output format compiles), as last reported:
    # owed like pending ones, or a worker busy compiling looks idle and takes every waiting request.
    stalled_prefill: int = 0
    plan: StepPlan = field(default_factory=StepPlan)  # the step plan last sent to it
    isolate_after_crashes: int = 2  # SchedulerConfig's: a suspect this often crashed runs alone

    # Of `running`, the isolated suspects (crashed isolate_after_crashes times): kept by start() and stop(), as
    # accepting() is asked several times an event and a count over every run was a cost per token (issue 38).
    isolated_running: int = 0
    # Of `running`, the interactive streams, and those of them with an ITL target of their own: counted as
    # they start and stop, as admission asks per candidate (rules.can_take) and bulk is the rest.
    interactive_running: int = 0
    own_itl_targets: int = 0
    # What its step plan was made from, as a count that moves whenever that changes: a run starting or stopping
    # here, or its own step report (its pace, and its runs' tokens). Nothing else of the worker's goes into a plan
    # (planner.py), so with the model's averages unchanged too a plan made at the same count is the same plan,
    # and _compose keeps it: with several workers each report re-planned every one of them, ~50 µs each (issue 38).
    changes: int = 0
    planned_at: tuple | None = None  # (changes, the model's averages) when `plan` was made

    def start(self, e: Entry) -> None:
        """`e` runs here now."""
        self.running[e.run_key] = e
        self.changes += 1
        self._count(e, 1)

    def stop(self, run_key: str) -> Entry | None:
        """The run no longer runs here; None if it did not."""
        e = self.running.pop(run_key, None)
        if e is not None:
            self.changes += 1
            self._count(e, -1)
        return e

    def _count(self, e: Entry, n: int) -> None:
        if e.crashes >= self.isolate_after_crashes:
            self.isolated_running += n
        if e.cls == TrafficClass.INTERACTIVE:
            self.interactive_running += n
            if e.itl_target_s is not None:
                self.own_itl_targets += n

    @property
    def bulk_running(self) -> int:
        return len(self.running) - self.interactive_running

    def accepting(self) -> bool:
        # An isolated suspect runs alone, so that a crash names it.
        if self.isolated_running:
            return False
        return self.spec.continuous or not self.running

    def slots_free(self, cls: TrafficClass | None = None) -> int:
        """Free sequence slots; for bulk, less those held for interactive streams."""
        if not self.accepting():
            return 0
        free = self.spec.engine_seqs - len(self.running)
        return max(free - self.held_for_interactive(), 0) if cls == TrafficClass.BULK else free

    def held_for_interactive(self) -> int:
        """Slots bulk may not take: the worker's interactive slots not used by interactive streams."""
        if not self.spec.interactive_slots:
            return 0
        return max(self.spec.interactive_slots - self.interactive_running, 0)


@dataclass
class ModelState:
    queues: dict[TrafficClass, ClassQueue]
    workers: list[int] = field(default_factory=list)
    # Workers being retired (another took their place: `retire`): out of `workers`, so they take no new work and
    # count in no forecast, while their running sequences finish (their step plans are still composed).
    retiring: list[int] = field(default_factory=list)
    last_spec: WorkerSpec | None = None  # the last worker that joined (what a request must fit while none runs)
    # Suspects waiting to rerun, by group: kept out of the class queues, so a group waiting for an
    # idle worker never holds up the requests queued behind it.
    suspects: list[Entry] = field(default_factory=list)
    # A crash's survivors waiting for a worker that leaves another clean (SchedulerConfig.survivors_wait_s),
    # also apart from the class queues, so that newcomers go ahead to the clean worker meanwhile.
    survivors: list[Entry] = field(default_factory=list)
    # When workers died holding work (the supervisor restarts them): replacements due, oldest first.
    replacements_due: list[float] = field(default_factory=list)
    # Integral over time of "no worker of this model has room" (for the queueing split).
    no_capacity_total: float = 0.0
    no_capacity_since: float | None = None
    # What the model finishes when it is full: (time, tokens) of requests that finished while no worker had
    # room, and the recent (start, end) spans with no room. Their ratio is the model's drain rate; a rate
    # taken over idle time would be the demand, not the capacity.
    drained: deque = field(default_factory=deque)
    full_spans: deque = field(default_factory=deque)
    # Prompt tokens an interactive arrival is expected to bring (moving average of those seen;
    # the prior until one has come): what the TTFT guard keeps room for.
    interactive_prompt_tokens: float = 128.0

    # Prompt tokens a bulk request brings per output token it makes (moving average; from max_tokens
    # on arrival, from what it made once it finishes): the prompt tokens a step must compute for
    # bulk's batch to stay full as sequences end, and what a bulk token costs beside its decode.
    bulk_prompt_per_output: float = 0.0

    def retire(self, worker_id: int) -> bool:
        """Take `worker_id` out of service without stopping what it runs: nothing new is admitted to it, and
        once it runs nothing (Scheduler.running) its owner stops it and reports it lost. False if not serving."""
        if worker_id not in self.workers:
            return False
        self.workers.remove(worker_id)
        self.retiring.append(worker_id)
        return True

    def saw_interactive_prompt(self, tokens: int) -> None:
        self.interactive_prompt_tokens += 0.2 * (tokens - self.interactive_prompt_tokens)

    def saw_bulk(self, prompt_tokens: int, output_tokens: int) -> None:
        self.bulk_prompt_per_output += 0.2 * (prompt_tokens / max(output_tokens, 1) - self.bulk_prompt_per_output)


@dataclass
class Round:
    """One admission round's working state, per worker: budget left, still taking work, admitted.

    Built by the dispatch round (core.py); the crash rules (crashes.py) place suspects and survivors in it first."""

    workers: list[int]
    budgets: dict[int, StepBudget]
    open: dict[int, bool]
    admitted: dict[int, list[Admission]]

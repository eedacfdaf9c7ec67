"""The step planner: what latency targets ask of a worker, from its pace (engine/scheduler/pace.py).

It owns the rules the scheduler applies with interactive streams on a worker: the plan for its next step
(composition.compose_step, given the step budget the streams' ITL targets allow), whether one more
interactive stream still fits the ITL target and leaves bulk its throughput goal, and which ITL target a
stream has. core.py asks it; it changes nothing but the plans it returns.
"""

from __future__ import annotations

import math

from tokenline.engine.scheduler.composition import (MIN_PREFILL_CHUNK, WorkerLoad, bulk_rate_beside, compose_step,
                                                    longest_step)
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.scheduler.records import Entry
from tokenline.engine.scheduler.state import ModelState, WorkerView
from tokenline.engine.types import StepPlan, TrafficClass


class StepPlanner:
    def __init__(self, config: SchedulerConfig):
        self.config = config

    def plan(self, w: WorkerView, model: ModelState) -> StepPlan:
        """The plan for what now runs on `w`."""
        interactive = [e for e in w.running.values() if e.cls == TrafficClass.INTERACTIVE]
        ttft_target = self.ttft_target(w, model)
        bulk_decoding = sum(1 for e in w.running.values() if e.cls == TrafficClass.BULK and e.prefilled)
        load = WorkerLoad(interactive=len(interactive),
                          interactive_prefill=sum(e.prompt_tokens + e.generated for e in interactive if not e.prefilled),
                          bulk=bulk_decoding,
                          interactive_decoding=sum(1 for e in interactive if e.prefilled),
                          bulk_prefilling=len(w.running) - len(interactive) - bulk_decoding,
                          interactive_prefill_due=self.prefill_due(w, interactive, ttft_target))
        pace, single = w.pace, w.pace.target_single()
        # `share` only sizes the TTFT guard (share × TTFT target), by its own set point: the ITL steps follow the
        # step budget.
        return compose_step(load, pace.cadence, self.itl_target(interactive, single),
                            share=self.config.ttft_set_point, min_bulk=self.config.min_bulk_decode,
                            step_budget_s=self.step_budget(w, interactive, single),
                            ttft_target_s=ttft_target,
                            typical_prompt=round(model.interactive_prompt_tokens), single_step_s=pace.single_step_s,
                            prefill_token_s=pace.prefill_token_s, bulk_prompt_per_output=model.bulk_prompt_per_output)

    def step_budget(self, w: WorkerView, interactive: list[Entry], single_step_s: float) -> float | None:
        """How long the worker's next planned step may be, in the planning line's seconds: the least
        any of its interactive streams allows (composition.stream_allowance), None with none that has a target.

        Counted from the worker's last report, whenever the plan is made (a plan remade between two
        reports is for the same step). A worker that steps on before its report is read has a step
        under way then, composed by the plan it has: that step comes first, as long as its plan
        predicted (or, unplanned, its step at the batch it runs), scaled by how long planned steps
        really take. The budget, in the line's seconds, is capped as each allowance is in real ones
        (composition.longest_step), so no plan predicts a step nearer the target than that."""
        pace = w.pace
        ahead = 1 if w.spec.runs_ahead else 0
        under_way = pace.under_way_step_s or pace.cadence.step_s(len(w.running))
        # Once per plan over every interactive stream: stream_allowance and itl_target([e]) written out (issue 38).
        set_point, before, last_report = self.config.itl_set_point, ahead * pace.step_ratio * under_way, pace.last_report_at
        class_target = self.config.interactive.itl_target_for(single_step_s)
        floor = self.config.min_itl_target_steps * single_step_s
        lowest = tightest = math.inf
        for e in interactive:
            own = e.itl_target_s
            if own is None:
                if class_target is None:
                    continue
                target = class_target
            else:
                target = max(own, floor) if class_target is None else min(class_target, max(own, floor))
            if e.first_token_at is None:  # stream_allowance with no gaps yet
                allowed = set_point * target
            else:
                allowed = min(set_point * target * (e.tokens_this_run + ahead) - max(last_report - e.first_token_at, 0.0)
                              - before, 0.5 * (1.0 + set_point) * target)  # longest_step
            if allowed < lowest:
                lowest = allowed
            if target < tightest:
                tightest = target
        if tightest == math.inf:
            return None
        return min(lowest / pace.step_ratio, longest_step(tightest, self.config.itl_set_point))

    def ttft_target(self, w: WorkerView, model: ModelState) -> float | None:
        """The interactive class's TTFT target on this worker: as given, or a multiple of what the worker, idle,
        needs for a typical interactive prompt's first token (its step line at one sequence, and the prompt)."""
        pace = w.pace
        idle_first_token_s = pace.single() + pace.line(1)[2] * model.interactive_prompt_tokens
        return self.config.interactive.ttft_target_for(idle_first_token_s, self.config.ttft_target_floor_s)

    def prefill_due(self, w: WorkerView, interactive: list[Entry], target: float | None) -> int:
        """Prompt tokens the worker's next step must compute so that each interactive prompt it owes still
        gets its first token within the TTFT target (at the guard's set point): each prompt's share of the
        steps left before then, the whole of it when one step or none is left. The ITL target chunks owed
        prompts to keep running streams' pace; it may not chunk one so thin that its own first token comes
        late (measured: with only the minimum chunk, an all-interactive flood's later prompts took 16 tokens
        a step, their first tokens came a minute late and the batch drained). A prompt's progress is not
        reported, so its whole length counts as owed until its first token: the chunk only errs larger."""
        owed = [e for e in interactive if not e.prefilled]
        if target is None or not owed:
            return 0
        pace = w.pace
        step_s = max(pace.cadence.step_s(len(w.running)), 1e-6)
        due = 0
        for e in owed:
            tokens = e.prompt_tokens + e.generated
            steps = math.floor((e.arrival + self.config.ttft_set_point * target - pace.last_report_at) / step_s)
            due += tokens if steps <= 1 else math.ceil(tokens / steps)
        return due

    def chunked_first_token_at(self, w: WorkerView, now: float, owed_tokens: int) -> float | None:
        """When a prompt with `owed_tokens` interactive prompt tokens ahead of it and its own gets its first token
        on `w`, computed as the ITL target of the interactive streams there lets it: a step of them (and the bulk
        that never starves) leaves room for so many prompt tokens (at least the minimum chunk), and each step lasts
        the planned share of the target (composition.py composes steps so). None without a stream with a target:
        nothing chunks prompts then, and the pace's forecast stands (admission.first_token_at). That forecast
        computes owed prompts at the unchunked rate: beside streams it promised first tokens the plan could not
        give (the simulator's steady overload, tests/test_targets_overload.py: up to 5.3 s against 4.17 s)."""
        interactive = [x for x in w.running.values() if x.cls == TrafficClass.INTERACTIVE]
        target = self.itl_target(interactive, w.pace.target_single()) if interactive else None
        if target is None:
            return None
        bulk = sum(1 for x in w.running.values() if x.cls == TrafficClass.BULK)
        a, b, c = w.pace.line(len(w.running) + 1)
        # The step the streams allow now: the target's planned share, more where they run ahead of it.
        planned = max(self.config.itl_set_point * target, self.step_budget(w, interactive, w.pace.target_single()) or 0.0)
        decode_s = a + b * (len(interactive) + min(self.config.min_bulk_decode, bulk))
        chunk = max((planned - decode_s) / c if c > 0 else math.inf, MIN_PREFILL_CHUNK)
        steps = math.ceil(owed_tokens / chunk)
        return now + steps * max(planned, decode_s + c * min(chunk, owed_tokens))

    def _streams_keep(self, streams: int, target: float, w: WorkerView, model: ModelState) -> bool:
        """Do `streams` interactive streams on `w` (and the bulk that never starves) keep steps within `target` at
        the ITL set point, and leave bulk its throughput goal?"""
        bulk = w.bulk_running
        a, b, c = w.pace.line(len(w.running))
        planned = self.config.itl_set_point * target
        goal = self.bulk_goal_per_worker(model)
        return (a + b * (streams + min(self.config.min_bulk_decode, bulk)) <= planned
                and (goal is None or bulk_rate_beside(streams, (a, b, c), planned, model.bulk_prompt_per_output) >= goal))

    def stream_room(self, e: Entry, w: WorkerView, model: ModelState) -> tuple[int, float] | None:
        """(How many interactive streams `w`'s steps keep within `e`'s ITL target, at least the one always let in;
        that target), or None without an ITL target: for retry hints (hints.py), the room a stream booked there
        takes."""
        interactive = [x for x in w.running.values() if x.cls == TrafficClass.INTERACTIVE]
        target = self.itl_target(interactive + [e], w.pace.target_single())
        if target is None:
            return None
        streams = 1
        while streams < w.spec.engine_seqs and self._streams_keep(streams + 1, target, w, model):
            streams += 1
        return streams, target

    def admits_late(self, e: Entry, w: WorkerView, model: ModelState, now: float) -> bool:
        """Has interactive `e` waited for ITL room as long as its TTFT target allows? Then it goes in anyway
        (the running streams' steps slow down; its first token does not wait on theirs for ever). The last
        moment: a step of everything running, it too, and its whole prompt still ends within the target at
        the guard's set point. Under an all-interactive flood the ITL target would otherwise cap the batch
        and queue the rest without bound; a bulk flood is still paused for interactive first."""
        target = self.ttft_target(w, model)
        if e.cls != TrafficClass.INTERACTIVE or target is None:
            return False
        batch = len(w.running) + 1
        a, b, c = w.pace.line(batch)
        own = a + b * batch + c * (e.prompt_tokens + e.generated)
        return now >= e.arrival + self.config.ttft_set_point * target - own

    def first_token_deadline(self, e: Entry, w: WorkerView, model: ModelState) -> float | None:
        """The latest first token on `w` that keeps interactive `e` within its TTFT target (at the guard's set
        point), for refusing late requests (config.late_interactive). None: no TTFT target, or a prompt that alone,
        on an idle worker, needs longer (no wait of its own made it late; it is served as it can be)."""
        target = self.ttft_target(w, model)
        if e.cls != TrafficClass.INTERACTIVE or target is None:
            return None
        a, b, c = w.pace.line(1)
        if a + b + c * (e.prompt_tokens + e.generated) > self.config.ttft_set_point * target:
            return None
        return e.arrival + self.config.ttft_set_point * target

    def bulk_goal_per_worker(self, model: ModelState) -> float | None:
        """Each worker's part of bulk's throughput goal: the model's goal shared evenly by its workers."""
        goal = self.config.bulk.throughput_goal_tok_s
        return goal / len(model.workers) if goal and model.workers else None

    def itl_target(self, interactive: list[Entry], single_step_s: float) -> float | None:
        """The tightest ITL target among the interactive requests running on a worker: the class's,
        or a request's own, which is never taken below `min_itl_target_steps` single steps."""
        target = self.config.interactive.itl_target_for(single_step_s)
        own = [e.itl_target_s for e in interactive if e.itl_target_s is not None]
        if own:
            floor = self.config.min_itl_target_steps * single_step_s
            tightest = max(min(own), floor)
            target = tightest if target is None else min(target, tightest)
        return target

    def keeps_itl_target(self, e: Entry, w: WorkerView, model: ModelState, now: float | None = None) -> bool:
        """Can the worker's steps still be composed within the ITL target with `e` decoding too, and
        still leave bulk its throughput goal?

        Interactive streams, unlike bulk, cannot be paused: past some number of them even a step of
        only them (and the one bulk sequence that never starves) is slower than the target, and every
        stream on the worker would miss it; and each one more leaves less of a step for bulk. Beyond
        that, a newcomer waits in the queue for one to end (its TTFT pays, not the running streams'
        ITL, nor bulk's goal); the first is always let in, and one that has waited as long as its TTFT target
        allows (`admits_late`, given `now`), unless late requests are refused (config.late_interactive)."""
        streams = w.interactive_running  # this round's admissions too
        if not streams:
            return True
        if w.own_itl_targets:  # the tightest of their own targets counts too
            interactive = [x for x in w.running.values() if x.cls == TrafficClass.INTERACTIVE]
            target = self.itl_target(interactive + [e], w.pace.target_single())
        else:  # asked per candidate of every admission round: no pass over the running streams
            target = self.itl_target([e], w.pace.target_single())
        if target is None:
            return True
        keeps = self._streams_keep(streams + 1, target, w, model)
        late_admitted = self.config.late_interactive == "admit" and now is not None
        return keeps or (late_admitted and self.admits_late(e, w, model, now))

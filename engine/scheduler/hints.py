"""Retry hints of late refusals (config.late_interactive = "refuse"): when to come back so as to be served.

A hint is the soonest moment a worker could serve the same request within its TTFT target, were it sent again
then: once the prompt tokens the worker owes leave its first token in time, and once its streams leave room under
the ITL target. A burst refused together must not be told one moment: sent again together, it met the same full
worker and was refused again (the simulator's burst flood: none of 186 served when they came back as told). So
each hint books what its request will take on the worker it was told about: its prompt, added to the prompt tokens
the worker owes when it comes back, and a stream's room under the ITL target from then until it ends (its
max_tokens at the target). A later hint on that worker comes after those booked, once the prompt tokens owed
then (what is owed now, computed at the rate the worker's step plan allows, plus the booked prompts) leave its first
token in time, and once the streams running and booked leave it room. A booking is dropped when its moment comes:
the request is back (and counted as what it then is) or is not coming.

Pure: the Scheduler holds one RetryHints and asks it with its state and the clock's reading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenline.engine.scheduler.planner import StepPlanner
from tokenline.engine.scheduler.records import Entry
from tokenline.engine.scheduler.rules import DispatchRules
from tokenline.engine.scheduler.state import ModelState, WorkerView
from tokenline.engine.types import TrafficClass

MIN_HINT_S = 0.05
MAX_HINT_S = 60.0


@dataclass(frozen=True)
class Booking:
    at: float  # when its request was told to come back
    prompt_tokens: int  # what it brings for the worker to compute then
    until: float  # its stream ended, if it came then (at + max_tokens at the ITL target)


@dataclass
class RetryHints:
    planner: StepPlanner
    rules: DispatchRules
    books: dict[int, list[Booking]] = field(default_factory=dict)  # by worker, pending (at > now)

    def hint(self, e: Entry, workers: list[WorkerView], model: ModelState, now: float) -> float | None:
        """Seconds until `e`, refused now for lateness, could come back and be served in time on one of
        `workers`, booked there; None if no worker has a TTFT target for it."""
        self._drop_past(now, {w.spec.worker_id for w in workers})
        best: tuple[float, WorkerView, tuple[int, float] | None] | None = None
        for w in workers:
            soonest = self._soonest(e, w, model, now)
            if soonest is not None and (best is None or soonest[0] < best[0]):
                best = (soonest[0], w, soonest[1])
        if best is None:
            return None
        at, w, room = best
        at = min(max(at, now + MIN_HINT_S), now + MAX_HINT_S)
        per_token = w.pace.estimator.step_s(len(w.running) + 1)
        if room is not None:
            per_token = min(per_token, room[1])
        self.books.setdefault(w.spec.worker_id, []).append(
            Booking(at, e.prompt_tokens + e.generated, at + e.max_tokens * per_token))
        return at - now

    def _soonest(self, e: Entry, w: WorkerView, model: ModelState, now: float
                 ) -> tuple[float, tuple[int, float] | None] | None:
        """(When `e` could come back to `w` and be served in time, after the bookings there; `w`'s stream room for
        it, planner.stream_room), or None if `w` has no TTFT target for it."""
        late = self.rules.lateness(e, w, model, now)
        if late is None:
            return None
        booked = sorted(self.books.get(w.spec.worker_id, []), key=lambda b: b.at)
        # Sent again at t, its first token is forecast with the prompt tokens owed at t (rules.lateness): in time once
        # they are at most `allowed`, which is what is owed now less what makes it `late` (its wait so far refunded:
        # its deadline moves on with it). Owed tokens drain at the rate the worker's plan computes prompts; each
        # booking adds its prompt when it comes, and this request comes after them.
        per_token = w.pace.estimator.prefill_per_token_s
        owed = self.rules.admission.prefill_owed(w)
        if per_token <= 0:
            at = max([now + max(late - (now - e.arrival), 0.0), *(b.at for b in booked)])
        else:
            allowed = owed - (late - (now - e.arrival)) / per_token
            rate = self._prompt_rate(w)
            t, level = now, float(owed)
            for b in booked:
                level = max(level - rate * (b.at - t), 0.0) + b.prompt_tokens
                t = b.at
            at = t + max(level - allowed, 0.0) / rate
        room = self.planner.stream_room(e, w, model)
        if room is not None:
            streams, _ = room
            ends = sorted([x.est_finish for x in w.running.values() if x.cls == TrafficClass.INTERACTIVE]
                          + [b.until for b in booked])
            if len(ends) >= streams:  # room once all but streams - 1 of them have ended
                at = max(at, ends[len(ends) - streams])
        return (at, room) if math.isfinite(at) else None

    @staticmethod
    def _prompt_rate(w: WorkerView) -> float:
        """Prompt tokens a second `w` computes: what its step plan allows a step (with interactive streams in, a
        prompt is computed in chunks that keep their ITL target), else all its steps' time."""
        if w.plan.prefill_tokens is not None and w.plan.predicted_step_s > 0:
            return max(w.plan.prefill_tokens, 1) / w.plan.predicted_step_s
        return 1.0 / w.pace.estimator.prefill_per_token_s

    def _drop_past(self, now: float, workers: set[int]) -> None:
        for wid in list(self.books):
            kept = [b for b in self.books[wid] if b.at > now] if wid in workers else []
            if kept:
                self.books[wid] = kept
            else:
                del self.books[wid]

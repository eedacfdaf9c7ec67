"""Crash recovery: what becomes of a dead worker's runs, and who is blamed for the crash.

One crash names no one: what it interrupted goes again as new attempts (or fails, its attempts spent, or
expires), and while other workers serve, waits as the crash's survivors for a worker that leaves another
clean, so that a poison among them takes one worker, never all. Requests running at `isolate_after_crashes`
crashes are suspects: they rerun by bisection, in two groups each alone on an idle worker, a group that
crashes again is split again, and one that crashes alone names its culprit, which is quarantined. A model of
several workers keeps one for the rest of the work meanwhile, counting those that are being restarted.

The Scheduler holds one CrashRecovery, built over its state and given what it asks of the other parts (can
a worker take a request: rules.py; when its first token would come: admission.py) and the scheduler's own
steps (queue, forget, admit into a round). It places suspects and survivors at the start of each dispatch
round (core.py), before the class queues. `isolated` is the one test of a suspect, which rules.py applies too.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenline.engine.scheduler.budget import StepBudget
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.scheduler.records import Action, Admission, Entry, Expire, Fail, Retry
from tokenline.engine.scheduler.state import ModelState, Round, WorkerView
from tokenline.engine.scheduler.status import Status, transition


def isolated(e: Entry, config: SchedulerConfig) -> bool:
    """A suspect: running when workers died often enough that it must run alone."""
    return e.crashes >= config.isolate_after_crashes


class CrashRecovery:
    """The crash rules over the Scheduler's state, given explicitly."""

    def __init__(self, config: SchedulerConfig, workers: dict[int, WorkerView], entries: dict[str, Entry],
                 model_of: Callable[[str], ModelState], *,
                 can_take: Callable[[Entry, WorkerView, StepBudget, ModelState, list[Admission], float], bool],
                 first_token_at: Callable[[Entry, WorkerView, float], tuple[float, int, int]],
                 enqueue: Callable[..., None], forget: Callable[[Entry], None],
                 take: Callable[[Entry, int, Round, float], None]):
        self.config = config
        self.workers = workers
        self.entries = entries
        self.model_of = model_of  # the model's state, created if new (Scheduler._model)
        self.can_take = can_take  # would the worker admit it now (DispatchRules.can_take)
        self.first_token_at = first_token_at  # when its first token would come there (AdmissionControl.first_token_at)
        self.enqueue = enqueue  # queue a request again: (entry, now, *, front, survivor) (Scheduler._enqueue)
        self.forget = forget  # drop an ended request (Scheduler._forget)
        self.take = take  # admit it onto a worker in this round: (entry, worker id, round, now) (Scheduler._take)
        self.next_group = 1  # the next suspect group's number

    def worker_lost(self, w: WorkerView, now: float) -> list[Action]:
        """`w` died (the scheduler has let it go): its runs go again as new attempts, or fail. The
        scheduler's dispatch round follows."""
        model = self.model_of(w.spec.model)
        retired = w.spec.worker_id in model.retiring  # being replaced already: nothing restarts it
        (model.retiring if retired else model.workers).remove(w.spec.worker_id)
        actions: list[Action] = []
        alone = len(w.running) == 1
        if w.running and not retired:  # a crash (a removed worker is idle): the supervisor restarts it
            model.replacements_due.append(now)
        suspects: list[Entry] = []
        for e in list(w.running.values()):
            was_isolated = self.isolated(e)
            e.crashes += 1
            e.worker_id, e.blocks = None, 0
            cls_cfg = self.config.for_class(e.cls)
            if (was_isolated and alone) or (not was_isolated and e.crashes >= self.config.quarantine_after_crashes):
                transition(e, Status.FAILED)
                why = "while it ran alone" if was_isolated and alone else "while running it"
                actions.append(Fail(e.key, f"quarantined: a worker died {e.crashes} times {why}", True))
            elif e.attempt >= cls_cfg.max_attempts and not was_isolated:  # a group's rerun is diagnosis, not a retry
                transition(e, Status.FAILED)
                actions.append(Fail(e.key, f"worker died and all {cls_cfg.max_attempts} attempts are spent"))
            elif e.deadline is not None and e.deadline <= now:
                transition(e, Status.EXPIRED)
                actions.append(Expire(e.key))
            else:
                transition(e, Status.QUEUED)
                e.attempt += 1
                if self.isolated(e):
                    suspects.append(e)
                elif model.workers:  # others still serve: one of them stays clean (see admit_survivors)
                    self.enqueue(e, now, survivor=True)
                else:
                    self.enqueue(e, now, front=True)
                actions.append(Retry(e.key, e.attempt))
                continue
            self.forget(e)
        # Bisection: the suspects of this crash rerun as two groups, each apart from all other work; a
        # group that finishes clears its members, one that crashes is split again, and one that crashes
        # alone names its culprit. log2(n) reruns, in parallel on idle workers, instead of n one by one.
        half = (len(suspects) + 1) // 2
        for i, e in enumerate(suspects):
            e.suspect_group = self.next_group + (i >= half)
            self.enqueue(e, now, front=True)
        self.next_group += 2
        return actions

    def isolated(self, e: Entry) -> bool:
        """A suspect, under the config now in force."""
        return isolated(e, self.config)

    def admit_suspects(self, model: ModelState, r: Round, now: float) -> None:
        """Each waiting suspect group onto an idle worker of its own, as far as they fit; while the model
        has more than one worker, one is always left to the rest of the work (newcomers are not held up
        by a diagnosis)."""
        def idle(wid: int) -> bool:
            return r.open[wid] and not self.workers[wid].running and not r.admitted[wid]

        def diagnosing(wid: int) -> bool:
            return any(self.isolated(e) for e in self.workers[wid].running.values()) or \
                any(self.isolated(self.entries[a.key]) for a in r.admitted[wid])

        several = len(r.workers) + self.replacements_due(model, now) > 1
        for group in dict.fromkeys(e.suspect_group for e in model.suspects):
            free = [wid for wid in r.workers if idle(wid)]
            busy = sum(1 for wid in r.workers if diagnosing(wid))
            if not free or (several and busy + 1 >= len(r.workers)):
                return  # (a model of several with one worker up, the others restarting: that one serves)
            wid = free[0]
            budget = r.budgets[wid]
            for e in [e for e in model.suspects if e.suspect_group == group]:
                if budget.slots < 1 or not budget.fits(e):
                    break  # the rest of the group waits for the next idle worker
                self.take(e, wid, r, now)
            r.open[wid] = False

    def admit_survivors(self, model: ModelState, r: Round, now: float) -> None:
        """A crash's survivors, each where its first token comes soonest among the workers that leave another
        worker of the model clean (no crashed run on it): were a poison among them, its next crash takes one
        worker, never all, and newcomers keep one. Past `survivors_wait_s` (the crashed worker's replacement
        has not come), any worker."""
        for e in list(model.survivors):
            waited_out = now - e.queued_since >= self.config.survivors_wait_s
            candidates = [wid for wid in r.workers if r.open[wid]
                          and (waited_out or any(not self.holds_crashed(o, r) for o in r.workers if o != wid))
                          and self.can_take(e, self.workers[wid], r.budgets[wid], model, r.admitted[wid], now)]
            if not candidates:
                continue
            # Where the fewest would share a next crash (a fresh replacement, rather than a worker full of
            # innocents), then where the first token comes soonest.
            wid = min(candidates, key=lambda i: (len(self.workers[i].running) + len(r.admitted[i]),
                                                 self.first_token_at(e, self.workers[i], now)))
            self.take(e, wid, r, now)

    def holds_crashed(self, wid: int, r: Round) -> bool:
        """Does the worker run (or get this round) a request that was running at a crash?"""
        return any(x.crashes for x in self.workers[wid].running.values()) or \
            any(self.entries[a.key].crashes for a in r.admitted[wid])

    def replacements_due(self, model: ModelState, now: float) -> int:
        """Workers of the model that died holding work and are being restarted (for survivors_wait_s at most)."""
        while model.replacements_due and model.replacements_due[0] < now - self.config.survivors_wait_s:
            model.replacements_due.pop(0)
        return len(model.replacements_due)

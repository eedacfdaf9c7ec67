"""The scheduler: a pure state machine deciding when each request departs.

Events in (submit, cancel, step report, worker up/down, timer), actions out
(dispatch, refuse, expire, stop a run, fail, retry). Time comes only from the
injected clock, so the same code runs in the server and in virtual time.

The decision at every event is `_dispatch`: for each worker with room, build a
fresh budget and admit interactive first, then bulk, each class only when its
dispatch rule fires (the budget would be filled, the oldest request has waited
its admission window, or waiting longer would threaten a deadline).

The event handlers and the dispatch round live here, over one state and one invariant (every event ends
in `_dispatch`); the rules they apply are composed parts, each given that state explicitly: admission.py
(estimates, refusals), rules.py (the dispatch rule), planner.py (step plans), crashes.py (a dead
worker's runs, suspects and survivors), preemption.py (when running bulk gives way), placement.py (n samples).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable

from tokenline.engine.scheduler.admission import AdmissionControl
from tokenline.engine.scheduler.budget import blocks_for
from tokenline.engine.scheduler.config import SchedulerConfig, model_name
from tokenline.engine.scheduler.crashes import CrashRecovery
from tokenline.engine.scheduler.hints import RetryHints
from tokenline.engine.scheduler.pace import WorkerPace, timed_single_step
from tokenline.engine.scheduler.placement import SiblingPlacement
from tokenline.engine.scheduler.planner import StepPlanner
from tokenline.engine.scheduler.preemption import Preemption
from tokenline.engine.scheduler.queues import ClassQueue
from tokenline.engine.scheduler.records import (Abort, Action, Admission, Admit, Counters, Delivery, Entry, Expire,
                                                Refusal, Refuse, SetPlan, StepResult)
from tokenline.engine.scheduler.rules import DispatchRules
from tokenline.engine.scheduler.state import ModelState, Round, WorkerView
from tokenline.engine.scheduler.status import FINAL, Status, transition
from tokenline.engine.types import FinishReason, StepReport, TrafficClass, WorkerSpec

CLASSES = (TrafficClass.INTERACTIVE, TrafficClass.BULK)


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]):
        self._config = config
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        self.models: dict[str, ModelState] = {}
        self.workers: dict[int, WorkerView] = {}
        self.planner = StepPlanner(config)  # what latency targets ask of each worker (engine/scheduler/planner.py)
        self.siblings = SiblingPlacement(self.workers, self.entries)  # a call's n samples share a worker (placement.py)
        self.counters = Counters()
        self._deadlines: list[tuple[float, str]] = []  # heap; stale rows skipped lazily
        self._tenant_inflight: Counter[str] = Counter()
        self._tenant_model_inflight: Counter[tuple[str, str]] = Counter()  # (tenant, model name): TenantConfig.model_concurrent
        self._tenant_queued_tokens: Counter[str] = Counter()
        self._decided_at: dict[str, float] = {}  # model -> when its dispatch rule was last applied
        # Models whose workers start on demand (autoscaled from zero) -> seconds a start takes: with no
        # worker their requests queue (the queue starts one) instead of being refused.
        self.on_demand: dict[str, float] = {}
        # Estimates and refusals (engine/scheduler/admission.py), over this state.
        self.admission = AdmissionControl(config, self.models, self.workers, self.entries, self.on_demand,
                                          self._tenant_inflight, self._tenant_queued_tokens, self._model,
                                          self._tenant_model_inflight)
        self.rules = DispatchRules(config, self.models, self.admission, self.planner, self.siblings)  # budgets, when queues are released
        # A dead worker's runs, suspects and survivors (engine/scheduler/crashes.py).
        self.crashes = CrashRecovery(config, self.workers, self.entries, self._model, can_take=self.rules.can_take,
                                     first_token_at=self.admission.first_token_at, enqueue=self._enqueue,
                                     forget=self._forget, take=self._take)
        # When a request refused for lateness is told to come back (engine/scheduler/hints.py).
        self.hints = RetryHints(self.planner, self.rules)
        # When running bulk gives way, and KV reservations as runs grow (engine/scheduler/preemption.py).
        self.preemption = Preemption(config, self.workers, self.counters, self.rules, self.planner,
                                     release=self._release, enqueue=self._enqueue)

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @config.setter
    def config(self, config: SchedulerConfig) -> None:
        """A new config (a changed keys file's quotas) reaches every part that reads one, at once."""
        self._config = config
        for part in (self.admission, self.rules, self.planner, self.crashes, self.preemption):
            part.config = config
        for w in self.workers.values():
            w.planned_at = None  # plans are made again under it

    # ------------------------------------------------------------------ events

    def add_worker(self, spec: WorkerSpec) -> list[Action]:
        old = self.workers.get(spec.worker_id)
        pace = old.pace.restarted() if old is not None else \
            WorkerPace.fresh(self.config.step_time_prior_s, self.config.prefill_per_token_prior_s)  # a restart keeps what was learnt
        if timed_single_step(spec.single_step_s) is not None:
            pace.single_step_s = spec.single_step_s  # timed on its idle engine: where its single step starts from
            pace.target_single_s = spec.single_step_s  # and what its ITL targets are named from (the start-up line)
        self.workers[spec.worker_id] = WorkerView(spec=spec, pace=pace, isolate_after_crashes=self.config.isolate_after_crashes)
        model = self._model(spec.model)
        model.last_spec = spec
        if spec.worker_id not in model.workers:
            model.workers.append(spec.worker_id)
            if model.replacements_due:
                model.replacements_due.pop(0)
        return self._dispatch(spec.model)

    def worker_lost(self, worker_id: int) -> list[Action]:
        """A worker died: its runs go again as new attempts, or fail (the crash rules: crashes.py)."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        return self.crashes.worker_lost(w, self.clock()) + self._dispatch(w.spec.model)

    def submit(self, entry: Entry, *, dispatch: bool = True) -> list[Action]:
        """A new request: refuse it now, or queue it (and maybe dispatch it). `dispatch=False`: only queue it
        (the actions are its refusal or none); the caller calls `dispatch` soon, once for many submissions."""
        now = self.clock()
        entry.arrival = now
        refusal = self.admission.check(entry, now)
        decided: list[Action] = []
        model = self.models.get(entry.model)
        if refusal is not None and not dispatch and model is not None and any(model.queues.values()):
            # Requests queued earlier without a decision yet (dispatch=False) may be admitted now and leave room (a
            # full queue): decide them first, as their own submit would have, and ask again.
            decided = self._dispatch(entry.model, now)
            refusal = self.admission.check(entry, now)
        if refusal is not None:
            transition(entry, Status.REFUSED)
            return decided + [refusal]
        self.entries[entry.key] = entry
        self._tenant_inflight[entry.tenant] += 1
        self._tenant_model_inflight[entry.tenant, model_name(entry.model)] += 1
        if entry.deadline is not None:
            heapq.heappush(self._deadlines, (entry.deadline, entry.key))
        self._enqueue(entry, now)
        if entry.cls == TrafficClass.INTERACTIVE:
            self.models[entry.model].saw_interactive_prompt(entry.prompt_tokens)
        else:  # what its prompt costs per token it may make, until it finishes and says what it made
            self.models[entry.model].saw_bulk(entry.prompt_tokens, entry.max_tokens)
        if not dispatch:
            return decided
        return self._dispatch(entry.model, now)  # one clock reading: admitted at once means zero wait

    def dispatch(self, model_name: str) -> list[Action]:
        """The decision every event makes (expire, admit, plan), for submissions queued with dispatch=False."""
        return self._dispatch(model_name) if model_name in self.models else []

    def cancel(self, key: str) -> list[Action]:
        e = self.entries.get(key)
        if e is None or e.status in FINAL:
            return []
        actions: list[Action] = []
        if e.status == Status.QUEUED:
            self._dequeue(e)
        else:
            actions.append(Abort(e.key, e.worker_id, e.run_key))
            self._release(e)
        transition(e, Status.CANCELLED)
        self._forget(e)
        return actions + self._dispatch(e.model)

    def on_step(self, report: StepReport) -> StepResult:
        """A worker finished a step: the one loop over its report.

        Learns the worker's speed, counts each current run's tokens, frees finished and rejected
        runs, and says what to deliver to callers and what to do next. Output of a run that is
        no longer current (preempted, retried, cancelled) is dropped here, and counted.
        """
        result = StepResult(report)
        w = self.workers.get(report.worker_id)
        if w is None:  # a worker already declared lost: all of it is stale
            self.counters.stale_outputs += len(report.outputs)
            return result
        now = self.clock()
        self._learn(w, report, now)
        if w.pace.target_moved and self.config.interactive.itl_target_in_steps:
            result.itl_target_moved_s = self.config.interactive.itl_target_for(w.pace.target_single())
        step = w.pace.estimator.step_s(max(len(w.running), 1))
        result.interactive = w.interactive_running
        result.plan = w.plan
        result.started = [w.running[k].key for k in report.first_scheduled if k in w.running]
        for run_key, reason in report.rejected.items():
            e = w.running.get(run_key)
            if e is not None:  # the engine refused it (its reason goes to the caller): it never runs
                self._release(e)
                transition(e, Status.FAILED)
                self._forget(e)
                result.rejected.append((e.key, reason))
        # Once per sequence per step: the frontend's largest per-token loop, so written for speed (issue 38).
        running, deliveries = w.running, result.deliveries
        block_size, margin = w.spec.block_size, self.config.kv_margin_tokens
        for out in report.outputs:
            e = running.get(out.key)
            if e is None:
                self.counters.stale_outputs += 1
                continue
            ids = out.new_token_ids
            if ids:
                n = len(ids)
                e.generated += n
                e.tokens_this_run += n
                if e.first_token_at is None:
                    e.first_token_at = now
                e.prefilled = True
            e.est_finish = now + max(e.max_tokens - e.generated, 0) * step  # Entry.remaining
            if out.finished:
                deliveries.append(Delivery(e.key, ids, out.text, out.finish_reason or FinishReason.STOP, out.logprobs,
                                           out.prompt_logprobs, out.cached_tokens))
                self._finish(e, now)
            else:
                deliveries.append(Delivery(e.key, ids, out.text, None, out.logprobs, out.prompt_logprobs,
                                           out.cached_tokens))
                # It grew: its reservation follows what it holds now, plus the margin (budget.blocks_for, written out).
                tokens = min(e.prompt_tokens + e.generated + margin, e.prompt_tokens + e.max_tokens)
                blocks = -(-tokens // block_size)
                if blocks != e.blocks:
                    w.reserved_blocks += blocks - e.blocks
                    e.blocks = blocks
        result.actions = self.preemption.relieve_kv_pressure(w, now) + self._dispatch(w.spec.model, reporting=w.spec.worker_id)
        return result

    def _learn(self, w: WorkerView, report: StepReport, now: float) -> None:
        """The worker's pace, and which admission batches it has applied."""
        w.applied_seq = max(w.applied_seq, report.applied_seq)
        w.changes += 1  # its pace and its runs' tokens move: its plan is made again
        w.pace.observe(report, now, busy=bool(w.running), plan=w.plan)
        for seq in [s for s in w.pending_prefill if s <= w.applied_seq]:
            del w.pending_prefill[seq]
        w.stalled_prefill = report.stalled_prompt_tokens

    def on_timer(self) -> list[Action]:
        """Expire what passed its deadline and fire admission windows that ran out."""
        actions: list[Action] = []
        for name in self.models:
            actions += self._dispatch(name)
        return actions

    def _expire_overdue(self, now: float) -> list[Action]:
        """Every event first removes what passed its deadline, so nothing overdue is admitted."""
        actions: list[Action] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            e = self.entries.get(key)
            if e is None or e.deadline is None or e.deadline > now:
                continue
            if e.status == Status.QUEUED:
                self._dequeue(e)
                actions.append(Expire(e.key))
            else:
                actions.append(Expire(e.key, e.worker_id, e.run_key))
                self._release(e)
            transition(e, Status.EXPIRED)
            self._forget(e)
        return actions

    def next_wakeup(self) -> float | None:
        """The earliest time `on_timer` has something to do: a deadline, or an admission rule that
        fires after the model's last decision (one that fired by then and admitted nothing waits
        for capacity, which comes with an event, never with a timer)."""
        while self._deadlines and self._deadlines[0][1] not in self.entries:
            heapq.heappop(self._deadlines)
        times = [self._deadlines[0][0]] if self._deadlines else []
        for name, model in self.models.items():
            decided = self._decided_at.get(name, -math.inf)
            times += [t for e in model.survivors if (t := e.queued_since + self.config.survivors_wait_s) > decided]
            for cls in CLASSES:
                t = self.rules.fires_at(name, model, cls)
                if t is not None and t > decided:
                    times.append(t)
            head = model.queues[TrafficClass.INTERACTIVE].peek()
            if head is not None and self.rules.late_refused(head):  # its refusal must not wait for a step
                hopeless_at = self._hopeless_at(head, model, self.clock())
                if decided < hopeless_at < math.inf:
                    times.append(hopeless_at)
        return min(times, default=None)

    # ------------------------------------------------------------- dispatching

    def _dispatch(self, model_name: str, now: float | None = None, *, reporting: int | None = None) -> list[Action]:
        """Every event's decision: expire what is overdue, admit what the dispatch rule releases,
        and, if interactive work still fits nowhere, preempt bulk for it and admit once more.
        `reporting`: the worker whose report this is (it is at a step boundary)."""
        now = self.clock() if now is None else now
        model = self.models[model_name]
        self._decided_at[model_name] = now
        actions: list[Action] = self._expire_overdue(now)
        admitted = self._admit_queued(model_name, model, now, reporting)
        if self.config.preempt_bulk:
            stopped = self.preemption.for_interactive(model_name, model, now)
            if stopped:
                actions += admitted + stopped
                admitted = self._admit_queued(model_name, model, now, reporting)
        self._note_capacity(model, now)
        return actions + self._compose(model) + admitted  # the plan before the admissions: in place when they land

    def _admit_queued(self, model_name: str, model: ModelState, now: float, reporting: int | None = None) -> list[Action]:
        """Interactive on every worker first, then bulk; passes until nothing moves (a head that fits
        no worker may unblock one behind it elsewhere, and slots held for waiting bulk return to
        interactive once bulk has gone). One Admit per worker that got anything."""
        if not (model.suspects or model.survivors or model.queues[TrafficClass.INTERACTIVE]
                or model.queues[TrafficClass.BULK]):
            return []  # nothing waits: no worker's budget need be counted (most step reports, issue 38)
        workers = sorted(model.workers, key=lambda i: -self.workers[i].slots_free())
        r = Round(workers, {wid: self.rules.budget(self.workers[wid], at_boundary=wid == reporting) for wid in workers},
                  {wid: self.workers[wid].accepting() for wid in workers}, {wid: [] for wid in workers})
        actions: list[Action] = []
        if model.suspects:
            self.crashes.admit_suspects(model, r, now)
        if model.survivors:
            self.crashes.admit_survivors(model, r, now)
        while any([self._admit_class(model_name, model, cls, r, now, actions) for cls in CLASSES]):  # both classes every pass
            pass
        for wid in workers:
            if r.admitted[wid]:
                w = self.workers[wid]
                w.seq += 1
                prompts = [(self.entries[a.key].prefill_tokens, self.entries[a.key].cls) for a in r.admitted[wid]]
                w.pending_prefill[w.seq] = (sum(n for n, _ in prompts),
                                            sum(n for n, cls in prompts if cls == TrafficClass.INTERACTIVE))
                actions.append(Admit(wid, w.seq, tuple(r.admitted[wid]), idle_before=len(w.running) == len(r.admitted[wid])))
        return actions

    def _admit_class(self, model_name: str, model: ModelState, cls: TrafficClass, r: Round, now: float,
                     actions: list[Action]) -> bool:
        """Admit heads of `cls`'s queue where its dispatch rule fires, each on the worker where its
        first token comes soonest; stops at a head that fits nowhere. True if any moved."""
        queue = model.queues[cls]
        fires = {wid: r.open[wid] and self.rules.fires(model_name, cls, r.budgets[wid], now) for wid in r.workers}
        moved = False
        while queue:
            e = queue.peek()
            candidates = [wid for wid in r.workers if (fires[wid] or r.budgets[wid].rides_with_sibling(e)) and r.open[wid]
                          and self.rules.can_take(e, self.workers[wid], r.budgets[wid], model, r.admitted[wid], now)]
            if not candidates:
                refusal = self._refused_late(e, model, now)
                if refusal is None:
                    return moved  # the head fits nowhere now: it keeps its place
                actions.append(refusal)
                continue
            # A worker running a crash's survivors may crash again: new work goes to a clean one if it can; a
            # call's sample to where its first sample went, if that worker is a candidate (placement.py), which it is
            # while it has a slot: a sample rides with its sibling past the dispatch rule and step room (budget.py).
            wid = self.siblings.choose(e, candidates, key=lambda i: (self.crashes.holds_crashed(i, r),
                                                                     self.admission.first_token_at(e, self.workers[i], now)))
            w = self.workers[wid]
            if self.admission.cannot_complete(e, w, now):
                self._dequeue(e)  # it asked to finish by its deadline, and no longer can
                transition(e, Status.EXPIRED)
                self._forget(e)
                actions.append(Expire(e.key))
                continue
            self._take(e, wid, r, now)
            r.open[wid] = not self.crashes.isolated(e)
            moved = True
        return moved

    def _refused_late(self, e: Entry, model: ModelState, now: float) -> Refuse | None:
        """With late interactive requests refused (config.late_interactive; rules.late_refused says which): `e`,
        which no worker takes now, is refused once no worker could give it its first token within its TTFT target
        even were it admitted now (rules.lateness): answered within its target with a retry hint
        (`_in_time_again`), rather than served late."""
        if not self.rules.late_refused(e) or now < self._hopeless_at(e, model, now):
            return None
        self._dequeue(e)
        transition(e, Status.REFUSED)
        self._forget(e)
        self.counters.late_refusals += 1
        return Refuse(e.key, Refusal.NO_ROOM_IN_TIME, "no worker has room for this interactive request in time for "
                      "its first token within the TTFT target; retry shortly, or on another instance",
                      self._in_time_again(e, model, now))

    def _in_time_again(self, e: Entry, model: ModelState, now: float) -> float:
        """The retry hint of a late refusal: the soonest a worker could serve the same request in time, were it sent
        again then, after the hints given before it (hints.py: a burst refused together is not told one moment)."""
        hint = self.hints.hint(e, [self.workers[wid] for wid in model.workers], model, now)
        return hint if hint is not None else self.admission.retry_after(model, e.cost, now)

    def _hopeless_at(self, e: Entry, model: ModelState, now: float) -> float:
        """From when no worker could give `e` its first token in time, were it admitted then (inf: some worker
        always could, or it has no deadline). A forecast that moves with the clock: its lateness now, added."""
        lates = [self.rules.lateness(e, self.workers[wid], model, now) for wid in model.workers]
        return now - min(lates) if lates and None not in lates else math.inf

    def _compose(self, model: ModelState) -> list[Action]:
        """Each worker's step plan for what now runs on it (engine/scheduler/planner.py); sent only when its
        limits change. Made again only for a worker whose plan's inputs moved (WorkerView.changes)."""
        actions: list[Action] = []
        averages = (model.interactive_prompt_tokens, model.bulk_prompt_per_output)
        for wid in model.workers + model.retiring:  # a retiring worker's paused bulk must resume, or it never idles
            w = self.workers[wid]
            inputs = (w.changes, averages)
            if w.planned_at == inputs:
                continue
            w.planned_at = inputs
            plan = self.planner.plan(w, model)
            if plan.worker_limits != w.plan.worker_limits:
                actions.append(SetPlan(wid, plan))
            w.plan = plan
        return actions

    def _take(self, e: Entry, wid: int, r: Round, now: float) -> None:
        """Admit `e` onto worker `wid` in this round: out of its budget and its queue, into the round's admissions."""
        r.budgets[wid].try_admit(e)
        self._dequeue(e, admitted=True)
        r.admitted[wid].append(self._admit(e, self.workers[wid], now))
        self.siblings.placed(e, wid)

    def _admit(self, e: Entry, w: WorkerView, now: float) -> Admission:
        model = self.models[e.model]
        transition(e, Status.RUNNING)
        no_cap_now = self._no_capacity_integral(model, now)
        waited = now - e.queued_since
        queueing = min(max(no_cap_now - e.no_capacity_at_enqueue, 0.0), waited)
        e.queueing_s, e.admission_wait_s = queueing, waited - queueing
        e.run += 1
        e.prefilled = False
        e.first_token_at, e.tokens_this_run = None, 0
        e.worker_id = w.spec.worker_id
        e.blocks = blocks_for(e, w.spec.block_size, self.config.kv_margin_tokens)
        w.reserved_blocks += e.blocks
        w.pace.woke_at = now if not w.running else w.pace.woke_at  # idle until now: no step period spans that
        w.start(e)
        batch = len(w.running)
        est = w.pace.estimator
        e.est_finish = now + est.first_token_s(batch, e.prompt_tokens) + max(e.remaining - 1, 0) * est.step_s(batch)
        return Admission(e.key, e.run_key, e.attempt, e.generated, e.queueing_s, e.admission_wait_s)

    def _may_preempt_for_kv(self, e: Entry) -> bool:
        """May `e` be stopped for KV (engine/scheduler/preemption.py)? The property test asks."""
        return self.preemption.may_preempt_for_kv(e)

    # ------------------------------------------------------------- bookkeeping

    def _model(self, name: str) -> ModelState:
        if name not in self.models:
            weight = lambda tenant: self.config.for_tenant(tenant).weight  # noqa: E731
            self.models[name] = ModelState(queues={cls: ClassQueue(weight) for cls in CLASSES})
        return self.models[name]

    def _enqueue(self, e: Entry, now: float, *, front: bool = False, survivor: bool = False) -> None:
        """Queue `e`; its arrival time stays what it was (a requeue keeps its age). A suspect waits
        with its group, and a crash's survivor with the others, apart from the class queues."""
        model = self._model(e.model)
        e.queued_since = now
        e.no_capacity_at_enqueue = self._no_capacity_integral(model, now)
        if self.crashes.isolated(e):
            model.suspects.append(e)
        elif survivor:
            model.survivors.append(e)
        else:
            model.queues[e.cls].push(e, front=front)
        self._tenant_queued_tokens[e.tenant] += e.cost

    def _dequeue(self, e: Entry, *, admitted: bool = False) -> None:
        model = self.models[e.model]
        for aside in (model.suspects, model.survivors):
            if e in aside:
                aside.remove(e)
                self._tenant_queued_tokens[e.tenant] -= e.cost
                return
        queue = model.queues[e.cls]
        if admitted:
            queue.pop_admitted(e)
        else:
            queue.remove(e)
        self._tenant_queued_tokens[e.tenant] -= e.cost

    def _finish(self, e: Entry, now: float) -> None:
        self._release(e)
        transition(e, Status.FINISHED)
        if e.cls == TrafficClass.BULK:
            self.models[e.model].saw_bulk(e.prompt_tokens, e.generated)
        model = self.models[e.model]
        drained = model.drained
        if model.no_capacity_since is not None:  # finished while the model was full: its capacity at work
            drained.append((now, e.prompt_tokens + e.generated))
        while drained and drained[0][0] < now - self.config.drain_window_s:  # bounded by its window, whoever reads it
            drained.popleft()
        self._forget(e)

    def _release(self, e: Entry) -> None:
        w = self.workers.get(e.worker_id) if e.worker_id is not None else None
        if w is not None and w.stop(e.run_key) is not None:
            w.reserved_blocks -= e.blocks
        e.worker_id, e.blocks = None, 0

    def _forget(self, e: Entry) -> None:
        self.siblings.forgot(e)
        if self.entries.pop(e.key, None) is not None:
            self._tenant_inflight[e.tenant] -= 1
            if not self._tenant_inflight[e.tenant]:
                del self._tenant_inflight[e.tenant]
            pair = (e.tenant, model_name(e.model))
            self._tenant_model_inflight[pair] -= 1
            if not self._tenant_model_inflight[pair]:
                del self._tenant_model_inflight[pair]

    def _note_capacity(self, model: ModelState, now: float) -> None:
        # Room means a slot, KV blocks and prefill budget this step: waiting for any of them is
        # waiting for capacity (queueing); waiting while all exist is waiting to be batched.
        has_room = any(self.workers[w].accepting() and not self.rules.budget(self.workers[w]).exhausted for w in model.workers)
        if has_room and model.no_capacity_since is not None:
            model.no_capacity_total += now - model.no_capacity_since
            model.full_spans.append((model.no_capacity_since, now))
            while model.full_spans[0][1] < now - self.config.drain_window_s:
                model.full_spans.popleft()
            model.no_capacity_since = None
        elif not has_room and model.no_capacity_since is None:
            model.no_capacity_since = now

    def _no_capacity_integral(self, model: ModelState, now: float) -> float:
        return model.no_capacity_total + (now - model.no_capacity_since if model.no_capacity_since is not None else 0.0)

    # ------------------------------------------------------------- inspection

    def queue_depth(self, model: str, cls: TrafficClass) -> tuple[int, int]:
        """(requests, tokens) queued."""
        q = self.models[model].queues[cls] if model in self.models else None
        return (q.requests, q.tokens) if q else (0, 0)

    def oldest_age(self, model: str, cls: TrafficClass) -> float:
        q = self.models.get(model)
        oldest = q.queues[cls].oldest() if q else None
        return self.clock() - oldest.arrival if oldest else 0.0

    def predicted_misses(self, model: str, now: float) -> int:
        """Queued requests of `model` predicted to miss their deadline (the autoscaler's signal)."""
        return self.admission.predicted_misses(model, now)

    def tenant_inflight(self, tenant: str) -> int:
        """The tenant's requests queued or running (what its max_concurrent bounds)."""
        return self._tenant_inflight[tenant]

    def running(self, worker_id: int) -> int:
        return len(self.workers[worker_id].running) if worker_id in self.workers else 0

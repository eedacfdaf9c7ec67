"""Virtual-time runs of the real scheduler against simulated workers.

Used by the scheduler's tests and by `tokenline bench simulate`. The workers
here are cost models, not processes: a step takes `cost(batch, prefill)`
virtual seconds and yields one token per running sequence. A fixed-batch
worker runs each batch to completion before it takes the next; a continuous
worker admits new sequences at every step boundary.

A worker whose spec `runs_ahead` (as tokenline's vLLM worker does) starts its next step the moment
it reports, before the scheduler has answered: what is admitted, and the plan composed, on that
report apply from the step after it. Otherwise the scheduler's answer comes first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.scheduler.core import Scheduler
from tokenline.engine.scheduler.records import Abort, Admit, Entry, Expire, Fail, Refuse, Retry, SetPlan, request_of
from tokenline.engine.sim_backend import StepCost
from tokenline.engine.types import SeqOutput, StepPlan, StepReport, TrafficClass, WorkerSpec


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class SimRequest:
    key: str
    arrival: float
    prompt_tokens: int = 16
    max_tokens: int = 1
    cls: TrafficClass = TrafficClass.INTERACTIVE
    deadline: float | None = None
    tenant: str = "default"
    cancel_at: float | None = None
    must_complete: bool = False
    stops_after: int | None = None  # the model ends it on its own (eos) after this many tokens; None: at max_tokens
    itl_target_s: float | None = None  # interactive: its own inter-token latency target (None: the class's)
    group: str | None = None  # one call's n samples share this (Entry.group: they prefer one worker)
    retries: int = 0  # refused with a retry hint, the caller sends it again when told, this many times ("key+1", ...)


@dataclass
class Outcome:
    key: str
    cls: TrafficClass
    tenant: str
    arrival: float
    status: str = "queued"  # finished | refused | expired | cancelled | failed
    departed: float | None = None  # first admission
    first_token: float | None = None
    completed: float | None = None
    worker_id: int | None = None
    tokens: int = 0
    message: str = ""
    queueing_s: float = 0.0
    admission_wait_s: float = 0.0
    admissions: int = 0
    retry_after_s: float | None = None  # a refusal's hint

    @property
    def waited(self) -> float | None:
        return None if self.departed is None else self.departed - self.arrival

    @property
    def end_to_end(self) -> float | None:
        return None if self.completed is None else self.completed - self.arrival


CostModel = Callable[[int, int], float]  # (batch size, prefill tokens) -> seconds


def fixed_cost(seconds: float) -> CostModel:
    return StepCost(seconds)


def linear_cost(base_s: float, per_seq_s: float, per_prefill_token_s: float = 0.0) -> CostModel:
    """The simulated engine's cost model (engine/sim_backend.py StepCost)."""
    return StepCost(base_s, per_seq_s, per_prefill_token_s)


@dataclass
class _Seq:
    run_key: str
    max_tokens: int
    prompt_tokens: int
    generated: int = 0
    prefilled: bool = False
    interactive: bool = False
    prompt_done: int = 0  # prompt tokens computed so far (a plan may prefill a prompt in chunks)

    @property
    def prompt_left(self) -> int:
        return 0 if self.prefilled else self.prompt_tokens - self.prompt_done


@dataclass(frozen=True)
class StepRecord:
    """One simulated step, for tests and plots."""

    start: float
    duration: float
    batch: int
    prefill_tokens: int
    interactive: int  # interactive sequences running on the worker (in the step or not)
    paused: int  # running sequences the plan held back
    predicted_s: float  # the plan's forecast (0: no plan in force)


@dataclass
class SimWorker:
    """A worker as a cost model, stepping in virtual time."""

    spec: WorkerSpec
    cost: CostModel
    running: dict[str, _Seq] = field(default_factory=dict)
    pending: list[tuple[int, list[_Seq]]] = field(default_factory=list)
    applied_seq: int = 0
    busy_until: float | None = None
    steps: int = 0
    busy_time: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)
    members: dict[str, int] = field(default_factory=dict)  # run key -> prompt tokens, of the step under way
    step_log: list[StepRecord] = field(default_factory=list)
    kv_blocks_peak: int = 0  # most KV blocks its sequences held in one step (what vLLM would have to allocate)


def worker_spec(worker_id: int, *, max_seqs: int, continuous: bool, kv_blocks: int = 1_000_000, block_size: int = 16, prefill_token_budget: int = 1_000_000, model: str = "sim",
                interactive_slots: int = 0, runs_ahead: bool = False) -> WorkerSpec:
    return WorkerSpec(
        worker_id=worker_id, model=model, model_version="sim", kv_blocks_total=kv_blocks, block_size=block_size,
        engine_seqs=max_seqs, max_model_len=1_000_000, prefill_token_budget=prefill_token_budget, vocab_size=1000,
        eos_token_id=None, continuous=continuous, interactive_slots=interactive_slots, runs_ahead=runs_ahead,
    )


class Simulation:
    """Drives one Scheduler and its simulated workers through a list of requests."""

    def __init__(self, config: SchedulerConfig, workers: Iterable[tuple[WorkerSpec, CostModel]], *, start: float = 0.0):
        self.clock = VirtualClock(start)
        self.scheduler = Scheduler(config, self.clock)
        self.workers = {spec.worker_id: SimWorker(spec, cost) for spec, cost in workers}
        self.outcomes: dict[str, Outcome] = {}
        self._events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self._timer_at: float | None = None
        self.dispatched: list[tuple[float, str, int]] = []  # (time, key, worker) of every admission
        self._stops_after: dict[str, int | None] = {}
        self._requests: dict[str, SimRequest] = {}  # by key, resent ones included
        self.max_queue = 0
        for w in self.workers.values():
            self._handle(self.scheduler.add_worker(w.spec))

    def run(self, requests: Iterable[SimRequest], *, until: float | None = None,
            after_event: Callable[[Simulation], None] | None = None) -> dict[str, Outcome]:
        """Play the requests to the end (or `until`); `after_event` sees the state after each event."""
        for r in requests:
            self._requests[r.key] = r
            self._push(r.arrival, "arrive", r)
            if r.cancel_at is not None:
                self._push(r.cancel_at, "cancel", r.key)
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            if until is not None and t > until:
                break
            self.clock.now = max(self.clock.now, t)
            if kind == "arrive":
                self._arrive(payload)
            elif kind == "cancel":
                o = self.outcomes.get(payload)
                actions = self.scheduler.cancel(payload)
                if o is not None and o.status in ("queued", "running"):
                    o.status, o.completed = "cancelled", self.clock.now
                self._handle(actions)
            elif kind == "step_end":
                self._step_end(self.workers[payload])
            elif kind == "timer":
                if self._timer_at == t:
                    self._timer_at = None
                    self._handle(self.scheduler.on_timer())
            self._arm_timer()
            depth = sum(len(q) for m in self.scheduler.models.values() for q in m.queues.values())
            self.max_queue = max(self.max_queue, depth)
            if after_event is not None:
                after_event(self)
        return self.outcomes

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, payload))

    def _arrive(self, r: SimRequest) -> None:
        self.outcomes[r.key] = Outcome(r.key, r.cls, r.tenant, r.arrival)
        self._stops_after[r.key] = r.stops_after
        entry = Entry(key=r.key, model=next(iter(self.workers.values())).spec.model, tenant=r.tenant, cls=r.cls,
                      prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens, arrival=r.arrival, deadline=r.deadline,
                      must_complete_by_deadline=r.must_complete, itl_target_s=r.itl_target_s, group=r.group)
        self._handle(self.scheduler.submit(entry))

    def _arm_timer(self) -> None:
        wake = self.scheduler.next_wakeup()
        if wake is None:
            return
        wake = max(wake, self.clock.now)
        if self._timer_at is None or wake < self._timer_at:
            self._timer_at = wake
            self._push(wake, "timer", None)

    def _handle(self, actions: list) -> None:
        now = self.clock.now
        for a in actions:
            if isinstance(a, Admit):
                w = self.workers[a.worker_id]
                seqs = []
                for adm in a.admissions:
                    o = self.outcomes[adm.key]
                    o.status = "running"
                    o.admissions += 1
                    o.worker_id = a.worker_id
                    o.queueing_s += adm.queueing_s
                    o.admission_wait_s += adm.admission_wait_s
                    self.dispatched.append((now, adm.key, a.worker_id))
                    if o.departed is None:
                        o.departed = now
                    e = self.scheduler.entries[adm.key]
                    stop = min(e.max_tokens, self._stops_after.get(adm.key) or e.max_tokens)
                    seqs.append(_Seq(adm.run_key, stop - adm.generated, e.prompt_tokens + adm.generated,
                                     interactive=e.cls == TrafficClass.INTERACTIVE))
                w.pending.append((a.seq, seqs))
                if w.busy_until is None:
                    self._start_step(w)
            elif isinstance(a, Refuse):
                o = self.outcomes[a.key]
                o.status, o.message, o.completed, o.retry_after_s = "refused", a.message, now, a.retry_after_s
                r = self._requests.get(a.key)
                if r is not None and r.retries > 0 and a.retry_after_s is not None:  # the caller comes back when told
                    base, _, n = r.key.partition("+")
                    again = replace(r, key=f"{base}+{int(n or 0) + 1}", arrival=now + a.retry_after_s,
                                    retries=r.retries - 1, cancel_at=None)
                    self._requests[again.key] = again
                    self._push(again.arrival, "arrive", again)
            elif isinstance(a, Expire):
                o = self.outcomes[a.key]
                o.status, o.completed = "expired", now
                if a.worker_id is not None:
                    self._abort(a.worker_id, a.run_key)
            elif isinstance(a, Abort):
                self._abort(a.worker_id, a.run_key)
            elif isinstance(a, Fail):
                o = self.outcomes[a.key]
                o.status, o.message, o.completed = "failed", a.message, now
            elif isinstance(a, SetPlan):
                self.workers[a.worker_id].plan = a.plan
            elif isinstance(a, Retry):
                pass

    def _abort(self, worker_id: int, run_key: str) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.running.pop(run_key, None)
        for _, seqs in w.pending:
            seqs[:] = [s for s in seqs if s.run_key != run_key]

    def _start_step(self, w: SimWorker) -> None:
        if not w.spec.continuous and w.running:
            pass  # a fixed batch runs to completion; admissions wait in `pending`
        else:
            for seq, seqs in w.pending:
                w.applied_seq = max(w.applied_seq, seq)
                for s in seqs:
                    w.running[s.run_key] = s
            w.pending.clear()
        if not w.running:
            w.busy_until = None
            return
        w.members = _step_members(w)
        prefill = sum(w.members.values())
        held = sum(-(-(s.prompt_tokens + s.generated + 1) // w.spec.block_size) for s in w.running.values())
        w.kv_blocks_peak = max(w.kv_blocks_peak, held)
        duration = w.cost(len(w.members), prefill)
        interactive = sum(s.interactive for s in w.running.values())
        w.step_log.append(StepRecord(self.clock.now, duration, len(w.members), prefill, interactive,
                                     len(w.running) - len(w.members), w.plan.predicted_step_s if interactive else 0.0))
        w.busy_until = self.clock.now + duration
        w.busy_time += duration
        w.steps += 1
        w.batch_sizes.append(len(w.members))
        self._push(w.busy_until, "step_end", w.spec.worker_id)

    def _step_end(self, w: SimWorker) -> None:
        now = self.clock.now
        outputs = []
        members = [w.running[k] for k in w.members if k in w.running]  # less what was aborted mid-step
        batch = len(members)
        prefill = 0
        for s in members:
            if not s.prefilled:
                chunk = w.members[s.run_key]
                prefill += chunk
                s.prompt_done += chunk
                s.prefilled = s.prompt_done >= s.prompt_tokens
                if not s.prefilled:
                    continue  # a prompt chunk: no token yet
            s.generated += 1
            done = s.generated >= s.max_tokens
            outputs.append(SeqOutput(s.run_key, [1], "x", finished=done))
            key = request_of(s.run_key)
            o = self.outcomes.get(key)
            if o is not None:
                o.tokens += 1
                if o.first_token is None:
                    o.first_token = now
                if done:
                    o.status, o.completed = "finished", now
            if done:
                del w.running[s.run_key]
        report = StepReport(worker_id=w.spec.worker_id, applied_seq=w.applied_seq, step_s=w.cost(batch, prefill),
                            batch_size=batch, prefill_tokens=prefill, kv_blocks_free=0, running=len(w.running),
                            waiting=0, outputs=outputs)
        w.busy_until = None
        if w.spec.runs_ahead:  # steps on with what it holds; the answer to this report lands a step later
            self._start_step(w)
        self._handle(self.scheduler.on_step(report).actions)
        if w.busy_until is None:
            self._start_step(w)


def _step_members(w: SimWorker) -> dict[str, int]:
    """The sequences in the next step, each with the prompt tokens it computes.

    All of them, whole prompts, unless a plan is in force. With no interactive one running, every
    decode and prompt chunks within the TTFT guard's `guard_prefill_tokens`. With one, as the
    vLLM worker does it: interactive sequences all run; the oldest `bulk_decode` bulk sequences
    decode, the others pause with their KV; prompts prefill in chunks within the plan's prefill
    tokens, interactive first.
    """
    seqs = list(w.running.values())
    plan = w.plan
    if not any(s.interactive for s in seqs):
        if plan.guard_prefill_tokens is None:
            return {s.run_key: s.prompt_left for s in seqs}
        members = {s.run_key: 0 for s in seqs if s.prefilled}  # the TTFT guard: every decode, prompts in chunks
        prefill_left = plan.guard_prefill_tokens
        for s in (s for s in seqs if not s.prefilled):
            chunk = min(s.prompt_left, prefill_left)
            if chunk > 0:
                members[s.run_key] = chunk
                prefill_left -= chunk
        return members
    if not plan.limits:
        return {s.run_key: s.prompt_left for s in seqs}
    owed = sum(s.prompt_left for s in seqs if s.interactive)
    prefill_left = plan.prefill_budget(owed) if plan.prefill_tokens is not None else 1 << 62
    decoding = [s for s in seqs if not s.interactive and s.prefilled]
    members = {s.run_key: 0 for s in seqs if s.interactive and s.prefilled}
    members.update((s.run_key, 0) for s in (decoding if plan.bulk_decode is None else decoding[:plan.bulk_decode]))
    for s in sorted((s for s in seqs if not s.prefilled), key=lambda s: not s.interactive):
        chunk = min(s.prompt_left, prefill_left)
        if chunk > 0:
            members[s.run_key] = chunk
            prefill_left -= chunk
    return members

"""The frontend's engine room: drives the scheduler from asyncio and fans out tokens.

One `Runtime` per server. It owns the scheduler (clocked by time.monotonic),
the worker supervisor (engine/supervisor.py), and one mailbox per request.
A local worker's pipe is read and written on the event loop (engine/loop_pipe.py);
a Ray worker's reader thread hands its messages to the loop. Everything that touches
the scheduler or a request runs on the loop, so nothing here needs a lock.
Output is keyed by run (request, attempt, admission): anything from a run that
is no longer current is dropped and counted, so a request completes once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from tokenline.engine.autoscale import AutoscaleConfig, Share, read_pressure
from tokenline.engine.config import WorkerConfig
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.scheduler.core import Scheduler
from tokenline.engine.scheduler.pace import TARGET_BAND
from tokenline.engine.scheduler.status import Status
from tokenline.engine import types as wire  # the messages a worker receives: wire.Admit, wire.Abort
from tokenline.engine.scheduler.records import Abort, Admit, Expire, Fail, Refusal, Refuse, Retry, SetPlan, StepResult
from tokenline.engine.types import FinishReason, StepReport, TrafficClass, WorkerSpec, WorkItem
from tokenline.engine.supervisor import Supervisor
from tokenline.engine.watchdog import StepWatchdog
from tokenline.engine.worker import WorkerHandle
from tokenline.server.catalog import ModelLoad
from tokenline.server.errors import (DeadlineUnmeetable, DuplicateRequest, InvalidRequest, ModelNotFound, Overloaded,
                                     Quarantined, ServingError, Unavailable)
# What a request is, on the connection side; imported from here by the servicer, jobs, telemetry.
from tokenline.server.request import _END, Chunk, Mailbox, RequestKey, RequestState, fingerprint  # noqa: F401

log = logging.getLogger("tokenline.runtime")


MAX_QUARANTINED = 10_000  # fingerprints refused at once; beyond it the soonest to expire goes



@dataclass
class RuntimeStats:
    completed: int = 0  # requests that ended, however


class Runtime:
    """Requests in, tokens out: the scheduler's decisions carried out on the event loop.

    Workers are the supervisor's (engine/supervisor.py): it reports them ready, lost, or done
    with a step, and this hands each report to the scheduler and each decision to a worker
    or a request's callers.
    """

    def __init__(self, scheduler_config: SchedulerConfig, workers: dict[str, tuple[WorkerConfig, int]],
                 *, restart_workers: bool = True, quarantine_s: float = 600.0, standby: int = 0,
                 watchdog: StepWatchdog | None = None, worker_factory: Callable[..., WorkerHandle] = WorkerHandle,
                 autoscale: AutoscaleConfig | None = None, cpu_sets: tuple[tuple[int, ...], ...] = (),
                 serve_while_compiling: bool = False, share: Share | None = None):
        self.loop = asyncio.get_running_loop()
        self.scheduler = Scheduler(scheduler_config, time.monotonic)
        self.worker_configs = workers
        self.requests: dict[RequestKey, RequestState] = {}  # in flight; runs are the scheduler's to index
        self.stats = RuntimeStats()
        self.quarantine_s = quarantine_s
        self._quarantined: dict[str, float] = {}  # fingerprint -> refused until (monotonic)
        self.step_hooks: list[Callable[[StepResult], None]] = []  # each step report, as the scheduler read it
        self.on_finished: list[Callable[[RequestState], None]] = []  # every request, once, when it ends
        self.on_capacity: list[Callable[[bool], None]] = []  # every model has a live worker: True / False
        self.on_action: list[Callable[[object], None]] = []  # each scheduler action, once carried out
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closing = False
        self._dispatch_due: set[str] = set()  # models with submissions that await their dispatch (submit)
        self.closed_models: set[str] = set()  # versions rolled out of service: new requests for them are refused
        # LoRA adapters unloaded from their workers, as (model name, id): a request resolved before the unload and
        # submitted after it is refused, never loaded back into a slot the admin service counts as free.
        self.unloaded_adapters: set[tuple[str, int]] = set()
        # A local process (WorkerHandle) or a Ray actor (engine/ray_workers.py) per worker.
        self.workers = Supervisor(workers, on_ready=self._worker_ready, on_lost=self._worker_lost, on_report=self._step_reported,
                                  on_capacity=self._capacity_changed, restart=restart_workers, standby=standby,
                                  watchdog=watchdog, busy=self._busy_workers, heaviest_step_s=self._heaviest_step_s,
                                  factory=worker_factory, autoscale=autoscale, cpu_sets=cpu_sets, share=share,
                                  serve_while_compiling=serve_while_compiling, on_retire=self._worker_retiring,
                                  pressure=lambda model, now, starting, idle: read_pressure(
                                      self.scheduler, model, now, starting=starting, idle_since=idle))

    # -------------------------------------------------------------- workers

    def start(self) -> None:
        self.workers.start()

    @property
    def specs(self) -> dict[int, WorkerSpec]:
        """Workers ready and taking work, by id."""
        return self.workers.specs

    @property
    def start_errors(self) -> dict[str, str]:
        """Models whose worker could not start, and why."""
        return self.workers.start_errors

    def model_loaded(self, model: str) -> bool:
        return any(s.model == model for s in self.specs.values())

    def model_load(self, model: str) -> ModelLoad:
        """What `model`'s queues and workers hold now, and whether it serves (ListModels)."""
        state = self.scheduler.models.get(model)
        if state is None:
            return ModelLoad(state="loading")
        running = sum(len(self.scheduler.workers[w].running) for w in state.workers + state.retiring
                      if w in self.scheduler.workers)
        serving = "serving" if self.model_loaded(model) else "restarting" if state.replacements_due else "loading"
        return ModelLoad(queued_interactive=len(state.queues[TrafficClass.INTERACTIVE]),
                         queued_bulk=len(state.queues[TrafficClass.BULK]), running=running, state=serving)

    def _worker_ready(self, spec: WorkerSpec) -> None:
        if self.workers.scales_from_zero(spec.model):  # with no worker left, requests queue for a start this long
            self.scheduler.on_demand[spec.model] = self.workers.startup_s.get(spec.model, 0.0)
        self._handle(self.scheduler.add_worker(spec))
        view = self.scheduler.workers.get(spec.worker_id)
        single = view.pace.target_single_s if view is not None else None  # None: too short to time (pace.py)
        interactive = self.scheduler.config.interactive
        if single is not None and interactive.itl_target_in_steps:
            log.info("worker %d (model %s): interactive ITL target %.1f ms (%g × the %.1f ms single-sequence step it timed)",
                     spec.worker_id, spec.model, interactive.itl_target_for(single) * 1000, interactive.itl_target_steps,
                     single * 1000)

    def _worker_lost(self, wid: int) -> None:
        view = self.scheduler.workers.get(wid)
        self._handle(self.scheduler.worker_lost(wid))
        if view is not None and view.spec.model in self.workers.retired_models:
            self._fail_stranded(view.spec.model)

    # -------------------------------------------------------------- versions (server/admin.py)

    def add_model(self, model: str, config: WorkerConfig, count: int) -> None:
        """Start serving another model (a version rolled out): its workers start now."""
        self.workers.add_model(model, config, count)

    def change_adapters(self, model: str, add: tuple[tuple[str, str, int], ...] = (), drop: tuple[int, ...] = ()) -> None:
        """LoRA adapters of `model` loaded or unloaded (server/admin.py): its workers load or free them now, and a
        worker started from now on (a restart, the autoscaler, a compiled swap) starts with the new set."""
        config, count = self.worker_configs[model]
        adapters = tuple(a for a in config.lora_adapters if a[2] not in drop) + tuple(add)
        self.worker_configs[model] = (replace(config, lora_adapters=adapters), count)
        self.workers.send_to_model(model, wire.AdapterChange(add=tuple(add), drop=tuple(drop)))

    def adapter_in_use(self, model_name: str, lora_id: int) -> bool:
        """A request of the adapter `lora_id` of the model named `model_name` is queued or running."""
        return any(st.lora is not None and st.lora[1] == lora_id and st.entry.model.split("@")[0] == model_name
                   for st in self.requests.values())

    def close_model(self, model: str) -> None:
        """Take no new request for `model` (another version took its name); what it has queued still runs on it."""
        self.closed_models.add(model)

    def retire_model(self, model: str) -> None:
        """Stop serving `model` (closed, its queue empty): its workers take no new work and stop once their streams
        end, and none is restarted."""
        self.closed_models.add(model)
        self.workers.retire_model(model)

    def queued(self, model: str) -> int:
        state = self.scheduler.models.get(model)
        return sum(len(q) for q in state.queues.values()) + len(state.suspects) + len(state.survivors) if state else 0

    def _fail_stranded(self, model: str) -> None:
        """A retired version lost a worker: the requests it ran wait for a worker that will never come (a
        continuation stays on its version). They fail, clearly, rather than continue on another version."""
        for key, st in list(self.requests.items()):
            if st.entry.model == model and st.entry.status == Status.QUEUED:
                self.scheduler.cancel(key)
                self._finish(key, None, Unavailable(
                    f"the worker running this request stopped, and its model version ({model}) was replaced by a "
                    "newer one: it cannot continue on the version it started on; send it again"))

    def _worker_retiring(self, wid: int) -> None:
        """Another worker took its place: it takes no new work, and once it runs nothing (`_busy_workers`) the
        supervisor stops it."""
        view = self.scheduler.workers.get(wid)
        if view is not None:
            self.scheduler.models[view.spec.model].retire(wid)

    def _busy_workers(self) -> set[int]:
        return {wid for wid in self.scheduler.workers if self.scheduler.running(wid)}

    def _heaviest_step_s(self, wid: int) -> float:
        """This worker's heaviest step: every slot and a full prefill, by its step-time model, or by
        the full step it timed while loading, whichever is longer (the model knows no prompt cost
        until it has seen prompt steps)."""
        view = self.scheduler.workers.get(wid)
        if view is None:
            return 0.0
        return max(view.pace.estimator.predict_s(view.spec.engine_seqs, view.spec.prefill_token_budget), view.spec.full_step_s)

    def _capacity_changed(self) -> None:
        # A model scaled to zero serves: its requests queue and start a worker.
        serving = all(self.model_loaded(m) or self.workers.scales_from_zero(m) for m in self.worker_configs
                      if m not in self.workers.retired_models)
        _run_hooks(self.on_capacity, serving)

    # ------------------------------------------------------------- requests

    def submit(self, state: RequestState) -> None:
        """Queue a validated request; raises a ServingError when it is refused at once."""
        if self._closing:
            raise Unavailable("the server is shutting down; retry on another instance")
        if state.lora is not None and (state.entry.model.split("@")[0], state.lora[1]) in self.unloaded_adapters:
            raise ModelNotFound(f"the LoRA adapter {state.lora[0]!r} was unloaded")
        if state.entry.model in self.closed_models:
            raise Unavailable(f"model version {state.entry.model} was rolled out of service and is finishing its "
                              "streams; name the model without a version for the current one")
        now = time.monotonic()
        until = self._quarantined.get(state.fingerprint) if self._quarantined else None  # a hash of the prompt: only when needed
        if until is not None and until <= now:
            del self._quarantined[state.fingerprint]
        elif until is not None:
            raise Quarantined(f"this request (same model, prompt and sampling) crashed workers repeatedly and is refused for another {until - now:.0f} s")
        state.timeline.enqueued = now
        actions = self.scheduler.submit(state.entry, dispatch=False)  # its refusal, and what was decided before it
        refused = next((a for a in actions if isinstance(a, Refuse) and a.key == state.key), None)
        if refused is not None:  # duplicates, queues, deadlines
            self._handle([a for a in actions if a is not refused])
            raise _refusal_error(refused, state)
        self.requests[state.key] = state
        self._handle(actions)
        # One dispatch (admit, plan) for all the submissions of a turn of the loop, not one each: a GenerateMany
        # message that starts a hundred streams, or a burst of calls, costs one step plan, not a hundred (issue 38).
        if not self._dispatch_due:
            self.loop.call_soon(self._dispatch_submitted)
        self._dispatch_due.add(state.entry.model)

    def _dispatch_submitted(self) -> None:
        models, self._dispatch_due = self._dispatch_due, set()
        if self._closing:
            return
        for model in models:
            self._handle(self.scheduler.dispatch(model))

    def cancel(self, key: RequestKey) -> bool:
        state = self.requests.get(key)
        if state is None or state.done:
            return False
        self._handle(self.scheduler.cancel(key))
        self._finish(key, FinishReason.CANCELLED)
        return True

    async def events(self, state: RequestState, mailbox: asyncio.Queue, from_index: int = 0,
                     direct: Callable[[Chunk], None] | None = None):
        """Chunks from token `from_index` on, as they come (coalesced when the reader falls behind), then the end.

        `direct`: once the chunks queued before are yielded, each later one is handed to `direct` as the step
        report emits it, in order, and this yields no more (the end still comes here): a reader that gathers
        many streams' chunks into one message wakes no task per chunk (GenerateMany, issue 38)."""
        try:
            while True:
                if direct is not None and mailbox.empty() and isinstance(mailbox, Mailbox) and mailbox.direct is None:
                    mailbox.direct = _from_index(state, from_index, direct)
                item = await mailbox.get()
                if item is _END:
                    if state.error is not None:
                        raise state.error
                    return
                if item.index + len(item.token_ids) <= from_index:
                    continue  # a resumed stream already has these
                if item.index < from_index:
                    item = state.chunk_from(from_index, item.index + len(item.token_ids))
                if mailbox.empty():  # the usual case, one step's tokens: the chunk as it is (shared: never mutated)
                    yield item
                    continue
                chunk = Chunk(item.index, list(item.token_ids), item.text, item.attempt,  # a copy, to append to
                              list(item.logprobs) if item.logprobs is not None else None)
                while not mailbox.empty():
                    nxt = mailbox.get_nowait()
                    if nxt is _END or nxt.attempt != chunk.attempt:
                        mailbox._queue.appendleft(nxt)  # type: ignore[attr-defined]
                        break
                    chunk.token_ids.extend(nxt.token_ids)
                    chunk.text += nxt.text
                    if chunk.logprobs is not None and nxt.logprobs is not None:
                        chunk.logprobs.extend(nxt.logprobs)
                yield chunk
        finally:
            if direct is not None and isinstance(mailbox, Mailbox):
                mailbox.direct = None

    def leave(self, state: RequestState, mailbox: asyncio.Queue) -> None:
        """A caller went away: the run stops when nobody follows it any more.

        A run with an idempotency key goes on (to its deadline) so that a caller
        whose stream broke can re-attach, or collect the stored result.
        """
        if state.unsubscribe(mailbox) == 0 and not state.done and not state.idempotency_key:
            self.cancel(state.key)

    # ------------------------------------------------------------ internals

    def _step_reported(self, report: StepReport) -> None:
        now = time.monotonic()
        result = self.scheduler.on_step(report)
        if result.itl_target_moved_s is not None:
            view = self.scheduler.workers[report.worker_id]
            log.warning("worker %d (model %s): interactive ITL target now %.1f ms (%g × the %.1f ms single-sequence step "
                        "its lone sequences take now: more than %.0f %% from the one it kept before)",
                        report.worker_id, view.spec.model, result.itl_target_moved_s * 1000,
                        self.scheduler.config.interactive.itl_target_steps, view.pace.target_single() * 1000, TARGET_BAND * 100)
        for key in result.started:
            st = self.requests.get(key)
            if st is not None and st.timeline.first_scheduled is None:
                st.timeline.first_scheduled = now
        for key, reason in result.rejected:
            self._finish(key, None, InvalidRequest(f"the engine refused the request: {reason}"))
        for d in result.deliveries:
            st = self.requests.get(d.key)
            if st is None:
                continue
            if d.cached_tokens is not None and st.attempt == 1 and not st.token_ids:
                st.cached_tokens = d.cached_tokens
            if d.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = d.prompt_logprobs
            ids = d.token_ids
            if ids:
                n = len(ids)
                st.timeline.on_tokens(now, n)
                index = len(st.token_ids)
                st.token_ids.extend(ids)
                if n > 1:
                    st.text.extend([""] * (n - 1))  # a step's text comes with its last token
                st.text.append(d.text)
                logprobs = None
                if st.logprobs is not None:
                    logprobs = list(d.logprobs or ())[:n]
                    st.logprobs.extend(logprobs)
                # The report's own list: nothing else holds it, and a chunk is never mutated (events copies to coalesce).
                st.emit(Chunk(index, ids, d.text, st.entry.attempt, logprobs))
            if d.finish_reason is not None:
                self._finish(d.key, d.finish_reason, at=now)
        _run_hooks(self.step_hooks, result)
        self._handle(result.actions)

    def _finish(self, key: RequestKey, reason: FinishReason | None, error: ServingError | None = None,
                *, at: float | None = None) -> None:
        """Tell a request's callers how it ended; the scheduler has already decided that it has."""
        st = self.requests.pop(key, None)
        if st is None:
            return
        st.finish_reason = reason
        st.error = error
        st.timeline.close(at if at is not None else time.monotonic())  # at: the step that produced its last token
        self.stats.completed += 1
        st.emit(_END)
        _run_hooks(self.on_finished, st)

    def _handle(self, actions: list) -> None:
        now = time.monotonic()
        for a in actions:
            if isinstance(a, Admit):
                self._send_admit(a, now)
            elif isinstance(a, SetPlan):
                self._send(a.worker_id, a.plan)
            elif isinstance(a, Expire):
                if a.worker_id is not None:
                    self._send(a.worker_id, wire.Abort((a.run_key,)))
                self._finish(a.key, FinishReason.DEADLINE, DeadlineUnmeetable("the request's deadline passed before it finished"))
            elif isinstance(a, Refuse):  # a queued request refused later (late interactive, when refused)
                st = self.requests.get(a.key)
                if st is not None:
                    self._finish(a.key, None, _refusal_error(a, st))
            elif isinstance(a, Abort):
                self._send(a.worker_id, wire.Abort((a.run_key,)))
                st = self.requests.get(a.key)
                if st is not None and a.preempted:
                    st.timeline.interrupt(now, "preemption")
            elif isinstance(a, Retry):
                st = self.requests.get(a.key)
                if st is not None:
                    st.timeline.interrupt(now, "retry")
            elif isinstance(a, Fail):
                st = self.requests.get(a.key)
                if st is not None and a.quarantined:
                    self._quarantine(st.fingerprint, now)
                    self._finish(a.key, None, Quarantined(f"{a.message}; identical requests are refused for {self.quarantine_s:.0f} s"))
                elif st is not None:
                    self._finish(a.key, None, Unavailable(a.message))
            _run_hooks(self.on_action, a)
        self._arm_timer()

    def _quarantine(self, fingerprint: str, now: float) -> None:
        """Refuse this work for a while; expired entries go as new ones come, so the list stays
        as long as what is quarantined now (and never longer than MAX_QUARANTINED)."""
        for fp in [fp for fp, until in self._quarantined.items() if until <= now]:
            del self._quarantined[fp]
        while len(self._quarantined) >= MAX_QUARANTINED:
            del self._quarantined[min(self._quarantined, key=self._quarantined.__getitem__)]
        self._quarantined[fingerprint] = now + self.quarantine_s

    def _send_admit(self, d: Admit, now: float) -> None:
        if d.idle_before:
            self.workers.expect(d.worker_id)
        items = []
        for adm in d.admissions:
            st = self.requests[adm.key]
            if st.timeline.admitted is None:
                # The scheduler's decision instant, so that enqueued + waits == admitted exactly.
                # The bill keeps the first admission's waits; later waits (after a preemption or a
                # crash) count as time lost, not as these.
                st.timeline.admitted = st.timeline.enqueued + adm.admission_wait_s + adm.queueing_s
                st.timeline.admission_wait_s = adm.admission_wait_s
                st.timeline.queueing_s = adm.queueing_s
            # A continuation re-reads what was already delivered and owes only the rest.
            delivered = st.token_ids[:adm.generated]
            sampling = replace(st.sampling, max_tokens=st.sampling.max_tokens - adm.generated) if adm.generated else st.sampling
            items.append(WorkItem(adm.run_key, tuple(st.prompt_ids) + tuple(delivered), sampling,
                                  priority=0 if st.cls == TrafficClass.INTERACTIVE else 1, fault_marker=st.fault_marker,
                                  delivered_tokens=adm.generated, shown_chars=sum(map(len, st.text[:adm.generated])),
                                  prompt_logprobs_sent=st.prompt_logprobs is not None, lora=st.lora))
        self._send(d.worker_id, wire.Admit(d.seq, tuple(items)))

    def _send(self, wid: int | None, msg: object) -> None:
        self.workers.send(wid, msg)

    def _arm_timer(self) -> None:
        wake = self.scheduler.next_wakeup()
        if wake is None:
            return
        now = time.monotonic()
        wake = max(wake, now)
        if self._timer is not None and self._timer_at is not None and self._timer_at <= wake:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake
        self._timer = self.loop.call_at(self.loop.time() + (wake - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._handle(self.scheduler.on_timer())

    # ------------------------------------------------------------- shutdown

    def idle(self) -> bool:
        return not self.requests

    async def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        for key in list(self.requests):
            self.scheduler.cancel(key)  # its actions are moot: every worker is told to shut down
            self._finish(key, None, Unavailable("the server shut down before the request finished"))
        await self.workers.close(timeout)


def _from_index(state: RequestState, from_index: int, direct: Callable[[Chunk], None]) -> Callable[[Chunk], None]:
    """`direct`, given only what a stream resumed at `from_index` does not have yet."""
    if from_index == 0:
        return direct

    def hand(item: Chunk) -> None:
        end = item.index + len(item.token_ids)
        if end <= from_index:
            return
        direct(item if item.index >= from_index else state.chunk_from(from_index, end))
    return hand


def _run_hooks(hooks: list[Callable], *args: object) -> None:
    """Observers (telemetry, the idempotency store, health) run in the middle of the runtime's
    bookkeeping: one that fails is logged, and never stops the rest of a step report, other
    requests' output or the scheduler's accounting."""
    for hook in hooks:
        try:
            hook(*args)
        except Exception:
            log.exception("%s failed; the request and the others go on", getattr(hook, "__qualname__", hook))


def _refusal_error(a: Refuse, state: RequestState) -> ServingError:
    """The scheduler's refusal as the caller's error; `reason` keeps the scheduler's word, for metrics."""
    if a.reason in (Refusal.QUEUE_FULL, Refusal.TENANT_LIMIT, Refusal.NO_ROOM_IN_TIME):
        err: ServingError = Overloaded(a.message, retry_after_s=a.retry_after_s)
    elif a.reason == Refusal.DEADLINE:
        err = DeadlineUnmeetable(a.message)
    elif a.reason == Refusal.DUPLICATE:
        err = DuplicateRequest(f"request id {state.request_id!r} is already in flight; use a new id")
    elif a.reason == Refusal.TOO_LARGE:
        err = InvalidRequest(a.message)
    else:
        err = Unavailable(a.message, retry_after_s=a.retry_after_s)
    err.reason = a.reason.value
    return err

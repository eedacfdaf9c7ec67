"""The frontend's engine room: drives the scheduler from asyncio and fans out tokens.

One `Runtime` per server. It owns the scheduler (clocked by time.monotonic),
the worker processes (restarted when they die), and one mailbox per request.
Worker reader threads hand messages to the event loop; everything that touches
the scheduler or a request runs on the loop, so nothing here needs a lock.
Output is keyed by run (request, attempt, admission): anything from a run that
is no longer current is dropped and counted, so a request completes once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from tokenline.engine.config import WorkerConfig
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.scheduler.core import Scheduler
from tokenline.engine.scheduler.records import Compose, Dispatch, Entry, Expire, Fail, Refusal, Refuse, Retry, StepResult, StopRun
from tokenline.engine.types import Abort, Admit, FinishReason, Sampling, Shutdown, StepReport, TrafficClass, WorkerFailed, WorkerSpec, WorkItem
from tokenline.engine.watchdog import StepWatchdog
from tokenline.engine.worker import WorkerHandle
from tokenline.server.errors import DeadlineUnmeetable, DuplicateRequest, InvalidRequest, Overloaded, Quarantined, ServingError, Unavailable
from tokenline.server.timeline import Timeline

log = logging.getLogger("tokenline.runtime")

WATCHDOG_CHECK_S = 0.5  # how often silent workers are looked for


@dataclass(frozen=True, order=True)
class RequestKey:
    """Who owns a request id: ids are the caller's choice, so they are unique only within a tenant.

    Kept as two fields, never joined into one string that a tenant name or id containing a
    separator could forge. `str()` (the scheduler's run keys and worker ids) is JSON, which is
    injective.
    """

    tenant: str
    request_id: str

    def __str__(self) -> str:
        return json.dumps([self.tenant, self.request_id])


@dataclass
class Chunk:
    """Tokens for the stream: index of the first one, ids and text."""

    index: int
    token_ids: list[int]
    text: str
    attempt: int


class RequestState:
    """The connection side of one request: what it asks (prompt, sampling), what its callers
    were given (token ids and text per token, its finish reason or error), its timeline and
    mailboxes.

    Its lifecycle (attempt, current run and worker, tokens generated, status, preemptions,
    waits) and what the scheduler decides by (model, tenant, class, deadline) live in the
    scheduler's `Entry`, which this holds as `entry` and reads through.
    """

    def __init__(self, key: RequestKey, model: str, cls: TrafficClass, prompt_ids: list[int], sampling: Sampling,
                 timeline: Timeline, deadline: float | None, *, fault_marker: bool = False,
                 must_complete_by_deadline: bool = False, idempotency_key: str = ""):
        self.entry = Entry(key=key, model=model, tenant=key.tenant, cls=cls, prompt_tokens=len(prompt_ids),
                           max_tokens=sampling.max_tokens, arrival=0.0, deadline=deadline,
                           must_complete_by_deadline=must_complete_by_deadline)
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.timeline = timeline
        self.fault_marker = fault_marker
        self.idempotency_key = idempotency_key
        self.token_ids: list[int] = []
        self.text: list[str] = []  # per token, so a stream can resume at any index
        self.finish_reason: FinishReason | None = None
        self.error: ServingError | None = None
        # One mailbox per caller following this run (a retry with the same idempotency key attaches).
        self.subscribers: list[asyncio.Queue] = []

    key = property(lambda self: self.entry.key)
    model = property(lambda self: self.entry.model)
    tenant = property(lambda self: self.entry.tenant)
    cls = property(lambda self: self.entry.cls)
    deadline = property(lambda self: self.entry.deadline)
    must_complete_by_deadline = property(lambda self: self.entry.must_complete_by_deadline)
    attempt = property(lambda self: self.entry.attempt)
    preemptions = property(lambda self: self.entry.preemptions)
    done = property(lambda self: self.entry.done, doc="Its lifecycle ended (finished, failed, cancelled, refused...).")

    @property
    def request_id(self) -> str:
        return self.key.request_id

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.model, self.sampling, self.prompt_ids)

    def subscribe(self, from_index: int = 0) -> asyncio.Queue:
        """A new mailbox, primed with what was produced after `from_index` so far."""
        q: asyncio.Queue = asyncio.Queue()
        if len(self.token_ids) > from_index:
            q.put_nowait(Chunk(from_index, self.token_ids[from_index:], "".join(self.text[from_index:]), self.attempt))
        if self.done:
            q.put_nowait(_END)
        self.subscribers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> int:
        """Forget a mailbox; returns how many callers still follow the run."""
        if q in self.subscribers:
            self.subscribers.remove(q)
        return len(self.subscribers)

    def emit(self, item: object) -> None:
        for q in self.subscribers:
            q.put_nowait(item)


def fingerprint(model: str, sampling: Sampling, prompt_ids: list[int]) -> str:
    """Canonical hash of what makes two requests the same work: model, prompt tokens and sampling."""
    h = hashlib.sha256(f"{model}|{sampling!r}|".encode())
    h.update(",".join(map(str, prompt_ids)).encode())
    return h.hexdigest()


MAX_QUARANTINED = 10_000  # fingerprints refused at once; beyond it the soonest to expire goes

_END = object()  # sentinel in a request's mailbox: finished (or failed, see .error)


@dataclass
class RuntimeStats:
    worker_restarts: int = 0
    completed: int = 0


class Runtime:
    def __init__(self, scheduler_config: SchedulerConfig, workers: dict[str, tuple[WorkerConfig, int]],
                 *, restart_workers: bool = True, quarantine_s: float = 600.0, standby: int = 0,
                 watchdog: StepWatchdog | None = None, worker_factory: Callable[..., WorkerHandle] = WorkerHandle):
        self.loop = asyncio.get_running_loop()
        self.scheduler = Scheduler(scheduler_config, time.monotonic)
        self.worker_configs = workers
        # How a worker is started: a local process (WorkerHandle) or a Ray actor (engine/ray_workers.py).
        self.worker_factory = worker_factory
        self.requests: dict[RequestKey, RequestState] = {}  # in flight; runs are the scheduler's to index
        self.handles: dict[int, WorkerHandle] = {}
        self.specs: dict[int, WorkerSpec] = {}
        self.stats = RuntimeStats()
        self.restart_workers = restart_workers
        self.quarantine_s = quarantine_s
        self._quarantined: dict[str, float] = {}  # fingerprint -> refused until (monotonic)
        self.on_step: list[Callable[[StepResult], None]] = []  # each step report, as the scheduler read it
        self.on_finished: list[Callable[[RequestState], None]] = []  # every request, once, when it ends
        self.on_capacity: list[Callable[[bool], None]] = []  # every model has a live worker: True / False
        self.on_action: list[Callable[[object], None]] = []  # each scheduler action, once carried out
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._last_timer_run: float | None = None
        self._next_worker_id = 0
        self._worker_model: dict[int, str] = {}
        # Standby workers load the model but take no work until an active worker dies.
        self.standby = standby
        self._standby_ids: set[int] = set()  # spawned as standby, not yet promoted
        self._standby_ready: dict[str, dict[int, WorkerSpec]] = {name: {} for name in workers}
        self._closing = False
        self.start_errors: dict[str, str] = {}
        self.watchdog = watchdog  # None: a hung worker is never declared lost
        self._watch_timer: asyncio.TimerHandle | None = None

    # -------------------------------------------------------------- workers

    def start(self) -> None:
        if self.watchdog is not None:
            self._watch_timer = self.loop.call_later(WATCHDOG_CHECK_S, self._check_silence)
        for model, (cfg, count) in self.worker_configs.items():
            for _ in range(count):
                self._spawn(model, cfg)
            for _ in range(self.standby):
                self._spawn(model, cfg, standby=True)

    def _spawn(self, model: str, cfg: WorkerConfig, *, standby: bool = False) -> None:
        wid = self._next_worker_id
        self._next_worker_id += 1
        self._worker_model[wid] = model
        if standby:
            self._standby_ids.add(wid)
        handle = self.worker_factory(
            wid, cfg,
            on_message=lambda w, m: self.loop.call_soon_threadsafe(self._on_worker_message, w, m),
            on_exit=lambda w, code: self.loop.call_soon_threadsafe(self._on_worker_exit, w, code),
        )
        self.handles[wid] = handle
        handle.start()

    def model_loaded(self, model: str) -> bool:
        return any(s.model == model for s in self.specs.values())

    def _on_worker_message(self, wid: int, msg: object) -> None:
        if isinstance(msg, StepReport):
            self._on_step(msg)
        elif isinstance(msg, WorkerSpec) and wid in self._standby_ids:
            self._standby_ready[msg.model][wid] = msg
            log.info("standby worker %d ready: model %s, pid %d", wid, msg.model, msg.pid)
        elif isinstance(msg, WorkerSpec):
            self._activate(wid, msg)
        elif isinstance(msg, WorkerFailed):
            model = self._worker_model.get(wid, "?")
            self.start_errors[model] = msg.message
            log.error("worker %d failed to start: %s", wid, msg.message)

    def _activate(self, wid: int, spec: WorkerSpec) -> None:
        self.specs[wid] = spec
        log.info("worker %d ready: model %s, pid %d, %d KV blocks of %d, %d seqs, %s, attention kernel %s, self-check %s",
                 wid, spec.model, spec.pid, spec.kv_blocks_total, spec.block_size, spec.max_seqs, spec.dtype or "-",
                 spec.attention_kernel or "-", spec.self_check or "-")
        placement = getattr(self.handles.get(wid), "placement", None)
        if placement is not None:  # a Ray actor: where Ray put it
            log.info("worker %d ready: model %s on Ray node %s (host %s, pid %d)", wid, spec.model, placement.node_id,
                     placement.host, placement.pid)
        self._handle(self.scheduler.add_worker(spec))
        self._capacity_changed()

    def _on_worker_exit(self, wid: int, exitcode: int | None) -> None:
        if self.watchdog is not None:
            self.watchdog.forget(wid)
        handle = self.handles.pop(wid, None)
        self.specs.pop(wid, None)
        model = self._worker_model.pop(wid, None)
        was_standby = wid in self._standby_ids
        self._standby_ids.discard(wid)
        if model is not None:
            self._standby_ready[model].pop(wid, None)
        if handle is None or self._closing:
            return
        log.warning("%sworker %d (model %s) exited with code %s", "standby " if was_standby else "", wid, model, exitcode)
        if not was_standby:
            self._handle(self.scheduler.worker_lost(wid))
            promoted = self._promote_standby(model) if model is not None else False
            if not promoted:
                self._capacity_changed()
        if self.restart_workers and model is not None and model not in self.start_errors:
            self.stats.worker_restarts += 1
            # A promoted standby is replaced by a new standby; otherwise the worker itself restarts.
            standby = was_standby or (self.standby > 0 and len(self._standby_ids) < self.standby)
            self._spawn(model, self.worker_configs[model][0], standby=standby and not self._needs_active(model))

    def _busy_workers(self) -> set[int]:
        return {wid for wid in self.scheduler.workers if self.scheduler.running(wid)}

    def _heaviest_step_s(self, wid: int) -> float:
        """The step-time model's estimate for this worker's heaviest step: every slot, a full prefill."""
        view, spec = self.scheduler.workers.get(wid), self.specs.get(wid)
        if view is None or spec is None:
            return 0.0
        return view.estimator.predict_s(spec.max_seqs, spec.prefill_token_budget)

    def _check_silence(self) -> None:
        """Kill a worker that has work in flight but has stopped reporting steps (hung, stopped):
        its exit then takes the path of any crash, and its runs continue as new attempts."""
        if self._closing or self.watchdog is None:
            return
        for silence in self.watchdog.silent(self._busy_workers(), time.monotonic()):
            handle = self.handles.get(silence.worker_id)
            if handle is None:
                continue
            log.error("worker %d sent no step report for %.1f s with work in flight (limit %.1f s): declared lost, killing it",
                      silence.worker_id, silence.silent_s, silence.limit_s)
            self.watchdog.forget(silence.worker_id)
            handle.kill()
        self._watch_timer = self.loop.call_later(WATCHDOG_CHECK_S, self._check_silence)

    def _promote_standby(self, model: str) -> bool:
        """Put a loaded standby worker to work at once, in place of one that died."""
        ready = self._standby_ready[model]
        if not ready:
            return False
        wid, spec = ready.popitem()
        self._standby_ids.discard(wid)
        log.warning("standby worker %d takes over for model %s", wid, model)
        self._activate(wid, spec)
        return True

    def _needs_active(self, model: str) -> bool:
        """Fewer active (or loading, non-standby) workers than configured."""
        active = sum(1 for w, m in self._worker_model.items() if m == model and w not in self._standby_ids)
        return active < self.worker_configs[model][1]

    def _capacity_changed(self) -> None:
        serving = all(self.model_loaded(m) for m in self.worker_configs)
        _run_hooks(self.on_capacity, serving)

    # ------------------------------------------------------------- requests

    def submit(self, state: RequestState) -> None:
        """Queue a validated request; raises a ServingError when it is refused at once."""
        if self._closing:
            raise Unavailable("the server is shutting down; retry on another instance")
        now = time.monotonic()
        until = self._quarantined.get(state.fingerprint)
        if until is not None and until <= now:
            del self._quarantined[state.fingerprint]
        elif until is not None:
            raise Quarantined(f"this request (same model, prompt and sampling) crashed workers repeatedly and is refused for another {until - now:.0f} s")
        state.timeline.enqueued = now
        actions = self.scheduler.submit(state.entry)
        if actions and isinstance(actions[0], Refuse):  # the scheduler checks duplicates, queues, deadlines
            raise _refusal_error(actions[0], state)
        self.requests[state.key] = state
        self._handle(actions)

    def cancel(self, key: RequestKey) -> bool:
        state = self.requests.get(key)
        if state is None or state.done:
            return False
        self._handle(self.scheduler.cancel(key))
        self._finish(key, FinishReason.CANCELLED)
        return True

    async def events(self, state: RequestState, mailbox: asyncio.Queue, from_index: int = 0):
        """Chunks from token `from_index` on, as they come (coalesced when the reader falls behind), then the end."""
        while True:
            item = await mailbox.get()
            if item is _END:
                if state.error is not None:
                    raise state.error
                return
            if item.index + len(item.token_ids) <= from_index:
                continue  # a resumed stream already has these
            if item.index < from_index:
                end = item.index + len(item.token_ids)
                item = Chunk(from_index, state.token_ids[from_index:end], "".join(state.text[from_index:end]), item.attempt)
            chunk = Chunk(item.index, list(item.token_ids), item.text, item.attempt)  # shared: never mutate
            while not mailbox.empty():
                nxt = mailbox.get_nowait()
                if nxt is _END or nxt.attempt != chunk.attempt:
                    mailbox._queue.appendleft(nxt)  # type: ignore[attr-defined]
                    break
                chunk.token_ids.extend(nxt.token_ids)
                chunk.text += nxt.text
            yield chunk

    def leave(self, state: RequestState, mailbox: asyncio.Queue) -> None:
        """A caller went away: the run stops when nobody follows it any more.

        A run with an idempotency key goes on (to its deadline) so that a caller
        whose stream broke can re-attach, or collect the stored result.
        """
        if state.unsubscribe(mailbox) == 0 and not state.done and not state.idempotency_key:
            self.cancel(state.key)

    # ------------------------------------------------------------ internals

    def _on_step(self, report: StepReport) -> None:
        now = time.monotonic()
        if self.watchdog is not None:
            self.watchdog.on_step(report.worker_id, report.step_s, now, self._heaviest_step_s(report.worker_id))
        result = self.scheduler.on_step(report)
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
            if d.token_ids:
                st.timeline.on_tokens(now, len(d.token_ids))
                index = len(st.token_ids)
                st.token_ids.extend(d.token_ids)
                st.text.extend([""] * (len(d.token_ids) - 1) + [d.text])
                st.emit(Chunk(index, list(d.token_ids), d.text, st.attempt))
            if d.finish_reason is not None:
                self._finish(d.key, d.finish_reason, at=now)
        _run_hooks(self.on_step, result)
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
            if isinstance(a, Dispatch):
                self._dispatch(a, now)
            elif isinstance(a, Compose):
                self._send(a.worker_id, a.plan)
            elif isinstance(a, Expire):
                if a.worker_id is not None:
                    self._send(a.worker_id, Abort((a.run_key,)))
                self._finish(a.key, FinishReason.DEADLINE, DeadlineUnmeetable("the request's deadline passed before it finished"))
            elif isinstance(a, StopRun):
                self._send(a.worker_id, Abort((a.run_key,)))
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

    def _dispatch(self, d: Dispatch, now: float) -> None:
        if self.watchdog is not None and d.idle_before:
            self.watchdog.expect(d.worker_id, now)  # an idle worker's silence was not a hang
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
                                  delivered_tokens=adm.generated, shown_chars=sum(map(len, st.text[:adm.generated]))))
        self._send(d.worker_id, Admit(d.seq, tuple(items)))

    def _send(self, wid: int | None, msg: object) -> None:
        handle = self.handles.get(wid) if wid is not None else None
        if handle is None:
            return
        try:
            handle.send(msg)
        except (BrokenPipeError, OSError, EOFError):
            pass  # its exit is being reported; the scheduler will requeue its runs

    def _arm_timer(self) -> None:
        wake = self.scheduler.next_wakeup()
        if wake is None:
            return
        now = time.monotonic()
        if wake <= now:
            if self._last_timer_run is not None and self._last_timer_run >= wake:
                return  # already acted on it; a capacity change will dispatch the rest
            wake = now
        if self._timer is not None and self._timer_at is not None and self._timer_at <= wake:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake
        self._timer = self.loop.call_at(self.loop.time() + (wake - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._last_timer_run = time.monotonic()
        self._handle(self.scheduler.on_timer())

    # ------------------------------------------------------------- shutdown

    def idle(self) -> bool:
        return not self.requests

    async def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        for key in list(self.requests):
            self.scheduler.cancel(key)  # its actions are moot: every worker is told to shut down
            self._finish(key, None, Unavailable("the server shut down before the request finished"))
        for h in list(self.handles.values()):
            try:
                h.send(Shutdown())
            except (BrokenPipeError, OSError, EOFError):
                pass
        await asyncio.gather(*(asyncio.to_thread(h.terminate, timeout) for h in list(self.handles.values())))
        self.handles.clear()


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
    if a.reason in (Refusal.QUEUE_FULL, Refusal.TENANT_LIMIT):
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

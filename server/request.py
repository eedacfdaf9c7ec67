"""One request on the connection side: who owns it, what it asks, what its callers were sent.

Its lifecycle (attempt, run, worker, tokens generated, status, waits) is the scheduler's
`Entry` (engine/scheduler/records.py), which a RequestState holds and reads through.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from tokenline.engine.scheduler.records import Entry
from tokenline.engine.types import FinishReason, PositionLogprobs, Sampling, TrafficClass
from tokenline.server.errors import ServingError
from tokenline.server.timeline import Timeline

log = logging.getLogger(__name__)

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


@dataclass(slots=True)
class Chunk:
    """Tokens for the stream: index of the first one, ids and text."""

    index: int
    token_ids: list[int]
    text: str
    attempt: int
    logprobs: list[PositionLogprobs] | None = None  # one per token, when the request asked for them


class Mailbox(asyncio.Queue):
    """One caller's chunks of a run, in order: an unbounded asyncio.Queue whose put and get skip what a
    mailbox never uses (a size bound, the task_done/join count). One put and one get per token per
    caller are the frontend's per-token path (issue 38)."""

    # Set by Runtime.events for a reader that takes chunks as they are emitted (a GenerateMany stream):
    # each chunk goes to it at once, and only the end is queued (no task woken per chunk).
    direct: Callable[[Chunk], None] | None = None

    def put_nowait(self, item: object) -> None:
        if self.direct is not None and item is not _END:
            try:
                self.direct(item)  # type: ignore[arg-type]
                return
            except Exception:  # a fault of ours: the reader takes this chunk the ordinary way, and fails alone if it must
                log.exception("handing a chunk straight to its reader failed")
                self.direct = None
        self._queue.append(item)  # type: ignore[attr-defined]
        getters = self._getters  # type: ignore[attr-defined]
        while getters:
            getter = getters.popleft()
            if not getter.done():
                getter.set_result(None)
                return

    async def get(self) -> object:
        queue = self._queue  # type: ignore[attr-defined]
        while not queue:
            getter = self._get_loop().create_future()  # type: ignore[attr-defined]
            self._getters.append(getter)  # type: ignore[attr-defined]
            try:
                await getter
            except BaseException:  # as asyncio.Queue.get: a cancelled reader passes its wake-up on
                getter.cancel()
                try:
                    self._getters.remove(getter)  # type: ignore[attr-defined]
                except ValueError:
                    pass
                if queue and not getter.cancelled():
                    self._wakeup_next(self._getters)  # type: ignore[attr-defined]
                raise
        return queue.popleft()


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
                 must_complete_by_deadline: bool = False, idempotency_key: str = "", itl_target_s: float | None = None,
                 group: str | None = None, lora: tuple[str, int, str] | None = None, version: str = ""):
        self.entry = Entry(key=key, model=model, tenant=key.tenant, cls=cls, prompt_tokens=len(prompt_ids),
                           max_tokens=sampling.max_tokens, arrival=0.0, deadline=deadline,
                           must_complete_by_deadline=must_complete_by_deadline, itl_target_s=itl_target_s, group=group)
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.lora = lora  # a LoRA adapter of the model (ServedModel.adapter): every run of it runs with it
        self.version = version  # ServedModel.version of what it was sent to (the adapter's own, for an adapter)
        self.timeline = timeline
        self.fault_marker = fault_marker
        self.idempotency_key = idempotency_key
        self.token_ids: list[int] = []
        self.text: list[str] = []  # per token, so a stream can resume at any index
        # Per token, when sampling.logprobs is set: sent once per index, whatever the attempt.
        self.logprobs: list[PositionLogprobs] | None = [] if sampling.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs] | None = None  # once the engine gave them
        self.cached_tokens = 0  # prompt tokens the prefix cache held, on the first run
        self.finish_reason: FinishReason | None = None
        self.error: ServingError | None = None
        # One mailbox per caller following this run (a retry with the same idempotency key attaches).
        self.subscribers: list[asyncio.Queue] = []

    key = property(lambda self: self.entry.key)
    model = property(lambda self: self.entry.model)
    # What the caller named, for telemetry and the request log: a LoRA adapter's name (its runs are the base model's,
    # `model`), else the runtime's model key ("name", or "name@version" for a version rolled out since).
    served_as = property(lambda self: self.lora[0] if self.lora is not None else self.entry.model)
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
        q = Mailbox()
        if len(self.token_ids) > from_index:
            q.put_nowait(self.chunk_from(from_index, len(self.token_ids)))
        if self.done:
            q.put_nowait(_END)
        self.subscribers.append(q)
        return q

    def chunk_from(self, start: int, end: int) -> Chunk:
        """What was produced at indexes [start, end), as one chunk."""
        return Chunk(start, self.token_ids[start:end], "".join(self.text[start:end]), self.attempt,
                     self.logprobs[start:end] if self.logprobs is not None else None)

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


_END = object()  # sentinel in a request's mailbox: finished (or failed, see .error)

"""Runs durable jobs in this frontend: claims them from the job store and drives them through the runtime.

A claimed job becomes a `RequestState` submitted to the same `Runtime` the
streaming RPCs use (same scheduler, classes, deadlines, worker-crash retries).
A job taken over from a dead frontend starts with its checkpointed tokens as
already delivered, so the runtime's continuation generates only the rest.
Tokens are checkpointed in batches (every `checkpoint_s`) on the store's
thread; watchers read only what the store holds. A heartbeat renews the
leases; a job whose lease was lost (taken over, cancelled) is stopped here,
and every write it still attempts is fenced by the store.

Each job that reaches its end state here is logged once ("job … ended …"),
which `bench jobs` counts across frontends.

Model versions (server/catalog.py): a job's output comes from one version. The version is
fixed when the job's first tokens are stored (or at submission, when the request named
"model@version"), and the store keeps it; until then nothing of the job was shown, so a job
with no token yet starts on its model's current version wherever it is claimed (a job queued
through a rollout runs on the new version, as a request sent then would). A job with stored
tokens continues only on the version that made them; where that version is not served (any
more), or is draining after a rollout, the job ends failed and says so: it never continues on
another version. Rows from before versions were stored continue on the current version, as
the servers that wrote them did (logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokenline.engine.flagspec import flag

from tokenline.engine.types import FinishReason, Sampling, TrafficClass
from tokenline.server.catalog import ServedModel
from tokenline.server.errors import DeadlineUnmeetable, Overloaded, ServingError, Unavailable
from tokenline.server.jobstore import Fenced, JobRecord, JobStore
from tokenline.server.runtime import RequestKey, RequestState, Runtime
from tokenline.server.timeline import Timeline

log = logging.getLogger("tokenline.jobs")

_SUCCESS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP_STRING)
STORE_RETRY_S = 0.5
PURGE_EVERY_S = 60.0
REVOKED = "the tenant's API keys were revoked; the job was stopped"
DEFER_FIRST_S = 0.25  # a job refused for now (quota, full queue, no worker) waits this long before its next claim,
DEFER_MAX_S = 10.0  # doubling with each refusal up to this (or the scheduler's retry hint, if longer)


@dataclass(frozen=True)
class JobConfig:
    """Where jobs are stored and how this frontend runs them."""

    # a SQLite file, or a postgresql:// URI shared by several frontends (`tokenline serve` picks the default)
    store: str = flag("", "--job-store", "where durable jobs live: a SQLite file, or postgresql://… shared by "
                      "several servers (default: <cache>/jobs-<port>.sqlite3, one per server; with --port 0, in "
                      "memory; 'off' disables)", metavar="PATH|URI")
    lease_s: float = flag(10.0, "--job-lease-s", "a dead server's jobs are taken over this long after its last heartbeat")
    retention_s: float = flag(7 * 86_400.0, "--job-retention-s",
                              "how long finished jobs and their tokens are kept (default one week)")
    max_running: int = flag(32, "--jobs-running", "jobs this server runs at once (the rest wait in the store)")
    max_attempts: int = flag(5, "--job-attempts",
                             "times a job is started (across server deaths) before it ends failed; a start the "
                             "scheduler refused for now (quota, full queue, no worker) is not counted: the job "
                             "waits, with a growing backoff, and is claimed again")
    checkpoint_s: float = 0.05  # tokens are written in batches at most this often per job
    poll_s: float = 0.5  # how often the store is asked for jobs (and watchers look for other frontends' tokens)
    max_wait_s: float = flag(86_400.0, "--job-max-wait-s",
                             "a job still queued this long after its submission ends expired (default one day)")

    def __post_init__(self) -> None:
        if not self.store:
            raise ValueError("a job store is needed: a SQLite file, or a postgresql:// URI")
        if self.lease_s <= 0:
            raise ValueError(f"--job-lease-s must be > 0, got {self.lease_s}")
        if self.retention_s <= 0:
            raise ValueError(f"--job-retention-s must be > 0, got {self.retention_s}")
        if self.max_running < 1:
            raise ValueError(f"--jobs-running must be >= 1, got {self.max_running}")
        if self.max_attempts < 1:
            raise ValueError(f"--job-attempts must be >= 1, got {self.max_attempts}")
        if self.max_wait_s <= 0:
            raise ValueError(f"--job-max-wait-s must be > 0, got {self.max_wait_s}")


def job_fingerprint(model: str, sampling: Sampling, prompt_ids: list[int]) -> str:
    """What makes two submissions the same work (an idempotency key's check)."""
    h = hashlib.sha256(f"{model}|{sampling!r}|".encode())
    h.update(",".join(map(str, prompt_ids)).encode())
    return h.hexdigest()


def sampling_from_json(text: str) -> Sampling:
    return Sampling.from_dict(json.loads(text))


def defer_s(refusals: int, hint_s: float | None) -> float:
    """How long a job refused for now waits before it is claimed again: doubling per refusal,
    at least the scheduler's hint, at most DEFER_MAX_S; jittered so refused jobs do not return together."""
    base = min(DEFER_MAX_S, max(DEFER_FIRST_S * 2 ** min(refusals, 16), hint_s or 0.0))
    return base * random.uniform(0.75, 1.0)


class JobRunner:
    """`store` takes the runner's writes and lease renewals; `reads` (a second connection on its own
    thread, when the store is a file or a database) answers watchers, so a crowd of them never delays
    a renewal past its lease."""

    def __init__(self, store: JobStore, runtime: Runtime, config: JobConfig, reads: JobStore | None = None,
                 revoked: Callable[[str], bool] = lambda tenant: False, *, models: Mapping[str, ServedModel]):
        self.store = store
        self.models = models  # the catalog (server/catalog.py): "name" or "name@version" -> that version
        self.reads = reads or store
        self.revoked = revoked  # a tenant whose keys were all revoked: its jobs stop, queued or running
        self.runtime = runtime
        self.config = config
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._running: dict[str, _Running] = {}
        self._progress: dict[str, asyncio.Event] = {}  # job id -> set at its next checkpoint here
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(f()) for f in (self._claim_loop, self._heartbeat_loop, self._purge_loop)]

    async def stop(self) -> None:
        """Stop claiming, stop this frontend's runs and give their jobs back to the queue (tokens kept)."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        running = list(self._running.values())
        for r in running:
            if r.state is not None:
                self.runtime.cancel(r.state.key)
        await asyncio.gather(*(r.task for r in running), return_exceptions=True)

    def wake(self) -> None:
        """A job was submitted here: look for work now rather than at the next poll."""
        self._wake.set()

    def progress(self, job_id: str) -> asyncio.Event:
        """An event set when this frontend next stores tokens of the job (watchers wait on it)."""
        return self._progress.setdefault(job_id, asyncio.Event())

    def cancel_local(self, job_id: str) -> None:
        r = self._running.get(job_id)
        if r is not None and r.state is not None:
            self.runtime.cancel(r.state.key)

    def _notify(self, job_id: str) -> None:
        event = self._progress.pop(job_id, None)
        if event is not None:
            event.set()

    # ---------------------------------------------------------------- loops

    async def _claim_loop(self) -> None:
        while not self._stopping:
            self._wake.clear()  # before looking: a wake-up during the claim is not lost
            free = self.config.max_running - len(self._running)
            if free > 0:
                try:
                    claimed = await self.store.call("claim", self.owner, self.config.lease_s, free, self.config.max_attempts)
                except Unavailable:
                    claimed = []
                except Exception:
                    log.exception("claiming jobs failed; trying again at the next poll")
                    claimed = []
                for job in claimed:
                    log.info("job %s claimed (attempt %d, %d tokens stored)", job.job_id, job.attempts, job.tokens)
                    # Our own lease may have expired while the store was away: that run is fenced now;
                    # it stops before this one starts (one run per job in this runtime).
                    previous = self._running.get(job.job_id)
                    if previous is not None:
                        previous.fenced = True
                        if previous.state is not None:
                            self.runtime.cancel(previous.state.key)
                    entry = self._running[job.job_id] = _Running(job)
                    entry.task = asyncio.ensure_future(self._run(entry, previous.task if previous else None))
                if len(claimed) == free:
                    continue  # there may be more waiting
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)
            except asyncio.TimeoutError:
                pass

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            leases = [(job_id, r.job.fence) for job_id, r in self._running.items()]
            if not leases:
                continue
            try:
                lost = await self.store.call("renew", leases, self.config.lease_s)
            except Unavailable:
                continue  # the fence still guards every write; renew when the store is back
            except Exception:
                log.exception("renewing job leases failed; the fence still guards every write")
                continue
            for job_id in lost:
                r = self._running.get(job_id)
                if r is not None:
                    log.warning("job %s: lease lost (taken over or cancelled); stopping its run here", job_id)
                    r.fenced = True
                    if r.state is not None:
                        self.runtime.cancel(r.state.key)

    async def _purge_loop(self) -> None:
        """End jobs that waited too long in the queue; forget finished ones past their retention."""
        while True:
            try:
                expired = await self.store.call("expire_waiting", self.config.max_wait_s)
                if expired:
                    log.info("%d queued jobs expired (deadline passed, or waited over %.0f s)", expired,
                             self.config.max_wait_s)
                purged = await self.store.call("purge", self.config.retention_s)
                if purged:
                    log.info("purged %d finished jobs older than %.0f s", purged, self.config.retention_s)
            except Unavailable:
                pass
            except Exception:
                log.exception("purging finished jobs failed; trying again later")
            await asyncio.sleep(min(PURGE_EVERY_S, self.config.retention_s, self.config.max_wait_s / 4))

    # ---------------------------------------------------------------- one job

    async def _run(self, entry: _Running, previous: asyncio.Task | None) -> None:
        job = entry.job
        try:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            await self._drive(job, entry)
        except Exception:
            log.exception("job %s: runner failed; its lease will expire and it will be taken over", job.job_id)
        finally:
            if self._running.get(job.job_id) is entry:
                del self._running[job.job_id]
                self._wake.set()  # a slot is free: claim the next job now, not at the next poll

    async def _drive(self, job: JobRecord, running: _Running) -> None:
        sampling = sampling_from_json(job.sampling)
        stored = await self._stored_tokens(job.job_id, job.tokens)
        if stored is None:
            return
        if len(stored) >= sampling.max_tokens:  # every token was stored before the last owner could say so
            await self._end(job, len(stored), [], "succeeded", FinishReason.LENGTH, None)
            return
        if self.revoked(job.tenant):
            await self._end(job, len(stored), [], "cancelled", FinishReason.CANCELLED, REVOKED)
            return
        served = self._version(job, bool(stored))
        if isinstance(served, str):
            await self._end(job, len(stored), [], "failed", None, served)
            return
        running.version = served.version
        state = self._state(job, served, sampling, stored)
        mailbox = state.subscribe(len(stored))
        try:
            self.runtime.submit(state)
        except (Overloaded, Unavailable) as err:
            wait = defer_s(job.refusals, err.retry_after_s)
            log.info("job %s: not started now (%s); back to the queue for %.2f s", job.job_id, err.message, wait)
            await self._release(job, wait)
            return
        except ServingError as err:
            await self._end(job, len(stored), [], _failed_state(err), None, err.message)
            return
        checkpoint = _Checkpoint(len(stored))
        reader = asyncio.ensure_future(self._read(state, mailbox, checkpoint))
        running.state = state
        while not reader.done():
            changed = asyncio.ensure_future(checkpoint.changed.wait())
            await asyncio.wait({reader, changed}, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if reader.done():
                break
            await asyncio.sleep(self.config.checkpoint_s)  # gather a batch
            if not await self._write(job, checkpoint, running, state):
                reader.cancel()
                state.unsubscribe(mailbox)
                return
            if not running.revoked and self.revoked(job.tenant):
                running.revoked = True
                self.runtime.cancel(state.key)
        error = reader.exception() if not reader.cancelled() else None
        state.unsubscribe(mailbox)
        if running.fenced:
            return
        if self._stopping and (isinstance(error, Unavailable) or state.finish_reason == FinishReason.CANCELLED):
            await self._write(job, checkpoint, running, state)
            await self._release(job)
            return
        if isinstance(error, Overloaded) and not running.revoked and len(state.token_ids) <= len(stored):
            # Refused after it was queued (a late interactive request, when those are refused): nothing ran, so
            # like a refusal at submit it goes back to the queue, never failed.
            wait = defer_s(job.refusals, error.retry_after_s)
            log.info("job %s: refused before it started (%s); back to the queue for %.2f s", job.job_id, error.message, wait)
            await self._release(job, wait)
            return
        if running.revoked:
            outcome, reason, message = "cancelled", FinishReason.CANCELLED, REVOKED
        elif isinstance(error, ServingError):
            outcome, reason, message = _failed_state(error), None, error.message
        elif state.finish_reason in _SUCCESS:
            outcome, reason, message = "succeeded", state.finish_reason, None
        elif state.finish_reason == FinishReason.DEADLINE:
            outcome, reason, message = "expired", state.finish_reason, "the job's deadline passed before it finished"
        else:  # cancelled: CancelJob already ended it in the store
            outcome, reason, message = "cancelled", state.finish_reason, None
        await self._end(job, checkpoint.stored, checkpoint.take(), outcome, reason, message, running.version)

    def _version(self, job: JobRecord, started: bool) -> ServedModel | str:
        """The version this job runs on here (see the module's docstring), or why it cannot run."""
        if job.model_version is None:
            served = self.models.get(job.model)
            if served is None:
                return f"model {job.model!r} is no longer served here; the job was not started: submit it again"
            if started:
                log.warning("job %s: its stored tokens do not say which version of %s made them (stored by an older "
                            "server); it continues on the current version, %s", job.job_id, job.model, served.version)
            return served
        pinned = f"{job.model}@{job.model_version}"
        served = self.models.get(pinned)
        if served is None or served.key in self.runtime.closed_models:
            done = "it ran on" if started else "it asked for"
            return (f"{done} model version {pinned}, which this server no longer serves (another version replaced "
                    "it); it does not continue on another version: submit the job again")
        return served

    def _state(self, job: JobRecord, served: ServedModel, sampling: Sampling,
               stored: list[tuple[int, str]]) -> RequestState:
        now = time.monotonic()
        deadline = None if job.deadline is None else now + (job.deadline - time.time())
        state = RequestState(key=RequestKey(job.tenant, f"job:{job.job_id}"), model=served.key, cls=TrafficClass(job.cls),
                             prompt_ids=json.loads(job.prompt_ids), sampling=sampling,
                             timeline=Timeline(received=now, validated=now), deadline=deadline, lora=served.adapter,
                             version=served.version)
        if stored:
            # Taken over: the checkpointed tokens are delivered; the runtime continues after them,
            # as it continues a run after a worker crash.
            state.token_ids.extend(t for t, _ in stored)
            state.text.extend(text for _, text in stored)
            state.entry.generated = len(stored)
        return state

    async def _read(self, state: RequestState, mailbox: asyncio.Queue, checkpoint: _Checkpoint) -> None:
        async for chunk in self.runtime.events(state, mailbox, checkpoint.next_index):
            end = chunk.index + len(chunk.token_ids)
            checkpoint.add(list(zip(state.token_ids[chunk.index:end], state.text[chunk.index:end])))

    async def _write(self, job: JobRecord, checkpoint: _Checkpoint, running: _Running, state: RequestState) -> bool:
        """Store the tokens gathered so far; False when the job is no longer this frontend's."""
        batch = checkpoint.take()
        if not batch:
            return True
        try:
            await self.store.call("append", job.job_id, job.fence, checkpoint.stored, batch, self.config.lease_s,
                                  running.version)
        except Unavailable:
            checkpoint.put_back(batch)  # kept in memory; written when the store answers again
            await asyncio.sleep(STORE_RETRY_S)
            return True
        except Fenced:
            log.warning("job %s: fenced (another frontend took it over, or it was cancelled); its run here stops",
                        job.job_id)
            running.fenced = True
            self.runtime.cancel(state.key)
            return False
        checkpoint.stored += len(batch)
        self._notify(job.job_id)
        return True

    async def _end(self, job: JobRecord, start: int, tokens: list, outcome: str, reason: FinishReason | None,
                   message: str | None, version: str | None = None) -> None:
        """Write the last tokens (made by model `version`) and the outcome; retried while the store is away (the
        job is accepted work)."""
        reason_name = reason.name.lower() if reason is not None else None
        while True:
            try:
                await self.store.call("finish", job.job_id, job.fence, start, tokens, outcome, reason_name, message,
                                      version if tokens else None)
            except Unavailable:
                if self._stopping:
                    return  # the lease expires; whoever takes the job over finishes it
                await asyncio.sleep(STORE_RETRY_S)
                continue
            except Fenced:
                log.info("job %s: not ended here (cancelled, or taken over)", job.job_id)
                return
            log.info("job %s ended %s after %d tokens (attempt %d, owner %s)", job.job_id, outcome, start + len(tokens),
                     job.attempts, self.owner)
            self._notify(job.job_id)
            return

    async def _release(self, job: JobRecord, defer: float = 0.0) -> None:
        try:
            await self.store.call("release", job.job_id, job.fence, defer)
        except (Unavailable, Fenced):
            pass  # the lease expires instead
        self._notify(job.job_id)

    async def _stored_tokens(self, job_id: str, count: int) -> list[tuple[int, str]] | None:
        out: list[tuple[int, str]] = []
        try:
            while len(out) < count:
                got = await self.store.call("tokens", job_id, len(out))
                if not got:
                    break
                out.extend(got)
        except Unavailable:
            return None  # not started; the lease expires and the job is claimed again
        return out


@dataclass
class _Running:
    job: JobRecord
    task: asyncio.Task | None = None
    state: RequestState | None = None
    fenced: bool = False
    revoked: bool = False  # its tenant's keys were revoked while it ran
    version: str | None = None  # the model version its run here generates with (stored with its first tokens)


class _Checkpoint:
    """Tokens produced but not yet stored, and how many are stored."""

    def __init__(self, stored: int):
        self.stored = stored
        self.pending: list[tuple[int, str]] = []
        self.changed = asyncio.Event()

    @property
    def next_index(self) -> int:
        return self.stored + len(self.pending)

    def add(self, tokens: list[tuple[int, str]]) -> None:
        self.pending.extend(tokens)
        self.changed.set()

    def take(self) -> list[tuple[int, str]]:
        batch, self.pending = self.pending, []
        self.changed.clear()
        return batch

    def put_back(self, batch: list[tuple[int, str]]) -> None:
        self.pending[:0] = batch


def _failed_state(err: ServingError) -> str:
    return "expired" if isinstance(err, DeadlineUnmeetable) else "failed"

"""Idempotency keys: a request's fingerprint and final result, kept in SQLite (one server) or
PostgreSQL (several frontends) across restarts, and `Idempotency`, which decides what a keyed
call does (attach, replay, wait, or run).

A row is written when a keyed request starts ("running", owned by this frontend) and completed
with the serialized result when it finishes normally. A failed or cancelled run deletes its
row so that a retry generates again. On SQLite (the store of one server) a "running" row found
with no live run behind it is stale at once (the server restarted mid-run) and replaced. On
PostgreSQL the owner renews a lease on its running rows (a heartbeat); another frontend that
finds a row whose lease holds waits for its result and replays it, and one whose lease lapsed
(its frontend died) is taken over: the key runs again there. Only the row's owner can complete
or delete it, so a result is stored once per run.

Every call runs on the store's own thread (server/sqlstore.py), in order; the event loop only
waits on a future. A store that cannot be used answers `Unavailable`, never an internal error,
and expired rows are purged while the server runs. A result that could not be written is kept
in memory (bounded) and written by the next call that can, so a retry of its key replays it
instead of generating again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenline.engine.types import FinishReason
from tokenline.server import responses
from tokenline.server.errors import IdempotencyMismatch, RunLost, ServingError
from tokenline.server.runtime import RequestState
from tokenline.server.sqlstore import SqlStore
from tokenline.v1 import tokenline_pb2 as pb

log = logging.getLogger("tokenline.idempotency")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL,          -- 'running' | 'done'
    result {blob},                 -- tokenline.v1.CompleteResponse, serialized
    expires {real} NOT NULL,       -- Unix time
    token_text TEXT,               -- each token's text (JSON list), so a stream resumed at token i gets the text from i on
    owner TEXT,                    -- the frontend running it (while 'running')
    lease_expires {real},          -- Unix time: until then the owner is alive; renewed by its heartbeat
    PRIMARY KEY (tenant, key)
)
"""
_ADDED_LATER = (("token_text", "TEXT"), ("owner", "TEXT"), ("lease_expires", "REAL"))  # SQLite files from before

PURGE_EVERY_S = 60.0
MAX_UNSAVED = 10_000  # results kept in memory while the store cannot be written
RETRY_FLUSH_S = 5.0
WAIT_POLL_S = 0.25  # how often a call waiting on another frontend's run looks at its row


@dataclass(frozen=True)
class StoredRun:
    fingerprint: str
    status: str
    result: bytes | None
    token_text: tuple[str, ...] | None = None  # per token; None for rows written before it was kept
    elsewhere: bool = False  # running on another frontend whose lease holds


class IdempotencyStore(SqlStore):
    what = "idempotency store"
    unavailable = ("the idempotency store is unavailable right now; retry shortly, "
                   "or send the request without an idempotency key")

    def __init__(self, target, ttl_s: float = 86_400.0, lease_s: float = 10.0):
        if ttl_s <= 0:
            raise ValueError(f"idempotency retention must be > 0 seconds, got {ttl_s}")
        if lease_s <= 0:
            raise ValueError(f"the idempotency lease must be > 0 seconds, got {lease_s}")
        self.ttl_s = ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._next_purge = 0.0
        # (tenant, key) -> (fingerprint, result, token_text JSON): finished, not yet written.
        self._unsaved: dict[tuple[str, str], tuple[str, bytes, str]] = {}
        self._next_flush = 0.0
        self._held: set[tuple[str, str]] = set()  # keys this frontend began and has not finished writing
        self._stop = threading.Event()
        super().__init__(target)
        # One server per SQLite file: a run not live in this process is dead. Shared PostgreSQL: leases.
        self.lease_s = lease_s if self.postgres else 0.0
        if self.lease_s:
            threading.Thread(target=self._heartbeat, name="tokenline-idempotency-lease", daemon=True).start()

    # ------------------------------------------------ called on the event loop

    async def lookup(self, tenant: str, key: str) -> StoredRun | None:
        return await self._call(self._lookup, tenant, key)

    async def begin(self, tenant: str, key: str, fingerprint: str) -> bool:
        """Own the key's run; False when another frontend began it first (look again)."""
        return await self._call(self._begin, tenant, key, fingerprint)

    def complete(self, tenant: str, key: str, fingerprint: str, result: bytes, token_text: list[str]) -> asyncio.Future:
        """Queued at once (so a later lookup sees it); the future says whether it reached the store."""
        return self._call(self._complete, tenant, key, fingerprint, result, json.dumps(token_text))

    def abandon(self, tenant: str, key: str) -> asyncio.Future:
        return self._call(self._abandon, tenant, key)

    def close(self) -> None:
        self._stop.set()
        super().close()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self._thread.submit(self._guarded, self._renew)
            except RuntimeError:  # closed
                return

    # ------------------------------------------------ on the store's thread

    def _open(self) -> None:
        self._connect()
        real, blob = ("DOUBLE PRECISION", "BYTEA") if self.postgres else ("REAL", "BLOB")
        if self.postgres:
            self._script(_SCHEMA.format(blob=blob, real=real))  # under the schema lock
        else:
            self._x(_SCHEMA.format(blob=blob, real=real))
        if not self.postgres:
            columns = {row[1] for row in self._x("PRAGMA table_info(idempotency)")}
            for column, kind in _ADDED_LATER:
                if column not in columns:
                    self._x(f"ALTER TABLE idempotency ADD COLUMN {column} {kind}")
        self.purge_expired()

    def _before_call(self, fn) -> None:
        if self._unsaved and fn != self._complete and time.monotonic() >= self._next_flush:
            try:
                self._flush()
            except Exception as err:  # still not writable: go on with this call, try again a little later
                if not self._is_db_error(err):
                    raise
                self._next_flush = time.monotonic() + RETRY_FLUSH_S
        if time.monotonic() >= self._next_purge:
            self._next_purge = time.monotonic() + PURGE_EVERY_S
            try:
                self.purge_expired()
            except Exception as err:  # expired rows are never served; the next purge gets them
                if not self._is_db_error(err):
                    raise
                log.warning("idempotency store (%s): purge failed: %s", self.description, err)

    def _lookup(self, tenant: str, key: str) -> StoredRun | None:
        unsaved = self._unsaved.get((tenant, key))
        if unsaved is not None:
            return StoredRun(unsaved[0], "done", unsaved[1], tuple(json.loads(unsaved[2])))
        now = time.time()
        row = self._x("SELECT fingerprint, status, result, token_text, owner, lease_expires FROM idempotency "
                      "WHERE tenant=? AND key=? AND expires>?", (tenant, key, now)).fetchone()
        if not row:
            return None
        token_text = tuple(json.loads(row[3])) if row[3] else None
        elsewhere = row[1] == "running" and row[4] not in (None, self.owner) and (row[5] or 0.0) > now
        return StoredRun(row[0], row[1], bytes(row[2]) if row[2] is not None else None, token_text, elsewhere)

    def _begin(self, tenant: str, key: str, fingerprint: str) -> bool:
        # A new row, or one that is free: expired, or running with no live owner (lease lapsed) or owned here.
        now = time.time()
        taken = self._x(
            "INSERT INTO idempotency (tenant, key, fingerprint, status, result, token_text, expires, owner, lease_expires) "
            "VALUES (?,?,?,'running',NULL,NULL,?,?,?) ON CONFLICT (tenant, key) DO UPDATE SET "
            "fingerprint=excluded.fingerprint, status='running', result=NULL, token_text=NULL, expires=excluded.expires, "
            "owner=excluded.owner, lease_expires=excluded.lease_expires "
            "WHERE idempotency.expires<=? OR (idempotency.status='running' AND (idempotency.owner IS NULL "
            "OR idempotency.owner=? OR idempotency.lease_expires IS NULL OR idempotency.lease_expires<=?))",
            (tenant, key, fingerprint, now + self.ttl_s, self.owner, now + self.lease_s, now, self.owner, now),
        ).rowcount == 1
        if taken:
            self._held.add((tenant, key))
        return taken

    def _renew(self) -> None:
        now = time.time()
        for tenant, key in list(self._held):
            self._x("UPDATE idempotency SET lease_expires=? WHERE tenant=? AND key=? AND owner=? AND status='running'",
                    (now + self.lease_s, tenant, key, self.owner))

    def _complete(self, tenant: str, key: str, fingerprint: str, result: bytes, token_text: str) -> None:
        self._unsaved[(tenant, key)] = (fingerprint, result, token_text)
        while len(self._unsaved) > MAX_UNSAVED:
            dropped = next(iter(self._unsaved))
            del self._unsaved[dropped]
            self._held.discard(dropped)
            log.error("idempotency store (%s): more than %d results could not be written; the oldest is dropped "
                      "(a retry of its key will generate again)", self.description, MAX_UNSAVED)
        self._flush()

    def _flush(self) -> None:
        """Write the results kept in memory, oldest first; stops at the first failure."""
        while self._unsaved:
            (tenant, key), (fingerprint, result, token_text) = next(iter(self._unsaved.items()))
            written = self._x(
                "UPDATE idempotency SET status='done', result=?, token_text=?, expires=?, lease_expires=NULL "
                "WHERE tenant=? AND key=? AND owner=? AND status='running'",
                (result, token_text, time.time() + self.ttl_s, tenant, key, self.owner),
            ).rowcount
            if not written:  # our lease lapsed and another frontend took the key over: its run stands
                log.warning("idempotency store (%s): key %r was taken over by another frontend; this run's result "
                            "is not stored", self.description, key)
            del self._unsaved[(tenant, key)]
            self._held.discard((tenant, key))

    def _abandon(self, tenant: str, key: str) -> None:
        self._held.discard((tenant, key))
        self._x("DELETE FROM idempotency WHERE tenant=? AND key=? AND status='running' AND owner=?",
                (tenant, key, self.owner))

    def purge_expired(self) -> int:
        return self._x("DELETE FROM idempotency WHERE expires<=?", (time.time(),)).rowcount


# ------------------------------------------------------------ joining calls

@dataclass(frozen=True)
class Attach:
    """Follow the live run of this key (started by an earlier call)."""

    state: RequestState


@dataclass(frozen=True)
class Replay:
    """Answer with the key's stored result."""

    result: pb.CompleteResponse
    token_text: tuple[str, ...] | None  # the stored result's text per token


@dataclass(frozen=True)
class _LiveRun:
    state: RequestState
    fingerprint: str  # what the key's first call asked (its model as named: "name" or "name@version")


class NewRun:
    """Nothing to join: the caller starts a run and says so with `started`."""

    def __init__(self, live: dict[tuple[str, str], _LiveRun], at: tuple[str, str], fingerprint: str):
        self._live, self._at, self._fingerprint = live, at, fingerprint

    def started(self, state: RequestState) -> None:
        if not state.done:  # one that ended as it was submitted has already freed its key (`finished`)
            self._live[self._at] = _LiveRun(state, self._fingerprint)


class Idempotency:
    """What a keyed call does: attach to the key's live run, replay its stored result (waiting for
    it while another live frontend runs the key), or start a new run. One call at a time per key
    decides; results are stored as runs end (`finished`, a runtime hook). Without a store, only
    live runs are joined.

    Model versions (server/catalog.py): a key's fingerprint holds the model as the call named it, so a
    call naming "name" matches an earlier one naming "name" whichever version is current now, and is
    answered by the run it started (attached, or its stored result): on the version that run used,
    never spliced with another. A call naming "name@v2" is different work from one that named
    "name@v1" (or "name"). A run that died without a result (its frontend's lease lapsed, or a
    restart) runs again whole from token 0 on what the call names; a stream resumed from an index
    continues only a live run or a stored result, so no output is ever continued on another version.
    """

    def __init__(self, store: IdempotencyStore | None):
        self.store = store
        self._live: dict[tuple[str, str], _LiveRun] = {}  # (tenant, key) -> its running request
        self._locks: dict[tuple[str, str], _KeyLock] = {}

    @contextlib.asynccontextmanager
    async def decide(self, tenant: str, key: str, fingerprint: str,
                     request: pb.GenerateRequest) -> AsyncIterator[Attach | Replay | NewRun]:
        """Held while the caller acts on the answer; a NewRun refused at once (ServingError) frees the key."""
        async with self._lock(tenant, key):
            while True:
                found = await self._find(tenant, key, fingerprint, request)
                if found is not None:
                    yield found
                    return
                if self.store is None or await self._begin(tenant, key, fingerprint):
                    break
                # Another frontend began this key between our look and our write: look again.
            try:
                yield NewRun(self._live, (tenant, key), fingerprint)
            except ServingError:
                if self.store is not None:
                    _in_background(self.store.abandon(tenant, key))
                raise

    async def _begin(self, tenant: str, key: str, fingerprint: str) -> bool:
        """The store's begin; if the caller goes away meanwhile, the begin still happens on the store's
        thread, so an abandon is queued right behind it: no row is left running under a lease this
        frontend would renew for ever, with every other frontend waiting on it."""
        try:
            return await self.store.begin(tenant, key, fingerprint)
        except asyncio.CancelledError:
            _in_background(self.store.abandon(tenant, key))  # deletes only a running row owned here
            raise

    def finished(self, state: RequestState) -> None:
        """A run ended: store its result (a normal finish), or free its key for a new run."""
        if not state.idempotency_key:
            return
        at = (state.tenant, state.idempotency_key)
        live = self._live.pop(at) if at in self._live and self._live[at].state is state else None
        if self.store is None:
            return
        # Queued to the store's thread now (a later lookup is queued after it); failures are logged there.
        # A run that ended before it was recorded as the key's (refused as it was submitted) frees the key.
        if live is not None and state.error is None and state.finish_reason in (
                FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP_STRING):
            _in_background(self.store.complete(state.tenant, state.idempotency_key, live.fingerprint,
                                               responses.complete_response(state).SerializeToString(), state.text))
        else:
            _in_background(self.store.abandon(state.tenant, state.idempotency_key))

    async def _find(self, tenant: str, key: str, fingerprint: str, request: pb.GenerateRequest) -> Attach | Replay | None:
        """A run or a stored result for this key, or None to generate.

        A resumed stream (resume_from_index > 0) continues only the run it followed (named by its
        request_id when the caller sends it): it is never stitched onto a different run.
        """
        resume_from = request.resume_from_index
        live = self._live.get((tenant, key))
        if live is not None:
            if live.fingerprint != fingerprint:
                raise IdempotencyMismatch(_mismatch(key))
            if resume_from:
                _same_run(request, live.state.request_id)
            return Attach(live.state)
        stored = await self.store.lookup(tenant, key) if self.store is not None else None
        if stored is not None and stored.fingerprint != fingerprint:
            raise IdempotencyMismatch(_mismatch(key))
        while stored is not None and stored.elsewhere:
            # Another frontend runs this key and is alive: wait for its result (bounded by this call's
            # deadline), or for its lease to lapse (it died), and then run here.
            await asyncio.sleep(WAIT_POLL_S)
            stored = await self.store.lookup(tenant, key)
            if stored is not None and stored.fingerprint != fingerprint:
                raise IdempotencyMismatch(_mismatch(key))
        if stored is not None and stored.status == "done" and stored.result is not None:
            result = pb.CompleteResponse.FromString(stored.result)
            if resume_from:
                _same_run(request, result.request_id)
            return Replay(result, stored.token_text)
        if resume_from:  # the run it followed ended without a result: a new run would be spliced on
            raise RunLost(f"the run of idempotency key {key!r} that this stream followed ended without a result; "
                          "nothing can be resumed: send the request again with resume_from_index 0")
        return None  # no run, or one that died with an earlier server process: generate again

    @contextlib.asynccontextmanager
    async def _lock(self, tenant: str, key: str):
        lock = self._locks.setdefault((tenant, key), _KeyLock())
        lock.users += 1
        try:
            async with lock.lock:
                yield
        finally:
            lock.users -= 1
            if not lock.users:
                del self._locks[(tenant, key)]


@dataclass
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


def _same_run(request: pb.GenerateRequest, run_request_id: str) -> None:
    if request.request_id and request.request_id != run_request_id:
        raise RunLost(f"the run this stream followed (request id {request.request_id!r}) is gone and another run of "
                      f"the same idempotency key took its place; nothing can be resumed: send the request again "
                      "with resume_from_index 0")


def _in_background(future: asyncio.Future) -> None:
    """A store write nobody waits for: its failure was logged where it happened."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


def _mismatch(key: str) -> str:
    return (f"idempotency key {key!r} was used for a different request (model or the version it names, prompt or "
            "sampling differ); use a new key for new work")

"""Idempotency keys: a request's fingerprint and final result, kept in SQLite across restarts,
and `Idempotency`, which decides what a keyed call does (attach, replay, or run).

A row is written when a keyed request starts ("running") and completed with
the serialized result when it finishes normally. A failed or cancelled run
deletes its row so that a retry generates again. A "running" row found with
no live run behind it (the server restarted mid-run) is stale and replaced.

SQLite blocks (disk, locks held by other processes), so every call runs on the
store's own thread, in the order the calls were made; the event loop only waits
on a future. A store that cannot be used answers `Unavailable`, never an
internal error, and expired rows are purged while the server runs. A result
that could not be written is kept in memory (bounded) and written by the next
call that can, so a retry of its key replays it instead of generating again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pathlib
import sqlite3
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenline.engine.types import FinishReason
from tokenline.server import convert
from tokenline.server.errors import IdempotencyMismatch, RunLost, ServingError, Unavailable
from tokenline.server.runtime import RequestState
from tokenline.v1 import tokenline_pb2 as pb

log = logging.getLogger("tokenline.idempotency")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL,          -- 'running' | 'done'
    result BLOB,                   -- tokenline.v1.CompleteResponse, serialized
    expires REAL NOT NULL,         -- Unix time
    PRIMARY KEY (tenant, key)
)
"""
# Added later: each token's text (JSON list), so a stream resumed at token i gets the text from token i on.
_TOKEN_TEXT = "ALTER TABLE idempotency ADD COLUMN token_text TEXT"

BUSY_TIMEOUT_S = 2.0  # how long one call waits for a lock another process holds
PURGE_EVERY_S = 60.0
MAX_UNSAVED = 10_000  # results kept in memory while the file cannot be written
RETRY_FLUSH_S = 5.0


@dataclass(frozen=True)
class StoredRun:
    fingerprint: str
    status: str
    result: bytes | None
    token_text: tuple[str, ...] | None = None  # per token; None for rows written before it was kept


class IdempotencyStore:
    def __init__(self, path: pathlib.Path | str, ttl_s: float = 86_400.0):
        if ttl_s <= 0:
            raise ValueError(f"idempotency retention must be > 0 seconds, got {ttl_s}")
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.ttl_s = ttl_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenline-idempotency")
        self._db: sqlite3.Connection | None = None
        self._next_purge = 0.0
        # (tenant, key) -> (fingerprint, result, token_text JSON): finished, not yet written.
        self._unsaved: dict[tuple[str, str], tuple[str, bytes, str]] = {}
        self._next_flush = 0.0
        self._thread.submit(self._open).result()  # at start-up: a store that cannot open stops the server

    # ------------------------------------------------ called on the event loop

    async def lookup(self, tenant: str, key: str) -> StoredRun | None:
        return await self._call(self._lookup, tenant, key)

    async def begin(self, tenant: str, key: str, fingerprint: str) -> None:
        await self._call(self._begin, tenant, key, fingerprint)

    def complete(self, tenant: str, key: str, fingerprint: str, result: bytes, token_text: list[str]) -> asyncio.Future:
        """Queued at once (so a later lookup sees it); the future says whether it reached the file."""
        return self._call(self._complete, tenant, key, fingerprint, result, json.dumps(token_text))

    def abandon(self, tenant: str, key: str) -> asyncio.Future:
        return self._call(self._abandon, tenant, key)

    def close(self) -> None:
        self._thread.submit(self._close).result()
        self._thread.shutdown()

    def _call(self, fn, *args) -> asyncio.Future:
        return asyncio.wrap_future(self._thread.submit(self._guarded, fn, *args))

    def _guarded(self, fn, *args):
        try:
            if self._unsaved and fn != self._complete and time.monotonic() >= self._next_flush:
                try:
                    self._flush()
                except sqlite3.Error:  # still not writable: go on with this call, try again a little later
                    self._next_flush = time.monotonic() + RETRY_FLUSH_S
            if time.monotonic() >= self._next_purge:
                self._next_purge = time.monotonic() + PURGE_EVERY_S
                try:
                    self.purge_expired()
                except sqlite3.Error as err:  # expired rows are never served; the next purge gets them
                    log.warning("idempotency store %s: purge failed: %s", self.path, err)
            return fn(*args)
        except sqlite3.Error as err:
            log.error("idempotency store %s: %s failed: %s", self.path, fn.__name__.lstrip("_"), err)
            raise Unavailable("the idempotency store is unavailable right now; retry shortly, "
                              "or send the request without an idempotency key") from None

    # ------------------------------------------------ on the store's thread

    def _open(self) -> None:
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(idempotency)")}
        if "token_text" not in columns:
            self._db.execute(_TOKEN_TEXT)
        self.purge_expired()

    def _lookup(self, tenant: str, key: str) -> StoredRun | None:
        unsaved = self._unsaved.get((tenant, key))
        if unsaved is not None:
            return StoredRun(unsaved[0], "done", unsaved[1], tuple(json.loads(unsaved[2])))
        row = self._db.execute(
            "SELECT fingerprint, status, result, token_text FROM idempotency WHERE tenant=? AND key=? AND expires>?",
            (tenant, key, time.time()),
        ).fetchone()
        if not row:
            return None
        token_text = tuple(json.loads(row[3])) if row[3] else None
        return StoredRun(row[0], row[1], row[2], token_text)

    def _begin(self, tenant: str, key: str, fingerprint: str) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO idempotency (tenant, key, fingerprint, status, result, token_text, expires) "
            "VALUES (?,?,?,?,NULL,NULL,?)",
            (tenant, key, fingerprint, "running", time.time() + self.ttl_s),
        )

    def _complete(self, tenant: str, key: str, fingerprint: str, result: bytes, token_text: str) -> None:
        self._unsaved[(tenant, key)] = (fingerprint, result, token_text)
        while len(self._unsaved) > MAX_UNSAVED:
            dropped = next(iter(self._unsaved))
            del self._unsaved[dropped]
            log.error("idempotency store %s: more than %d results could not be written; the oldest is dropped "
                      "(a retry of its key will generate again)", self.path, MAX_UNSAVED)
        self._flush()

    def _flush(self) -> None:
        """Write the results kept in memory, oldest first; stops at the first failure."""
        while self._unsaved:
            (tenant, key), (fingerprint, result, token_text) = next(iter(self._unsaved.items()))
            self._db.execute(
                "INSERT OR REPLACE INTO idempotency (tenant, key, fingerprint, status, result, token_text, expires) "
                "VALUES (?,?,?,'done',?,?,?)",
                (tenant, key, fingerprint, result, token_text, time.time() + self.ttl_s),
            )
            del self._unsaved[(tenant, key)]

    def _abandon(self, tenant: str, key: str) -> None:
        self._db.execute("DELETE FROM idempotency WHERE tenant=? AND key=? AND status='running'", (tenant, key))

    def purge_expired(self) -> int:
        return self._db.execute("DELETE FROM idempotency WHERE expires<=?", (time.time(),)).rowcount

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()


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


class NewRun:
    """Nothing to join: the caller starts a run and says so with `started`."""

    def __init__(self, live: dict[tuple[str, str], RequestState], at: tuple[str, str]):
        self._live, self._at = live, at

    def started(self, state: RequestState) -> None:
        self._live[self._at] = state


class Idempotency:
    """What a keyed call does: attach to the key's live run, replay its stored result, or start
    a new run. One call at a time per key decides; results are stored as runs end (`finished`,
    a runtime hook). Without a store, only live runs are joined."""

    def __init__(self, store: IdempotencyStore | None):
        self.store = store
        self._live: dict[tuple[str, str], RequestState] = {}  # (tenant, key) -> its running request
        self._locks: dict[tuple[str, str], _KeyLock] = {}

    @contextlib.asynccontextmanager
    async def decide(self, tenant: str, key: str, fingerprint: str,
                     request: pb.GenerateRequest) -> AsyncIterator[Attach | Replay | NewRun]:
        """Held while the caller acts on the answer; a NewRun refused at once (ServingError) frees the key."""
        async with self._lock(tenant, key):
            found = await self._find(tenant, key, fingerprint, request)
            if found is not None:
                yield found
                return
            if self.store is not None:
                await self.store.begin(tenant, key, fingerprint)
            try:
                yield NewRun(self._live, (tenant, key))
            except ServingError:
                if self.store is not None:
                    _in_background(self.store.abandon(tenant, key))
                raise

    def finished(self, state: RequestState) -> None:
        """A run ended: store its result (a normal finish), or free its key for a new run."""
        if not state.idempotency_key:
            return
        self._live.pop((state.tenant, state.idempotency_key), None)
        if self.store is None:
            return
        # Queued to the store's thread now (a later lookup is queued after it); failures are logged there.
        if state.error is None and state.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP_STRING):
            _in_background(self.store.complete(state.tenant, state.idempotency_key, state.fingerprint,
                                               convert.complete_response(state).SerializeToString(), state.text))
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
                _same_run(request, live.request_id)
            return Attach(live)
        stored = await self.store.lookup(tenant, key) if self.store is not None else None
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
    return (f"idempotency key {key!r} was used for a different request (model, prompt or sampling differ); "
            "use a new key for new work")

"""Idempotency keys: a request's fingerprint and final result, kept in SQLite across restarts.

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
import json
import logging
import pathlib
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tokenline.server.errors import Unavailable

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

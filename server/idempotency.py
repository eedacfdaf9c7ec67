"""Idempotency keys: a request's fingerprint and final result, kept in SQLite across restarts.

A row is written when a keyed request starts ("running") and completed with
the serialized result when it finishes normally. A failed or cancelled run
deletes its row so that a retry generates again. A "running" row found with
no live run behind it (the server restarted mid-run) is stale and replaced.
"""

from __future__ import annotations

import pathlib
import sqlite3
import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class StoredRun:
    fingerprint: str
    status: str
    result: bytes | None


class IdempotencyStore:
    def __init__(self, path: pathlib.Path | str, ttl_s: float = 86_400.0):
        if ttl_s <= 0:
            raise ValueError(f"idempotency retention must be > 0 seconds, got {ttl_s}")
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.ttl_s = ttl_s
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self.purge_expired()

    def lookup(self, tenant: str, key: str) -> StoredRun | None:
        row = self._db.execute(
            "SELECT fingerprint, status, result FROM idempotency WHERE tenant=? AND key=? AND expires>?",
            (tenant, key, time.time()),
        ).fetchone()
        return StoredRun(*row) if row else None

    def begin(self, tenant: str, key: str, fingerprint: str) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO idempotency (tenant, key, fingerprint, status, result, expires) VALUES (?,?,?,?,NULL,?)",
            (tenant, key, fingerprint, "running", time.time() + self.ttl_s),
        )

    def complete(self, tenant: str, key: str, result: bytes) -> None:
        self._db.execute(
            "UPDATE idempotency SET status='done', result=?, expires=? WHERE tenant=? AND key=?",
            (result, time.time() + self.ttl_s, tenant, key),
        )

    def abandon(self, tenant: str, key: str) -> None:
        self._db.execute("DELETE FROM idempotency WHERE tenant=? AND key=? AND status='running'", (tenant, key))

    def purge_expired(self) -> int:
        return self._db.execute("DELETE FROM idempotency WHERE expires<=?", (time.time(),)).rowcount

    def close(self) -> None:
        self._db.close()

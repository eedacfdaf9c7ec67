"""Durable jobs: records, checkpointed tokens and leases with fencing, on SQLite or PostgreSQL.

A job is accepted when its row is written. A frontend runs a job only while it
holds the job's lease: `claim` takes queued jobs (and running ones whose lease
expired, i.e. whose owner died or froze) and bumps the job's fencing token.
Every later write by that owner (`append`, `renew`, `finish`, `release`) names
the token in its WHERE clause; zero rows changed means another frontend took
the job over (or the caller cancelled it), and the write is refused with
`Fenced`. Tokens are appended only at the index the row says comes next, so
stored tokens are contiguous and never rewritten: what a watcher read once
stays true whoever finishes the job.

Both backends speak the same SQL, on the connection handling of server/sqlstore.py:
every call runs on the store's own thread, in order; the event loop only awaits a
future. A store that cannot be reached answers `Unavailable`.

Leases run on the database's clock on PostgreSQL (frontends' own clocks may
disagree), on this machine's for a SQLite file. Claims take turns across
tenants: a tenant's k-th waiting job goes after every other tenant's
(k - running)-th, so one tenant's backlog never queues another's first job.

What an acknowledged job survives: on PostgreSQL, what its commit settings
promise (by default a power loss). On SQLite (WAL, synchronous=NORMAL) a crash
of the server or of every process on the machine; a power loss or an operating
system crash can lose the last acknowledged jobs and tokens — use PostgreSQL
where that matters.

This module is over 300 lines because it is one schema and its two dialects;
splitting the SQL from the calls that use it would only scatter the invariants.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from tokenline.server.sqlstore import SqlStore

log = logging.getLogger("tokenline.jobs")

STATES = ("queued", "running", "succeeded", "failed", "cancelled", "expired")
FINAL_STATES = ("succeeded", "failed", "cancelled", "expired")
MAX_TOKENS_PER_READ = 4096

_COLUMNS = ("job_id", "tenant", "idempotency_key", "fingerprint", "model", "request", "prompt_ids", "sampling",
            "cls", "deadline", "state", "attempts", "lease_owner", "lease_expires", "fence", "tokens",
            "finish_reason", "error", "created", "finished", "not_before", "refusals", "model_version")
# What a list shows: everything but the request itself (megabytes at worst), read only to run a job.
_LISTED = tuple(c for c in _COLUMNS if c not in ("request", "prompt_ids", "sampling"))

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,      -- '' when none
    fingerprint TEXT NOT NULL,          -- model, prompt and sampling (server/runtime.py fingerprint)
    model TEXT NOT NULL,
    request {blob} NOT NULL,            -- tokenline.v1.GenerateRequest, serialized
    prompt_ids TEXT NOT NULL,           -- JSON list of token ids
    sampling TEXT NOT NULL,             -- JSON of engine.types.Sampling
    cls INTEGER NOT NULL,               -- engine.types.TrafficClass value
    deadline {real},                    -- Unix time, NULL: none
    state TEXT NOT NULL,                -- queued | running | succeeded | failed | cancelled | expired
    attempts INTEGER NOT NULL DEFAULT 0,-- claims so far
    lease_owner TEXT,
    lease_expires {real},               -- Unix time
    fence INTEGER NOT NULL DEFAULT 0,   -- bumped by every claim, named by every owner write
    tokens INTEGER NOT NULL DEFAULT 0,  -- tokens stored in job_tokens
    finish_reason TEXT,
    error TEXT,
    created {real} NOT NULL,
    finished {real},
    not_before {real},                  -- a queued job refused for now is not claimed before this (Unix time)
    refusals INTEGER NOT NULL DEFAULT 0,-- times the scheduler refused it for now (its backoff, not attempts)
    model_version TEXT                  -- the version of `model` its tokens come from (ServedModel.version): set at
                                        -- submission when the request named one ("name@version"), else with its
                                        -- first stored tokens (NULL: no token yet, or a row from before it was kept)
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key <> '';
CREATE INDEX IF NOT EXISTS jobs_claimable ON jobs (state, created);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, created, job_id);
CREATE TABLE IF NOT EXISTS job_tokens (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    token_id INTEGER NOT NULL,
    text {blob} NOT NULL,               -- this token's share of the text, UTF-8 (PostgreSQL TEXT refuses NUL)
    PRIMARY KEY (job_id, idx)
)
"""


class Fenced(Exception):
    """The write named a fencing token that is no longer the job's: another owner has it, or it ended."""


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    tenant: str
    idempotency_key: str
    fingerprint: str
    model: str
    request: bytes
    prompt_ids: str
    sampling: str
    cls: int
    deadline: float | None
    state: str
    attempts: int
    lease_owner: str | None
    lease_expires: float | None
    fence: int
    tokens: int
    finish_reason: str | None
    error: str | None
    created: float
    finished: float | None
    not_before: float | None = None
    refusals: int = 0
    model_version: str | None = None

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


@dataclass(frozen=True)
class NewJob:
    """What a submission records (the job id is the store's answer if the key was seen)."""

    job_id: str
    tenant: str
    idempotency_key: str
    fingerprint: str
    model: str
    request: bytes
    prompt_ids: list[int]
    sampling: dict
    cls: int
    deadline: float | None
    model_version: str | None = None  # the request named "model@version": the job runs on that version only


class JobStore(SqlStore):
    """One interface, two backends: `JobStore("path.sqlite3")` or `JobStore("postgresql://…")`."""

    what = "job store"

    def _open(self) -> None:
        self._connect()
        if self.postgres:
            self._script(_SCHEMA.format(blob="BYTEA", real="DOUBLE PRECISION"))
        else:
            self._script(_SCHEMA.format(blob="BLOB", real="REAL"))
        self._add_columns("jobs", {"not_before": "DOUBLE PRECISION" if self.postgres else "REAL",
                                   "refusals": "INTEGER NOT NULL DEFAULT 0", "model_version": "TEXT"})

    def _add_columns(self, table: str, columns: dict[str, str]) -> None:
        """Columns added since a store was created (an older server's file or database)."""
        if self.postgres:
            for name, kind in columns.items():
                self._x(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {kind}")
            return
        have = {row[1] for row in self._x(f"PRAGMA table_info({table})").fetchall()}
        for name, kind in columns.items():
            if name not in have:
                self._x(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    def _now(self) -> float:
        """The lease clock: PostgreSQL's, shared by every frontend on it (their own clocks may disagree);
        this machine's for a SQLite file (every frontend on it is on this machine)."""
        if self.postgres:
            return float(self._x("SELECT EXTRACT(EPOCH FROM clock_timestamp())").fetchone()[0])
        return time.time()

    # ------------------------------------------------ submissions and callers (store's thread)

    def submit(self, job: NewJob) -> tuple[JobRecord, bool]:
        """Record a job; (record, True) when new, (the existing record, False) when its key was seen.
        Raises ValueError when the key was used for different work."""
        if job.idempotency_key:
            found = self._by_key(job.tenant, job.idempotency_key)
            if found is not None:
                return self._same_work(found, job), False
        try:
            self._x("INSERT INTO jobs (job_id, tenant, idempotency_key, fingerprint, model, request, prompt_ids, sampling, "
                    "cls, deadline, state, created, model_version) VALUES (?,?,?,?,?,?,?,?,?,?,'queued',?,?)",
                    (job.job_id, job.tenant, job.idempotency_key, job.fingerprint, job.model, job.request,
                     json.dumps(job.prompt_ids), json.dumps(job.sampling), job.cls, job.deadline, self._now(),
                     job.model_version))
        except Exception as err:
            # Another frontend recorded the same key between our look and our write.
            found = self._by_key(job.tenant, job.idempotency_key) if job.idempotency_key else None
            if found is None:
                raise err
            return self._same_work(found, job), False
        return self.get(job.tenant, job.job_id), True

    def _same_work(self, found: JobRecord, job: NewJob) -> JobRecord:
        if found.fingerprint != job.fingerprint:
            raise ValueError(f"idempotency key {job.idempotency_key!r} was already used for a different job "
                             f"(model, prompt or sampling differ); use a new key")
        return found

    def _by_key(self, tenant: str, key: str) -> JobRecord | None:
        row = self._x(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE tenant=? AND idempotency_key=?", (tenant, key)).fetchone()
        return _record(row)

    def get(self, tenant: str, job_id: str) -> JobRecord:
        """The job, or LookupError (another tenant's job is no job at all)."""
        row = self._x(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE tenant=? AND job_id=?", (tenant, job_id)).fetchone()
        if row is None:
            raise LookupError(job_id)
        return _record(row)

    def tokens(self, job_id: str, start: int, limit: int = MAX_TOKENS_PER_READ) -> list[tuple[int, str]]:
        """Stored (token id, text) from index `start`, in order."""
        rows = self._x("SELECT token_id, text FROM job_tokens WHERE job_id=? AND idx>=? ORDER BY idx LIMIT ?",
                       (job_id, start, limit)).fetchall()
        return [(int(r[0]), bytes(r[1]).decode("utf-8", "surrogatepass")) for r in rows]

    def cancel(self, tenant: str, job_id: str) -> JobRecord:
        """Cancel a queued or running job (its owner finds out at its next write); a finished job is left as is."""
        self._x("UPDATE jobs SET state='cancelled', finish_reason='cancelled', finished=?, lease_owner=NULL "
                "WHERE tenant=? AND job_id=? AND state IN ('queued','running')", (self._now(), tenant, job_id))
        return self.get(tenant, job_id)

    def list(self, tenant: str, states: tuple[str, ...], after: tuple[float, str] | None, limit: int) -> list[JobRecord]:
        """A tenant's jobs, oldest first, after the cursor (created, job_id)."""
        where, args = ["tenant=?"], [tenant]
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        if after is not None:
            where.append("(created > ? OR (created = ? AND job_id > ?))")
            args.extend((after[0], after[0], after[1]))
        rows = self._x(f"SELECT {', '.join(_LISTED)} FROM jobs WHERE {' AND '.join(where)} "
                       "ORDER BY created, job_id LIMIT ?", (*args, limit)).fetchall()
        return [_record(r, _LISTED) for r in rows]

    # ------------------------------------------------ runners (store's thread)

    def claim(self, owner: str, lease_s: float, limit: int, max_attempts: int) -> list[JobRecord]:
        """Take up to `limit` waiting jobs for `owner`: queued ones (not deferred), and running ones
        whose lease expired. Tenants take turns (see the module's docstring).

        Jobs past their deadline end `expired` here instead; jobs claimed `max_attempts` times
        already end `failed` (something about them keeps killing frontends).
        """
        claimed = []
        with self._transaction():
            now = self._now()
            ready = ("(state='queued' AND (not_before IS NULL OR not_before <= ?)) "
                     "OR (state='running' AND lease_expires < ?)")
            order = self._x(
                f"WITH busy AS (SELECT tenant, COUNT(*) AS n FROM jobs WHERE state='running' AND lease_expires >= ? "
                f"GROUP BY tenant), ready AS (SELECT job_id, tenant, created FROM jobs WHERE {ready}) "
                "SELECT ready.job_id FROM ready LEFT JOIN busy ON busy.tenant = ready.tenant "
                "ORDER BY ROW_NUMBER() OVER (PARTITION BY ready.tenant ORDER BY ready.created, ready.job_id) "
                "+ COALESCE(busy.n, 0), ready.created, ready.job_id LIMIT ?", (now, now, now, limit)).fetchall()
            ids = [r[0] for r in order]
            if not ids:
                return []
            lock = " FOR UPDATE SKIP LOCKED" if self.postgres else ""
            rows = self._x(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE job_id IN ({','.join('?' * len(ids))}) "
                           f"AND ({ready}){lock}", (*ids, now, now)).fetchall()
            found = {job.job_id: job for job in map(_record, rows)}
            for job in (found[j] for j in ids if j in found):
                if job.deadline is not None and job.deadline <= now:
                    self._x("UPDATE jobs SET state='expired', finish_reason='deadline', error=?, finished=?, "
                            "lease_owner=NULL, fence=fence+1 WHERE job_id=? AND fence=?",
                            ("the job's deadline passed before it finished", now, job.job_id, job.fence))
                elif job.attempts >= max_attempts:
                    self._x("UPDATE jobs SET state='failed', error=?, finished=?, lease_owner=NULL, fence=fence+1 "
                            "WHERE job_id=? AND fence=?",
                            (f"the job was started {job.attempts} times and never finished; not started again",
                             now, job.job_id, job.fence))
                else:
                    self._x("UPDATE jobs SET state='running', lease_owner=?, lease_expires=?, fence=fence+1, "
                            "attempts=attempts+1 WHERE job_id=? AND fence=?", (owner, now + lease_s, job.job_id, job.fence))
                    claimed.append(job.job_id)
        return [self._get_any(j) for j in claimed]

    def expire_waiting(self, max_wait_s: float) -> int:
        """End queued jobs that waited past their deadline, or more than `max_wait_s` since submission."""
        with self._transaction():
            now = self._now()
            n = self._x("UPDATE jobs SET state='expired', finish_reason='deadline', error=?, finished=?, fence=fence+1 "
                        "WHERE state='queued' AND deadline IS NOT NULL AND deadline <= ?",
                        ("the job's deadline passed before it started", now, now)).rowcount
            n += self._x("UPDATE jobs SET state='expired', finish_reason='deadline', error=?, finished=?, fence=fence+1 "
                         "WHERE state='queued' AND created < ?",
                         (f"the job waited more than {max_wait_s:g} s in the queue without finishing "
                          "(the server's --job-max-wait-s)", now, now - max_wait_s)).rowcount
        return n

    def _get_any(self, job_id: str) -> JobRecord:
        return _record(self._x(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE job_id=?", (job_id,)).fetchone())

    def append(self, job_id: str, fence: int, start: int, tokens: list[tuple[int, str]], lease_s: float,
               model_version: str | None = None) -> None:
        """Store tokens from index `start` (which must be the next one), renewing the lease. `model_version`: the
        version that generated them, kept with the first tokens (a continuation must stay on it)."""
        with self._transaction():
            self._owned_write("UPDATE jobs SET tokens=tokens+?, lease_expires=?, model_version=COALESCE(model_version, ?) "
                              "WHERE job_id=? AND fence=? AND state='running' AND tokens=?",
                              (len(tokens), self._now() + lease_s, model_version, job_id, fence, start))
            self._insert_tokens(job_id, start, tokens)

    def finish(self, job_id: str, fence: int, start: int, tokens: list[tuple[int, str]], state: str,
               finish_reason: str | None, error: str | None, model_version: str | None = None) -> None:
        """Store the last tokens and the outcome in one transaction: a job completes once."""
        if state not in FINAL_STATES:
            raise ValueError(f"not a final state: {state}")
        with self._transaction():
            self._owned_write("UPDATE jobs SET tokens=tokens+?, state=?, finish_reason=?, error=?, finished=?, "
                              "lease_owner=NULL, model_version=COALESCE(model_version, ?) "
                              "WHERE job_id=? AND fence=? AND state='running' AND tokens=?",
                              (len(tokens), state, finish_reason, error, self._now(), model_version, job_id, fence,
                               start))
            self._insert_tokens(job_id, start, tokens)

    def renew(self, leases: list[tuple[str, int]], lease_s: float) -> list[str]:
        """Extend the leases (job id, fence) still held; returns the job ids whose lease is lost."""
        lost = []
        with self._transaction():
            expires = self._now() + lease_s
            for job_id, fence in leases:
                n = self._x("UPDATE jobs SET lease_expires=? WHERE job_id=? AND fence=? AND state='running'",
                            (expires, job_id, fence)).rowcount
                if n == 0:
                    lost.append(job_id)
        return lost

    def release(self, job_id: str, fence: int, defer_s: float = 0.0) -> None:
        """Give a job back to the queue; tokens stay, and the claim is not counted as an attempt (nothing
        about the job failed). `defer_s` > 0: the scheduler refused it for now (a quota, a full queue, no
        worker); it is not claimed again for that long, and its refusals are counted for the backoff."""
        with self._transaction():
            now = self._now()
            self._owned_write("UPDATE jobs SET state='queued', lease_owner=NULL, lease_expires=NULL, "
                              "attempts=attempts-1, not_before=?, refusals=refusals+? "
                              "WHERE job_id=? AND fence=? AND state='running'",
                              (now + defer_s if defer_s > 0 else None, 1 if defer_s > 0 else 0, job_id, fence))

    def _owned_write(self, sql: str, args: tuple) -> None:
        if self._x(sql, args).rowcount != 1:
            raise Fenced(args)

    def _insert_tokens(self, job_id: str, start: int, tokens: list[tuple[int, str]]) -> None:
        if not tokens:
            return
        rows = [(job_id, start + i, t, text.encode("utf-8", "surrogatepass")) for i, (t, text) in enumerate(tokens)]
        sql = "INSERT INTO job_tokens (job_id, idx, token_id, text) VALUES (?,?,?,?)"
        if self.postgres:
            with self._db.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), rows)
        else:
            self._db.executemany(sql, rows)

    def purge(self, retention_s: float) -> int:
        """Forget jobs that finished more than `retention_s` ago, with their tokens."""
        with self._transaction():
            cutoff = self._now() - retention_s
            self._x("DELETE FROM job_tokens WHERE job_id IN (SELECT job_id FROM jobs WHERE finished < ?)", (cutoff,))
            return self._x("DELETE FROM jobs WHERE finished < ?", (cutoff,)).rowcount


def _record(row, columns: tuple[str, ...] = _COLUMNS) -> JobRecord | None:
    if row is None:
        return None
    values = {"request": b"", "prompt_ids": "", "sampling": ""} | dict(zip(columns, row))
    values["request"] = bytes(values["request"])
    return JobRecord(**values)

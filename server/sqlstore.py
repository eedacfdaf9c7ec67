"""One SQL database used from one thread: a SQLite file (WAL) or a PostgreSQL URI shared by frontends.

The job store and the idempotency store both sit on this. Both backends speak the
same SQL (`?` placeholders, rewritten for psycopg). Every call runs on the store's
own thread, in order; the event loop only awaits a future. A database that cannot
be reached or used right now answers `Unavailable` (with the subclass's message,
no internals), drops a PostgreSQL connection, and the next call connects again.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import sqlite3
from concurrent.futures import ThreadPoolExecutor

from tokenline.server.errors import Unavailable

BUSY_TIMEOUT_S = 2.0  # how long one call waits for a lock held elsewhere, or for a connection
SCHEMA_LOCK_KEY = 0x746F6B656E6C  # PostgreSQL advisory lock taken while a schema is created ("tokenl")

log = logging.getLogger("tokenline.store")


def is_postgres(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


class SqlStore:
    what = "store"  # in log lines and the Unavailable message: "the job store", "the idempotency store"
    unavailable = "the {what} is unavailable right now; retry shortly"

    def __init__(self, target: str):
        self.target = str(target)
        self.postgres = is_postgres(self.target)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"tokenline-{self.what.split()[0]}")
        self._db = None
        self._thread.submit(self._open).result()  # at start-up: a store that cannot open stops the server

    @property
    def description(self) -> str:
        return "PostgreSQL" if self.postgres else f"SQLite {self.target}"

    # ------------------------------------------------ called on the event loop

    def call(self, method: str, *args) -> asyncio.Future:
        """Run one of this class's blocking methods on the store's thread."""
        return self._call(getattr(self, method), *args)

    def _call(self, fn, *args) -> asyncio.Future:
        return asyncio.wrap_future(self._thread.submit(self._guarded, fn, *args))

    def close(self) -> None:
        self._thread.submit(self._close).result()
        self._thread.shutdown()

    def _guarded(self, fn, *args):
        try:
            if self._db is None:
                self._connect()
            self._before_call(fn)
            return fn(*args)
        except Exception as err:
            if not self._is_db_error(err):
                raise
            log.error("%s (%s): %s failed: %s", self.what, self.description, fn.__name__.lstrip("_"), err)
            self._drop_connection()
            raise Unavailable(self.unavailable.format(what=self.what)) from None

    def _before_call(self, fn) -> None:
        """A subclass's housekeeping before each call (on the store's thread)."""

    def _is_db_error(self, err: Exception) -> bool:
        """The store cannot be reached or used right now (not: this statement or its data is wrong,
        which retrying cannot fix; those propagate)."""
        if isinstance(err, (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError)):
            return False
        if isinstance(err, sqlite3.Error):
            return True
        if self.postgres:
            import psycopg

            if isinstance(err, (psycopg.DataError, psycopg.ProgrammingError, psycopg.IntegrityError)):
                return False
            return isinstance(err, psycopg.Error)
        return False

    # ------------------------------------------------ connection (store's thread)

    def _open(self) -> None:
        """Connect and create the schema (subclasses add theirs)."""
        self._connect()

    def _connect(self) -> None:
        if self.postgres:
            import psycopg

            self._db = psycopg.connect(self.target, autocommit=True, connect_timeout=int(BUSY_TIMEOUT_S) + 1)
        else:
            pathlib.Path(self.target).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.target, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")

    def _drop_connection(self) -> None:
        if self.postgres and self._db is not None:
            try:
                self._db.close()
            except Exception:
                pass
            self._db = None
        elif self._db is not None and self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _x(self, sql: str, args: tuple = ()):
        """Execute one statement; returns the cursor (rowcount, fetch*)."""
        if self.postgres:
            sql = sql.replace("?", "%s")
        return self._db.execute(sql, args)

    def _script(self, schema: str) -> None:
        """Create a schema. On PostgreSQL under a lock: two servers creating the same tables at once can
        both pass `IF NOT EXISTS`, and the second then fails on PostgreSQL's own catalog (a unique
        violation), which stopped a frontend started beside another on a fresh database."""
        if not self.postgres:
            for statement in schema.split(";"):  # sqlite3 runs one statement per call
                if statement.strip():
                    self._x(statement)
            return
        with self._transaction():
            self._x("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK_KEY,))
            self._db.execute(schema)  # the whole script, no parameters: PostgreSQL's simple protocol runs it all

    def _transaction(self):
        store = self

        class _Tx:
            def __enter__(self):
                store._x("BEGIN" if store.postgres else "BEGIN IMMEDIATE")

            def __exit__(self, kind, *_):
                if kind is None:
                    store._x("COMMIT")
                else:
                    try:
                        store._x("ROLLBACK")
                    except Exception:
                        pass
                return False

        return _Tx()

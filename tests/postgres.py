"""A real PostgreSQL server for tests, from the `pgserver` package (it ships the server's binaries).

As root, pgserver runs PostgreSQL as its own system user (PostgreSQL refuses to run as root).
The server listens on a Unix socket in its data folder only; `stop()` and `start()` take it
down and bring it back on the same address, for tests of a store that goes away.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
import uuid

import pytest


class Postgres:
    def __init__(self, folder: pathlib.Path):
        import pgserver

        self._server = pgserver.get_server(folder, cleanup_mode="stop")
        self.uri = self._server.get_uri()

    def database(self) -> str:
        """A fresh, empty database on this server: its URI."""
        name = "t" + uuid.uuid4().hex[:12]
        self._server.psql(f"CREATE DATABASE {name};")
        return self._server.get_uri(name)

    def stop(self) -> None:
        from pgserver._commands import pg_ctl

        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self._server.pgdata, user=self._server.system_user)

    def start(self) -> None:
        self._server.ensure_postgres_running()

    def close(self) -> None:
        self._server.cleanup()


@pytest.fixture(scope="session")
def postgres():
    # Not under pytest's temporary folder: that is private to root, and the server runs as another user.
    folder = pathlib.Path(tempfile.mkdtemp(prefix="tokenline-pg-"))
    pg = Postgres(folder / "data")
    yield pg
    pg.close()
    shutil.rmtree(folder, ignore_errors=True)

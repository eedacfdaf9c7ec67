"""Start-up: what lets `tokenline serve` serve sooner (docs/deployment.md, "Start-up: serving while compiling").

A spawned worker imports the parent's main module again, so the `tokenline` command's module stays light.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import ServerProcess


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_a_worker_process_does_not_load_the_frontends_libraries():
    server = ServerProcess("--engine", "sim", "--model", "tiny").start()
    try:
        pids = server.worker_pids()
        assert pids
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "cygrpc" not in maps, "a worker imported gRPC: the main module it re-imports is not light"
    finally:
        server.stop()

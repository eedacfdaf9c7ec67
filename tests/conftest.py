"""Shared fixtures: real servers are started once per test session (start-up costs seconds)."""

from __future__ import annotations

import os

import pytest

from tests.support import ServerProcess, free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `make test` runs the tests in two processes (pytest-xdist, --dist loadgroup). A file's tests stay in one
# process, so its module-scoped server starts once; files that share a costly session server or a stateful
# outside part share a group, so only one process starts it.
SHARED_GROUPS = {
    "test_frontends.py": "postgres", "test_jobs_postgres.py": "postgres", "test_jobstore.py": "postgres",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(SHARED_GROUPS.get(item.path.name, item.path.name)))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without it
def pytest_xdist_node_collection_finished(node, ids):
    """Grouping must work, or every file's module-scoped server starts in both processes and the groups above split.
    pytest-xdist groups by a suffix it writes into each test's node id; pytest 9.2 keeps the id where xdist 3.8's write
    does not reach (pyproject.toml bounds pytest below it). Said at once rather than found as a slower, odder run."""
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid]
    if node.config.getvalue("dist") == "loadgroup" and ungrouped:
        pytest.exit(f"pytest-xdist's --dist loadgroup left {len(ungrouped)} tests ungrouped (e.g. {ungrouped[0]}): this "
                    "pytest keeps node ids where pytest-xdist cannot extend them; install the versions "
                    "requirements/constraints.txt names (make install)", returncode=4)


# A small KV cache and a few sequences make admission and preemption observable.
TINY_ARGS = ("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "2048")


@pytest.fixture(scope="session")
def tiny_server():
    """The real vLLM engine on the tiny random model (gibberish text: assert on token counts)."""
    port = free_port()
    # With the gRPC-Web port too: tests/test_web.py drives the page and gRPC-Web against it.
    server = ServerProcess(*TINY_ARGS, "--metrics-port", str(port), "--web-port", "0").start()
    server.metrics_port = port
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_server():
    """The real default model, prepared the way `make run` prepares it."""
    # Compiled from its first request, as test_default_model.py asserts (not served eagerly while compiling).
    server = ServerProcess("--kv-cache-mb", "256", "--max-seqs", "8", "--compile", "on",
                           "--serve-while-compiling", "off").start(timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sim_server():
    """The simulated engine (no vLLM): fast, deterministic, for frontend behaviour."""
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--max-seqs", "8").start()
    yield server
    server.stop()

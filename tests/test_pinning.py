"""`--pin-workers on`: workers bound to CPUs of their own when their threads fill the machine
(engine/machine.py pin_sets, engine/supervisor.py): real worker processes, their CPUs read back from
the kernel.

The server is started with this process's affinity cut to two CPUs, so that on any machine it sees
exactly two and plans two 1-thread workers that fill them."""

import os
import re
import signal

import pytest

from tests.support import ServerProcess, wait_until
from tests.test_failures import worker_pids

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs two CPUs")
TWO = set(CPUS[:2])


def serve_on_two_cpus(*args: str, workers: int = 2) -> ServerProcess:
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, TWO)  # the server inherits it
    try:
        return ServerProcess("--engine", "sim", "--model", "tiny", "--idempotency-db", "off", "--log-level", "INFO",
                             "--workers", str(workers), *args).start()
    finally:
        os.sched_setaffinity(0, mine)


def affinities(server: ServerProcess) -> dict[int, set[int]]:
    """Each worker's CPUs, every one of its threads agreeing."""
    out = {}
    for pid in worker_pids(server):
        per_thread = [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
        assert all(cpus == per_thread[0] for cpus in per_thread), f"worker {pid}'s threads disagree: {per_thread}"
        out[pid] = per_thread[0]
    return out


def pinned_apart(server: ServerProcess, count: int = 2) -> bool:
    found = affinities(server)
    return len(found) == count and sorted(map(sorted, found.values())) == [[c] for c in sorted(TWO)]


def test_two_pinned_workers_on_two_cpus_each_get_a_cpu_of_their_own_and_a_restart_takes_the_freed_one():
    s = serve_on_two_cpus("--pin-workers", "on")
    try:
        line = next(line for line in s.output().splitlines() if "2 workers × 1 thread" in line)
        assert f"pinned to CPUs {min(TWO)} | {max(TWO)}" in line  # the start-up line says so
        assert wait_until(lambda: pinned_apart(s), timeout=30), affinities(s)
        victim, cpus = next(iter(affinities(s).items()))
        os.kill(victim, signal.SIGKILL)
        # The worker that replaces it is bound to the CPU it left, not stacked on the survivor's.
        assert wait_until(lambda: victim not in affinities(s) and pinned_apart(s), timeout=60), affinities(s)
        replacement = next(pid for pid, c in affinities(s).items() if c == cpus)
        assert re.search(rf"worker \d+ ready: model \S+, pid {replacement},", s.output())
    finally:
        s.stop()


def test_by_default_or_with_workers_that_leave_cpus_over_the_os_places_them():
    for args, workers in (((), 2), (("--pin-workers", "on"), 1)):
        s = serve_on_two_cpus(*args, workers=workers)
        try:
            assert wait_until(lambda: len(affinities(s)) == workers, timeout=30)
            assert all(cpus == TWO for cpus in affinities(s).values()), affinities(s)
            assert "pinned" not in s.output()
        finally:
            s.stop()

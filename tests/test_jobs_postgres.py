"""Two frontends sharing a PostgreSQL job store: one frozen past its lease (SIGSTOP) or killed (SIGKILL of
its whole process group) has its jobs taken over by the other; each job is completed exactly once, and
the frozen one, resumed, cannot write.

"Completed once" is read from the servers' own logs: a server logs "job <id> ended" only after its
fenced end-state write succeeded.
"""

import os
import signal
import threading

import pytest

from tokenline.client import Client
from tests.postgres import postgres  # noqa: F401 - the fixture
from tests.jobs_support import ended, tokens_of, watch_to_end
from tests.support import ServerProcess, wait_until

pytestmark = pytest.mark.engine

ARGS = ("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024", "--job-lease-s", "2")
TOKENS = 1000  # long enough (seconds on the tiny model) that a job is running when its frontend is frozen or killed
def test_two_frontends_on_postgresql_take_over_and_fence_each_other(postgres):  # noqa: F811
    store = postgres.database()
    a, b = ServerProcess(*ARGS, "--job-store", store), ServerProcess(*ARGS, "--job-store", store)
    starting = [threading.Thread(target=s.start) for s in (a, b)]  # side by side: start-up is most of the time
    for t in starting:
        t.start()
    for t in starting:
        t.join()
    assert a.address and b.address and a.proc.poll() is None and b.proc.poll() is None, \
        f"a frontend did not start:\n--- a ---\n{a.output()[-2000:]}\n--- b ---\n{b.output()[-2000:]}"
    try:
        with Client(a.address) as ca, Client(b.address) as cb:
            # A frozen past its lease: B takes its jobs over; resumed, A cannot write.
            # The premise: A is frozen while a job of its is unfinished. A job may end between the check and the
            # SIGSTOP on a slow or busy box; then the round is run again with new jobs (at most three rounds).
            frozen: list[str] = []
            for attempt in range(3):
                jobs = [ca.submit_job(f"frozen {attempt} {i}", max_tokens=TOKENS, ignore_eos=True).job_id for i in range(2)]
                frozen += jobs
                assert wait_until(lambda: all(cb.get_job(j).tokens_stored > 0 for j in jobs), timeout=60)
                os.kill(a.proc.pid, signal.SIGSTOP)
                try:
                    running = [j for j in jobs if not cb.get_job(j).final]
                    if running:
                        assert wait_until(lambda: any(cb.get_job(j).attempts == 2 for j in running), timeout=60), \
                            f"B took over none of frozen A's unfinished jobs: {[cb.get_job(j) for j in running]}"
                        break
                finally:
                    os.kill(a.proc.pid, signal.SIGCONT)
            else:
                pytest.fail("A's jobs ended before every freeze: the takeover was never exercised")
            # B killed (frontend and workers): A takes its jobs over after the lease expires.
            killed = [cb.submit_job(f"killed {i}", max_tokens=TOKENS, ignore_eos=True).job_id for i in range(2)]
            assert wait_until(lambda: all(ca.get_job(j).tokens_stored > 0 for j in killed), timeout=60)
            b.signal(signal.SIGKILL)
            b.wait(30)
            whole = {job: tokens_of(watch_to_end(ca, job)) for job in frozen + killed}
            attempts = {job: ca.get_job(job).attempts for job in frozen + killed}
    finally:
        a.stop()
        b.stop()
    assert all(len(t) == TOKENS for t in whole.values())
    assert ended(a, b) == {job: 1 for job in frozen + killed}  # no job completed twice
    assert any(attempts[j] >= 2 for j in frozen) and any(attempts[j] >= 2 for j in killed)
    assert any("fenced" in line or "lease lost" in line for line in a.lines)  # A's stale writes were refused

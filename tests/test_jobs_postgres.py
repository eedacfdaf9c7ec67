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
            frozen = [ca.submit_job(f"frozen {i}", max_tokens=400, ignore_eos=True).job_id for i in range(2)]
            assert wait_until(lambda: all(cb.get_job(j).tokens_stored > 0 for j in frozen), timeout=60)
            os.kill(a.proc.pid, signal.SIGSTOP)
            try:
                assert wait_until(lambda: any(cb.get_job(j).attempts == 2 for j in frozen), timeout=60)
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            # B killed (frontend and workers): A takes its jobs over after the lease expires.
            killed = [cb.submit_job(f"killed {i}", max_tokens=400, ignore_eos=True).job_id for i in range(2)]
            assert wait_until(lambda: all(ca.get_job(j).tokens_stored > 0 for j in killed), timeout=60)
            b.signal(signal.SIGKILL)
            b.wait(30)
            whole = {job: tokens_of(watch_to_end(ca, job)) for job in frozen + killed}
            attempts = {job: ca.get_job(job).attempts for job in frozen + killed}
    finally:
        a.stop()
        b.stop()
    assert all(len(t) == 400 for t in whole.values())
    assert ended(a, b) == {job: 1 for job in frozen + killed}  # no job completed twice
    assert any(attempts[j] >= 2 for j in frozen) and any(attempts[j] >= 2 for j in killed)
    assert any("fenced" in line or "lease lost" in line for line in a.lines)  # A's stale writes were refused

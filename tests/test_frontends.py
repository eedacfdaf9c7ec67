"""Several frontends on one PostgreSQL store: keyed retries and job watches complete through another
frontend when one dies (SIGKILL of its whole process group), each key run once, each job token once.

Two `tokenline serve` processes on the simulated engine (slowed to a fixed step so work is in
flight when the kill lands), short leases; and the store's own fencing, with two stores on one database.
"""

import asyncio
import concurrent.futures
import json
import re
import signal
import threading
import time

import pytest

from tokenline.client import SERVICE_CONFIG, Client, service_config_json
from tokenline.client.errors import TokenlineError, Unavailable
from tokenline.server.idempotency import IdempotencyStore
from tokenline.v1 import tokenline_pb2 as pb
from tests.postgres import postgres  # noqa: F401 - the fixture
from tests.support import ServerProcess, wait_until

LEASE_S = "3"  # heartbeats every second; generous for a contended machine
SIM = ("--engine", "sim", "--model", "tiny", "--max-seqs", "8", "--sim-step-ms", "20")
KEYED_TOKENS = 150  # about 3 s at 20 ms a step
JOB_TOKENS = 400


@pytest.fixture(scope="module")
def frontends(postgres):  # noqa: F811
    store = postgres.database()
    args = (*SIM, "--idempotency-db", store, "--idempotency-lease-s", LEASE_S, "--job-store", store,
            "--job-lease-s", LEASE_S)
    a, b = ServerProcess(*args), ServerProcess(*args)
    starting = [threading.Thread(target=s.start) for s in (a, b)]  # side by side: start-up is most of the time
    for t in starting:
        t.start()
    for t in starting:
        t.join()
    assert a.proc.poll() is None and b.proc.poll() is None, a.output() + b.output()
    yield a, b
    a.stop()
    b.stop()


def test_two_idempotency_stores_on_one_database_hand_a_key_over_only_when_its_lease_lapses(postgres):  # noqa: F811
    async def scenario():
        target = postgres.database()
        a, b = IdempotencyStore(target, lease_s=2.0), IdempotencyStore(target, lease_s=2.0)
        try:
            assert await a.begin("t", "k", "fp")
            held = await b.lookup("t", "k")
            refused = await b.begin("t", "k", "fp")
            a._stop.set()  # a freezes: no more heartbeats
            await asyncio.sleep(2.5)  # its lease lapses
            lapsed = await b.lookup("t", "k")
            taken = await b.begin("t", "k", "fp")
            await a.complete("t", "k", "fp", b"a's result", ["a"])  # the stale owner's write is refused
            await b.complete("t", "k", "fp", b"b's result", ["b"])
            return held, refused, lapsed, taken, await a.lookup("t", "k")
        finally:
            a.close()
            b.close()

    held, refused, lapsed, taken, stored = asyncio.run(scenario())
    assert held.status == "running" and held.elsewhere and not refused
    assert lapsed.status == "running" and not lapsed.elsewhere and taken
    assert (stored.status, stored.result, stored.token_text) == ("done", b"b's result", ("b",))


def test_a_call_that_leaves_while_its_key_is_being_claimed_leaves_no_lease_behind(postgres):  # noqa: F811
    """The caller went away during the store's begin: the begin still ran on the store's thread, and its
    row was then renewed by this frontend's heartbeat for ever, so every other frontend waited on the key."""
    from tokenline.server.idempotency import Idempotency

    async def scenario():
        target = postgres.database()
        a, b = IdempotencyStore(target, lease_s=1.0), IdempotencyStore(target, lease_s=1.0)
        try:
            import psycopg

            await a.lookup("t", "other")  # a's housekeeping (a purge, which the lock below would block) is done
            blocker = psycopg.connect(target, autocommit=True)
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE idempotency IN EXCLUSIVE MODE")  # a's begin runs, and waits for this

            async def keyed_call():
                async with Idempotency(a).decide("t", "k", "fp", pb.GenerateRequest()):
                    await asyncio.sleep(60)

            call = asyncio.ensure_future(keyed_call())
            await asyncio.sleep(0.5)
            call.cancel()  # the client left while the key was being claimed
            await asyncio.gather(call, return_exceptions=True)
            blocker.execute("COMMIT")  # the begin completes on a's thread after all
            blocker.close()
            await asyncio.sleep(2.5)  # past a's lease, had it not been renewed
            return await b.lookup("t", "k"), await b.begin("t", "k", "fp")
        finally:
            a.close()
            b.close()

    seen, taken = asyncio.run(scenario())
    assert seen is None or not seen.elsewhere
    assert taken


def test_a_load_balancing_policy_joins_the_service_config_and_keeps_the_retry_policy():
    config = json.loads(service_config_json("round_robin"))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["methodConfig"] == SERVICE_CONFIG["methodConfig"]
    assert "loadBalancingConfig" not in json.loads(service_config_json())


def test_round_robin_over_one_target_of_two_frontends_reaches_both_and_a_key_runs_once_across_them(frontends):
    a, b = frontends
    ids = [f"rr-{i}" for i in range(8)]
    with Client(f"ipv4:{a.address},{b.address}", load_balancing="round_robin") as client:
        for rid in ids:
            client.complete("spread me", max_tokens=2, request_id=rid, timeout=60)

    def served(server):
        return {rid for rid in ids if any(re.search(rf"\bid={rid}\b", line) for line in server.lines)}

    assert wait_until(lambda: served(a) | served(b) == set(ids), timeout=10)
    assert served(a) and served(b)  # both frontends got calls
    # One key sent to both frontends at once: one run, whose result both callers get.
    with Client(a.address) as ca, Client(b.address) as cb, concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(c.complete, "one run across frontends", max_tokens=50, ignore_eos=True,
                             idempotency_key="both", timeout=60) for c in (ca, cb)]
        first, second = (f.result() for f in calls)
    assert first.request_id == second.request_id and first.token_ids == second.token_ids


def _claimed_by(server, job_id):
    return any(re.search(rf"job {job_id} claimed", line) for line in server.lines)


def _contiguous(chunks, start):
    index = start
    for c in chunks:
        assert c.index == index, (c.index, index)  # no gap, no repeat
        index += len(c.token_ids)
    return [t for c in chunks for t in c.token_ids]


def test_keyed_retries_and_job_watches_complete_on_the_other_frontend_after_a_sigkill(frontends):
    a, b = frontends
    with Client(a.address) as ca, Client(b.address) as cb:
        done_on_a = ca.complete("finished before the kill", max_tokens=16, idempotency_key="before", timeout=60)

        # A job that A runs (both frontends claim queued jobs: submit until A has one), watched on A for a while.
        job = None
        for i in range(8):
            submitted = ca.submit_job(f"job {i}", max_tokens=JOB_TOKENS, ignore_eos=True).job_id
            if wait_until(lambda: _claimed_by(a, submitted) or _claimed_by(b, submitted), timeout=30) and _claimed_by(a, submitted):
                job = submitted
                break
        assert job is not None, "frontend A never claimed a job"
        seen = []
        for chunk in ca.watch_job(job, 0, timeout=60):
            seen.extend(chunk.token_ids)
            assert chunk.state is None, chunk  # still running when the kill lands
            if len(seen) >= 20:
                break

        # Keyed runs in flight on A.
        keys = [f"key-{i}" for i in range(3)]
        streams = [ca.generate(f"keyed {k}", max_tokens=KEYED_TOKENS, ignore_eos=True, idempotency_key=k, timeout=60)
                   for k in keys]
        firsts = [next(s) for s in streams]
        assert all(f.token_ids for f in firsts)

        a.signal(signal.SIGKILL)
        a.wait(30)
        killed_at = time.monotonic()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            watch = pool.submit(lambda: list(cb.watch_job(job, len(seen), timeout=120)))
            retries = {k: [pool.submit(cb.complete, f"keyed {k}", max_tokens=KEYED_TOKENS, ignore_eos=True,
                                       idempotency_key=k, timeout=120) for _ in range(2)] for k in keys}
            replayed_before = cb.complete("finished before the kill", max_tokens=16, idempotency_key="before", timeout=60)
            results = {k: [f.result() for f in fs] for k, fs in retries.items()}
            chunks = watch.result()
        again = {k: cb.complete(f"keyed {k}", max_tokens=KEYED_TOKENS, ignore_eos=True, idempotency_key=k, timeout=60)
                 for k in keys}
        whole_job = _contiguous(list(cb.watch_job(job, 0, timeout=60)), 0)
        with pytest.raises(TokenlineError):  # the key is not free for other work on the new frontend either
            cb.complete("other work", max_tokens=4, idempotency_key=keys[0], timeout=60)
    print(f"kill to all retries and the job done: {time.monotonic() - killed_at:.1f} s")

    # A result stored before the kill is replayed by the other frontend: the same run.
    assert replayed_before.request_id == done_on_a.request_id and replayed_before.token_ids == done_on_a.token_ids
    for k in keys:
        first, second = results[k]
        # Run once on B (the second caller joined that run), whole, and replayed unchanged afterwards.
        assert first.request_id == second.request_id == again[k].request_id, k
        assert first.request_id != firsts[keys.index(k)].request_id  # a new run: A's died with A
        assert len(first.token_ids) == KEYED_TOKENS and first.finish_reason == "length"
        assert second.token_ids == first.token_ids == again[k].token_ids
    # The job: taken over by B, watched on B from the last index seen on A, every remaining token once.
    assert chunks[-1].state == "succeeded", chunks[-1]
    remaining = _contiguous(chunks, len(seen))
    assert len(seen) + len(remaining) == JOB_TOKENS
    assert whole_job == seen + remaining  # what was seen on A stays true
    assert cb_attempts(b, job) >= 2


def cb_attempts(server, job_id):
    with Client(server.address) as client:
        return client.get_job(job_id).attempts


def test_a_stopped_postgresql_refuses_keyed_requests_unavailable_and_serves_them_again_when_back(frontends, postgres):  # noqa: F811
    _, b = frontends  # A was killed above; B is the surviving frontend
    with Client(b.address) as client:
        postgres.stop()
        try:
            with pytest.raises(Unavailable) as info:
                client.complete("keyed while the store is down", max_tokens=4, idempotency_key="down", timeout=60)
            unkeyed = client.complete("unkeyed while the store is down", max_tokens=4, timeout=60)
        finally:
            postgres.start()
        first = client.complete("keyed while the store is down", max_tokens=4, idempotency_key="down", timeout=60)
        again = client.complete("keyed while the store is down", max_tokens=4, idempotency_key="down", timeout=60)
    assert "idempotency store is unavailable" in info.value.details and "postgresql" not in info.value.details
    assert len(unkeyed.token_ids) == 4
    assert again.request_id == first.request_id  # back: stored once, replayed

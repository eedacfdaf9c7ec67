"""Durable jobs through the API: submit, watch from any index, get, cancel, list, the refusals, and
accepted jobs surviving a SIGKILL of the whole server.

One server for the module, on a SQLite job store; the tiny model. The last test kills it for real
(frontend and workers) and restarts a server on the same store.
"""

import signal
import sqlite3
import threading

import pytest

from tokenline.client import Client
from tokenline.client.errors import TokenlineError
from tests.jobs_support import ended, tokens_of, watch_to_end
from tests.support import ServerProcess

pytestmark = pytest.mark.engine

ARGS = ("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jobs") / "jobs.sqlite3")


@pytest.fixture(scope="module")
def server(db):
    s = ServerProcess(*ARGS, "--job-store", db, "--job-lease-s", "2").start()
    yield s
    s.stop()


def watch_all(client, job_id, from_index=0):
    chunks = list(client.watch_job(job_id, from_index, timeout=120))
    assert chunks[-1].state is not None
    for a, b in zip(chunks, chunks[1:]):
        assert b.index == a.index + len(a.token_ids)  # contiguous: no gap, no repeat
    return chunks


def test_a_job_is_stored_watched_and_its_result_kept(server):
    with Client(server.address) as client:
        job = client.submit_job("a durable job", max_tokens=48, ignore_eos=True, temperature=0)
        assert job.state in ("queued", "running") and job.job_id
        chunks = watch_all(client, job.job_id)
        done = client.get_job(job.job_id)
        resumed = watch_all(client, job.job_id, from_index=20)
    tokens = [t for c in chunks for t in c.token_ids]
    assert (chunks[-1].state, chunks[-1].finish_reason, len(tokens)) == ("succeeded", "length", 48)
    assert (done.state, done.tokens_stored, done.token_ids) == ("succeeded", 48, tokens)
    assert done.text == "".join(c.text for c in chunks)
    assert resumed[0].index == 20 and [t for c in resumed for t in c.token_ids] == tokens[20:]


def test_many_watchers_see_the_same_tokens(server):
    with Client(server.address) as client:
        job = client.submit_job("watched by many", max_tokens=64, ignore_eos=True, temperature=1.0)
        seen = [None] * 3

        def watch(i):
            seen[i] = [t for c in watch_all(client, job.job_id) for t in c.token_ids]

        threads = [threading.Thread(target=watch, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 64


def test_an_idempotency_key_records_one_job_and_refuses_different_work(server):
    with Client(server.address) as client:
        first = client.submit_job("keyed job", max_tokens=8, idempotency_key="job-key")
        again = client.submit_job("keyed job", max_tokens=8, idempotency_key="job-key")
        with pytest.raises(TokenlineError) as info:
            client.submit_job("another prompt", max_tokens=8, idempotency_key="job-key")
    assert again.job_id == first.job_id
    assert info.value.code.name == "FAILED_PRECONDITION" and "different job" in info.value.details


def test_cancel_and_list_by_state(server):
    with Client(server.address) as client:
        job = client.submit_job("cancel me", max_tokens=900, ignore_eos=True)
        cancelled = client.cancel_job(job.job_id)
        chunks = watch_all(client, job.job_id)
        listed, _ = client.list_jobs(["cancelled"])
        first, token = client.list_jobs(page_size=1)
        second, _ = client.list_jobs(page_size=1, page_token=token)
    assert cancelled.state == "cancelled" and chunks[-1].state == "cancelled"
    assert job.job_id in [j.job_id for j in listed]
    assert token and first[0].job_id != second[0].job_id


def test_a_job_past_its_deadline_ends_expired(server):
    with Client(server.address) as client:
        job = client.submit_job("too slow", max_tokens=1000, ignore_eos=True, deadline_s=0.5)
        chunks = watch_all(client, job.job_id)
    assert chunks[-1].state == "expired"


@pytest.mark.parametrize("kwargs, message", [
    (dict(request_id="mine"), "request_id must be empty"),
    (dict(max_tokens=5000), "max_tokens"),
    (dict(model="nope"), "unknown model"),
])
def test_bad_submissions_are_refused_with_what_to_change(server, kwargs, message):
    with Client(server.address) as client, pytest.raises(TokenlineError) as info:
        client.submit_job("x", **kwargs)
    assert message in info.value.details


def test_unknown_jobs_and_bad_pages_answer_clearly(server):
    with Client(server.address) as client:
        with pytest.raises(TokenlineError) as missing:
            client.get_job("no-such-job")
        with pytest.raises(TokenlineError) as page:
            client.list_jobs(page_token="garbage")
    assert missing.value.code.name == "NOT_FOUND"
    assert page.value.code.name == "INVALID_ARGUMENT" and "page_token" in page.value.details


def test_a_locked_store_refuses_submissions_but_not_streams_or_accepted_jobs(server, db):
    with Client(server.address) as client:
        job = client.submit_job("accepted before the lock", max_tokens=300, ignore_eos=True, temperature=0)
        locker = sqlite3.connect(db, isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")
        try:
            with pytest.raises(TokenlineError) as refused:
                client.submit_job("while locked", max_tokens=8)
            stream = [d for d in client.generate("a stream meanwhile", max_tokens=32, ignore_eos=True)]
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        chunks = watch_all(client, job.job_id)
    assert refused.value.code.name == "UNAVAILABLE"
    assert sum(len(d.token_ids) for d in stream) == 32 and stream[-1].finish_reason == "length"
    assert chunks[-1].state == "succeeded" and sum(len(c.token_ids) for c in chunks) == 300


def test_jobs_survive_a_sigkill_of_the_whole_server_and_a_watcher_resumes_without_gap(server, db):
    """Last in the module: it kills the module's server."""
    first, second = server, None
    try:
        with Client(first.address) as client:
            # A format and a penalty, taken over mid-output too (submitted first, so it runs from the start):
            # the new owner's run continues the pattern where the stored tokens left it.
            shaped = client.submit_job("survive shaped", max_tokens=400, temperature=1.0, regex="(abc){90}",
                                       presence_penalty=0.5).job_id
            jobs = [client.submit_job(f"survive {i}", max_tokens=300, ignore_eos=True, temperature=1.0).job_id
                    for i in range(4)]
            seen = []
            for chunk in client.watch_job(jobs[0], timeout=120):
                seen.append(chunk)
                if sum(len(c.token_ids) for c in seen) >= 30:
                    break
        first.signal(signal.SIGKILL)  # frontend and workers at once
        first.wait(30)
        second = ServerProcess(*ARGS, "--job-store", db, "--job-lease-s", "2").start()
        with Client(second.address) as client:
            next_index = seen[-1].index + len(seen[-1].token_ids)
            rest = watch_to_end(client, jobs[0], next_index)
            whole = {job: tokens_of(watch_to_end(client, job)) for job in jobs}
            attempts = [client.get_job(job).attempts for job in jobs]
            shaped_text = "".join(c.text for c in watch_to_end(client, shaped))
            shaped_attempts = client.get_job(shaped).attempts
    finally:
        if second is not None:
            second.stop()
    assert all(len(t) == 300 for t in whole.values())
    assert rest[0].index == next_index
    assert tokens_of(seen) + tokens_of(rest) == whole[jobs[0]]  # every token once, the seen ones unchanged
    assert {job: ended(first, second).get(job) for job in jobs} == {job: 1 for job in jobs}  # each accepted job completed exactly once
    assert max(attempts) == 2  # at least one was taken over mid-way
    assert shaped_text == "abc" * 90 and shaped_attempts == 2, (shaped_text, shaped_attempts)

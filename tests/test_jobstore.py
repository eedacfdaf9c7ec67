"""The job store on both backends: accepted jobs are recorded once, leases are fenced, tokens stay contiguous.

Two `JobStore` instances on one database stand for two frontends (each has its own connection).
PostgreSQL is a real server started by the tests (tests/postgres.py).
"""

import sqlite3
import time

import pytest

from tokenline.server.errors import Unavailable
from tokenline.server.jobstore import Fenced, JobStore, NewJob
from tests.postgres import postgres  # noqa: F401 - the fixture

LEASE_S = 0.3


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "jobs.sqlite3")
    return request.getfixturevalue("postgres").database()


@pytest.fixture
def stores(target):
    a, b = JobStore(target), JobStore(target)
    yield a, b
    a.close()
    b.close()


def new_job(job_id, key="", fingerprint="fp", tenant="acme", deadline=None, model_version=None):
    return NewJob(job_id=job_id, tenant=tenant, idempotency_key=key, fingerprint=fingerprint, model="tiny",
                  request=b"\x00request", prompt_ids=[1, 2, 3], sampling={"max_tokens": 8}, cls=2, deadline=deadline,
                  model_version=model_version)


def test_a_key_records_one_job_and_refuses_different_work(stores):
    a, b = stores
    first, created = a.submit(new_job("j1", key="k"))
    again, created_again = b.submit(new_job("j2", key="k"))
    assert created and not created_again
    assert again.job_id == first.job_id == "j1"
    with pytest.raises(ValueError, match="different job"):
        b.submit(new_job("j3", key="k", fingerprint="other"))
    with pytest.raises(LookupError):
        a.get("another-tenant", "j1")  # jobs are tenant-scoped


def test_a_claimed_job_is_checkpointed_and_finished_once(stores):
    a, b = stores
    a.submit(new_job("j1"))
    (job,) = a.claim("frontend-a", LEASE_S, 10, 5)
    assert (job.state, job.attempts, job.fence) == ("running", 1, 1)
    assert b.claim("frontend-b", LEASE_S, 10, 5) == []  # leased: nobody else takes it
    a.append("j1", job.fence, 0, [(5, "a"), (6, "b")], LEASE_S)
    a.finish("j1", job.fence, 2, [(7, "c")], "succeeded", "length", None)
    done = b.get("acme", "j1")
    assert (done.state, done.tokens, done.finish_reason) == ("succeeded", 3, "length")
    assert b.tokens("j1", 1) == [(6, "b"), (7, "c")]
    with pytest.raises(Fenced):
        a.finish("j1", job.fence, 3, [], "succeeded", "length", None)  # a job completes once


def test_an_expired_lease_is_taken_over_and_the_stale_owner_is_fenced(stores):
    a, b = stores
    a.submit(new_job("j1"))
    (mine,) = a.claim("frontend-a", LEASE_S, 10, 5)
    a.append("j1", mine.fence, 0, [(5, "a\x00")], LEASE_S)  # any text a model produces, NUL included
    time.sleep(LEASE_S + 0.1)  # frontend a is frozen past its lease
    (theirs,) = b.claim("frontend-b", LEASE_S, 10, 5)
    assert theirs.fence == mine.fence + 1 and theirs.tokens == 1 and theirs.attempts == 2
    # Resumed, a writes with its old token: every write is refused, nothing it sends is stored.
    with pytest.raises(Fenced):
        a.append("j1", mine.fence, 1, [(9, "x")], LEASE_S)
    with pytest.raises(Fenced):
        a.finish("j1", mine.fence, 1, [(9, "x")], "succeeded", "stop", None)
    assert a.renew([("j1", mine.fence)], LEASE_S) == ["j1"]
    b.append("j1", theirs.fence, 1, [(6, "b")], LEASE_S)
    b.finish("j1", theirs.fence, 2, [], "succeeded", "stop", None)
    assert a.tokens("j1", 0) == [(5, "a\x00"), (6, "b")]


def test_tokens_are_only_written_at_the_next_index(stores):
    a, _ = stores
    a.submit(new_job("j1"))
    (job,) = a.claim("frontend-a", LEASE_S, 10, 5)
    a.append("j1", job.fence, 0, [(5, "a")], LEASE_S)
    with pytest.raises(Fenced):
        a.append("j1", job.fence, 3, [(6, "b")], LEASE_S)  # a gap
    with pytest.raises(Fenced):
        a.append("j1", job.fence, 0, [(6, "b")], LEASE_S)  # a rewrite
    assert a.tokens("j1", 0) == [(5, "a")]


def test_a_cancelled_job_fences_its_runner(stores):
    a, b = stores
    a.submit(new_job("j1"))
    (job,) = a.claim("frontend-a", LEASE_S, 10, 5)
    assert b.cancel("acme", "j1").state == "cancelled"
    with pytest.raises(Fenced):
        a.append("j1", job.fence, 0, [(5, "a")], LEASE_S)
    assert a.renew([("j1", job.fence)], LEASE_S) == ["j1"]


def test_deadlines_and_attempts_end_jobs_at_claim(stores):
    a, _ = stores
    a.submit(new_job("late", deadline=time.time() - 1))
    a.submit(new_job("crashy"))
    for _ in range(2):
        (job,) = a.claim("frontend-a", 0.01, 10, 2)
        time.sleep(0.05)
    assert a.claim("frontend-a", 0.01, 10, 2) == []
    assert a.get("acme", "late").state == "expired"
    assert a.get("acme", "crashy").state == "failed"


def test_released_jobs_return_to_the_queue_with_their_tokens(stores):
    a, b = stores
    a.submit(new_job("j1"))
    (job,) = a.claim("frontend-a", LEASE_S, 10, 5)
    a.append("j1", job.fence, 0, [(5, "a")], LEASE_S)
    a.release("j1", job.fence)
    (again,) = b.claim("frontend-b", LEASE_S, 10, 5)
    assert again.tokens == 1 and again.state == "running"


def test_a_job_refused_for_now_waits_out_its_backoff_and_is_not_counted_as_an_attempt(stores):
    a, b = stores
    a.submit(new_job("j1"))
    for _ in range(4):  # refused again and again (a quota, a full queue): never ends failed
        (job,) = a.claim("frontend-a", LEASE_S, 10, 2)
        a.release("j1", job.fence, 0.2)
        assert b.claim("frontend-b", LEASE_S, 10, 2) == []  # not claimed during its backoff
        time.sleep(0.25)
    (job,) = b.claim("frontend-b", LEASE_S, 10, 2)
    assert (job.state, job.attempts, job.refusals) == ("running", 1, 4)


def test_tenants_take_turns_at_claims(stores):
    a, _ = stores
    for i in range(6):
        a.submit(new_job(f"a{i}", tenant="a"))
    a.submit(new_job("b0", tenant="b"))
    a.submit(new_job("b1", tenant="b"))
    a.submit(new_job("c0", tenant="c"))
    first = [j.job_id for j in a.claim("frontend-a", LEASE_S, 3, 5)]
    assert first == ["a0", "b0", "c0"]  # each tenant's oldest, though a's backlog came first
    # b has one running, a has one running: a1 and b1 are next, then a's backlog.
    assert [j.job_id for j in a.claim("frontend-a", LEASE_S, 3, 5)] == ["a1", "b1", "a2"]


def test_queued_jobs_expire_after_the_longest_wait_or_their_deadline(stores):
    a, _ = stores
    a.submit(new_job("old"))
    a.submit(new_job("due", deadline=time.time() + 0.05))
    time.sleep(0.1)
    a.submit(new_job("new"))
    assert a.expire_waiting(0.08) == 2
    assert [a.get("acme", j).state for j in ("old", "due", "new")] == ["expired", "expired", "queued"]
    assert "waited more than" in a.get("acme", "old").error


def test_a_list_does_not_read_the_stored_requests(stores):
    a, _ = stores
    a.submit(new_job("j1"))
    (listed,) = a.list("acme", (), None, 10)
    assert listed.job_id == "j1" and listed.request == b"" and a.get("acme", "j1").request == b"\x00request"


def test_a_store_made_by_an_older_server_gains_the_new_columns(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE jobs (job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL, "
               "fingerprint TEXT NOT NULL, model TEXT NOT NULL, request BLOB NOT NULL, prompt_ids TEXT NOT NULL, "
               "sampling TEXT NOT NULL, cls INTEGER NOT NULL, deadline REAL, state TEXT NOT NULL, "
               "attempts INTEGER NOT NULL DEFAULT 0, lease_owner TEXT, lease_expires REAL, "
               "fence INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0, finish_reason TEXT, error TEXT, "
               "created REAL NOT NULL, finished REAL)")
    db.execute("INSERT INTO jobs (job_id, tenant, idempotency_key, fingerprint, model, request, prompt_ids, sampling, "
               "cls, state, created) VALUES ('j1','acme','','fp','tiny',x'00','[1]','{}',2,'queued',1.0)")
    db.commit()
    db.close()
    store = JobStore(str(path))
    try:
        (job,) = store.claim("frontend-a", LEASE_S, 10, 5)
        assert (job.job_id, job.refusals, job.not_before, job.model_version) == ("j1", 0, None, None)
        store.append("j1", job.fence, 0, [(5, "a")], LEASE_S, "v1")
        assert store.get("acme", "j1").model_version == "v1"
    finally:
        store.close()


def test_a_job_keeps_the_model_version_its_first_tokens_came_from(stores):
    a, b = stores
    a.submit(new_job("j1"))
    a.submit(new_job("j2", model_version="v9"))  # submitted naming "tiny@v9"
    fences = {job.job_id: job.fence for job in a.claim("frontend-a", LEASE_S, 10, 5)}
    assert b.get("acme", "j1").model_version is None  # no token yet: it may start on any version
    a.append("j1", fences["j1"], 0, [(5, "a")], LEASE_S, "v1")
    a.append("j1", fences["j1"], 1, [(6, "b")], LEASE_S, "v2")  # a continuation never re-labels what was stored
    a.finish("j2", fences["j2"], 0, [(7, "c")], "succeeded", "length", None, "v3")
    assert (b.get("acme", "j1").model_version, b.get("acme", "j2").model_version) == ("v1", "v9")


def test_a_postgresql_store_from_before_model_versions_gains_the_column(postgres):  # noqa: F811
    target = postgres.database()  # (SQLite: test_a_store_made_by_an_older_server_gains_the_new_columns)
    store = JobStore(target)
    try:
        store.submit(new_job("j1"))
        store._x("ALTER TABLE jobs DROP COLUMN model_version")  # the table as an older server made it
    finally:
        store.close()
    store = JobStore(target)
    try:
        (job,) = store.claim("frontend-a", LEASE_S, 10, 5)
        assert (job.job_id, job.model_version) == ("j1", None)
        store.append("j1", job.fence, 0, [(5, "a")], LEASE_S, "v1")
        assert store.get("acme", "j1").model_version == "v1"
    finally:
        store.close()


def test_lists_are_tenant_scoped_paginated_and_filtered(stores):
    a, _ = stores
    for i in range(5):
        a.submit(new_job(f"j{i}"))
    a.submit(new_job("other", tenant="someone-else"))
    a.cancel("acme", "j1")
    page = a.list("acme", (), None, 2)
    rest = a.list("acme", (), (page[-1].created, page[-1].job_id), 10)
    assert [j.job_id for j in page + rest] == [f"j{i}" for i in range(5)]
    assert [j.job_id for j in a.list("acme", ("cancelled",), None, 10)] == ["j1"]


def test_finished_jobs_are_purged_after_retention(stores):
    a, _ = stores
    a.submit(new_job("old"))
    a.submit(new_job("live"))
    a.cancel("acme", "old")
    time.sleep(0.05)
    assert a.purge(0.01) == 1
    with pytest.raises(LookupError):
        a.get("acme", "old")
    assert a.get("acme", "live").state == "queued"


def test_a_locked_sqlite_file_answers_unavailable_and_recovers(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(str(path))
    locker = sqlite3.connect(str(path), isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(Unavailable):
            store._guarded(store.submit, new_job("j1"))
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    store._guarded(store.submit, new_job("j1"))
    assert store._guarded(store.get, "acme", "j1").state == "queued"
    store.close()


def test_a_stopped_postgresql_answers_unavailable_and_the_store_reconnects(postgres):  # noqa: F811
    store = JobStore(postgres.database())
    store.submit(new_job("j1"))
    postgres.stop()
    try:
        with pytest.raises(Unavailable):
            store._guarded(store.submit, new_job("j2"))
    finally:
        postgres.start()
    store._guarded(store.submit, new_job("j2"))
    assert [j.job_id for j in store._guarded(store.list, "acme", (), None, 10)] == ["j1", "j2"]
    store.close()


def test_servers_opening_one_fresh_postgresql_database_at_once_all_open(postgres):  # noqa: F811
    # Two CREATE TABLE IF NOT EXISTS at once can both pass the check, and the second then fails on
    # PostgreSQL's catalog: frontends started side by side on a new database must not.
    import threading

    from tokenline.server.idempotency import IdempotencyStore

    uri = postgres.database()
    opened, errors = [], []

    def open_one(kind):
        try:
            opened.append(kind(uri))
        except Exception as err:  # noqa: BLE001 - what the test is about
            errors.append(repr(err))

    threads = [threading.Thread(target=open_one, args=(kind,)) for kind in (JobStore, IdempotencyStore) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert len(opened) == 8
    finally:
        for store in opened:
            store.close()

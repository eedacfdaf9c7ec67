"""How durable jobs wait: a refusal for now is a wait (never a failed attempt), tenants take turns,
nothing waits for ever, and what is stored is what the server understood.

Real servers on the simulated engine (the queueing is the frontend's and the store's, not the
model's), a SQLite job store, tenants from a keys file.
"""

import base64
import json
import sqlite3
import time

import grpc
import pytest

from tokenline.client import Client
from tokenline.client.errors import TokenlineError
from tokenline.server.auth import hash_key
from tokenline.v1 import tokenline_pb2 as pb
from tests.jobs_support import watch_to_end
from tests.support import ServerProcess, wait_until

KEY_A, KEY_B = "tl-key-of-a", "tl-key-of-b"


def keys(path, **quotas):
    path.write_text(json.dumps({"tenants": {
        "a": {"keys": [hash_key(KEY_A)], **quotas},
        "b": {"keys": [hash_key(KEY_B)]},
    }}))
    return path


def test_a_job_refused_by_its_tenants_quota_waits_and_then_runs_once(tmp_path):
    path = keys(tmp_path / "keys.json", max_concurrent=1)
    db = str(tmp_path / "jobs.sqlite3")
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--sim-step-ms", "20", "--api-keys", str(path),
                           "--job-store", db, "--idempotency-db", "off").start()
    try:
        with Client(server.address, api_key=KEY_A) as a:
            stream = a.generate("holds the tenant's only slot", max_tokens=1500, ignore_eos=True)
            next(iter(stream))
            job = a.submit_job("waits its turn", max_tokens=16, ignore_eos=True)
            # Refused again and again while the stream runs: more refusals than --job-attempts allows.
            assert wait_until(lambda: server.output().count(f"job {job.job_id}: not started now") >= 6, timeout=60)
            assert a.get_job(job.job_id).state == "queued"
            stream.cancel()
            chunks = watch_to_end(a, job.job_id)
            done = a.get_job(job.job_id)
        assert sum(len(c.token_ids) for c in chunks) == 16
        assert done.attempts == 1  # the refused claims were not attempts
        assert "limit is 1" in server.output()
    finally:
        server.stop()


def test_an_interactive_job_refused_as_late_waits_and_then_runs_once(tmp_path):
    """`--late-interactive refuse`: an ITL target below the simulated engine's fixed step leaves no room beside a
    running stream (the first is always let in), so an interactive job queued behind it is refused once its TTFT
    target is out of reach. Like a refusal at submission, that is a wait, never a failed attempt: it runs once the
    stream has gone. (A target in single steps made "no room" hang on the measured single step: a busy box that
    stretched one batch-1 step made room, and the job ran instead of waiting.)"""
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--sim-step-ms", "20", "--job-store",
                           str(tmp_path / "jobs.sqlite3"), "--idempotency-db", "off", "--late-interactive", "refuse",
                           "--interactive-itl-target-ms", "15", "--interactive-ttft-target-ms", "300").start()
    try:
        with Client(server.address) as client:
            stream = client.generate("takes the only room", max_tokens=1500, ignore_eos=True)
            next(iter(stream))
            job = client.submit_job("waits its turn", max_tokens=16, ignore_eos=True, traffic_class="interactive")
            assert wait_until(lambda: f"job {job.job_id}: refused before it started" in server.output(), timeout=60)
            assert client.get_job(job.job_id).state == "queued"
            stream.cancel()
            chunks = watch_to_end(client, job.job_id)
            done = client.get_job(job.job_id)
        assert sum(len(c.token_ids) for c in chunks) == 16 and done.state == "succeeded"
        assert done.attempts == 1  # the refusals were not attempts
    finally:
        server.stop()


def test_one_tenants_backlog_does_not_queue_another_tenants_job(tmp_path):
    path = keys(tmp_path / "keys.json")
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--sim-step-ms", "5", "--api-keys", str(path),
                           "--job-store", str(tmp_path / "jobs.sqlite3"), "--jobs-running", "2",
                           "--idempotency-db", "off").start()
    try:
        with Client(server.address, api_key=KEY_A) as a, Client(server.address, api_key=KEY_B) as b:
            backlog = [a.submit_job(f"a's job {i}", max_tokens=200, ignore_eos=True).job_id for i in range(30)]
            late = b.submit_job("b's only job", max_tokens=40, ignore_eos=True)
            watch_to_end(b, late.job_id)
            done = b.get_job(late.job_id)
            a_jobs = [a.get_job(j) for j in backlog]
        # Timed by the store's own clock: a's jobs still waiting when b's was submitted, and those of them
        # that finished before b's did. Taking turns, b's job starts at the next free slot: at most the two
        # running then and one beside it finish first; first come, first served, every one of a's would.
        waiting = [j for j in a_jobs if not j.finished_unix_ms or j.finished_unix_ms > late.created_unix_ms]
        before_b = [j for j in waiting if j.finished_unix_ms and j.finished_unix_ms <= done.finished_unix_ms]
        assert len(waiting) >= 10, f"only {len(waiting)} of a's jobs were left when b's came: nothing to overtake"
        assert len(before_b) <= 4, f"{len(before_b)} of a's {len(waiting)} waiting jobs finished before b's one job"
    finally:
        server.stop()


def test_a_job_that_waits_longer_than_the_servers_limit_expires(tmp_path):
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--sim-step-ms", "20",
                           "--job-store", str(tmp_path / "jobs.sqlite3"), "--jobs-running", "1",
                           "--job-max-wait-s", "2", "--idempotency-db", "off").start()
    try:
        with Client(server.address) as client:
            first = client.submit_job("takes the only runner", max_tokens=400, ignore_eos=True)
            second = client.submit_job("waits behind it", max_tokens=4, ignore_eos=True)
            end = list(client.watch_job(second.job_id, timeout=60))[-1]
            assert (end.state, end.finish_reason) == ("expired", "deadline")
            assert "--job-max-wait-s" in client.get_job(second.job_id).error
            client.cancel_job(first.job_id)
    finally:
        server.stop()


def test_fields_the_server_does_not_know_are_not_stored_with_a_job(tmp_path):
    db = str(tmp_path / "jobs.sqlite3")
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--job-store", db, "--idempotency-db", "off").start()
    try:
        inner = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
        unknown = _varint(999 << 3 | 2) + _varint(1 << 20) + b"\x00" * (1 << 20)  # field 999, 1 MiB
        raw = b"\x0a" + _varint(len(inner) + len(unknown)) + inner + unknown  # SubmitJobRequest.request = 1
        with grpc.insecure_channel(server.address) as channel:
            submit = channel.unary_unary("/tokenline.v1.Tokenline/SubmitJob", request_serializer=lambda b: b,
                                         response_deserializer=pb.Job.FromString)
            job = submit(raw, timeout=30)
        with sqlite3.connect(db) as conn:
            (size,) = conn.execute("SELECT length(request) FROM jobs WHERE job_id=?", (job.job_id,)).fetchone()
        assert size < 100
    finally:
        server.stop()


@pytest.mark.parametrize("job_id", ["abc\x00def", "x" * 100_000, "A" * 32])
def test_job_ids_the_server_never_gave_are_no_job(tmp_path_factory, job_id):
    server = _plain_server(tmp_path_factory)
    with Client(server.address) as client, pytest.raises(TokenlineError) as info:
        client.get_job(job_id)
    assert info.value.code.name == "NOT_FOUND" and len(info.value.details) < 200


@pytest.mark.parametrize("cursor", ["[1e400, \"a\"]", "[1" + "0" * 400 + ", \"a\"]", "[1.0, \"a\\u0000b\"]"])
def test_page_tokens_the_server_never_gave_are_invalid(tmp_path_factory, cursor):
    token = base64.urlsafe_b64encode(cursor.encode()).decode()
    server = _plain_server(tmp_path_factory)
    with Client(server.address) as client, pytest.raises(TokenlineError) as info:
        client.list_jobs(page_token=token)
    assert info.value.code.name == "INVALID_ARGUMENT" and "page_token" in info.value.details


_SERVERS = {}


def _plain_server(tmp_path_factory):
    if "plain" not in _SERVERS:
        db = str(tmp_path_factory.mktemp("plain") / "jobs.sqlite3")
        _SERVERS["plain"] = ServerProcess("--engine", "sim", "--model", "tiny", "--job-store", db,
                                          "--idempotency-db", "off").start()
    return _SERVERS["plain"]


@pytest.fixture(scope="module", autouse=True)
def _stop_plain():
    yield
    for s in _SERVERS.values():
        s.stop()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_revoking_a_tenants_keys_stops_its_jobs_and_its_watches(tmp_path):
    path = keys(tmp_path / "keys.json")
    db = str(tmp_path / "jobs.sqlite3")
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--sim-step-ms", "20", "--api-keys", str(path),
                           "--job-store", db, "--jobs-running", "1", "--idempotency-db", "off").start()
    try:
        with Client(server.address, api_key=KEY_A) as a:
            running = a.submit_job("runs", max_tokens=1500, ignore_eos=True)
            queued = a.submit_job("waits", max_tokens=8, ignore_eos=True)
            watch = iter(a.watch_job(running.job_id, timeout=60))
            next(watch)  # running, and watched
            time.sleep(1.1)  # file times have a resolution: make the change visible
            path.write_text(json.dumps({"tenants": {"b": {"keys": [hash_key(KEY_B)]}}}))  # a is gone
            with pytest.raises(TokenlineError) as info:
                for _ in watch:
                    pass
        assert info.value.code.name == "UNAUTHENTICATED"

        def ended():
            with sqlite3.connect(db) as conn:
                return dict(conn.execute("SELECT job_id, state || ': ' || COALESCE(error, '') FROM jobs").fetchall())

        assert wait_until(lambda: all(v.startswith("cancelled") for v in ended().values()), timeout=30), ended()
        states = ended()
        assert "revoked" in states[running.job_id] and "revoked" in states[queued.job_id]
        with sqlite3.connect(db) as conn:
            (stored,) = conn.execute("SELECT tokens FROM jobs WHERE job_id=?", (queued.job_id,)).fetchone()
        assert stored == 0  # the queued one never ran
    finally:
        server.stop()

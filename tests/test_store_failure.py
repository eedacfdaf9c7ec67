"""A failing idempotency store costs only the keyed request its answer: UNAVAILABLE with a clear
message; other streams keep every token, ids and keys are not left taken, results are not lost."""

import concurrent.futures
import sqlite3
import time

import pytest

from tokenline.client import Client
from tokenline.client.errors import Unavailable
from tests.support import ServerProcess


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return tmp_path_factory.mktemp("store") / "idempotency.sqlite3"


@pytest.fixture(scope="module")
def server(db):
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--idempotency-db", str(db)).start()
    yield s
    s.stop()


class LockedStore:
    """Another process holds the store's write lock while the block runs."""

    def __init__(self, db):
        self.db = db

    def __enter__(self):
        self.conn = sqlite3.connect(str(self.db), isolation_level=None)
        self.conn.execute("BEGIN EXCLUSIVE")
        return self

    def __exit__(self, *exc):
        self.conn.execute("ROLLBACK")
        self.conn.close()


def _stream(client, tokens):
    arrivals, count, finish = [], 0, None
    for delta in client.generate("an unkeyed stream", max_tokens=tokens, ignore_eos=True, timeout=120):
        arrivals.append(time.monotonic())
        count += len(delta.token_ids)
        finish = delta.finish_reason or finish
    return count, finish, max(b - a for a, b in zip(arrivals, arrivals[1:]))


def test_a_locked_store_refuses_the_keyed_request_unavailable_and_other_streams_lose_nothing(server, db):
    with Client(server.address) as client, concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(_stream, client, 1500) for _ in range(6)]
        time.sleep(0.2)
        with LockedStore(db):
            with pytest.raises(Unavailable) as info:
                client.complete("keyed work", max_tokens=8, idempotency_key="k1", request_id="keyed-1", timeout=60)
        results = [f.result() for f in streams]

        assert "idempotency store is unavailable" in info.value.details
        assert str(db) not in info.value.details  # no internals to callers
        assert [(n, finish) for n, finish, _ in results] == [(1500, "length")] * 6
        assert max(gap for _, _, gap in results) < 2.0  # the loop never waited on the lock
        # Neither the request id nor the key is left taken: the request runs once, and a retry replays it.
        first = client.complete("keyed work", max_tokens=8, idempotency_key="k1", request_id="keyed-1", timeout=60)
        again = client.complete("keyed work", max_tokens=8, idempotency_key="k1", timeout=60)
        assert again.request_id == "keyed-1" and again.token_ids == first.token_ids


def test_a_result_that_finishes_while_the_store_is_locked_is_delivered_and_still_replayed(server, db):
    with Client(server.address) as client:
        stream = client.generate("keyed story", max_tokens=300, ignore_eos=True, idempotency_key="k2",
                                 request_id="keyed-2", timeout=60)
        first = next(stream)  # the run has started (and its key is recorded)
        with LockedStore(db):
            deltas = [first, *stream]
            assert sum(len(d.token_ids) for d in deltas) == 300 and deltas[-1].finish_reason == "length"
            time.sleep(0.5)
        # Not generated again: the result comes back under the first run's id, whole.
        again = client.complete("keyed story", max_tokens=300, ignore_eos=True, idempotency_key="k2", timeout=60)
        assert again.request_id == "keyed-2"
        assert again.text == "".join(d.text for d in deltas)
    # And it reaches the file once the lock is gone (the next store call writes it).
    with Client(server.address) as client:
        client.complete("another", max_tokens=2, idempotency_key="k3", timeout=60)
    row = sqlite3.connect(str(db)).execute("SELECT status FROM idempotency WHERE key='k2'").fetchone()
    assert row == ("done",)

"""Streams attached to a running idempotency key cost what any stream costs: they count against the
tenant's max_concurrent, and one run takes a bounded number of them (300 attached streams once rode
past a quota of 2 and tripled another tenant's token gaps).

A real server on the simulated engine; tenants from a keys file.
"""

import json

import pytest

from tokenline.client import Client
from tokenline.client.errors import Overloaded
from tokenline.server.auth import hash_key
from tests.support import ServerProcess

KEY_A, KEY_B = "tl-attach-a", "tl-attach-b"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("attach") / "keys.json"
    path.write_text(json.dumps({"tenants": {"a": {"keys": [hash_key(KEY_A)], "max_concurrent": 2},
                                            "b": {"keys": [hash_key(KEY_B)]}}}))
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--sim-step-ms", "20", "--api-keys", str(path),
                      "--idempotency-db", "off").start()
    yield s
    s.stop()


def keyed(client, key):
    stream = client.generate("one run, followed", max_tokens=1500, ignore_eos=True, temperature=0, idempotency_key=key)
    stream.run_id = next(iter(stream)).request_id  # running
    return stream


def end_run(client, streams):
    """A keyed run outlives its streams (to be re-attached): cancel it by its id, as its caller would, so the
    server's drain at the module's end has no 30-second run to wait for."""
    for s in streams:
        s.cancel()
    assert client.cancel(streams[0].run_id)


def test_attached_streams_count_against_the_tenants_concurrency(server):
    with Client(server.address, api_key=KEY_A) as a:
        owner = keyed(a, "a-key")
        second = keyed(a, "a-key")  # one run + one attached: the quota of 2
        with pytest.raises(Overloaded) as info:
            keyed(a, "a-key")
        assert "attached streams" in info.value.details and "limit is 2" in info.value.details
        end_run(a, [owner, second])


def test_a_run_takes_a_bounded_number_of_attached_streams(server):
    with Client(server.address, api_key=KEY_B) as b:
        streams = [keyed(b, "b-key") for _ in range(16)]  # the run's own stream and 15 attached
        with pytest.raises(Overloaded) as info:
            keyed(b, "b-key")
        assert "already follow" in info.value.details
        end_run(b, streams)

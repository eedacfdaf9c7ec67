"""One caller cannot reach into another's work: tenants are separated whatever their names and ids contain."""

import itertools
import json

import pytest

from tokenline.client import Client
from tokenline.server.auth import hash_key
from tests.support import ServerProcess

# Tenant names and request ids with the separators a joined key would use ("/", "@", quotes, backslash).
TENANTS = {"acme": "key-acme", "acme/eu": "key-acme-eu", 'acme"@x': "key-acme-quote", "acme\\": "key-acme-backslash"}
IDS = ["job1", "eu/job1", "job1@0", '"]@0', "\\job1", "eu"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("isolation") / "keys.json"
    path.write_text(json.dumps({"tenants": {t: {"keys": [hash_key(k)]} for t, k in TENANTS.items()}}))
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--api-keys", str(path), "--idempotency-db", "off").start()
    yield s
    s.stop()


@pytest.mark.parametrize("owner, other", list(itertools.permutations(TENANTS, 2)))
def test_another_tenant_can_neither_cancel_nor_collide_with_requests_whatever_the_separators(server, owner, other):
    with Client(server.address, api_key=TENANTS[owner]) as a, Client(server.address, api_key=TENANTS[other]) as b:
        streams = {rid: a.generate("long", max_tokens=300, ignore_eos=True, request_id=rid) for rid in IDS}
        firsts = {rid: next(iter(s)) for rid, s in streams.items()}

        # To the other tenant these requests do not exist: nothing to cancel, every id free to use.
        assert [b.cancel(rid) for rid in IDS] == [False] * len(IDS)
        for rid in IDS:
            assert len(b.complete("short", max_tokens=2, ignore_eos=True, request_id=rid).token_ids) == 2

        for rid, stream in streams.items():
            deltas = [firsts[rid], *stream]
            assert sum(len(d.token_ids) for d in deltas) == 300, rid
            assert deltas[-1].finish_reason == "length", rid

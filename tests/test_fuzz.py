"""Fuzzing the request message: hostile input gets INVALID_ARGUMENT (or a legitimate answer), never INTERNAL.

Runs against the real server and gRPC stack on the simulated engine, so
thousands of inputs fit in CI; validation is the same for every engine.
"""

from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenline.bench.fuzz import ALLOWED, cap, fuzz_raw, requests, send
from tokenline.client import Client
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

# The short version for `make test`; `python -m tokenline.bench.fuzz` runs 10,000 and more.


@pytest.fixture(scope="module")
def channel(sim_server):
    with grpc.insecure_channel(sim_server.address) as ch:
        yield ch


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(requests(), st.booleans())
def test_generated_messages_are_answered_with_a_legitimate_status(channel, req, streaming):
    req = cap(req)
    code, details = send(channel, req, streaming)
    assert code == grpc.StatusCode.OK or details, "every refusal says why"
    assert code in ALLOWED, f"{code} for {req}"


def test_raw_random_bytes_are_answered_invalid_argument_and_the_server_stays_alive(channel, sim_server):
    codes: Counter = Counter()
    failures: list[str] = []
    tried = fuzz_raw(channel, 1000, 7, codes, failures)
    assert failures == [], failures
    assert codes["INVALID_ARGUMENT"] > 0
    with Client(sim_server.address) as client:
        assert len(client.complete("alive", max_tokens=3, ignore_eos=True).token_ids) == 3
    print(f"\nraw bytes: {tried} inputs, answers {dict(codes)}")


def test_an_oversized_message_is_refused_resource_exhausted(channel):
    stub = pb_grpc.TokenlineStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(pb.GenerateRequest(text="x" * (5 * 1024 * 1024)), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

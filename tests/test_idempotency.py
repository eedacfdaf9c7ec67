"""Idempotency keys: one execution per key, mismatches refused, results replayed across restarts."""

import asyncio

import pytest

from tokenline.client import AsyncClient, Client
from tokenline.client.errors import TokenlineError
from tests.support import ServerProcess, free_port, scrape

pytestmark = pytest.mark.engine

ARGS = ("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return str(tmp_path_factory.mktemp("idem") / "idempotency.sqlite3")


@pytest.fixture(scope="module")
def server(db):
    port = free_port()
    s = ServerProcess(*ARGS, "--idempotency-db", db, "--metrics-port", str(port)).start()
    s.metrics_port = port
    yield s
    s.stop()


def requests_total(server, outcome):
    return sum(v for k, v in scrape(server.metrics_port).items()
               if k.startswith("tokenline_requests_total{") and f'outcome="{outcome}"' in k)


def sampled(client, key, prompt="tell me something", **kw):
    # Temperature 1 without a seed: two executions would almost surely differ.
    return client.complete(prompt, max_tokens=48, temperature=1.0, ignore_eos=True, idempotency_key=key, **kw)


def test_concurrent_duplicates_execute_once(server):
    async def run():
        async with AsyncClient(server.address) as client:
            calls = [client.complete("one run only", max_tokens=64, temperature=1.0, ignore_eos=True,
                                     idempotency_key="dup-key") for _ in range(6)]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    assert len({tuple(r.token_ids) for r in results}) == 1
    assert len({r.request_id for r in results}) == 1  # every caller got the one run's result
    assert len(results[0].token_ids) == 64
    # One run; the other five calls were served by it (attached while running, or replayed).
    assert requests_total(server, "length") == 1
    assert requests_total(server, "attached") + requests_total(server, "replayed") == 5


def test_a_key_reused_for_different_work_is_refused_naming_the_mismatch(server):
    with Client(server.address) as client:
        sampled(client, "mismatch-key", prompt="first prompt")
        with pytest.raises(TokenlineError) as info:
            sampled(client, "mismatch-key", prompt="another prompt")
    assert info.value.code.name == "FAILED_PRECONDITION"
    assert "different request" in info.value.details


def test_a_completed_result_is_replayed_as_a_stream_without_generating_again(server):
    with Client(server.address) as client:
        first = sampled(client, "replay-key")
        deltas = list(client.generate("tell me something", max_tokens=48, temperature=1.0, ignore_eos=True,
                                      idempotency_key="replay-key"))
    assert [t for d in deltas for t in d.token_ids] == list(first.token_ids)
    assert "".join(d.text for d in deltas) == first.text
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].request_id == first.request_id


def test_a_broken_stream_resumes_from_its_last_token_without_duplicates(server):
    with Client(server.address) as client:
        stream = client.generate("resume me", max_tokens=300, temperature=0, ignore_eos=True, idempotency_key="resume-key")
        got = []
        for d in stream:
            got.extend(d.token_ids)
            if len(got) >= 10:
                break
        stream.cancel()  # the connection "breaks"; the keyed run goes on
        rest = list(resume_stub(server.address, _resume_request("resume me", "resume-key", len(got))))
        whole = client.complete("resume me", max_tokens=300, temperature=0, ignore_eos=True, idempotency_key="resume-key")
    assert rest[0].index == len(got)
    resumed = got + [t for c in rest for t in c.token_ids]
    assert resumed == list(whole.token_ids)
    assert len(resumed) == 300


def resume_stub(address, request):
    import grpc

    from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.TokenlineStub(channel).Generate(request, timeout=60))


def _resume_request(prompt, key, index):
    from tokenline.v1 import tokenline_pb2 as pb

    return pb.GenerateRequest(text=prompt, idempotency_key=key, resume_from_index=index,
                              sampling=pb.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))


def test_results_are_replayed_after_a_server_restart(db):
    first_server = ServerProcess(*ARGS, "--idempotency-db", db).start()
    try:
        with Client(first_server.address) as client:
            first = sampled(client, "restart-key", prompt="survive a restart")
    finally:
        assert first_server.stop() == 0
    second_server = ServerProcess(*ARGS, "--idempotency-db", db).start()
    try:
        with Client(second_server.address) as client:
            again = sampled(client, "restart-key", prompt="survive a restart")
    finally:
        second_server.stop()
    assert list(again.token_ids) == list(first.token_ids)
    # The stored run itself, not a new one: its id and its timeline come back unchanged.
    assert again.request_id == first.request_id
    assert again.timeline.ttft_ms == first.timeline.ttft_ms
    assert again.timeline.finished_ms == first.timeline.finished_ms

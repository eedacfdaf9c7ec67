"""Resuming a keyed stream continues the run it followed, and only that run: its text is the tail
of the whole text, and a run that is gone is an error the caller sees, never another run spliced on."""

import grpc
import pytest

from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc
from tests.support import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("resume") / "idempotency.sqlite3"
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--idempotency-db", str(db)).start()
    yield s
    s.stop()


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TokenlineStub(channel)


def keyed(key, request_id="", resume_from=0, max_tokens=40):
    return pb.GenerateRequest(text="tell me a story", idempotency_key=key, request_id=request_id,
                              resume_from_index=resume_from,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def test_a_stream_resumed_from_a_stored_result_gets_the_tail_of_the_text(stub):
    chunks = [c for c in stub.Generate(keyed("story-1"), timeout=60) if c.token_ids]
    full_text = "".join(c.text for c in chunks)
    assert full_text and sum(len(c.token_ids) for c in chunks) == 40

    # The run is stored now; resume at each chunk boundary of the original stream.
    for i, chunk in enumerate(chunks[1:], start=1):
        resumed = [c for c in stub.Generate(keyed("story-1", resume_from=chunk.index), timeout=60) if c.token_ids]
        expected_text = "".join(c.text for c in chunks[i:])
        assert [t for c in resumed for t in c.token_ids] == [t for c in chunks[i:] for t in c.token_ids]
        assert "".join(c.text for c in resumed) == expected_text
        assert full_text.endswith(expected_text)


def _read_some(stream, tokens):
    seen = []
    for chunk in stream:
        seen.append(chunk)
        if sum(len(c.token_ids) for c in seen) >= tokens:
            return seen
    return seen


def test_resuming_a_run_that_ended_without_a_result_is_an_error_not_a_new_run(stub):
    stream = stub.Generate(keyed("story-2", request_id="run-1", max_tokens=1500), timeout=60)
    seen = _read_some(stream, 5)
    index = seen[-1].index + len(seen[-1].token_ids)
    assert stub.Cancel(pb.CancelRequest(request_id="run-1"), timeout=10).cancelled
    stream.cancel()

    # No run and no stored result: nothing may be resumed (before, a fresh run was silently spliced on).
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(keyed("story-2", request_id="run-1", resume_from=index, max_tokens=1500), timeout=60))
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "resume_from_index 0" in info.value.details()


def test_resuming_is_refused_when_another_run_of_the_key_took_the_place_of_the_one_followed(stub):
    first = stub.Generate(keyed("story-3", request_id="run-1", max_tokens=1500), timeout=60)
    index = sum(len(c.token_ids) for c in _read_some(first, 5))
    stub.Cancel(pb.CancelRequest(request_id="run-1"), timeout=10)
    first.cancel()
    second = stub.Generate(keyed("story-3", request_id="run-2", max_tokens=1500), timeout=60)
    _read_some(second, 1)

    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(keyed("story-3", request_id="run-1", resume_from=index, max_tokens=1500), timeout=60))
    assert info.value.code() == grpc.StatusCode.ABORTED
    # The run that is there can be followed from the start, or resumed by its own id.
    resumed = stub.Generate(keyed("story-3", request_id="run-2", resume_from=3, max_tokens=1500), timeout=60)
    assert next(iter(resumed)).index == 3
    resumed.cancel()
    stub.Cancel(pb.CancelRequest(request_id="run-2"), timeout=10)
    second.cancel()


def test_the_client_names_the_run_it_followed_when_it_re_attaches():
    from tokenline.client._client import resumed

    again = resumed(keyed("k"), 7, "run-9")
    assert (again.resume_from_index, again.request_id, again.idempotency_key) == (7, "run-9", "k")

"""Frontend behaviour on the simulated engine: validation, statuses, health, reflection.

The simulated worker has the same process interface as the vLLM worker, so
these tests exercise the real server, scheduler and gRPC path quickly.
"""

import re

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tokenline.client import Client
from tokenline.client.errors import InvalidRequest, NotFound
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc


@pytest.fixture
def stub(sim_server):
    with grpc.insecure_channel(sim_server.address) as channel:
        yield pb_grpc.TokenlineStub(channel)


def call_status(fn, request):
    with pytest.raises(grpc.RpcError) as info:
        result = fn(request, timeout=30)
        for _ in result if not isinstance(result, pb.CompleteResponse) else ():
            pass
    return info.value.code(), info.value.details()


BAD_REQUESTS = {
    "no prompt": (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    "empty text": (pb.GenerateRequest(text="   "), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "token id out of vocabulary": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**9])), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    "empty chat": (pb.GenerateRequest(chat=pb.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT, "chat"),
    "bad chat role": (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="hi")])), grpc.StatusCode.INVALID_ARGUMENT, "role"),
    "temperature too high": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=5)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "negative temperature": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "top_p zero": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "top_k below -1": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=-5)), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    "too many stop strings": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["x"] * 17)), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    "empty stop string": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=[""])), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    "prompt longer than context": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 2100)), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
    "max_tokens beyond context": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=4000)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    "unknown traffic class": (pb.GenerateRequest(text="hi", traffic_class=7), grpc.StatusCode.INVALID_ARGUMENT, "traffic_class"),
    "request id too long": (pb.GenerateRequest(text="hi", request_id="x" * 200), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    "unknown model": (pb.GenerateRequest(text="hi", model="gpt-17"), grpc.StatusCode.NOT_FOUND, "unknown model"),
    # 100 KB echoed into grpc-message was RESOURCE_EXHAUSTED in every client with default header limits.
    "unknown model with a 100 KB name": (pb.GenerateRequest(text="hi", model="m" * 100_000), grpc.StatusCode.NOT_FOUND, "(100000 characters)"),
    "resume past any answer": (pb.GenerateRequest(text="hi", idempotency_key="k", resume_from_index=2**32 - 1, sampling=pb.SamplingParams(max_tokens=4)), grpc.StatusCode.INVALID_ARGUMENT, "past the end"),
    "resume without an idempotency key": (pb.GenerateRequest(text="hi", resume_from_index=3), grpc.StatusCode.INVALID_ARGUMENT, "idempotency_key"),
    "negative ITL target": (pb.GenerateRequest(text="hi", itl_target_ms=-5), grpc.StatusCode.INVALID_ARGUMENT, "itl_target_ms"),
    "ITL target not a number": (pb.GenerateRequest(text="hi", itl_target_ms=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "itl_target_ms"),
    "ITL target of a minute and more": (pb.GenerateRequest(text="hi", itl_target_ms=60_001), grpc.StatusCode.INVALID_ARGUMENT, "itl_target_ms"),
    "ITL target on bulk": (pb.GenerateRequest(text="hi", itl_target_ms=80, traffic_class=pb.BULK), grpc.StatusCode.INVALID_ARGUMENT, "interactive"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
@pytest.mark.parametrize("method", ["Generate", "Complete"])
def test_bad_input_gets_a_clear_status_and_message(stub, case, method):
    request, code, words = BAD_REQUESTS[case]
    got_code, details = call_status(getattr(stub, method), request)
    assert got_code == code
    assert words in details


def test_asking_for_completion_by_a_deadline_without_giving_one_is_invalid(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(pb.GenerateRequest(text="hi", require_completion_by_deadline=True))  # no gRPC timeout either
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs a deadline" in info.value.details()


def test_an_interactive_request_may_carry_its_own_itl_target(sim_server):
    with Client(sim_server.address) as client:
        result = client.complete("pace me", max_tokens=6, ignore_eos=True, itl_target_ms=80)
    assert len(result.token_ids) == 6


def test_the_server_keeps_serving_after_bad_input(stub, sim_server):
    for request, _, _ in BAD_REQUESTS.values():
        with pytest.raises(grpc.RpcError):
            stub.Complete(request, timeout=30)
    with Client(sim_server.address) as client:
        result = client.complete("still alive?", max_tokens=5, ignore_eos=True)
    assert len(result.token_ids) == 5


def test_health_is_serving_once_the_model_is_loaded(sim_server):
    assert sim_server.health() == health_pb2.HealthCheckResponse.SERVING
    assert sim_server.health("tokenline.v1.Tokenline") == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(sim_server):
    with grpc.insecure_channel(sim_server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = [s.name for r in responses for s in r.list_services_response.service]
    assert "tokenline.v1.Tokenline" in names
    assert "grpc.health.v1.Health" in names


def test_list_models_names_the_loaded_model_and_its_context(sim_server):
    with Client(sim_server.address) as client:
        models = client.list_models()
    assert [m.name for m in models] == ["tiny-llama"]
    assert models[0].loaded and models[0].max_context == 2048 and models[0].version


def test_cancel_of_an_unknown_request_is_not_found(stub):
    code, details = call_status(stub.Cancel, pb.CancelRequest(request_id="never-sent"))
    assert code == grpc.StatusCode.NOT_FOUND


def test_a_duplicate_request_id_in_flight_is_refused(sim_server):
    with Client(sim_server.address) as client:
        first = client.generate("long one", max_tokens=400, ignore_eos=True, request_id="dup-1")
        next(iter(first))
        with pytest.raises(Exception) as info:
            client.complete("again", max_tokens=4, request_id="dup-1")
        first.cancel()
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_stream_chunks_are_contiguous_and_end_with_usage_and_timeline(sim_server):
    with Client(sim_server.address) as client:
        deltas = list(client.generate("count", max_tokens=20, ignore_eos=True))
    index = 0
    for d in deltas:
        assert d.index == index
        index += len(d.token_ids)
    last = deltas[-1]
    assert index == 20
    assert last.finish_reason == "length"
    assert last.usage.completion_tokens == 20
    assert last.timeline.first_token_ms <= last.timeline.finished_ms <= last.timeline.last_byte_ms


def test_cancel_rpc_ends_a_running_stream(sim_server):
    with Client(sim_server.address) as client:
        stream = client.generate("long one", max_tokens=2000 - 10, ignore_eos=True, request_id="to-cancel")
        it = iter(stream)
        next(it)
        assert client.cancel("to-cancel") is True
        rest = list(it)
    assert rest[-1].finish_reason == "cancelled"
    assert sum(len(d.token_ids) for d in rest) < 1990




def test_once_serving_the_frontend_takes_what_start_up_made_out_of_the_garbage_collectors_scans():
    # Full collections walked every module, descriptor and instrument made at start-up (~375,000 objects, ~150 ms of
    # the loop each); once serving they are frozen out of the scans (gc.freeze), as vllm serve's API server does.
    from tests.support import ServerProcess, wait_until

    server = ServerProcess("--engine", "sim", "--model", "tiny", "--max-seqs", "8").start()
    try:
        pattern = re.compile(r"(\d+) objects made at start-up are out of the garbage collector's scans")
        assert wait_until(lambda: any(pattern.search(line) for line in server.lines), timeout=30), server.output()[-2000:]
        frozen = int(next(m for line in server.lines if (m := pattern.search(line))).group(1))
        assert frozen > 100_000
        with Client(server.address) as client:  # and it serves on
            assert len(client.complete("still serving", max_tokens=4, ignore_eos=True).token_ids) == 4
    finally:
        server.stop()

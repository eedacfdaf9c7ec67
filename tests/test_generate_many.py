"""GenerateMany: many Generate streams on one call, one response per engine step for all of them.

Each stream is a Generate call of its own in everything but the wire: the same checks, keys, deadlines
and paths; it fails alone; leaving it stops its run; a keyed one re-attaches on a new call. What the call
adds is that a step's chunks for all its streams travel in one message (issue 38: gRPC's cost per message
is most of the frontend's cost per token).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from tokenline.client import AsyncClient
from tokenline.client.errors import DeadlineExceeded, Overloaded, Unavailable, error_from_status
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc
from tests.support import ServerProcess
from tests.test_failures import judge  # noqa: F401  (a fixture: the float32 reference of tiny-trained)
from tests.test_request_surface import is_a_greedy_pick


def run(coro):
    return asyncio.run(coro)


async def collect(stream):
    deltas = []
    async for d in stream:
        deltas.append(d)
    return deltas


def tokens_of(deltas):
    return [t for d in deltas for t in d.token_ids]


def contiguous(deltas) -> bool:
    index = 0
    for d in deltas:
        if d.index != index:
            return False
        index += len(d.token_ids)
    return True


async def raw_call(address, messages):
    """The responses (and the final status) of one GenerateMany call that sends `messages`, then half-closes."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.TokenlineStub(channel).GenerateMany(iter(messages), timeout=60)
        responses = []
        try:
            async for response in call:
                responses.append(response)
        except grpc.aio.AioRpcError as error:
            return responses, error.code(), error.details()
        return responses, grpc.StatusCode.OK, ""


def one(**action) -> pb.GenerateManyRequest:
    """A message with one action (StreamRequest)."""
    return pb.GenerateManyRequest(streams=[pb.StreamRequest(**action)])


def generate(n, **sampling):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                              sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True, **sampling))


# ------------------------------------------------------------------ the protocol, on the simulated engine


def test_a_step_s_chunks_for_every_stream_travel_in_one_message(sim_server):
    messages = [one(stream=i, generate=generate(24)) for i in range(1, 9)]
    responses, code, _ = run(raw_call(sim_server.address, messages))
    assert code == grpc.StatusCode.OK
    chunks = [c for r in responses for c in r.chunks]
    by_stream = {i: [c.chunk for c in chunks if c.stream == i] for i in range(1, 9)}
    for i, got in by_stream.items():
        assert [t for c in got for t in c.token_ids] and sum(len(c.token_ids) for c in got) == 24
        assert [c.index for c in got] == sorted(c.index for c in got)
        assert got[-1].finish_reason == pb.LENGTH and got[-1].HasField("timeline")
    assert sorted(n for r in responses for n in r.ended) == list(range(1, 9))
    # 8 streams decoding together: a step's tokens for all of them in one response, not 8.
    assert len(responses) <= len(chunks) / 3, (len(responses), len(chunks))


def test_a_stream_that_fails_fails_alone_with_its_generate_status(sim_server):
    messages = [one(stream=1, generate=generate(8)),
                one(stream=2, generate=generate(8, temperature=5.0)),
                one(stream=3, generate=generate(8))]
    responses, code, _ = run(raw_call(sim_server.address, messages))
    assert code == grpc.StatusCode.OK
    (error,) = [e for r in responses for e in r.errors]
    assert error.stream == 2 and error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in error.message
    assert sorted(n for r in responses for n in r.ended) == [1, 3]
    assert not [c for r in responses for c in r.chunks if c.stream == 2]


@pytest.mark.parametrize("messages, says", [
    ([one(stream=4, generate=generate(200)), one(stream=4, generate=generate(2))],
     "already open"),
    ([one(stream=4)], "sets generate or leave"),
    ([one(stream=4, generate=generate(2), leave=True)], "not both"),
])
def test_a_caller_that_breaks_the_protocol_gets_invalid_argument_for_the_call(sim_server, messages, says):
    _, code, details = run(raw_call(sim_server.address, messages))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details


def test_a_stream_error_becomes_the_client_error_a_generate_call_would_raise():
    err = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "queue full", 1500)
    assert isinstance(err, Overloaded) and err.retry_after_s == 1.5 and err.details == "queue full"
    assert error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "x", 0).retry_after_s is None


def test_a_call_with_no_streams_ends_ok_once_the_caller_half_closes(sim_server):
    assert run(raw_call(sim_server.address, [])) == ([], grpc.StatusCode.OK, "")


def test_one_message_may_start_many_streams_and_leave_one_and_an_empty_one_does_nothing(sim_server):
    actions = [pb.StreamRequest(stream=i, generate=generate(6)) for i in range(1, 7)]
    long = pb.StreamRequest(stream=7, generate=pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), request_id="left-at-once",
                                                                  sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True)))
    messages = [pb.GenerateManyRequest(streams=actions + [long, pb.StreamRequest(stream=7, leave=True)]),
                pb.GenerateManyRequest()]
    responses, code, _ = run(raw_call(sim_server.address, messages))
    assert code == grpc.StatusCode.OK
    assert sorted(n for r in responses for n in r.ended) == [1, 2, 3, 4, 5, 6]  # 7 was left: no end for it
    for i in range(1, 7):
        assert sum(len(c.chunk.token_ids) for r in responses for c in r.chunks if c.stream == i) == 6
    assert not [e for r in responses for e in r.errors]


def test_a_response_over_the_size_limit_goes_as_several_in_order_with_the_ends_last():
    from tokenline.server.servicer import _Outbox

    box = _Outbox()
    for i in range(10):
        box.chunk(i % 3).MergeFrom(pb.GenerateChunk(index=i // 3, text="x" * 100))
    box.response.ended.append(2)
    box.response.errors.add(stream=1, code=8, message="m")
    parts = box.take(max_bytes=450)
    assert len(parts) > 1 and all(p.ByteSize() <= 450 for p in parts)
    assert [(c.stream, c.chunk.index) for p in parts for c in p.chunks] == [(i % 3, i // 3) for i in range(10)]
    assert not any(p.ended or p.errors for p in parts[:-1]) and list(parts[-1].ended) == [2] and len(parts[-1].errors) == 1
    assert box.empty()
    box.chunk(1).text = "y" * 1000  # larger than the limit alone
    box.chunk(2).text = "z"
    assert [len(p.chunks) for p in box.take(max_bytes=450)] == [1, 1]
    box.chunk(1).text = "small"
    assert [len(p.chunks) for p in box.take(max_bytes=450)] == [1]


def test_the_client_sends_what_was_queued_during_a_write_in_one_message_under_the_size_limit(monkeypatch):
    from tokenline.client import _multiplex

    class Recorder:  # the call's write side: each write is a message on the wire
        def __init__(self):
            self.messages = []

        async def write(self, message):
            self.messages.append([a.stream for a in message.streams])
            await asyncio.sleep(0.01)  # a write on its way, while more is queued

    async def scenario(limit):
        monkeypatch.setattr(_multiplex, "MAX_REQUEST_BYTES", limit)
        call, queue = Recorder(), asyncio.Queue()
        writer = asyncio.create_task(_multiplex.Multiplex._write(call, queue))
        for i in range(1, 6):
            queue.put_nowait(pb.StreamRequest(stream=i, generate=generate(8)))
        await asyncio.sleep(0.005)  # the first write is on its way: these wait for the next
        for i in range(6, 9):
            queue.put_nowait(pb.StreamRequest(stream=i, leave=True))
        await asyncio.sleep(0.1)
        writer.cancel()
        return call.messages

    assert run(scenario(1 << 20)) == [[1, 2, 3, 4, 5], [6, 7, 8]]
    two = 2 * pb.StreamRequest(stream=1, generate=generate(8)).ByteSize()
    assert run(scenario(two)) == [[1, 2], [3, 4], [5, 6, 7, 8]]  # leaves are small: three fit beside a start


def test_leaving_a_stream_stops_its_run_and_the_others_go_on(sim_server):
    async def scenario():
        async with AsyncClient(sim_server.address) as client, client.multiplex() as streams:
            left = streams.generate(token_ids=[1, 2, 3], max_tokens=2000, ignore_eos=True, request_id="to-leave")
            kept = streams.generate(token_ids=[1, 2, 3], max_tokens=40, ignore_eos=True)
            first = await left.__anext__()
            left.cancel()
            rest = await collect(left)
            kept_deltas = await collect(kept)
            # The run is gone from the server: cancelling it by id finds nothing.
            for _ in range(100):
                if not await client.cancel("to-leave"):
                    break
                await asyncio.sleep(0.05)
            return first, rest, kept_deltas, await client.cancel("to-leave")

    first, rest, kept, still_running = run(scenario())
    assert first.index == 0 and rest == []
    assert len(tokens_of(kept)) == 40 and contiguous(kept) and kept[-1].finish_reason == "length"
    assert still_running is False


def test_a_stream_s_deadline_bounds_it_alone(sim_server):
    async def scenario():
        async with AsyncClient(sim_server.address) as client, client.multiplex() as streams:
            bounded = streams.generate(token_ids=[1, 2], max_tokens=2000, ignore_eos=True, timeout=0.5)
            free = streams.generate(token_ids=[1, 2], max_tokens=30, ignore_eos=True)
            with pytest.raises(DeadlineExceeded):
                await collect(bounded)
            return await collect(free)

    free = run(scenario())
    assert len(tokens_of(free)) == 30 and contiguous(free)


@pytest.fixture(scope="module")
def one_slot_server():
    """One sequence at a time and one queued per class: the third stream at once is refused."""
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--max-seqs", "1", "--interactive-slots", "0",
                           "--queue-requests", "1").start()
    yield server
    server.stop()


def test_a_refused_stream_gets_resource_exhausted_with_its_retry_hint(one_slot_server):
    async def scenario():
        async with AsyncClient(one_slot_server.address) as client, client.multiplex() as streams:
            started = [streams.generate(token_ids=[1, 2], max_tokens=60, ignore_eos=True) for _ in range(4)]
            outcomes = []
            for s in started:
                try:
                    outcomes.append(tokens_of(await collect(s)))
                except Overloaded as err:
                    outcomes.append(err)
            return outcomes

    outcomes = run(scenario())
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    served = [o for o in outcomes if not isinstance(o, Overloaded)]
    assert refused and all(e.retry_after_s is not None and e.retry_after_s > 0 for e in refused), outcomes
    assert served and all(len(tokens) == 60 for tokens in served)


# ------------------------------------------------------------------ the real engine

pytest_engine = pytest.mark.engine


@pytest_engine
def test_streams_on_one_call_are_greedy_generate_streams_on_the_real_engine(tiny_server):
    async def scenario():
        async with AsyncClient(tiny_server.address) as client, client.multiplex() as streams:
            started = [streams.generate(token_ids=[5 + i, 6, 7, 8], max_tokens=20 + 4 * i, temperature=0,
                                        ignore_eos=True, logprobs=2) for i in range(6)]
            return await asyncio.gather(*(collect(s) for s in started))

    for i, deltas in enumerate(run(scenario())):
        assert contiguous(deltas) and len(tokens_of(deltas)) == 20 + 4 * i
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 20 + 4 * i
        positions = [p for d in deltas for p in d.logprobs]
        assert [p.token.token_id for p in positions] == tokens_of(deltas)
        assert all(is_a_greedy_pick(p) for p in positions)


@pytest_engine
def test_a_keyed_stream_left_mid_run_resumes_on_another_call_without_a_token_lost_or_repeated(tiny_server):
    options = dict(token_ids=[9, 8, 7, 6], max_tokens=160, temperature=0, ignore_eos=True, idempotency_key="many-key")

    async def scenario():
        async with AsyncClient(tiny_server.address) as client:
            async with client.multiplex() as streams:
                stream = streams.generate(**options)
                got = []
                async for d in stream:
                    got.append(d)
                    if len(tokens_of(got)) >= 10:
                        break
            # The call is gone; the keyed run went on. Another call follows it from the next index.
            async with client.multiplex() as streams:
                rest = await collect(streams.generate(**options, resume_from_index=len(tokens_of(got)),
                                                      request_id=got[0].request_id))
            whole = await client.complete(**options)
        return got, rest, whole

    got, rest, whole = run(scenario())
    assert rest[0].index == len(tokens_of(got))
    assert tokens_of(got) + tokens_of(rest) == list(whole.token_ids) and len(whole.token_ids) == 160

    async def replayed():  # the run has ended: the key's stored result comes back as chunks, from any index
        async with AsyncClient(tiny_server.address) as client, client.multiplex() as streams:
            return await collect(streams.generate(**options, resume_from_index=100, request_id=whole.request_id))

    tail = run(replayed())
    assert tail[0].index == 100 and tokens_of(tail) == list(whole.token_ids)[100:]
    assert tail[-1].finish_reason == "length"


class _CuttableProxy:
    """A TCP forwarder whose connections can be cut: the client's call then breaks with UNAVAILABLE."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src, dst):
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self):
        for w in self.writers:
            w.transport.abort()
        self.writers = []


@pytest_engine
def test_a_keyed_stream_re_attaches_by_itself_when_the_call_breaks(tiny_server):
    options = dict(token_ids=[3, 4, 5, 6], max_tokens=160, temperature=0, ignore_eos=True)

    async def scenario():
        proxy = _CuttableProxy(int(tiny_server.address.rsplit(":", 1)[1]))
        port = await proxy.start()
        async with AsyncClient(f"127.0.0.1:{port}") as client, client.multiplex() as streams:
            keyed = streams.generate(**options, idempotency_key="many-reattach")
            unkeyed = streams.generate(**options)
            got, cut = [], False
            async for d in keyed:
                got.append(d)
                if not cut and len(tokens_of(got)) >= 8:
                    proxy.cut()  # mid-stream: both streams' call breaks
                    cut = True
            with pytest.raises(Unavailable) as unkeyed_error:
                await collect(unkeyed)
            whole = await client.complete(**options, idempotency_key="many-reattach")
        proxy.server.close()
        return got, keyed.reattached, unkeyed_error.value, whole

    got, reattached, unkeyed_error, whole = run(scenario())
    assert reattached >= 1
    assert contiguous(got) and tokens_of(got) == list(whole.token_ids) and len(whole.token_ids) == 160


@pytest.fixture(scope="module")
def trained_server():
    s = ServerProcess("--model", "tiny-trained", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024",
                      "--log-level", "WARNING").start()
    yield s
    s.stop()


@pytest_engine
def test_streams_on_one_call_go_on_whole_and_greedy_across_a_worker_sigkill(trained_server, judge):
    import os
    import signal

    from tests.test_failures import PROMPTS, TOKENS, assert_whole_and_greedy, worker_pids

    prompts = [judge.encode(p) for p in PROMPTS[:8]]

    async def scenario():
        async with AsyncClient(trained_server.address) as client, client.multiplex() as streams:
            started = [streams.generate(token_ids=p, max_tokens=TOKENS, temperature=0, ignore_eos=True) for p in prompts]
            results = [[] for _ in started]
            killed = False

            async def read(i, stream):
                nonlocal killed
                async for d in stream:
                    results[i].append(d)
                    if not killed and len(tokens_of(results[i])) >= 20:
                        killed = True
                        for pid in worker_pids(trained_server):
                            os.kill(pid, signal.SIGKILL)

            await asyncio.gather(*(read(i, s) for i, s in enumerate(started)))
            return results, killed

    results, killed = run(scenario())
    assert killed
    for prompt_ids, deltas in zip(prompts, results):
        assert_whole_and_greedy(judge, prompt_ids, deltas)
    assert any(deltas[-1].attempt > 1 for deltas in results)  # the kill interrupted runs, which went on

"""The load generator against stand-in targets: schedules kept, loops closed, falling behind caught,
and the two wire formats (tokenline gRPC, OpenAI server-sent events) read into the same records."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from tokenline.bench.loopback import LoopbackServicer
from tokenline.bench.records import OK, REFUSED, UNFINISHED, RequestRecord
from tokenline.bench.runner import LoadGeneratorBehind, RunOptions, run_load
from tokenline.bench.targets import OpenAITarget, TokenlineTarget
from tokenline.bench.workload import PlannedRequest, RequestFactory, parse_stream
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc


def request(i=0, at=0.0, cls="interactive", max_tokens=4, ids=(5, 6, 7)):
    return PlannedRequest(f"r{i}", "chat", cls, at, tuple(ids), None, max_tokens, True, None, None)


class FakeTarget:
    """Streams `tokens` one-token chunks `gap_s` apart; `block_s` hogs the event loop per request."""

    name, address = "fake", "fake"

    def __init__(self, tokens=3, gap_s=0.001, block_s=0.0, forever=False):
        self.tokens, self.gap_s, self.block_s, self.forever = tokens, gap_s, block_s, forever
        self.in_flight = self.peak = self.calls = 0

    async def open(self):
        pass

    async def close(self):
        pass

    async def send(self, planned, record, t0):
        record.sent = time.monotonic() - t0
        self.calls += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.block_s:
                time.sleep(self.block_s)  # a load generator too slow for its schedule
            if self.forever:
                await asyncio.Event().wait()
            for _ in range(self.tokens):
                await asyncio.sleep(self.gap_s)
                record.chunk_times.append(time.monotonic() - t0)
                record.chunk_tokens.append(1)
            record.status = OK
        finally:
            self.in_flight -= 1


def test_every_planned_request_is_sent_once_and_timed_from_its_schedule():
    plan = [request(i, at=i * 0.005) for i in range(40)]
    target = FakeTarget()
    result = asyncio.run(run_load(target, plan))
    assert target.calls == 40
    assert [r.scheduled for r in result.records] == [p.at for p in plan]
    assert all(r.status == OK and r.output_tokens == 3 for r in result.records)
    assert all(r.ttft >= r.send_lag for r in result.records)
    assert result.loadgen["cpu_s"] > 0 and result.stopped is None


class Tok:
    all_special_ids = [0]

    def __len__(self):
        return 50

    def decode(self, ids):
        return ""


def test_a_closed_loop_keeps_at_most_its_concurrency_in_flight_until_its_count():
    from tokenline.bench.prompts import SyntheticPrompts

    stream = parse_stream("name=c,concurrency=3,input=4,output=2")
    factory = RequestFactory(stream, 0, 0, SyntheticPrompts(Tok()))
    target = FakeTarget(gap_s=0.002)
    result = asyncio.run(run_load(target, [], [factory], RunOptions(num_requests=20)))
    assert len(result.records) == 20 and target.peak == 3
    assert sorted(r.request_id for r in result.records) == sorted(f"c-{i}" for i in range(20))


def test_a_load_generator_that_falls_behind_its_schedule_stops_with_a_clear_message():
    plan = [request(i, at=i * 0.01) for i in range(400)]
    with pytest.raises(LoadGeneratorBehind, match="fell behind"):
        asyncio.run(run_load(FakeTarget(block_s=0.03), plan, options=RunOptions(max_lag_ms=50)))


def test_requests_still_running_after_the_drain_period_are_recorded_as_unfinished():
    result = asyncio.run(run_load(FakeTarget(forever=True), [request(0), request(1, at=0.01)],
                                  options=RunOptions(drain_s=0.2)))
    assert [r.status for r in result.records] == [UNFINISHED, UNFINISHED]
    assert "still running" in result.stopped
    assert all(r.end is not None for r in result.records)


def test_an_early_stop_check_ends_the_run_with_its_reason():
    plan = [request(i, at=i * 0.05) for i in range(100)]
    options = RunOptions(stop_check=lambda state: "enough" if state.finished >= 3 else None)
    result = asyncio.run(run_load(FakeTarget(), plan, options=options))
    assert result.stopped == "enough" and len(result.records) < 100


def test_the_tokenline_target_records_chunks_and_the_servers_timeline():
    async def scenario():
        server = grpc.aio.server()
        pb_grpc.add_TokenlineServicer_to_server(LoopbackServicer(tokens_per_chunk=3), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        target = TokenlineTarget(f"127.0.0.1:{port}")
        await target.open()
        record = RequestRecord("r", "chat", "interactive", 0.0, 3, 7)
        await target.send(request(max_tokens=7), record, time.monotonic())
        await target.close()
        await server.stop(None)
        return record

    record = asyncio.run(scenario())
    assert record.status == OK and record.finish_reason == "length"
    assert record.chunk_tokens == [3, 3, 1] and record.output_tokens == 7
    assert record.prompt_tokens == 3 and record.server["completion_ms"] >= 0


async def models(_request):
    from aiohttp import web

    return web.json_response({"data": [{"id": "m", "root": "/nowhere"}]})


async def too_many(_request):
    from aiohttp import web

    return web.Response(status=429, headers={"Retry-After": "2"})


async def sse_server(handler):
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_the_openai_target_counts_tokens_per_event_and_sends_the_same_request():
    from aiohttp import web

    seen = {}

    async def completions(http_request):
        seen.update(await http_request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(http_request)
        events = [{"choices": [{"text": "ab", "token_ids": [1, 2]}]}, {"choices": [{"text": "c", "token_ids": [3]}]},
                  {"choices": [{"text": "", "token_ids": [], "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}]
        for event in events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def scenario():
        runner, address = await sse_server(completions)
        target = OpenAITarget(address, send_priority=True)
        await target.open()
        record = RequestRecord("r", "chat", "bulk", 0.0, 3, 3)
        await target.send(request(cls="bulk", max_tokens=3), record, time.monotonic())
        await target.close()
        await runner.cleanup()
        return record

    record = asyncio.run(scenario())
    assert record.status == OK and record.chunk_tokens == [2, 1] and record.finish_reason == "length"
    assert record.prompt_tokens == 3
    assert seen["prompt"] == [5, 6, 7] and seen["max_tokens"] == 3 and seen["ignore_eos"] is True
    assert seen["stream"] is True and seen["priority"] == 1 and seen["model"] == "m"


def test_the_openai_target_records_429_as_a_refusal_with_its_retry_hint():
    async def scenario():
        runner, address = await sse_server(too_many)
        target = OpenAITarget(address)
        await target.open()
        record = RequestRecord("r", "chat", "interactive", 0.0, 3, 3)
        await target.send(request(), record, time.monotonic())
        await target.close()
        await runner.cleanup()
        return record

    record = asyncio.run(scenario())
    assert record.status == REFUSED and record.retry_after_s == 2.0 and record.end is not None


def test_only_the_engine_subprocess_modules_of_the_bench_import_vllm():
    import subprocess
    import sys

    modules = ["arrivals", "capacity", "cli", "commands", "compare", "loadgen", "loopback", "plots", "progress",
               "prompts", "records", "report", "runner", "servers", "session", "simulate", "stats", "targets",
               "workload"]
    code = "; ".join(f"import tokenline.bench.{m}" for m in modules) + "; import sys; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_servers_cpu_per_output_token_is_its_own_cpu_time_over_the_run_divided_by_the_tokens():
    import subprocess
    import sys

    from tokenline.bench.server_cpu import ServerCpu

    # A stand-in server: burns 0.3 s of CPU once told to, then idles (its idle time must not count).
    code = ("import sys, time; sys.stdin.readline(); t = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint('done', flush=True); time.sleep(30)")
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # its start-up (interpreter, imports) is before the window
        cpu = ServerCpu.start(server.pid)
        server.stdin.write("go\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "done"
        time.sleep(0.3)
        result = cpu.result(output_tokens=1000)
    finally:
        server.kill()
        server.wait()
    assert 0.25 <= result["cpu_s"] <= 0.6
    assert result["us_per_output_token"] == pytest.approx(result["cpu_s"] * 1e6 / 1000, rel=0.02)
    assert ServerCpu.start(server.pid).result(1000) is None  # the process is gone: no figure, not a wrong one

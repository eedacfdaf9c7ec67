"""The frontend's own per-token path, in one process and without gRPC, for before/after comparisons of it.

    python -m tokenline.bench.frontend_path [--streams 256] [--reports 200] [--tokens 128]

Step reports go through `Runtime._step_reported` (its scheduler replaced by one that hands back a
one-token delivery per stream), the mailboxes, `Runtime.events` and `responses.chunk_pb`, with one
reader task per stream taking its chunk before the next report. Prints CPU µs per token: a figure that
a busy machine disturbs far less than a served run's (docs/performance.md, issue 38).

Then a request's end in telemetry (`Telemetry.on_request_done`, metrics read by a Prometheus reader as
`--metrics-port` serves them, no tracing) for requests of `--tokens` tokens, as CPU µs per token.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.scheduler.records import Delivery, StepResult
from tokenline.engine.types import Sampling, StepReport, TrafficClass
from tokenline.server import responses
from tokenline.server.request import RequestKey, RequestState
from tokenline.server.runtime import Runtime
from tokenline.server.timeline import Timeline


class _OneTokenEach:
    """The scheduler's part, fixed: every stream gets one token per report."""

    def __init__(self, states: list[RequestState]):
        self.states = states

    def on_step(self, report: StepReport) -> StepResult:
        return StepResult(report=report, deliveries=[Delivery(st.key, [7], "x") for st in self.states])

    def next_wakeup(self) -> None:
        return None


async def measure(streams: int, reports: int) -> tuple[float, int]:
    """(CPU µs per token, tokens read) over `reports` step reports to `streams` streams."""
    runtime = Runtime(SchedulerConfig(), {})
    states = []
    for i in range(streams):
        st = RequestState(RequestKey("bench", f"r{i}"), "m", TrafficClass.INTERACTIVE, [1, 2, 3],
                          Sampling(max_tokens=10**9), Timeline(received=0.0, validated=0.0), None)
        runtime.requests[st.key] = st
        states.append(st)
    runtime.scheduler = _OneTokenEach(states)  # type: ignore[assignment]
    tokens = 0

    async def read(st: RequestState, mailbox: asyncio.Queue) -> None:
        nonlocal tokens
        async for chunk in runtime.events(st, mailbox):
            responses.chunk_pb(st, chunk)
            tokens += len(chunk.token_ids)

    readers = [asyncio.create_task(read(st, st.subscribe())) for st in states]
    await asyncio.sleep(0)
    report = StepReport(0, 0, 0.005, streams, 0, 100, streams, 0)
    cpu = await _timed(runtime, reports, lambda: report, readers)
    return (cpu * 1e6 / tokens if tokens else float("nan")), tokens


async def _timed(runtime: Runtime, reports: int, report: Callable[[], StepReport], readers: list[asyncio.Task],
                 after: Callable[[], None] = lambda: None) -> float:
    """CPU seconds of `reports` step reports through the runtime, each read by the readers before the next;
    then the readers are stopped."""
    cpu0 = time.process_time()
    for _ in range(reports):
        runtime._step_reported(report())
        after()
        await asyncio.sleep(0)  # each reader wakes and takes its chunk
        await asyncio.sleep(0)
    cpu = time.process_time() - cpu0
    for task in readers:
        task.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    return cpu


async def measure_scheduled(streams: int, reports: int, *, direct: bool) -> tuple[float, int]:
    """(CPU µs per token, tokens read) as `measure`, with the real scheduler: `streams` requests submitted
    through `Runtime.submit` onto one worker (what it would be sent is dropped), then `reports` step reports
    of a token for each, through `Scheduler.on_step` and its dispatch. `direct`: the chunks go straight
    into a GenerateMany-like outbox (Runtime.events' `direct`), else one reader task per stream."""
    from tokenline.engine import types as wire
    from tokenline.engine.types import SeqOutput, WorkerSpec

    runtime = Runtime(SchedulerConfig(), {})
    sent: list = []
    runtime._send = lambda wid, msg: sent.append(msg)  # type: ignore[method-assign]
    runtime._arm_timer = lambda: None  # type: ignore[method-assign]  no timers: every decision comes with a report
    runtime._handle(runtime.scheduler.add_worker(WorkerSpec(
        worker_id=0, model="m", model_version="", kv_blocks_total=1 << 20, block_size=16, engine_seqs=streams,
        max_model_len=1 << 20, prefill_token_budget=1 << 20, vocab_size=1000, eos_token_id=None)))
    states = []
    for i in range(streams):
        st = RequestState(RequestKey("bench", f"r{i}"), "m", TrafficClass.BULK, [1, 2, 3],
                          Sampling(max_tokens=reports + 8), Timeline(received=0.0, validated=0.0), None)
        states.append(st)
    tokens = 0
    box: list = []

    async def read(st: RequestState, mailbox: asyncio.Queue) -> None:
        nonlocal tokens
        async for chunk in runtime.events(st, mailbox):
            responses.chunk_pb(st, chunk)
            tokens += len(chunk.token_ids)

    def hand(st: RequestState):  # noqa: ANN202
        def take(chunk) -> None:  # noqa: ANN001
            nonlocal tokens
            box.append(responses.chunk_pb(st, chunk))
            tokens += len(chunk.token_ids)
        return take

    readers = []
    for st in states:
        mailbox = st.subscribe()
        runtime.submit(st)
        readers.append(asyncio.create_task(
            _drain(runtime.events(st, mailbox, 0, hand(st))) if direct else read(st, mailbox)))
    running: list[str] = []
    seq = 0
    for _ in range(100):  # admit them all: reports of steps with nothing to say yet
        for msg in sent:
            if isinstance(msg, wire.Admit):
                running += [item.key for item in msg.items]
                seq = max(seq, msg.seq)
        sent.clear()
        if len(running) == streams:
            break
        runtime._step_reported(StepReport(0, seq, 0.005, len(running), 0, 1 << 19, len(running), 0))
    assert len(running) == streams, f"{len(running)} of {streams} admitted"
    runtime._step_reported(StepReport(0, seq, 0.005, streams, 3 * streams, 1 << 19, streams, 0, first_scheduled=running))
    await asyncio.sleep(0)

    def sent_on() -> None:  # the worker's messages and one response's chunks, sent
        sent.clear()
        box.clear()

    cpu = await _timed(runtime, reports, lambda: StepReport(0, seq, 0.005, streams, 0, 1 << 19, streams, 0, outputs=[
        SeqOutput(key, [7], "x") for key in running]), readers, sent_on)
    return (cpu * 1e6 / tokens if tokens else float("nan")), tokens


async def _drain(chunks) -> None:  # noqa: ANN001
    async for _ in chunks:
        pass


def measure_request_end(tokens: int, requests: int = 500) -> float:
    """CPU µs per token of telemetry's bill at the end of `requests` requests of `tokens` tokens each."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    from tokenline.server.telemetry import Telemetry, TelemetryConfig

    telemetry = Telemetry(TelemetryConfig(), metric_readers=[
        PrometheusMetricReader(registry=CollectorRegistry(), scope_info_enabled=False)])
    telemetry._log = lambda record: None  # the request log line is not what is measured  # type: ignore[method-assign]
    states = []
    for i in range(requests):
        st = RequestState(RequestKey("bench", f"e{i}"), "m", TrafficClass.BULK, [1, 2, 3],
                          Sampling(max_tokens=tokens), Timeline(received=0.0, validated=0.0), None)
        st.timeline.enqueued = st.timeline.admitted = 0.0
        for t in range(tokens):
            st.timeline.on_tokens(0.1 + 0.004 * t + 0.0001 * (t % 7), 1)
        st.token_ids.extend([7] * tokens)
        st.timeline.finished = st.timeline.last_byte = 0.1 + 0.004 * tokens
        states.append(st)
    cpu0 = time.process_time()
    for st in states:
        telemetry.on_request_done(st, "finished")
    return (time.process_time() - cpu0) * 1e6 / (requests * tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenline.bench.frontend_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--reports", type=int, default=200)
    p.add_argument("--tokens", type=int, default=128, help="tokens of each request whose end telemetry records")
    p.add_argument("--scheduled", action="store_true",
                   help="the real scheduler's on_step and dispatch too (bulk requests on one worker), with a reader "
                        "task per stream and with chunks handed straight to a GenerateMany-like outbox")
    args = p.parse_args(argv)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    if args.scheduled:
        for direct in (False, True):
            us, tokens = run(measure_scheduled(args.streams, args.reports, direct=direct))
            print(f"{us:.2f} µs of CPU per token with the scheduler, {'handed straight on' if direct else 'a reader task per stream'} "
                  f"({tokens} tokens, {args.streams} streams, {args.reports} reports)")
        return 0
    us, tokens = run(measure(args.streams, args.reports))
    print(f"{us:.2f} µs of CPU per token ({tokens} tokens, {args.streams} streams, {args.reports} reports)")
    print(f"{measure_request_end(args.tokens):.2f} µs of CPU per token at a request's end in telemetry "
          f"({args.tokens}-token requests)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

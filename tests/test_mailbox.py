"""A request's mailboxes (server/request.py) and the stream of chunks read from one (Runtime.events):
chunks are shared by every caller following a run, so coalescing in one caller's stream never
changes what another caller reads."""

from __future__ import annotations

import asyncio

from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.types import Sampling, TrafficClass
from tokenline.server.request import _END, Chunk, RequestKey, RequestState
from tokenline.server.runtime import Runtime
from tokenline.server.timeline import Timeline


def _state() -> RequestState:
    return RequestState(RequestKey("t", "r"), "m", TrafficClass.INTERACTIVE, [1, 2, 3], Sampling(max_tokens=8),
                        Timeline(received=0.0, validated=0.0), None)


async def _read(runtime: Runtime, state: RequestState, mailbox: asyncio.Queue, from_index: int = 0) -> list[tuple]:
    async def chunks() -> list[tuple]:
        return [(c.index, list(c.token_ids), c.text) async for c in runtime.events(state, mailbox, from_index)]

    return await asyncio.wait_for(chunks(), 5.0)  # a mailbox that never wakes its reader fails, not hangs


def test_a_caller_that_fell_behind_gets_one_coalesced_chunk_and_the_other_callers_chunks_are_untouched():
    async def scenario():
        runtime = Runtime(SchedulerConfig(), {})
        state = _state()
        first, second = state.subscribe(), state.subscribe()
        state.emit(Chunk(0, [7], "a", 1))
        state.emit(Chunk(1, [8, 9], "bc", 1))
        state.emit(_END)
        return await _read(runtime, state, first), await _read(runtime, state, second)

    first, second = asyncio.run(scenario())
    assert first == [(0, [7, 8, 9], "abc")]
    assert second == [(0, [7, 8, 9], "abc")]


def test_a_chunk_read_as_it_comes_is_one_steps_tokens():
    async def scenario():
        runtime = Runtime(SchedulerConfig(), {})
        state = _state()
        mailbox = state.subscribe()
        seen = []

        async def read():
            async for c in runtime.events(state, mailbox):
                seen.append((c.index, list(c.token_ids), c.text))

        reader = asyncio.create_task(read())
        for i, tok in enumerate((7, 8, 9)):
            state.emit(Chunk(i, [tok], "x", 1))
            await asyncio.sleep(0)  # the reader takes each step's chunk before the next
            await asyncio.sleep(0)
        state.emit(_END)
        await asyncio.wait_for(reader, 5.0)
        return seen

    assert asyncio.run(scenario()) == [(0, [7], "x"), (1, [8], "x"), (2, [9], "x")]


def test_the_frontend_path_bench_reads_every_token_of_every_report_once():
    from tokenline.bench.frontend_path import measure

    us, tokens = asyncio.run(measure(streams=4, reports=3))
    assert tokens == 12 and us > 0


def test_a_mailbox_wakes_its_waiting_reader_on_each_put_in_order_and_a_cancelled_read_loses_nothing():
    from tokenline.server.request import Mailbox

    async def scenario():
        mailbox = Mailbox()
        waiting = asyncio.create_task(mailbox.get())
        await asyncio.sleep(0)
        waiting.cancel()  # a caller that left while waiting
        await asyncio.gather(waiting, return_exceptions=True)
        reader = asyncio.create_task(mailbox.get())
        await asyncio.sleep(0)
        mailbox.put_nowait("a")
        mailbox.put_nowait("b")
        first = await asyncio.wait_for(reader, 1.0)
        return first, await asyncio.wait_for(mailbox.get(), 1.0), mailbox.empty()

    assert asyncio.run(scenario()) == ("a", "b", True)

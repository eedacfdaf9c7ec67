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


def test_a_direct_reader_gets_the_queued_chunks_first_then_each_later_one_as_it_is_emitted_and_the_end_as_before():
    """GenerateMany's path (issue 38): what was queued before the reader came is read from the mailbox;
    every later chunk is handed over inside `emit` itself, in order, trimmed to the resume index."""
    async def scenario():
        runtime = Runtime(SchedulerConfig(), {})
        state = _state()
        state.token_ids, state.text = [5, 6, 7], ["a", "b", "c"]
        mailbox = state.subscribe(from_index=1)  # an attach that resumes at 1: [6, 7] are queued
        handed: list[tuple] = []
        read: list[tuple] = []

        async def follow():
            async for c in runtime.events(state, mailbox, 1, lambda c: handed.append((c.index, list(c.token_ids)))):
                read.append((c.index, list(c.token_ids)))

        reader = asyncio.create_task(follow())
        await asyncio.sleep(0)
        state.emit(Chunk(3, [8], "d", 1))
        state.emit(Chunk(4, [9], "e", 1))
        during_emit = list(handed)  # before the reader's task has run again
        state.emit(_END)
        await asyncio.wait_for(reader, 5.0)
        return read, during_emit, handed, mailbox.direct

    read, during_emit, handed, left = asyncio.run(scenario())
    assert read == [(1, [6, 7])]
    assert during_emit == [(3, [8]), (4, [9])] == handed
    assert left is None  # a reader that has ended takes nothing more


def test_a_direct_reader_resumed_past_a_chunks_start_gets_only_the_tokens_it_lacks():
    async def scenario():
        runtime = Runtime(SchedulerConfig(), {})
        state = _state()
        mailbox = state.subscribe()
        handed: list[tuple] = []

        async def follow():
            async for _ in runtime.events(state, mailbox, 2, lambda c: handed.append((c.index, list(c.token_ids), c.text))):
                pass

        reader = asyncio.create_task(follow())
        await asyncio.sleep(0)
        for i, (ids, text) in enumerate((([7], "a"), ([8, 9], "bc"), ([10], "d"))):
            index = len(state.token_ids)
            state.token_ids.extend(ids)
            state.text.extend([""] * (len(ids) - 1) + [text])
            state.emit(Chunk(index, ids, text, 1))
        state.emit(_END)
        await asyncio.wait_for(reader, 5.0)
        return handed

    assert asyncio.run(scenario()) == [(2, [9], "bc"), (3, [10], "d")]  # a step's text comes with its last token


def test_a_direct_reader_that_fails_on_a_chunk_gets_it_the_ordinary_way_and_nothing_is_lost():
    async def scenario():
        runtime = Runtime(SchedulerConfig(), {})
        state = _state()
        mailbox = state.subscribe()
        handed: list[int] = []
        read: list[int] = []

        def direct(c: Chunk) -> None:
            if c.index == 1:
                raise RuntimeError("a fault in the reader's hand-off")
            handed.append(c.index)

        async def follow():
            async for c in runtime.events(state, mailbox, 0, direct):
                read.append(c.index)

        reader = asyncio.create_task(follow())
        await asyncio.sleep(0)
        state.emit(Chunk(0, [7], "a", 1))
        state.emit(Chunk(1, [8], "b", 1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        state.emit(Chunk(2, [9], "c", 1))
        state.emit(_END)
        await asyncio.wait_for(reader, 5.0)
        return handed, read

    handed, read = asyncio.run(scenario())
    assert sorted(handed + read) == [0, 1, 2] and 1 in read


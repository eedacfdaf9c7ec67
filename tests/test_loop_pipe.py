"""A worker's pipe served on the event loop (engine/loop_pipe.py): what a plain `Connection` on the other end
sends arrives whole and in order, what the loop sends arrives whole and in order even when the other end reads
nothing for a while (the loop never blocks on it), the other end's close is told once after its last message,
and one unreadable message costs only itself."""

import asyncio
import multiprocessing
import os
import threading
import time

from tokenline.engine.loop_pipe import LoopPipe, frame

SIZES = [0, 1, 3, 4, 5, 100, 16_383, 16_384, 16_385, 70_000, 300_000, 1_500_000]  # around the read and framing edges


def payload(i: int, n: int) -> tuple[int, bytes]:
    return i, bytes((i + k) % 251 for k in range(n))


async def _served(conn, **kw):
    got: list[object] = []
    eof = asyncio.Event()
    eofs: list[float] = []
    loop = asyncio.get_running_loop()

    def on_eof() -> None:
        eofs.append(time.monotonic())
        eof.set()
    pipe = LoopPipe(conn, loop, got.append, on_eof, **kw)
    pipe.start()
    return pipe, got, eof, eofs


def test_messages_from_the_other_end_arrive_whole_in_order_and_its_close_after_the_last():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    sent = [payload(i, n) for i, n in enumerate(SIZES * 3)]

    def other_end() -> None:
        for m in sent:
            theirs.send(m)
        theirs.close()

    async def main():
        pipe, got, eof, eofs = await _served(ours)
        threading.Thread(target=other_end).start()
        await asyncio.wait_for(eof.wait(), 30)
        await asyncio.sleep(0.05)
        return got, eofs, pipe.open

    got, eofs, still_open = asyncio.run(main())
    assert got == sent
    assert len(eofs) == 1 and not still_open


def test_what_the_loop_sends_waits_for_a_busy_reader_without_blocking_the_loop_and_arrives_in_order():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    sent = [payload(i, n) for i, n in enumerate(SIZES * 2)]  # ~3.8 MB: far past what the socket holds
    received: list[object] = []
    reading = threading.Event()

    def other_end() -> None:
        reading.wait()
        for _ in sent:
            received.append(theirs.recv())

    async def main():
        pipe, *_ = await _served(ours)
        t = threading.Thread(target=other_end)
        t.start()
        start = time.monotonic()
        for m in sent:
            pipe.send(m)  # nobody reads yet: a blocking write would hang here
        queued_s = time.monotonic() - start
        reading.set()
        while t.is_alive():
            await asyncio.sleep(0.01)  # the loop writes the rest as the socket drains
        return queued_s

    queued_s = asyncio.run(main())
    assert received == sent
    assert queued_s < 10  # it returned while nothing was read (a blocked send never returns: the reader waits)


def test_a_send_from_another_thread_reaches_the_other_end():
    ours, theirs = multiprocessing.Pipe(duplex=True)

    async def main():
        pipe, *_ = await _served(ours)
        await asyncio.to_thread(pipe.send, ("from a thread", 7))
        assert await asyncio.to_thread(theirs.poll, 10), "nothing arrived"
        return theirs.recv()

    assert asyncio.run(main()) == ("from a thread", 7)


def test_an_unreadable_message_is_skipped_and_the_next_one_still_arrives(caplog):
    ours, theirs = multiprocessing.Pipe(duplex=True)

    async def main():
        pipe, got, eof, _ = await _served(ours, name="worker 9's pipe")
        bad = frame("ok")
        bad = bad[:4] + b"\x00" * (len(bad) - 4)  # framed right, not a pickle
        os.write(theirs.fileno(), bad + frame("after"))
        theirs.send(("last", 1))
        theirs.close()
        await asyncio.wait_for(eof.wait(), 10)
        return got

    assert asyncio.run(main()) == ["after", ("last", 1)]
    assert "unreadable message on worker 9's pipe" in caplog.text


def test_frames_are_what_connection_send_writes():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    for m in [None, ("x" * 20_000, 3), list(range(1000))]:
        os.write(ours.fileno(), frame(m))
        assert theirs.recv() == m


def test_a_send_before_start_is_dropped_and_the_pipe_then_serves():
    ours, theirs = multiprocessing.Pipe(duplex=True)

    async def main():
        got: list[object] = []
        pipe = LoopPipe(ours, asyncio.get_running_loop(), got.append, lambda: None)
        await asyncio.to_thread(pipe.send, "too early")  # from another thread: not handed to the loop for ever
        pipe.start()
        pipe.send("first")
        theirs.send("back")
        while not got:
            await asyncio.sleep(0.01)
        first = await asyncio.to_thread(theirs.recv)
        return got, first, await asyncio.to_thread(theirs.poll, 0.3)

    assert asyncio.run(asyncio.wait_for(main(), 10)) == (["back"], "first", False)  # nothing after "first"

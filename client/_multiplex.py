"""Many Generate streams on one GenerateMany call (asyncio): one message per engine step for all of them.

    async with AsyncClient("127.0.0.1:50051") as client, client.multiplex() as streams:
        a = streams.generate("Hello", max_tokens=16)
        b = streams.generate("Bonjour", max_tokens=16)
        async for delta in a:
            ...

Each stream reads like an `AsyncDeltaStream`: Deltas in order, `cancel()` to leave it, a TokenlineError
when it fails (its own failure; the others go on). For callers that hold many streams to one server
(gateways, batch clients, load generators): where a Generate call costs a message per token per stream,
here a response carries every stream's chunks of a step. A keyed stream (idempotency_key) survives a
broken call as a Generate stream does: the next call re-attaches it from the next token index.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import grpc
from tokenline.v1 import tokenline_pb2 as pb

from ._client import MAX_REATTACH, prepare_call, reattach_backoff_s, resumed
from ._convert import GenerateOptions, delta_from_chunk
from ._types import Delta
from .errors import DeadlineExceeded, TokenlineError, Unavailable, error_from_rpc, error_from_status

if TYPE_CHECKING:
    from typing_extensions import Unpack

_END = object()
# Actions gathered into one GenerateManyRequest: well under the server's default receive limit (4 MiB).
MAX_REQUEST_BYTES = 1 << 20


class MultiplexedStream:
    """One stream of a `Multiplex`: iterate it with `async for` (Deltas, in order)."""

    def __init__(self, mux: Multiplex, number: int, request: pb.GenerateRequest, sent_at: float) -> None:
        self._mux = mux
        self.number = number
        self.request = request
        self.sent_at = sent_at
        self._items: deque[Any] = deque()  # Deltas, then _END or a TokenlineError
        self._waiter: asyncio.Future | None = None
        self._next_index = 0  # the index of the next token wanted (a keyed stream has one sample)
        self._request_id = ""
        self.reattached = 0
        self.done = False
        self._timer: asyncio.TimerHandle | None = None

    def __aiter__(self) -> MultiplexedStream:
        return self

    async def __anext__(self) -> Delta:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item is _END:
            self._items.appendleft(item)  # stays ended
            raise StopAsyncIteration
        if isinstance(item, TokenlineError):
            self._items.appendleft(_END)
            raise item
        return item

    def cancel(self) -> None:
        """Leave the stream: the server stops its run (unless another call follows it); iteration ends."""
        if not self.done:
            self._mux._leave(self)
            self._finish(_END)

    # ------------------------------------------------------------ fed by the Multiplex

    def _put(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _chunk(self, chunk: pb.GenerateChunk, received_at: float) -> None:
        if self.done:
            return
        self._next_index = chunk.index + len(chunk.token_ids)
        self._request_id = chunk.request_id
        self._put(delta_from_chunk(chunk, received_at))

    def _finish(self, item: Any) -> None:
        if not self.done:
            self.done = True
            if self._timer is not None:
                self._timer.cancel()
            self._put(item)

    def _resumable(self) -> bool:
        """A keyed stream of one sample that has started: it can follow its run again on a new call."""
        return bool(self.request.idempotency_key) and self._next_index > 0 and self.reattached < MAX_REATTACH


class Multiplex:
    """Streams on one GenerateMany call. Make it with `AsyncClient.multiplex()`; use it as an async
    context manager (leaving it cancels the streams still open)."""

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = stub
        self._metadata = metadata
        self._streams: dict[int, MultiplexedStream] = {}
        self._numbers = itertools.count(1)
        self._closed = False
        self._call: Any = None  # opened by the first stream, and again after a break
        self._outgoing: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> MultiplexedStream:
        """Start a stream on this call. Arguments as for `Client.generate`; `timeout` and `deadline_s`
        bound this stream alone (the call itself has no deadline)."""
        if self._closed:
            raise RuntimeError("this multiplexed call is closed: open another with AsyncClient.multiplex()")
        request, wire_timeout = prepare_call(prompt, options)
        stream = MultiplexedStream(self, next(self._numbers), request, time.monotonic())
        self._streams[stream.number] = stream
        if wire_timeout is not None:
            stream._timer = asyncio.get_running_loop().call_later(wire_timeout, self._expire, stream)
        if self._call is None:
            self._open_call()
        self._send(pb.StreamRequest(stream=stream.number, generate=request))
        return stream

    async def aclose(self) -> None:
        """Cancel the streams still open and end the call."""
        self._closed = True
        for stream in list(self._streams.values()):
            stream._finish(_END)
        self._streams.clear()
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> Multiplex:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------ internals

    def _open_call(self) -> None:
        loop = asyncio.get_running_loop()
        self._call = call = self._stub.GenerateMany(metadata=self._metadata)
        self._outgoing = outgoing = asyncio.Queue()
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks += [loop.create_task(self._write(call, outgoing)), loop.create_task(self._read(call))]

    def _send(self, message: pb.StreamRequest) -> None:
        assert self._outgoing is not None
        self._outgoing.put_nowait(message)

    @staticmethod
    async def _write(call: Any, outgoing: asyncio.Queue) -> None:
        """One writer per call: grpc.aio takes one write at a time, so what was queued while a write was
        on its way goes in the next message together (up to MAX_REQUEST_BYTES; the server reads one message
        per turn of its loop). A failed write ends it; the reader sees the call's status and acts on it."""
        try:
            while True:
                actions = [await outgoing.get()]
                size = actions[0].ByteSize()
                while not outgoing.empty():
                    nxt = outgoing.get_nowait()
                    n = nxt.ByteSize()
                    if size + n > MAX_REQUEST_BYTES:
                        outgoing._queue.appendleft(nxt)  # type: ignore[attr-defined]  the next message's first
                        break
                    actions.append(nxt)
                    size += n
                await call.write(pb.GenerateManyRequest(streams=actions))
        except asyncio.CancelledError:
            return
        except Exception:  # noqa: BLE001  an RpcError, or grpc.aio's UsageError once the call has ended
            return

    def _leave(self, stream: MultiplexedStream) -> None:
        if self._streams.pop(stream.number, None) is not None and not self._closed and self._call is not None:
            self._send(pb.StreamRequest(stream=stream.number, leave=True))

    def _expire(self, stream: MultiplexedStream) -> None:
        if not stream.done:
            self._leave(stream)
            stream._finish(DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    async def _read(self, call: Any) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:  # the server ended the call: the next `generate` opens another
                    if call is self._call:
                        self._call = None
                        for stream in list(self._streams.values()):
                            stream._finish(Unavailable(grpc.StatusCode.UNAVAILABLE, "the server ended the call"))
                        self._streams.clear()
                    return
                now = time.monotonic()
                streams = self._streams
                for item in response.chunks:
                    stream = streams.get(item.stream)
                    if stream is not None:
                        stream._chunk(item.chunk, now)
                for error in response.errors:
                    stream = streams.pop(error.stream, None)
                    if stream is not None:
                        stream._finish(error_from_status(error.code, error.message, error.retry_after_ms))
                for number in response.ended:
                    stream = streams.pop(number, None)
                    if stream is not None:
                        stream._finish(_END)
        except asyncio.CancelledError:
            return
        except grpc.RpcError as error:
            if not self._closed and call is self._call:
                await self._broken(error)

    async def _broken(self, error: grpc.RpcError) -> None:
        """The call failed: keyed streams that have started follow their runs on a new call (from the next
        token each wants, after a backoff), the others fail with the call's error."""
        self._call = None
        mapped = error_from_rpc(error)
        resumable = [s for s in self._streams.values() if isinstance(mapped, Unavailable) and s._resumable()]
        for number, stream in list(self._streams.items()):
            if stream not in resumable:
                del self._streams[number]
                stream._finish(mapped)
        if not resumable:
            return  # the next `generate` opens a new call
        await asyncio.sleep(reattach_backoff_s(max(s.reattached for s in resumable)))
        if self._closed or self._call is not None:
            return
        self._open_call()
        for stream in resumable:
            if stream.done:
                continue
            stream.reattached += 1
            self._send(pb.StreamRequest(stream=stream.number,
                                        generate=resumed(stream.request, stream._next_index, stream._request_id)))

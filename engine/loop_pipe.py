"""A worker's pipe read and written on the frontend's event loop: no reader or writer thread per worker.

The frontend used to give each worker a reader thread (blocking `recv`, unpickle, hand the message to the
loop with `call_soon_threadsafe`) and a writer thread (a queue the loop fills, blocking `send`). Each step
report then cost a thread wake-up, a GIL hand-over with the loop, a self-pipe write and read; with two
workers stepping 120-150 times a second each, those threads took ~8 % of a core beside the loop's ~23 %
(issue 38, docs/performance.md). Here the loop watches the pipe's descriptor (`add_reader`), reads what
is there without blocking, and unpickles each whole message on its own thread; a message is written
straight away, and what the socket does not take now is written when it is writable again (a worker
mid-step reads nothing), in order.

The framing is `multiprocessing.connection.Connection`'s, so the worker keeps its plain `Connection`: a
4-byte big-endian signed length, or -1 and an 8-byte length for payloads over 2 GiB, then the pickle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pickle import loads

log = logging.getLogger(__name__)

READ_SIZE = 1 << 18  # bytes a read asks for: a step report of hundreds of sequences is a few tens of KB
_HEADER = struct.Struct("!i")
_LONG = struct.Struct("!Q")


def frame(msg: object) -> bytes:
    """`msg` as `Connection.send` writes it: its pickle behind the length header `Connection.recv` reads."""
    payload = ForkingPickler.dumps(msg)
    n = len(payload)
    header = _HEADER.pack(n) if n <= 0x7FFFFFFF else _HEADER.pack(-1) + _LONG.pack(n)
    return header + payload


class LoopPipe:
    """One end of a `multiprocessing.Pipe` (a socket pair) served on `loop`'s thread.

    `on_message(msg)` runs on the loop for every message, in order; `on_eof()` once when the other end
    has closed (after every message before it). A message that does not unpickle is logged and skipped
    (the stream stays framed). `send` may be called from any thread; off the loop's it is handed over.
    A send before `start` or after the other end is gone is dropped (its EOF tells of the latter)."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, on_message: Callable[[object], None],
                 on_eof: Callable[[], None], *, name: str = "pipe"):
        self._conn, self._loop, self._name = conn, loop, name
        self._on_message, self._on_eof = on_message, on_eof
        self._fd = conn.fileno()
        self._rbuf = bytearray()
        self._wbuf = bytearray()  # what the socket has not taken yet, in order
        self._writing = False  # add_writer is on
        self._open = False
        self._loop_thread: int | None = None

    def start(self) -> None:
        """Begin reading; call on the loop's thread."""
        os.set_blocking(self._fd, False)
        self._loop_thread = threading.get_ident()
        self._open = True
        self._loop.add_reader(self._fd, self._readable)

    @property
    def open(self) -> bool:
        return self._open

    def send(self, msg: object) -> None:
        if threading.get_ident() != self._loop_thread:
            if self._loop_thread is None:
                return  # not started: there is no one to send to yet
            try:
                self._loop.call_soon_threadsafe(self.send, msg)
            except RuntimeError:
                pass  # the loop is closed: the frontend is going away, and the worker with it
            return
        if not self._open:
            return
        data = frame(msg)
        if self._wbuf:
            self._wbuf += data  # behind what waits: order is kept
            return
        try:
            n = os.write(self._fd, data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            return  # the worker is gone; the read side reports it
        if n < len(data):
            self._wbuf += memoryview(data)[n:]
            self._writing = True
            self._loop.add_writer(self._fd, self._writable)

    def _writable(self) -> None:
        try:
            n = os.write(self._fd, self._wbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._wbuf.clear()
            n = 0
        del self._wbuf[:n]
        if not self._wbuf:
            self._stop_writing()

    def _stop_writing(self) -> None:
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            buf = self._rbuf
            buf += data
            self._deliver(buf)
        else:
            self.close()
            self._on_eof()

    def _deliver(self, buf: bytearray) -> None:
        """Hand over every whole message at the front of `buf`; keep a partial one for the next read."""
        start, end = 0, len(buf)
        view = memoryview(buf)
        try:
            while end - start >= 4:
                n = _HEADER.unpack_from(buf, start)[0]
                head = 4
                if n == -1:
                    if end - start < 12:
                        break
                    n, head = _LONG.unpack_from(buf, start + 4)[0], 12
                if end - start < head + n:
                    break
                payload = view[start + head:start + head + n]
                start += head + n
                try:
                    msg = loads(payload)
                except Exception:
                    log.exception("unreadable message on %s", self._name)
                    continue
                finally:
                    payload.release()
                try:
                    self._on_message(msg)
                except Exception:
                    log.exception("handling a message from %s failed", self._name)
        finally:
            view.release()
            if start:
                del buf[:start]

    def close(self) -> None:
        """Stop reading and writing (what was not written is dropped); the connection stays the caller's."""
        if not self._open:
            return
        self._open = False
        self._stop_writing()
        self._wbuf.clear()
        try:
            self._loop.remove_reader(self._fd)
        except (RuntimeError, ValueError):
            pass  # the loop is closed

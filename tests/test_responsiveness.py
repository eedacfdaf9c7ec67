"""No request can stall the event loop: oversized prompts are refused before any expensive work,
and tokenizing and chat templating run off the loop."""

import concurrent.futures
import threading
import time

import pytest

from tokenline.client import Client
from tokenline.client.errors import InvalidRequest
from tests.support import ServerProcess

# Each of these took seconds of event-loop time (tokenizing) before it was refused.
HUGE_CHAT = [{"role": "user", "content": "hello world " * 333_334}]  # 4,000,008 characters
HUGE_TEXT = "hello world " * 83_333  # 999,996 characters
# Generous on a shared, noisy machine; before the fix the loop stopped for many seconds at a time.
STALL_S = 2.0


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--idempotency-db", "off").start()
    yield s
    s.stop()


class Observer:
    """While a block runs: a long stream's token arrival times, and how long health checks take."""

    def __init__(self, server, client):
        self.server, self.client = server, client
        self.arrivals: list[float] = []
        self.health_s: list[float] = []
        self.stream_ended_early = False
        self.outlived = False  # the stream was still running when the block ended (it is stopped by us)
        self.errors: list[BaseException] = []  # what ended a thread early; raised when the block ends
        self._stop = threading.Event()

    def _read_stream(self):
        try:
            stream = self.client.generate("a running stream", max_tokens=2000, ignore_eos=True)
            for delta in stream:
                self.arrivals.append(time.monotonic())
                if self._stop.is_set():
                    self.outlived = True
                    stream.cancel()
                    return
                if delta.finish_reason is not None:
                    self.stream_ended_early = True
        except BaseException as err:  # noqa: BLE001 - an aborted stream must fail the test, not end quietly
            self.errors.append(err)

    def _check_health(self):
        try:
            while not self._stop.is_set():
                start = time.monotonic()
                self.server.health()
                self.health_s.append(time.monotonic() - start)
                time.sleep(0.02)
        except BaseException as err:  # noqa: BLE001 - a health check that timed out is a finding
            self.errors.append(err)

    def __enter__(self):
        self._threads = [threading.Thread(target=self._read_stream), threading.Thread(target=self._check_health)]
        for t in self._threads:
            t.start()
        while not self.arrivals:  # the stream is running
            time.sleep(0.01)
        return self

    def __exit__(self, kind, *exc):
        self._stop.set()
        for t in self._threads:
            t.join()
        if kind is None and self.errors:
            raise AssertionError(f"the stream or the health checks failed while observed: {self.errors[0]!r}")

    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.arrivals, self.arrivals[1:]))


def _refused(client, **prompt) -> str:
    with pytest.raises(InvalidRequest) as info:
        client.complete(max_tokens=4, timeout=120, **prompt)
    return info.value.details


def test_huge_prompts_are_refused_without_stalling_other_streams_or_health_checks(server):
    with Client(server.address) as client, concurrent.futures.ThreadPoolExecutor(8) as pool, \
            Observer(server, client) as seen:
        refusals = [pool.submit(_refused, client, messages=HUGE_CHAT) for _ in range(6)]
        refusals += [pool.submit(_refused, client, prompt=HUGE_TEXT) for _ in range(2)]
        details = [f.result() for f in refusals]

    assert all("characters" in d and "fit" in d for d in details), details
    assert seen.outlived and not seen.stream_ended_early, "the stream must outlast the refusals for the gaps to mean anything"
    assert seen.longest_gap() < STALL_S, f"a running stream waited {seen.longest_gap():.2f} s for its next token"
    assert max(seen.health_s) < STALL_S, f"a health check took {max(seen.health_s):.2f} s"


def test_prompts_that_pass_the_size_bound_are_tokenized_off_the_loop(server):
    # 25,000 characters: under the character bound, so each is tokenized (to too many tokens).
    too_many_tokens = "word " * 5_000
    with Client(server.address) as client, concurrent.futures.ThreadPoolExecutor(6) as pool, \
            Observer(server, client) as seen:
        refusals = [pool.submit(_refused, client, prompt=too_many_tokens) for _ in range(6)]
        details = [f.result() for f in refusals]
        fits = client.complete("word " * 200, max_tokens=2, ignore_eos=True, timeout=60)

    assert all("tokens" in d for d in details), details
    assert len(fits.token_ids) == 2
    assert seen.outlived and not seen.stream_ended_early
    assert seen.longest_gap() < STALL_S, f"a running stream waited {seen.longest_gap():.2f} s for its next token"
    assert max(seen.health_s) < STALL_S, f"a health check took {max(seen.health_s):.2f} s"

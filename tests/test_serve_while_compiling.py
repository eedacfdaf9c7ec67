"""Serve while compiling (`--compile on`, `--serve-while-compiling on`, serve's defaults): the server answers from
eager workers before any compiled worker is ready; compiled workers are then built one at a time and each takes
over from an eager one, which finishes its streams before it stops; greedy streams run across the swaps, each
whole and the same as on an eager worker; at the end every worker is compiled, and nothing was counted as a
crash, a restart or a retry.

Real parts: `tokenline serve` with two vLLM workers of the trained tiny model (its greedy margins are large, so
its greedy output is the same whatever the batch and the kernels: tests/test_judge.py), real gRPC.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from tests.support import ServerProcess, free_port, metric_values, scrape, wait_until
from tokenline.client import Client

pytestmark = pytest.mark.engine

PROMPTS = [[3 + i, 11, 17 + i, 5, 29] for i in range(6)]
TOKENS = 48
# Two workers kept busy, with room left for the compiler beside them on two cores. Three at once left an eager worker
# idle at a take-over on a loaded box (each stream's next request is placed where its first token comes soonest, and
# an idle eager worker is the one retired), so that no retiring worker ran streams; six keep both busy.
STREAMS_AT_ONCE = 6
SWAPPED = re.compile(r"worker (\d+) \(compiled\) took over from worker (\d+) \(eager\) after [\d.]+ s.*\((running some now|idle now)\)")
ALL_COMPILED = "all active workers of model"


@pytest.fixture(scope="module")
def server():
    metrics_port = free_port()
    s = ServerProcess("--model", "tiny-trained", "--workers", "2", "--kv-cache-mb", "64", "--max-seqs", "8",
                      "--max-model-len", "1024", "--compile", "on", "--serve-while-compiling", "on",
                      "--metrics-port", str(metrics_port), "--log-level", "INFO")
    s.start(timeout=300)
    s.metrics_port = metrics_port
    s.reference = {}  # prompt -> its greedy stream, on an eager worker
    yield s
    s.stop()


def greedy(client: Client, prompt: list[int]) -> tuple[list[int], set[int], bool]:
    """(tokens, attempts seen, chunks contiguous) of one greedy stream."""
    tokens: list[int] = []
    attempts: set[int] = set()
    contiguous = True
    for d in client.generate(token_ids=prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True):
        contiguous &= d.index == len(tokens)
        tokens += d.token_ids
        attempts.add(d.attempt)
    return tokens, attempts, contiguous


def swaps(server: ServerProcess) -> list[re.Match]:
    return [m for line in server.output().splitlines() if (m := SWAPPED.search(line))]


def all_compiled(server: ServerProcess, timeout: float = 480) -> bool:
    return wait_until(lambda: ALL_COMPILED in server.output(), timeout=timeout, interval=0.1)


def test_it_answers_from_eager_workers_before_any_compiled_worker_is_ready(server):
    assert "(eager; compiled workers swap in as they are built)" in server.output()
    with Client(server.address) as client:
        before = client.list_models()[0]
        for prompt in PROMPTS:
            tokens, attempts, contiguous = greedy(client, prompt)
            assert len(tokens) == TOKENS and attempts == {1} and contiguous
            server.reference[tuple(prompt)] = tokens
        after = client.list_models()[0]
    # How we know an eager worker answered: every active worker was eager before the first request and still is
    # after the last (a compiled worker, once active, stays), and no compiled worker took over in between.
    assert (before.execution, after.execution) == ("eager", "eager"), (before.execution, after.execution)
    assert swaps(server) == [], server.output()


def test_greedy_streams_run_across_the_swaps_and_each_ends_whole_and_as_on_an_eager_worker(server):
    if not server.reference:
        test_it_answers_from_eager_workers_before_any_compiled_worker_is_ready(server)
    done: list[tuple[list[int], list[int], set[int], bool, float, float]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def load(n: int) -> None:
        try:
            with Client(server.address) as client:
                i = n
                while not stop.is_set():
                    prompt = PROMPTS[i % len(PROMPTS)]
                    began = time.monotonic()
                    tokens, attempts, contiguous = greedy(client, prompt)
                    done.append((prompt, tokens, attempts, contiguous, began, time.monotonic()))
                    i += 1
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(STREAMS_AT_ONCE)]
    for t in threads:
        t.start()
    swapped_at: dict[int, float] = {}  # compiled worker -> when its take-over line appeared

    def watch() -> bool:
        for m in swaps(server):
            swapped_at.setdefault(int(m.group(1)), time.monotonic())
        return ALL_COMPILED in server.output() or bool(errors)

    finished = wait_until(watch, timeout=480, interval=0.05)
    time.sleep(1.0)  # streams on the compiled workers alone, too
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert finished, server.output()

    assert len(swapped_at) == 2, server.output()
    for prompt, tokens, attempts, contiguous, _, _ in done:
        assert attempts == {1}, attempts  # no retry: a retiring worker's streams were not moved
        assert contiguous and tokens == server.reference[tuple(prompt)], prompt  # none lost, repeated or changed
    for wid, at in swapped_at.items():  # each swap happened while streams ran
        assert any(began < at < ended for *_, began, ended in done), wid
    # At least one eager worker was retired while it ran streams: it finished them before it stopped.
    assert any(m.group(3) == "running some now" for m in swaps(server)), server.output()
    print(f"\n{len(done)} greedy streams across {len(swapped_at)} swaps")


def test_in_the_end_every_worker_is_compiled_and_nothing_counted_a_crash(server):
    assert all_compiled(server), server.output()
    with Client(server.address) as client:
        info = client.list_models()[0]
        tokens, attempts, _ = greedy(client, PROMPTS[0])
    assert info.execution == "compiled" and info.workers == 2, info
    out = server.output()
    assert [m.group(2) for m in swaps(server)] and len(swaps(server)) == 2
    assert len(re.findall(r"worker \d+ \(eager\) retired", out)) == 2  # both eager workers stopped
    assert "exited with code" not in out  # stopped, not crashed
    metrics = scrape(server.metrics_port)
    assert sum(metric_values(metrics, "tokenline_worker_restarts_total")) == 0
    assert sum(metric_values(metrics, "tokenline_retries_total")) == 0
    if server.reference:
        assert tokens == server.reference[tuple(PROMPTS[0])]

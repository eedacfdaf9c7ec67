"""Several models autoscaled under one worker budget (issue 34): a worker idle on one model is lent to a model that
needs one, and given back when its own model's work returns, without dropping a stream. A real server (simulated
engine, real worker processes): models a and b, one worker each of a budget of two; b is flooded while a is idle,
then a is asked again."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.support import ServerProcess, wait_until
from tokenline.client import AsyncClient, Client


FLOOD, TOKENS = 24, 60  # b: 24 streams of 60 tokens at 20 ms a step, two at a time per worker: ~15 s on one worker


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "sim", "--model", "a=tiny@blue", "--model", "b=tiny", "--workers", "2",
                      "--max-seqs", "2", "--interactive-slots", "0", "--sim-step-ms", "20",
                      "--autoscale-max-workers", "2", "--autoscale-min-workers", "0", "--autoscale-cooldown-s", "600",
                      "--autoscale-settle-s", "0.5", "--autoscale-queue-age-s", "0.5", "--lend-idle-after-s", "1",
                      "--log-level", "INFO").start()
    yield s
    s.stop()


async def generate(address: str, model: str, prompt: str) -> tuple[int, int, str]:
    """(tokens, attempts, "model version" as the stream's timeline says it was served)."""
    async with AsyncClient(address) as client:
        tokens, attempts, served = 0, 0, ""
        async for d in client.generate(prompt, model=model, max_tokens=TOKENS, ignore_eos=True, traffic_class="bulk"):
            tokens += len(d.token_ids)
            if d.timeline is not None:
                attempts, served = d.timeline.attempts, f"{d.timeline.model} {d.timeline.model_version}"
        return tokens, attempts, served


def test_an_idle_models_worker_is_lent_to_a_flooded_one_and_given_back_when_its_work_returns(server):
    async def run() -> tuple[list[tuple[int, int]], tuple[int, int]]:
        flood = [asyncio.create_task(generate(server.address, "b", f"flood {i}")) for i in range(FLOOD)]
        # b's queue ages past 0.5 s while a's worker has been idle 1 s: a's worker goes, b gets one in its place.
        lent = await asyncio.to_thread(wait_until, lambda: "lent to b" in server.output(), 60)
        assert lent, server.output()[-3000:]
        assert await asyncio.to_thread(wait_until, lambda: re.search(r"adding worker \d+ for model b", server.output()), 30)
        # a's work returns while b's flood still runs: a has no worker, so b gives one back once its streams end.
        mine = await generate(server.address, "a", "a again")
        return list(await asyncio.gather(*flood)), mine

    flooded, mine = asyncio.run(run())
    out = server.output()
    with Client(server.address) as client:
        versions = {m.name: m.version for m in client.list_models()}
    assert versions["a"] == "blue"  # the label --model a=tiny@blue gave its version
    assert mine == (TOKENS, 1, "a blue")
    assert "given back to a" in out, out[-3000:]
    assert re.search(r"worker \d+ \(given back\) retired", out), out[-3000:]
    # No stream of b was dropped or restarted: the worker given back finished its streams before it stopped.
    assert [f for f in flooded if f != (TOKENS, 1, f"b {versions['b']}")] == []

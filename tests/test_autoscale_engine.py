"""The autoscaler for real: a worker added under a step of load, and removed once the load is gone (the simulated
engine, then tiny vLLM workers)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tokenline.client import AsyncClient
from tests.support import ServerProcess, free_port, metric_values, scrape, wait_until

pytestmark = pytest.mark.engine

TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    steps = tmp_path_factory.mktemp("autoscale") / "steps.jsonl"
    metrics_port = free_port()
    s = ServerProcess("--metrics-port", str(metrics_port), "--engine", "sim", "--model", "tiny", "--workers", "1", "--max-seqs", "4", "--sim-step-ms", "60",
                      "--autoscale-max-workers", "2", "--autoscale-queue-age-s", "0.5", "--autoscale-cooldown-s", "3",
                      "--autoscale-settle-s", "1", "--step-log", str(steps), "--log-level", "INFO").start()
    s.step_log = steps
    s.metrics_port = metrics_port
    yield s
    s.stop()


async def burst(address: str, n: int):
    async with AsyncClient(address) as client:
        async def one(i: int):
            deltas = [d async for d in client.generate(token_ids=[3 + i, 5, 7], max_tokens=TOKENS, ignore_eos=True,
                                                       traffic_class="bulk")]
            return deltas

        return await asyncio.gather(*(one(i) for i in range(n)))


def decisions(server: ServerProcess) -> list[str]:
    return [line for line in server.output().splitlines() if "autoscale:" in line]


def test_a_step_of_load_adds_a_worker_that_serves_and_goes_once_idle_for_the_cool_down(server):
    assert decisions(server) == []  # one worker is what no load needs

    results = asyncio.run(burst(server.address, 48))  # 48 streams on 4 slots: a queue that ages

    for deltas in results:  # nothing lost or repeated while capacity changed
        position = 0
        for d in deltas:
            assert d.index == position
            position += len(d.token_ids)
        assert position == TOKENS
    added = [line for line in decisions(server) if "adding worker" in line]
    assert added and "oldest queued request waited" in added[0]
    new_worker = int(re.search(r"adding worker (\d+)", added[0]).group(1))
    steps = [json.loads(line) for line in server.step_log.read_text().splitlines()]
    assert any(s["worker"] == new_worker and s["batch"] > 0 for s in steps), "the added worker took no work"
    adds = {k: v for k, v in scrape(server.metrics_port).items()
            if k.startswith("tokenline_autoscale_decisions_total{") and 'action="add"' in k}
    assert list(adds.values()) == [float(len(added))], adds  # and as a metric

    # The load is gone: after the cool-down the idle worker is removed, and no more are added.
    assert wait_until(lambda: any("removing worker" in line for line in decisions(server)), timeout=60), decisions(server)
    removed = [line for line in decisions(server) if "removing worker" in line]
    assert "idle" in removed[0]
    assert len([line for line in decisions(server) if "adding worker" in line]) == len(added)
    metrics = scrape(server.metrics_port)
    assert sum(metric_values(metrics, "tokenline_autoscale_decisions_total")) == len(added) + len(removed)
    assert metric_values(metrics, "tokenline_workers_wanted") == [1.0]
    # What is left serves on.
    again = asyncio.run(burst(server.address, 2))
    assert all(sum(len(d.token_ids) for d in deltas) == TOKENS for deltas in again)


def test_real_vllm_workers_a_step_of_load_adds_one_that_serves_and_it_goes_after_the_cool_down(tmp_path):
    """The same on the real engine (tiny vLLM workers): the added worker loads vLLM, takes streams from
    the queue, and is removed once idle; nothing lost or repeated meanwhile."""
    steps = tmp_path / "steps.jsonl"
    metrics_port = free_port()
    server = ServerProcess("--metrics-port", str(metrics_port), "--model", "tiny", "--workers", "1", "--max-seqs", "4",
                           "--kv-cache-mb", "64", "--max-model-len", "512", "--autoscale-max-workers", "2",
                           "--autoscale-queue-age-s", "0.5", "--autoscale-cooldown-s", "3", "--autoscale-settle-s", "1",
                           "--step-log", str(steps), "--log-level", "INFO").start()
    try:
        def added_worker_served() -> bool:
            added = [line for line in decisions(server) if "adding worker" in line]
            if not added:
                return False
            wid = int(re.search(r"adding worker (\d+)", added[0]).group(1))
            return steps.exists() and any(s["worker"] == wid and s["batch"] > 0
                                          for s in map(json.loads, steps.read_text().splitlines()))

        async def load_until_the_added_worker_serves():
            # A closed loop of 16 streams on 4 slots, a queue that ages, until the added worker has taken work: its
            # vLLM load takes tens of seconds here, more on a loaded machine (a fixed burst had ended before it).
            async with AsyncClient(server.address) as client:
                async def one(i: int):
                    return [d async for d in client.generate(token_ids=[3 + i % 400, 5, 7], max_tokens=500,
                                                             ignore_eos=True, traffic_class="bulk")]

                pending, done, i = set(), [], 0
                for _ in range(240):  # at most ~4 minutes
                    while len(pending) < 16:
                        pending.add(asyncio.create_task(one(i)))
                        i += 1
                    finished, pending = await asyncio.wait(pending, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                    done += [t.result() for t in finished]
                    if added_worker_served():
                        break
                return done + list(await asyncio.gather(*pending))

        results = asyncio.run(load_until_the_added_worker_serves())
        for deltas in results:
            position = 0
            for d in deltas:
                assert d.index == position
                position += len(d.token_ids)
            assert position == 500
        added = [line for line in decisions(server) if "adding worker" in line]
        assert added, server.output()[-3000:]
        new_worker = int(re.search(r"adding worker (\d+)", added[0]).group(1))
        assert re.search(rf"worker {new_worker} ready: model tiny-llama, pid \d+", server.output())
        assert added_worker_served(), "the added worker took no work"
        assert wait_until(lambda: any("removing worker" in line for line in decisions(server)), timeout=90)
        assert metric_values(scrape(metrics_port), "tokenline_workers_wanted") == [1.0]
    finally:
        server.stop()

"""On the real engine (tiny model): an interactive stream keeps its pace through a bulk flood (issue 15).

No tight timing: the bound on inter-token latency is generous (machines here are shared and noisy);
what the step log shows is exact: while the interactive stream runs, bulk sequences are paused in
the engine and at least one keeps decoding; once it has gone, nothing is held back.
"""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest

from tests.support import ServerProcess
from tokenline.client import AsyncClient

pytestmark = pytest.mark.engine

BULK = 24


@pytest.fixture(scope="module")
def composing_server(tmp_path_factory):
    step_log = tmp_path_factory.mktemp("steps") / "steps.jsonl"
    server = ServerProcess("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "32", "--max-model-len", "1024",
                           "--self-check", "off", "--interactive-itl-target-steps", "1.5",
                           "--step-log", str(step_log)).start()
    yield server, step_log
    server.stop()


async def _stream(client, prompt, **kw):
    return [d async for d in client.generate(prompt, ignore_eos=True, **kw)]


def _mean_itl_ms(deltas) -> float:
    return deltas[-1].timeline.itl_mean_ms


def test_an_interactive_stream_keeps_its_pace_through_a_bulk_flood(composing_server):
    server, step_log = composing_server

    async def run():
        async with AsyncClient(server.address) as client:
            solo = [await _stream(client, f"alone {i}", max_tokens=48) for i in range(3)]
            bulk = [asyncio.create_task(_stream(client, f"bulk {i}", max_tokens=600, traffic_class="bulk"))
                    for i in range(BULK)]
            await asyncio.sleep(1.5)  # the flood is decoding
            during = [await _stream(client, f"person {i}", max_tokens=48) for i in range(3)]
            await asyncio.sleep(0.5)  # interactive has gone: bulk alone again
            return solo, during, await asyncio.gather(*bulk)

    solo, during, bulk = asyncio.run(run())
    assert all(sum(len(d.token_ids) for d in b) == 600 for b in bulk)  # bulk finished, every token once
    solo_itl = statistics.median(_mean_itl_ms(d) for d in solo)
    during_itl = statistics.median(_mean_itl_ms(d) for d in during)
    assert during_itl < 4 * solo_itl + 5, (solo_itl, during_itl)

    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    composed = [s for s in steps if s["interactive"] and s["paused"]]
    assert composed, "bulk sequences were never paused while interactive streams ran"
    assert all(s["batch"] > s["interactive"] for s in composed)  # bulk kept decoding beside them
    assert max(s["batch"] for s in steps if not s["interactive"]) >= BULK  # bulk alone ran whole
    assert all(s["paused"] == 0 for s in steps if not s["interactive"])

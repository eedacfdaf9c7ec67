"""Several models served at once from one port, each on workers of its own (issue 34).

`tokenline serve --model a=tiny --model b=tiny-trained` starts both; callers choose by name. What must hold:
each request is answered by the model it named (its greedy tokens are greedy for that model and not for the
other), ListModels shows each with its own workers, and a flood on one model never makes the other's
requests wait: its workers are its own.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.greedy import Float32Judge
from tests.support import ServerProcess
from tokenline.client import AsyncClient, Client
from tokenline.engine.models import resolve_model

pytestmark = pytest.mark.engine

PROMPTS = [[3 + i, 17, 42 + i, 99, 7] for i in range(3)]
FLOOD_TOKENS = 1000


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "a=tiny", "--model", "b=tiny-trained", "--workers", "2", "--kv-cache-mb", "64",
                      "--max-seqs", "8", "--max-model-len", "1024", "--self-check", "off").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def judges():
    return {"a": Float32Judge(resolve_model("tiny")), "b": Float32Judge(resolve_model("tiny-trained"))}


def test_the_start_up_line_and_list_models_show_each_model_on_workers_of_its_own(server):
    line = next(x for x in server.lines if x.startswith("tokenline: 2 models — "))
    assert "a: 1 worker × 1 thread, KV " in line and "; b: 1 worker × 1 thread, KV " in line
    with Client(server.address) as client:
        models = {m.name: m for m in client.list_models(timeout=30)}
    assert sorted(models) == ["a", "b"]
    assert [models[n].workers for n in "ab"] == [1, 1]
    assert models["a"].version != models["b"].version


def test_each_request_is_answered_by_the_model_it_names(server, judges):
    with Client(server.address) as client:
        for prompt in PROMPTS:
            for name in "ab":
                done = client.complete(token_ids=prompt, model=name, max_tokens=24, temperature=0, ignore_eos=True)
                tokens = list(done.token_ids)
                assert len(tokens) == 24
                assert judges[name].violations(prompt, tokens) == [], name
                other = judges["b" if name == "a" else "a"]
                assert len(other.violations(prompt, tokens)) >= 12, f"{name}'s tokens are greedy for the other model too"


def test_a_flood_on_one_model_never_makes_the_others_requests_wait(server, judges):
    async def run():
        async with AsyncClient(server.address) as client:
            flood = [asyncio.create_task(client.complete(token_ids=[5, 6, 7 + i], model="a", max_tokens=FLOOD_TOKENS,
                                                         temperature=0, ignore_eos=True, traffic_class="bulk"))
                     for i in range(20)]  # 20 on a worker of 8 sequences: a queue
            for _ in range(600):  # until ListModels shows a's worker full (8 run for seconds) and 12 waiting
                load = {m.name: m for m in await client.list_models(timeout=10)}
                if (load["a"].running, load["a"].queued_bulk) == (8, 12):
                    break
                await asyncio.sleep(0.05)
            during = []
            for prompt in PROMPTS:
                during.append(await client.complete(token_ids=prompt, model="b", max_tokens=16, temperature=0,
                                                    ignore_eos=True))
            return load, during, await asyncio.gather(*flood)

    load, during, flood = asyncio.run(run())
    # ListModels shows each model's own load: a's queue and its full worker, b idle and serving
    assert (load["a"].state, load["a"].running, load["a"].queued_bulk) == ("serving", 8, 12)  # within 30 s
    assert (load["b"].state, load["b"].running, load["b"].queued_bulk, load["b"].queued_interactive) == ("serving", 0, 0, 0)
    waits = [f.timeline.admitted_ms - f.timeline.enqueued_ms for f in flood]
    assert max(waits) > 500  # a's requests waited for its worker's sequences to end
    for prompt, done in zip(PROMPTS, during):
        # Admitted by the first decision after it came (the end of that turn of b's server loop), never waiting for
        # capacity: a's queue and full worker are not b's.
        assert done.timeline.queueing_ms == 0.0
        assert done.timeline.admitted_ms - done.timeline.enqueued_ms < max(waits) / 100
        assert judges["b"].violations(prompt, list(done.token_ids)) == []
    assert all(len(f.token_ids) == FLOOD_TOKENS for f in flood)

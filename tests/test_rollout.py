"""A model rolled out to a new version while it serves (issue 34): `tokenline admin rollout NAME MODEL`.

Model "a" serves the tiny model; 32 greedy streams run (and 96 more wait) when it is rolled out to tiny-trained.
What must hold: no stream loses, repeats or mixes a token (every one of the old streams is greedy for the tiny
model from its first token to its last, judged in float32), requests sent after the rollout are answered by the
new version, the old version is unloaded once its streams end, and a version that is gone is NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.greedy import Float32Judge
from tests.support import ServerProcess
from tokenline.client import AsyncClient, Client
from tokenline.client.errors import NotFound, TokenlineError
from tokenline.engine.models import model_version, resolve_model

pytestmark = pytest.mark.engine

# 32 run at once and the rest wait, so that the old version is still busy when the new one is ready however fast
# this machine steps (the new version's worker takes seconds to start: beside a CPU hog, four waves of 800 tokens had
# all ended before it was ready, so each stream is 2,000 tokens long).
STREAMS, RUNNING, TOKENS = 128, 32, 2000


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "a=tiny", "--kv-cache-mb", "256", "--max-seqs", str(RUNNING), "--interactive-slots", "0",
                      "--max-model-len", "2048", "--self-check", "off").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def judges():
    return {"tiny": Float32Judge(resolve_model("tiny")), "tiny-trained": Float32Judge(resolve_model("tiny-trained"))}


def test_a_rollout_under_running_streams_loses_repeats_and_mixes_nothing(server, judges):
    old, new = model_version(resolve_model("tiny")), model_version(resolve_model("tiny-trained"))
    prompts = [[11 + i, 23, 5 + i % 7, 42] for i in range(STREAMS)]

    async def run():
        async with AsyncClient(server.address) as client:
            streams = [asyncio.create_task(client.complete(token_ids=p, model="a", max_tokens=TOKENS, temperature=0,
                                                           ignore_eos=True, traffic_class="bulk")) for p in prompts]
            for _ in range(600):  # until the old version runs 32 and queues the rest
                load = {m.name: m for m in await client.list_models(timeout=10)}["a"]
                if (load.running, load.queued_bulk) == (RUNNING, STREAMS - RUNNING):
                    break
                await asyncio.sleep(0.05)
            loop = asyncio.get_running_loop()
            done = await loop.run_in_executor(None, _roll_out, server.address)
            unfinished = sum(not s.done() for s in streams)
            after = [await client.complete(token_ids=p, model="a", max_tokens=32, temperature=0, ignore_eos=True)
                     for p in prompts[:3]]
            listed = await client.list_models(timeout=10)
            return done, unfinished, after, listed, await asyncio.gather(*streams)

    done, unfinished, after, listed, finished = asyncio.run(run())
    assert (done["version"], done["previous_version"]) == (new, old)
    assert unfinished >= RUNNING  # the switch happened with (at least) 32 streams running on the old version
    versions = {(m.version, m.current) for m in listed if m.name == "a"}
    assert (new, True) in versions and (old, False) in versions  # the old one still finishing its streams
    for prompt, done_ in zip(prompts, finished):
        tokens = list(done_.token_ids)
        assert len(tokens) == TOKENS and done_.attempt == 1
        assert judges["tiny"].violations(prompt, tokens) == [], "a stream sent before the rollout left its version"
    for prompt, done_ in zip(prompts, after):
        assert judges["tiny-trained"].violations(prompt, list(done_.token_ids)) == [], "sent after: not the new version"
        assert len(judges["tiny"].violations(prompt, list(done_.token_ids))) >= 16

    with Client(server.address) as client:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len([m for m in client.list_models(timeout=10) if m.name == "a"]) > 1:
            time.sleep(0.2)
        models = [m for m in client.list_models(timeout=10) if m.name == "a"]
        assert [(m.version, m.current, m.workers) for m in models] == [(new, True, 1)]  # the old one unloaded
        with pytest.raises(NotFound):
            client.complete(token_ids=prompts[0], model=f"a@{old}", max_tokens=4)
        pinned = client.complete(token_ids=prompts[0], model=f"a@{new}", max_tokens=8, temperature=0, ignore_eos=True)
        assert judges["tiny-trained"].violations(prompts[0], list(pinned.token_ids)) == []


def _roll_out(address: str) -> dict:
    with Client(address) as client:
        return client.roll_out("a", "tiny-trained")


def test_a_rollout_to_what_cannot_load_changes_nothing(server):
    with Client(server.address) as client:
        with pytest.raises(TokenlineError, match="cannot load"):
            client.roll_out("a", "/no/such/model")
        with pytest.raises(NotFound, match="no model is named 'b'"):
            client.roll_out("b", "tiny")
        assert [m.name for m in client.list_models(timeout=10)] == ["a"]

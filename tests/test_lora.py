"""LoRA adapters (issue 34): a light version of a served model, named by a request as its model, run on the model's
workers and batched with its own requests, on the real engine. The adapter is built here with `peft` on the tiny
model (random weights in its B matrices, so that it changes the answers), and each stream is judged against the
weights it asked for: every token a greedy choice of that model in float32 (tests/greedy.py), and not of the other.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.greedy import Float32Judge
from tests.support import ServerProcess
from tests.test_failures import worker_pids
from tokenline.client import AsyncClient, Client
from tokenline.client.errors import InvalidRequest
from tokenline.engine.models import resolve_model

pytestmark = pytest.mark.engine

PROMPT = "The lighthouse keeper wrote in his log that the storm"


def build_adapter(base: Path, folder: Path, *, seed: int = 0, rank: int = 8) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts B at zero (the adapter a no-op): random, so that it answers otherwise
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    peft.save_pretrained(folder)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lora") / "tuned"
    build_adapter(resolve_model("tiny"), folder)
    return folder


@pytest.fixture(scope="module")
def judges(adapter) -> tuple[Float32Judge, Float32Judge]:
    from peft import PeftModel

    base, tuned = Float32Judge(resolve_model("tiny")), Float32Judge(resolve_model("tiny"))
    tuned.model = PeftModel.from_pretrained(tuned.model, adapter).merge_and_unload().eval()
    return base, tuned


@pytest.fixture(scope="module")
def server(adapter):
    # Four slots, none held for interactive and no bulk floor: four interactive arrivals preempt four bulk runs.
    s = ServerProcess("--model", "tiny", "--lora", f"tuned={adapter}", "--kv-cache-mb", "64", "--max-seqs", "4",
                      "--interactive-slots", "0", "--bulk-floor", "0", "--bulk-window-ms", "5",
                      "--max-model-len", "1024", "--log-level", "WARNING").start()
    yield s
    s.stop()


def base_name(server: ServerProcess) -> str:
    with Client(server.address) as client:
        return next(m.name for m in client.list_models() if not m.base_model)


async def stream(address: str, model: str, max_tokens: int, cls: str = "interactive", on_token=None) -> dict:
    out = {"model": model, "tokens": [], "first": None, "last": None, "timeline": None}
    async with AsyncClient(address) as client:
        async for d in client.generate(PROMPT, model=model, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                       traffic_class=cls):
            if d.token_ids:
                now = time.monotonic()
                out["first"] = out["first"] or now
                out["last"] = now
                out["tokens"].extend(d.token_ids)
                if on_token is not None:
                    await on_token(len(out["tokens"]))
            if d.timeline is not None:
                out["timeline"] = d.timeline
    return out


def killer(server: ServerProcess, at: int = 8):
    """A stream's on_token hook that SIGKILLs the server's workers once the client has seen `at` tokens."""
    killed = False

    async def kill_at(n: int) -> None:
        nonlocal killed
        if n >= at and not killed:
            killed = True
            for pid in worker_pids(server):
                os.kill(pid, signal.SIGKILL)

    return kill_at


def follows(judge: Float32Judge, tokens: list[int]) -> bool:
    return not judge.violations(judge.encode(PROMPT), tokens)


def test_an_adapter_is_listed_as_a_model_of_its_base(server):
    with Client(server.address) as client:
        models = {m.name: m for m in client.list_models()}
    base = base_name(server)
    assert models["tuned"].base_model == base and models[base].base_model == ""
    assert models["tuned"].loaded and len(models["tuned"].version) == 12 and models["tuned"].version != models[base].version


def test_lora_and_base_requests_run_together_each_on_its_own_weights(server, judges):
    base, tuned = judges
    name = base_name(server)

    async def run() -> list[dict]:
        return await asyncio.gather(*(stream(server.address, m, 32) for m in (name, "tuned", name, "tuned")))

    outs = asyncio.run(run())
    for out in outs:
        own, other = (tuned, base) if out["model"] == "tuned" else (base, tuned)
        assert follows(own, out["tokens"]), (out["model"], own.violations(own.encode(PROMPT), out["tokens"]))
        assert not follows(other, out["tokens"]), f"{out['model']}'s tokens are also the other weights' choices"
    # One worker, four slots: the adapter's streams and the base model's were decoded in the same steps.
    adapted = [o for o in outs if o["model"] == "tuned"]
    plain = [o for o in outs if o["model"] != "tuned"]
    assert any(a["first"] < p["last"] and p["first"] < a["last"] for a in adapted for p in plain)


def test_a_lora_request_continues_on_its_adapter_after_its_worker_is_sigkilled(server, judges):
    _, tuned = judges
    # Long enough to be running still when the client has seen its 8th token, on a loaded machine.
    out = asyncio.run(stream(server.address, "tuned", 400, on_token=killer(server)))
    assert out["timeline"].attempts == 2 and len(out["tokens"]) == 400
    assert follows(tuned, out["tokens"]), tuned.violations(tuned.encode(PROMPT), out["tokens"])


def test_a_preempted_lora_run_continues_on_its_adapter(server, judges):
    base, tuned = judges
    name = base_name(server)

    async def run() -> list[dict]:
        started = asyncio.Event()

        async def after(n: int) -> None:
            if n >= 8:
                started.set()

        bulk = [asyncio.create_task(stream(server.address, "tuned", 96, cls="bulk", on_token=after)) for _ in range(4)]
        await started.wait()
        interactive = await asyncio.gather(*(stream(server.address, name, 8) for _ in range(4)))
        return [*await asyncio.gather(*bulk), *interactive]

    outs = asyncio.run(run())
    adapted = outs[:4]
    assert any(o["timeline"].preemptions > 0 for o in adapted), [o["timeline"] for o in adapted]
    for out in adapted:
        assert len(out["tokens"]) == 96 and follows(tuned, out["tokens"])
    for out in outs[4:]:
        assert follows(base, out["tokens"])


def test_prompt_logprobs_on_a_model_with_adapters_is_refused_before_any_work(server):
    with Client(server.address) as client:
        with pytest.raises(InvalidRequest, match="LoRA"):
            client.complete(PROMPT, model="tuned", max_tokens=2, prompt_logprobs=1)
        assert client.complete(PROMPT, model="tuned", max_tokens=2, logprobs=2).logprobs  # output logprobs work


def test_a_bad_adapter_folder_stops_the_start_with_what_is_wrong(tmp_path):
    args = ServerProcess("--model", "tiny", "--lora", f"tuned={tmp_path}").args
    done = subprocess.run([sys.executable, "-m", "tokenline.server.cli", "serve", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "not a LoRA adapter folder" in done.stderr, done.stderr

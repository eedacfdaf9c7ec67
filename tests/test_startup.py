"""Start-up: what lets `tokenline serve` serve sooner (docs/deployment.md, "Start-up: serving while compiling").

A spawned worker imports the parent's main module again, so the `tokenline` command's module stays light; the eager
workers beyond a model's first load at a lower CPU priority, so that on a small machine the first one is ready
sooner; and the rank count vLLM would compile on a worker's first log-probabilities (the self-check's) runs eagerly,
giving the same integers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from tokenline.engine.config import WorkerConfig
from tokenline.engine.simulation import worker_spec
from tokenline.engine.supervisor import Supervisor
from tokenline.engine.supervisor_swaps import LOADING_NICE
from tests.support import ServerProcess


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_a_worker_process_does_not_load_the_frontends_libraries():
    server = ServerProcess("--engine", "sim", "--model", "tiny").start()
    try:
        pids = server.worker_pids()
        assert pids
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "cygrpc" not in maps, "a worker imported gRPC: the main module it re-imports is not light"
    finally:
        server.stop()


class LocalHandle:
    """A stand-in local worker whose process is a real one (a sleep), so that its priority can be read."""

    local = True

    def __init__(self, wid: int, cfg: WorkerConfig, *, on_message, on_exit):
        self.wid, self.cfg, self.on_message, self.on_exit = wid, cfg, on_message, on_exit
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.proc = subprocess.Popen(["sleep", "60"])

    def send(self, msg: object) -> None:
        pass

    def terminate(self, timeout: float) -> None:
        self.proc.kill()
        self.proc.wait()

    def ready(self) -> None:
        spec = worker_spec(self.wid, max_seqs=4, continuous=True, model="m")
        self.on_message(self.wid, dataclasses.replace(spec, execution="compiled" if self.cfg.compile else "eager"))


def _can_raise_priority_back() -> bool:
    probe = subprocess.Popen(["sleep", "5"])
    try:
        os.setpriority(os.PRIO_PROCESS, probe.pid, os.getpriority(os.PRIO_PROCESS, 0) + 1)
        os.setpriority(os.PRIO_PROCESS, probe.pid, os.getpriority(os.PRIO_PROCESS, 0))
        return True
    except PermissionError:
        return False
    finally:
        probe.kill()
        probe.wait()


@pytest.mark.parametrize("serve_while_compiling", [True, False])
def test_eager_workers_beyond_the_first_load_at_a_lower_cpu_priority_until_ready(serve_while_compiling):
    handles: dict[int, LocalHandle] = {}

    def factory(wid, cfg, **callbacks):
        handles[wid] = LocalHandle(wid, cfg, **callbacks)
        return handles[wid]

    def nice(wid: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, handles[wid].pid)

    async def scenario():
        cfg = WorkerConfig(model_path="/m", model_name="m", compile=True)
        sup = Supervisor({"m": (cfg, 3)}, on_ready=lambda spec: None, on_lost=lambda wid: None,
                         on_report=lambda r: None, on_capacity=lambda: None, factory=factory,
                         serve_while_compiling=serve_while_compiling)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        try:
            sup.start()
            behind = min(base + LOADING_NICE, 19) if serve_while_compiling else base
            assert [nice(w) for w in (0, 1, 2)] == [base, behind, behind]
            handles[1].ready()
            await asyncio.sleep(0.05)
            if _can_raise_priority_back():
                assert [nice(w) for w in (0, 1, 2)] == [base, base, behind]
        finally:
            await sup.close(timeout=1.0)

    asyncio.run(scenario())


@pytest.mark.engine
def test_the_eager_rank_count_gives_vllms_integers_ties_included():
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from tokenline.engine.vllm_build import _count_at_least

    torch.manual_seed(0)
    logits = torch.randn(7, 301).round(decimals=1)  # rounded: many ties with the chosen values
    chosen = logits[torch.arange(7), torch.randint(0, 301, (7,))].unsqueeze(-1)
    assert torch.equal(_count_at_least(logits, chosen), batched_count_greater_than(logits, chosen))

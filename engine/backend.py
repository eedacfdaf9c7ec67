"""The interface a worker's step loop drives: the vLLM engine or the simulator.

A backend is owned by one thread of one worker process. It takes work items
and aborts between steps and runs one engine step at a time; everything it
has to say about a step goes into that step's StepReport.
"""

from __future__ import annotations

from typing import Protocol

from tokenline.engine.config import WorkerConfig
from tokenline.engine.types import StepPlan, StepReport, WorkerSpec, WorkItem


class Backend(Protocol):
    def spec(self) -> WorkerSpec:
        """What this replica can hold; valid once the backend is built."""
        ...

    def add(self, item: WorkItem) -> None:
        """Queue an item; it joins the batch at a coming step. A refused item is reported in the next step's report."""
        ...

    def abort(self, keys: tuple[str, ...]) -> None:
        """Drop the named items, freeing their KV blocks now; unknown keys are ignored."""
        ...

    def set_plan(self, plan: StepPlan) -> None:
        """Apply `plan` to the steps from the next one on: while interactive sequences are in the engine, at most
        `bulk_decode` bulk sequences decode (the rest pause, keeping their KV) and at most `prefill_tokens`
        prompt tokens are computed; with none in, only `guard_prefill_tokens` caps a step's prompt tokens
        (engine/types.py StepPlan). A backend that cannot apply plans ignores them and says so at start-up.
        Each StepReport names the bulk limit the step ran under (`plan_bulk_decode`). In the vLLM backend the
        plan takes effect in engine/vllm_schedule_hook.py, inside vLLM's scheduler; the simulator applies it
        in its own step (engine/sim_backend.py)."""
        ...

    def has_work(self) -> bool:
        """Whether step() has anything to do or to report (running, waiting, or news of aborts)."""
        ...

    def step(self) -> StepReport:
        """Run one engine step and report it; `applied_seq` is left for the worker to stamp."""
        ...


def build_backend(config: WorkerConfig, worker_id: int) -> Backend:
    """The backend the config asks for; importing vLLM only when it is the one."""
    if config.backend == "sim":
        from tokenline.engine.sim_backend import SimBackend

        return SimBackend(config, worker_id)
    from tokenline.engine.vllm_backend import VllmBackend

    return VllmBackend(config, worker_id)

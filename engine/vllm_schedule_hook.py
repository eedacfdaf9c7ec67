"""Where a StepPlan takes effect: the hook in vLLM's scheduler.

A worker's engine runs in-process (engine/vllm_build.py), so its scheduler can be reached. `ScheduleHook`
wraps `scheduler.schedule` and, each step, (1) carries out the step plan the frontend's scheduler sent
(engine/types.py StepPlan; engine/scheduler/composition.py decides it): it narrows vLLM's running list and
token budget for that one call, then restores them; (2) records what vLLM scheduled (batch, prompt tokens,
first-scheduled requests, the bulk limit the step ran under); (3) replays a continuation's delivered tokens
over its structured-output grammar once compiled; (4) saves seeded requests' random generators so a step
can be rewound. It reads vLLM internals checked on the releases in engine/kernels.py STEP_PLANS_CHECKED_ON
(the worker turns plans off on another release and says so at start-up), and degrades to estimates when
those internals are missing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm reads its settings (as engine/vllm_backend.py)

import torch  # noqa: E402
from vllm import LLMEngine  # noqa: E402

from tokenline.engine.types import StepPlan
from tokenline.engine.vllm_continuation import compiled, replay_grammar

log = logging.getLogger(__name__)


class _CpuRewind:
    """What the model runner's rewind calls on a generator (get_offset, set_offset), done on a CPU one:
    back to its state before the step sampled (saved when the step was scheduled), or, for a request
    that joined in the step, to its seed."""

    def __init__(self, generator: torch.Generator, saved: torch.Tensor | None):
        self.generator, self.saved = generator, saved

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        if self.saved is not None:
            self.generator.set_state(self.saved)
        else:
            self.generator.manual_seed(self.generator.initial_seed())


class _RewindableGenerators(dict):
    """The model runner's per-request generators (batch index -> torch.Generator). Its `get` is used only
    to rewind a generator after a partial prefill: it hands out a `_CpuRewind` instead."""

    saved: dict[int, torch.Tensor] = {}

    def save(self) -> None:
        """Before a step: every seeded request's generator state."""
        self.saved = {id(g): g.get_state() for g in self.values()} if self else {}

    def get(self, key, default=None):  # noqa: ANN001, ANN201
        generator = dict.get(self, key)
        return default if generator is None else _CpuRewind(generator, self.saved.get(id(generator)))


def rewindable_generators_on_cpu(engine: LLMEngine) -> _RewindableGenerators | None:
    """vLLM 0.32 crashes a CPU engine on a seeded request whose prompt takes several steps.

    After a step that computed part of a prompt, the model runner discards the token sampled for it
    and rewinds the request's generator by its Philox offset (`gen.set_offset(gen.get_offset() - 4)`,
    gpu_model_runner._bookkeeping_sync): a CPU generator has no offset, and the step raises
    "CPU Generator does not use offset", which ends the worker (and the retried request the next one).
    Measured: a request with seed, temperature 1 and a prompt over the step's token budget crashed the
    engine every time. Here the rewind restores the generator's state from before the step instead (saved
    by `ScheduleHook` when the step is scheduled), so a seeded request draws the same samples however its
    prompt is split into steps, as on a GPU."""
    if torch.cuda.is_available():
        return None
    try:
        batch = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.input_batch
    except AttributeError:
        log.warning("vLLM model runner internals not found: seeded requests with long prompts may fail")
        return None
    batch.generators = _RewindableGenerators(batch.generators)
    return batch.generators


@dataclass
class Scheduled:
    """What vLLM's scheduler put into one step."""

    batch_size: int
    prefill_tokens: int
    new_request_ids: list[str] = field(default_factory=list)
    paused: int = 0  # running bulk sequences the step plan held back
    plan_bulk_decode: int | None = None  # the plan's bulk decode limit, when it applied to this step
    bulk_decoded: int = 0  # bulk (priority != 0) sequences that decoded a token


class ScheduleHook:
    """The one place that reads vLLM internals (0.32 in-process mode).

    It records each SchedulerOutput by wrapping `scheduler.schedule`, and reads
    free blocks and queue lengths from the scheduler. Without those internals
    it falls back to what the public API gives, and says so once in the log.

    It also carries out the step plan (engine/types.py StepPlan): while an interactive request
    (priority 0) is running or waiting, `schedule` sees a running list of the interactive requests
    and only the first `bulk_decode` bulk ones, and a token budget of one per such request plus
    `prefill_tokens`; with none, the whole running list and a budget of one per request plus
    `guard_prefill_tokens` (the TTFT guard), so bulk prompts are computed in chunks. The bulk requests left out are put back at the end of the running list
    afterwards, unscheduled for that step with their KV blocks kept, as vLLM leaves any running
    request its token budget did not reach. (Lowering the token budget alone would not do: vLLM
    schedules its running list in the order requests joined it, before any waiting prompt.)
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.scheduled: Scheduled | None = None
        self.plan = StepPlan()
        self._applied_bulk_decode: int | None = None  # the plan's bulk limit as applied to the step being scheduled
        # Structured-output requests (vLLM's id) whose grammar is compiling: (added at, the delivered
        # tokens to replay over it once compiled, for a continuation).
        self.grammars: dict[str, tuple[float, list[int]]] = {}
        self.generators: _RewindableGenerators | None = None  # seeded requests' generators, saved each step
        self.kv_blocks_total = engine.vllm_config.cache_config.num_gpu_blocks - 1  # block 0 is never handed out
        try:
            self.scheduler = engine.engine_core.engine_core.scheduler
            self.block_pool = self.scheduler.kv_cache_manager.block_pool
            self._wrap_schedule()
        except AttributeError:
            log.warning("vLLM scheduler internals not found: reporting free KV blocks and batch shape as estimates")
            self.scheduler = None

    def start_step(self) -> None:
        self.scheduled = None

    def counts(self) -> tuple[int, int, int]:
        """(free KV blocks, running sequences, waiting sequences)."""
        if self.scheduler is None:
            return self.kv_blocks_total, self.engine.get_num_unfinished_requests(), 0
        running, waiting = self.scheduler.get_request_counts()
        return self.block_pool.get_num_free_blocks(), running, waiting

    def _wrap_schedule(self) -> None:
        scheduler = self.scheduler
        schedule = scheduler.schedule

        def recording_schedule(*args: Any, **kwargs: Any) -> Any:
            paused, budget = self._hold_back(scheduler)
            try:
                out = schedule(*args, **kwargs)
            finally:
                if paused:
                    scheduler.running = scheduler.running + paused
                scheduler.max_num_scheduled_tokens = budget
            if self.grammars:  # after schedule, before the engine computes this step's grammar masks
                self._replay_grammars(scheduler)
            if self.generators is not None:  # before the step samples: what a rewind goes back to
                self.generators.save()
            try:
                self.scheduled = _summarise(scheduler, out)
                self.scheduled.paused = len(paused)
                self.scheduled.plan_bulk_decode = self._applied_bulk_decode
            except Exception:  # never let bookkeeping break a step
                log.exception("could not read the scheduler's output")
            return out

        scheduler.schedule = recording_schedule


    def _replay_grammars(self, scheduler: Any) -> None:
        for internal, (_, delivered) in list(self.grammars.items()):
            request = scheduler.requests.get(internal)
            # None while the format compiles: kept (it counts as stalled, and against the compile limit).
            done = True if request is None else replay_grammar(request, delivered) if delivered else compiled(request)
            if done is None:
                continue
            if done is False:
                log.warning("the structured-output grammar refused the delivered tokens of %s", internal)
            del self.grammars[internal]

    def compiling_prompt_tokens(self) -> int:
        """Prompt tokens of the requests waiting for their format to compile (vLLM skips them meanwhile)."""
        if self.scheduler is None or not self.grammars:
            return 0
        requests = self.scheduler.requests
        return sum(r.num_prompt_tokens for i in self.grammars if (r := requests.get(i)) is not None)

    def stuck_grammars(self, now: float, limit_s: float) -> list[tuple[str, str]]:
        """Requests whose format has compiled for longer than `limit_s`, with the reason to give."""
        if self.scheduler is None:
            return []
        if self.grammars:
            self._replay_grammars(self.scheduler)
        return [(internal, f"compiling the structured-output format took longer than {limit_s:.0f} s; simplify it")
                for internal, (added, _) in self.grammars.items() if now - added > limit_s]

    def _hold_back(self, scheduler: Any) -> tuple[list[Any], int]:
        """Apply the plan to this step: (the bulk requests taken out of the running list, the token budget to restore)."""
        budget = scheduler.max_num_scheduled_tokens
        plan = self.plan
        self._applied_bulk_decode = None
        running = scheduler.running
        if not any(r.priority == 0 for r in running) and not any(r.priority == 0 for r in scheduler.waiting):
            # No interactive request: every sequence decodes; only the TTFT guard caps prompt tokens.
            # Decoding requests go first in the running list, which vLLM serves in order until the
            # budget is spent, so a bulk prompt part-way through its prefill takes only what is left.
            if plan.guard_prefill_tokens is not None:
                decoding = [r for r in running if r.num_computed_tokens >= r.num_prompt_tokens]
                if len(decoding) < len(running):
                    scheduler.running = decoding + [r for r in running if r.num_computed_tokens < r.num_prompt_tokens]
                scheduler.max_num_scheduled_tokens = min(budget, len(running) + plan.guard_prefill_tokens)
            return [], budget
        if not plan.limits:
            return [], budget
        interactive = [r for r in running if r.priority == 0]
        bulk = [r for r in running if r.priority != 0]
        decoding = [r for r in bulk if r.num_computed_tokens >= r.num_prompt_tokens]
        keep = decoding if plan.bulk_decode is None else decoding[:plan.bulk_decode]
        # A bulk prompt part-way through its prefill sits in the running list, which vLLM serves
        # before any waiting prompt: while an interactive prompt waits, it would take the step's
        # prefill tokens first. It pauses until the interactive prompt is in.
        if not any(r.priority == 0 for r in scheduler.waiting):
            keep = keep + [r for r in bulk if r not in decoding]
        kept = set(map(id, keep))
        paused = [r for r in bulk if id(r) not in kept]
        self._applied_bulk_decode = plan.bulk_decode
        if paused:
            scheduler.running = interactive + keep
        if plan.prefill_tokens is not None:
            owed = sum(_prompt_owed(r) for r in interactive) + sum(_prompt_owed(r) for r in scheduler.waiting
                                                                   if r.priority == 0)
            scheduler.max_num_scheduled_tokens = min(budget, len(scheduler.running) + plan.prefill_budget(owed))
        return paused, budget


def _prompt_owed(request: Any) -> int:
    """Prompt tokens a vLLM request has still to compute (0 once it decodes; a preempted one recomputes its output too)."""
    left = request.num_tokens - request.num_computed_tokens
    return left if left > 1 or request.num_computed_tokens < request.num_prompt_tokens else 0


def _summarise(scheduler: Any, out: Any) -> Scheduled:
    prefill = bulk_decoded = 0
    for req_id, n in out.num_scheduled_tokens.items():
        req = scheduler.requests.get(req_id)
        if req is None:
            continue
        before = req.num_computed_tokens - n  # schedule() has already advanced it
        # Decoding computes only the newest token; anything before it is prefill
        # (a prompt chunk, or recomputation after preemption).
        if before < max(req.num_prompt_tokens, req.num_tokens - 1):
            prefill += n
        elif req.priority != 0:
            bulk_decoded += 1
    return Scheduled(
        batch_size=len(out.num_scheduled_tokens),
        prefill_tokens=prefill,
        new_request_ids=[r.req_id for r in out.scheduled_new_reqs],
        bulk_decoded=bulk_decoded,
    )

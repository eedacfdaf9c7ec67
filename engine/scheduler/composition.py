"""Step composition: how many bulk sequences decode and how many prompt tokens prefill in a worker's next step.

While interactive streams run on a worker, each of its steps is one token of theirs, so its step
time is their inter-token latency (ITL). The rule fills a step, by the worker's fitted step-time
model (a + b·batch + c·prefill tokens), up to `share × target`, in this order:
  1. every interactive sequence decodes;
  2. interactive prompts still owed prefill (as much as fits, at least a chunk, so they progress);
  3. as many bulk sequences decode as fit, never fewer than `min_bulk`, so bulk never starves;
  4. prompt tokens (bulk's new prompts) fill what is left.
With no interactive stream, or no target, there is no limit: bulk gets the whole machine.
Pure: the worker carries the plan out (engine/types.py StepPlan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenline.engine.scheduler.estimator import StepEstimator
from tokenline.engine.types import StepPlan

NO_LIMIT = StepPlan()
MIN_PREFILL_CHUNK = 16  # an interactive prompt advances at least this much per step, even past the target


@dataclass(frozen=True)
class WorkerLoad:
    """What runs on a worker at a step boundary."""

    interactive: int  # interactive sequences running (decoding, or their prompt still owed)
    interactive_prefill: int  # prompt tokens of those not computed yet
    bulk: int  # bulk sequences decoding (a bulk prompt still owed is prefill, planned in step 4)


def compose_step(load: WorkerLoad, estimator: StepEstimator, itl_target_s: float | None, *,
                 share: float = 0.85, min_bulk: int = 1) -> StepPlan:
    """The plan for the worker's next steps, or NO_LIMIT when no interactive stream needs one."""
    if itl_target_s is None or load.interactive == 0:
        return NO_LIMIT
    a, b, c = estimator.coefficients
    room = share * itl_target_s - (a + b * load.interactive)
    interactive_prefill = load.interactive_prefill
    if c > 0:
        interactive_prefill = min(interactive_prefill, max(_fit(room, c), MIN_PREFILL_CHUNK))
    room -= c * interactive_prefill
    bulk = load.bulk if b <= 0 else min(load.bulk, _fit(room, b))
    bulk = max(bulk, min(min_bulk, load.bulk))
    room -= b * bulk
    prefill = interactive_prefill + _fit(room, c) if c > 0 else None
    predicted = a + b * (load.interactive + bulk) + c * (prefill or 0)
    return StepPlan(bulk_decode=bulk, prefill_tokens=prefill, predicted_step_s=predicted)


def _fit(room_s: float, cost_s: float) -> int:
    """How many items of `cost_s` fit in `room_s` (none when there is no room)."""
    return max(math.floor(room_s / cost_s + 1e-9), 0)

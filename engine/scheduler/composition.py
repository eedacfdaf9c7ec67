"""Step composition: how many bulk sequences decode and how many prompt tokens prefill in a worker's next step.

While interactive streams run on a worker, each of its steps is one token of theirs, so its step
time is their inter-token latency (ITL). The rule fills a step, by the worker's fitted step-time
model (a + b·batch + c·prefill tokens), up to the step budget the streams allow (stream_allowance:
what keeps each one's mean time per token at the set point), in this order:
  1. every interactive sequence decodes;
  2. interactive prompts still owed prefill: whole, beside only `min_bulk` bulk sequences, when no
     interactive stream is decoding yet (no one's ITL is at stake, and the step that gives their
     first token is as short as it can be), otherwise as much as fits (at least a chunk, and at least what
     keeps each owed prompt's first token within the TTFT target: planner.py `prefill_due`);
  3. as many bulk sequences decode as fit, never fewer than `min_bulk`, so bulk never starves (a
     bulk throughput goal is kept by admitting fewer interactive streams: `bulk_rate_beside`);
  4. prompt tokens (bulk's new prompts) fill what is left.
With no interactive stream there is no ITL to keep, and bulk keeps every sequence decoding. But an
interactive request may arrive at any moment, and it waits for the step under way before its own
can start: with a TTFT target, the prompt tokens of such a step are capped (`guard_prefill_tokens`,
chunked prefill) so that the step under way plus the newcomer's own first step fit in
`share × TTFT target`. Bulk prompts still get computed, in chunks that ride along decode steps,
never fewer tokens a step than replace the bulk sequences that end (bulk's batch never drains for
the guard: measured on a slow CPU, where the guard left 16 tokens a step, a 24-stream bulk loop
ran at 0.63 of its speed with no interactive request at all).
Pure: the worker carries the plan out (engine/types.py StepPlan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenline.engine.scheduler.estimator import StepEstimator
from tokenline.engine.types import StepPlan

NO_LIMIT = StepPlan()
MIN_PREFILL_CHUNK = 16  # a prompt advances at least this much per step, even past the target
PREFILL_SAMPLE_TOKENS = 64  # a step computing this many prompt tokens or more measures their cost


@dataclass(frozen=True)
class WorkerLoad:
    """What runs on a worker at a step boundary."""

    interactive: int  # interactive sequences running (decoding, or their prompt still owed)
    interactive_prefill: int  # prompt tokens of those not computed yet
    bulk: int  # bulk sequences decoding (a bulk prompt still owed is prefill, planned in step 4)
    interactive_decoding: int | None = None  # of `interactive`, those past their prompt (None: all of them)
    bulk_prefilling: int = 0  # bulk sequences running whose prompt is still owed
    interactive_prefill_due: int = 0  # of `interactive_prefill`, what this step must compute to keep TTFT targets


def step_line(estimator: StepEstimator, single_step_s: float | None, batch: int,
              prefill_token_s: float | None = None) -> tuple[float, float, float]:
    """(a, b, c) of a step = a + b·sequences + c·prompt tokens, for planning steps of 1 to `batch` sequences.

    The fitted model forgets: after a long run at one batch size (a bulk flood) it can no longer tell
    the fixed part from the per-sequence part, and would call a sequence free. The worker's measured
    single-sequence step is kept apart, so the line through it and the fitted step at `batch` bounds
    the per-sequence cost from below; the steeper of the two is used (the cautious choice: fewer bulk
    sequences per step), and either way the step at `batch` is predicted as fitted. Likewise the
    per-prompt-token cost: steps that compute prompts are rare beside decode steps, so the fit can let
    c drift low, and a step planned to take a short chunk would take a whole prompt's worth of time;
    the cost measured on steps that computed many prompt tokens (`prefill_token_s`) is its floor.
    """
    a, b, c = estimator.coefficients
    if prefill_token_s is not None:
        c = max(c, prefill_token_s)
    if single_step_s is not None and batch > 1:
        at_batch = a + b * batch
        through_single = (at_batch - single_step_s) / (batch - 1)
        if through_single > b:
            b = through_single
            a = at_batch - b * batch
    return a, b, c


def bulk_rate_beside(streams: int, coef: tuple[float, float, float], step_s: float, bulk_prompt_per_output: float) -> float:
    """Bulk tokens a second that steps of `step_s` beside `streams` interactive streams leave room for:
    what is left after the streams, divided by what a bulk token costs (its decode, and its share of
    the prefill of the bulk prompt that replaces a sequence when it ends)."""
    a, b, c = coef
    per_bulk = b + max(c, 0.0) * bulk_prompt_per_output
    room = step_s - (a + b * streams)
    return max(room, 0.0) / per_bulk / step_s if per_bulk > 0 else math.inf


def stream_allowance(target_s: float, set_point: float, gaps: int | None, elapsed_s: float = 0.0,
                     before_s: float = 0.0, steps_before: int = 0) -> float:
    """The longest planned step (seconds) that keeps one stream's mean time per token at or under
    `set_point × target_s` once the planned step's token has come.

    `gaps`: gaps between its tokens so far (None: no token yet, and the planned step is at most its
    first gap); `elapsed_s`: since its first token; `before_s`: the steps that run before the planned
    one (`steps_before` of them: a worker that steps on before its report is read has one under
    way). A stream behind its pace gets a shorter step (even none: the room goes negative and the
    step holds only what may never pause), one ahead a longer one, but never one past half way from
    the set point to the target: every gap, not only the mean, stays inside the target."""
    if gaps is None:
        return set_point * target_s
    allowed = set_point * target_s * (gaps + steps_before + 1) - elapsed_s - before_s
    return min(allowed, longest_step(target_s, set_point))


def longest_step(target_s: float, set_point: float) -> float:
    """The longest step planned for a stream however far ahead of its pace it is."""
    return 0.5 * (1.0 + set_point) * target_s


def compose_step(load: WorkerLoad, estimator: StepEstimator, itl_target_s: float | None, *,
                 share: float = 0.85, min_bulk: int = 1, ttft_target_s: float | None = None,
                 typical_prompt: int = 128, single_step_s: float | None = None,
                 prefill_token_s: float | None = None, bulk_prompt_per_output: float = 0.0,
                 step_budget_s: float | None = None) -> StepPlan:
    """The plan for the worker's next steps (NO_LIMIT when no target asks for one).

    Steps are filled up to `step_budget_s` (by the step-time model: the streams' allowance, see
    stream_allowance), or `share × itl_target_s` when no budget is given.
    `bulk_prompt_per_output`: prompt tokens a bulk request brings per token it makes; the TTFT guard
    never caps a step's prompt tokens below what keeps bulk's batch full as its sequences end."""
    a, b, c = step_line(estimator, single_step_s, load.interactive + load.bulk, prefill_token_s)
    guard = _ttft_guard(load, (a, b, c), itl_target_s, ttft_target_s, share, typical_prompt, min_bulk)
    if guard is not None:
        guard = max(guard, math.ceil((load.bulk + load.bulk_prefilling) * bulk_prompt_per_output))
    if itl_target_s is None or load.interactive == 0:
        return StepPlan(guard_prefill_tokens=guard) if guard is not None else NO_LIMIT
    room = (share * itl_target_s if step_budget_s is None else step_budget_s) - (a + b * load.interactive)
    # Prompt tokens the step budget allows beside the decodes that always run (StepPlan.prefill_budget).
    within = _fit(room - b * min(min_bulk, load.bulk), c) if c > 0 else None
    interactive_prefill = load.interactive_prefill
    decoding = load.interactive if load.interactive_decoding is None else load.interactive_decoding
    whole = decoding == 0  # no interactive stream waits for a next token: its prompts go in whole
    if c > 0 and not whole:
        interactive_prefill = min(interactive_prefill, max(_fit(room, c), MIN_PREFILL_CHUNK, load.interactive_prefill_due))
    if not whole:
        room -= c * interactive_prefill
    if whole:  # someone's first token, and no one waits on this step for a next one: only the bulk that never starves
        bulk = min(min_bulk, load.bulk)
    else:
        bulk = load.bulk if b <= 0 else min(load.bulk, _fit(room, b))
        bulk = max(bulk, min(min_bulk, load.bulk))
    room -= b * bulk
    if whole:
        prefill = interactive_prefill if c > 0 else None  # nothing else: this step is someone's first token
    else:
        prefill = interactive_prefill + _fit(room, c) if c > 0 else None
    predicted = a + b * (load.interactive + bulk) + c * (prefill or 0)
    return StepPlan(bulk_decode=bulk, prefill_tokens=prefill, predicted_step_s=predicted, guard_prefill_tokens=guard,
                    budget_prefill_tokens=within)


def _ttft_guard(load: WorkerLoad, coef: tuple[float, float, float], itl_target_s: float | None,
                ttft_target_s: float | None, share: float, typical_prompt: int, min_bulk: int) -> int | None:
    """Prompt tokens a step may compute while no interactive stream runs, so that an interactive
    request arriving during it still gets its first token within `share × TTFT target`: it waits
    for that step, then its own first step (with an ITL target: its whole prompt beside the bulk
    sequences that never starve; without one, a step of everything running plus its prompt)."""
    a, b, c = coef
    if ttft_target_s is None or c <= 0:
        return None
    alongside = min(min_bulk, load.bulk) if itl_target_s is not None else load.bulk
    own = a + b * (alongside + 1) + c * typical_prompt
    room = share * ttft_target_s - own - (a + b * load.bulk)
    return max(_fit(room, c), MIN_PREFILL_CHUNK)


def _fit(room_s: float, cost_s: float) -> int:
    """How many items of `cost_s` fit in `room_s` (none when there is no room)."""
    return max(math.floor(room_s / cost_s + 1e-9), 0)

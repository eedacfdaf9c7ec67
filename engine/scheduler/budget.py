"""A worker's budget at one step boundary: built fresh, used up by try_admit.

KV is counted on what sequences really hold, not on what they might: a running sequence
reserves the blocks for its prompt and the tokens it has produced, plus a margin of
`margin_tokens` it may add before the scheduler sees its worker's next report. Reservations
grow with every report (the scheduler re-counts them) and, when a worker's KV runs short,
bulk gives way first (preemption.py). A request asking for 4,000 tokens that stops after 40 holds
40 tokens' worth of KV, not 4,000.

An interactive request is admitted only where its whole output would fit in the KV free now,
so that growing into it later cannot push it out; it is still charged only what it holds.

Prompt tokens are counted per class: a worker computes interactive prompts before bulk prompts it
has not started (vLLM's priority order; engine/vllm_backend.py), so bulk prompts sent to it and not
yet begun take an interactive request's room in no step. Interactive prompts take bulk's: they go
first.

A prompt is charged what the worker will compute of it: less the full KV blocks its prefix cache holds for it
(`cached`: a call's sample on a worker that runs a sibling, placement.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tokenline.engine.scheduler.records import Entry
from tokenline.engine.types import TrafficClass


def blocks_at_most(entry: Entry, block_size: int) -> int:
    """KV blocks for prompt + every token it may still produce (a continuation re-prefills its output)."""
    return math.ceil((entry.prompt_tokens + entry.max_tokens) / block_size)


def blocks_for(entry: Entry, block_size: int, margin_tokens: int) -> int:
    """KV blocks reserved for `entry` now: what it holds, plus the margin, never beyond its last token."""
    tokens = min(entry.prompt_tokens + entry.generated + margin_tokens, entry.prompt_tokens + entry.max_tokens)
    return math.ceil(tokens / block_size)


class StepBudget:
    """`prefill_tokens` / `fresh_step`: the step's prompt room for bulk, after every prompt sent
    and not yet applied; `interactive_prefill_tokens` / `interactive_fresh`: for interactive, after
    the interactive ones only."""

    def __init__(self, slots: int, blocks: int, prefill_tokens: int, block_size: int, *, fresh_step: bool,
                 interactive_prefill_tokens: int, interactive_fresh: bool, margin_tokens: int = 0,
                 cached: Callable[[Entry], int] | None = None):
        self.slots = slots
        self.blocks = blocks
        self.prefill_tokens = prefill_tokens
        self.interactive_prefill_tokens = interactive_prefill_tokens
        self.block_size = block_size
        self.margin_tokens = margin_tokens
        # One prompt longer than the whole per-step budget may still go alone
        # into a step that has no other new prompt (vLLM chunks it).
        self._fresh_step = fresh_step
        self._interactive_fresh = interactive_fresh
        self.cached = cached  # prompt tokens of a request this worker's prefix cache holds (None: none)

    def copy(self) -> StepBudget:
        return StepBudget(self.slots, self.blocks, self.prefill_tokens, self.block_size,
                          fresh_step=self._fresh_step, margin_tokens=self.margin_tokens,
                          interactive_prefill_tokens=self.interactive_prefill_tokens,
                          interactive_fresh=self._interactive_fresh, cached=self.cached)

    def prompt_tokens(self, entry: Entry) -> int:
        """What the worker computes of `entry`'s prompt (a continuation's includes the tokens delivered before)."""
        tokens = entry.prompt_tokens + entry.generated
        return tokens - self.cached(entry) if self.cached is not None else tokens

    def blocks_charged(self, entry: Entry) -> int:
        return blocks_for(entry, self.block_size, self.margin_tokens)

    def _prompt_room(self, cls: TrafficClass) -> tuple[int, bool]:
        if cls == TrafficClass.INTERACTIVE:
            return self.interactive_prefill_tokens, self._interactive_fresh
        return self.prefill_tokens, self._fresh_step

    def fits(self, entry: Entry) -> bool:
        if self.slots < 1 or self.blocks_charged(entry) > self.blocks:
            return False
        if entry.cls == TrafficClass.INTERACTIVE and blocks_at_most(entry, self.block_size) > self.blocks:
            return False
        room, fresh = self._prompt_room(entry.cls)
        # A call's sample beside a sibling rides with it past the step's prompt room: its shared blocks are the
        # sibling's (vLLM computes the rest in a later step, on this worker); sent elsewhere, it computes the whole
        # prompt again (placement.py).
        return self.prompt_tokens(entry) <= room or fresh or self.rides_with_sibling(entry)

    def rides_with_sibling(self, entry: Entry) -> bool:
        return self.cached is not None and self.cached(entry) > 0

    def try_admit(self, entry: Entry) -> bool:
        if not self.fits(entry):
            return False
        tokens = self.prompt_tokens(entry)
        self.slots -= 1
        self.blocks -= self.blocks_charged(entry)
        self.prefill_tokens = max(self.prefill_tokens - tokens, 0)  # every prompt comes before bulk's next
        self._fresh_step = False
        if entry.cls == TrafficClass.INTERACTIVE:
            self.interactive_prefill_tokens = max(self.interactive_prefill_tokens - tokens, 0)
            self._interactive_fresh = False
        return True

    def exhausted_for(self, cls: TrafficClass) -> bool:
        room, fresh = self._prompt_room(cls)
        return self.slots < 1 or self.blocks < 1 or (room < 1 and not fresh)

    @property
    def exhausted(self) -> bool:
        """No room for bulk (the stricter view: interactive may still fit past bulk's pending prompts)."""
        return self.exhausted_for(TrafficClass.BULK)

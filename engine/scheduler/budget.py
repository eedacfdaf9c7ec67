"""A worker's budget at one step boundary: built fresh, used up by try_admit."""

from __future__ import annotations

import math

from tokenline.engine.scheduler.records import Entry


def blocks_for(entry: Entry, block_size: int) -> int:
    """KV blocks for prompt + every token still owed (a continuation re-prefills its output)."""
    return math.ceil((entry.prompt_tokens + entry.max_tokens) / block_size)


class StepBudget:
    def __init__(self, slots: int, blocks: int, prefill_tokens: int, block_size: int, *, fresh_step: bool):
        self.slots = slots
        self.blocks = blocks
        self.prefill_tokens = prefill_tokens
        self.block_size = block_size
        # One prompt longer than the whole per-step budget may still go alone
        # into a step that has no other new prompt (vLLM chunks it).
        self._fresh_step = fresh_step

    def fits(self, entry: Entry) -> bool:
        if self.slots < 1 or blocks_for(entry, self.block_size) > self.blocks:
            return False
        tokens = entry.prompt_tokens + entry.generated
        return tokens <= self.prefill_tokens or self._fresh_step

    def try_admit(self, entry: Entry) -> bool:
        if not self.fits(entry):
            return False
        self.slots -= 1
        self.blocks -= blocks_for(entry, self.block_size)
        self.prefill_tokens = max(self.prefill_tokens - (entry.prompt_tokens + entry.generated), 0)
        self._fresh_step = False
        return True

    @property
    def exhausted(self) -> bool:
        return self.slots < 1 or self.blocks < 1 or (self.prefill_tokens < 1 and not self._fresh_step)

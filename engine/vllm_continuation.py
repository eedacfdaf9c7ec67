"""What a continuation needs from the vLLM engine that a fresh request would not: the output so far.

A continuation (after a worker crash or a preemption) is a new engine request whose prompt ends with
the tokens already delivered. Two request features read "the output so far", which the engine then
no longer sees as output:
- presence and frequency penalties count output tokens only: `EarlierOutputPenalties`, a logits
  processor, applies all three penalties over (delivered + new) output, as vLLM's own
  `apply_penalties` does over its output (repetition, then frequency, then presence), while the
  request's own penalties are set to neutral;
- a structured-output grammar must stand where the delivered tokens left it: `replay_grammar`
  advances the engine's grammar over them once it is compiled, before the first token is sampled.
Imported only by the worker side (engine/vllm_backend.py and its vllm_* parts); nothing else here imports vllm.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

log = logging.getLogger(__name__)

# SamplingParams.extra_args key: {"delivered": n, "presence": p, "frequency": f, "repetition": r}
EARLIER_OUTPUT = "tokenline_earlier_output"


class EarlierOutputPenalties(LogitsProcessor):
    """Penalties over a continuation's whole output: the last `delivered` prompt tokens and the new ones."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[dict, list[int], list[int]]] = {}  # batch index -> (args, prompt, output)

    def is_argmax_invariant(self) -> bool:
        return False  # penalties change which token is most likely

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            args = (params.extra_args or {}).get(EARLIER_OUTPUT) if params is not None else None
            if args:
                self.rows[index] = (args, list(prompt_ids or ()), output_ids)  # output_ids: the engine's live list
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if direction == MoveDirectionality.SWAP and row_b is not None:
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (args, prompt, output) in self.rows.items():
            if index >= logits.shape[0]:
                continue
            vocab = logits.shape[1]
            row = logits[index]
            delivered = args["delivered"]
            earlier = prompt[len(prompt) - delivered:] + list(output)
            repetition = args["repetition"]
            if repetition != 1.0:
                seen = torch.tensor(sorted({t for t in prompt + list(output) if t < vocab}), dtype=torch.long)
                values = row[seen]
                row[seen] = torch.where(values > 0, values / repetition, values * repetition)
            if earlier:
                counts = torch.bincount(torch.tensor([t for t in earlier if t < vocab], dtype=torch.long),
                                        minlength=vocab)[:vocab].to(row.dtype)
                row -= args["frequency"] * counts
                row -= args["presence"] * (counts > 0).to(row.dtype)
        return logits


def compiled(request: Any) -> bool | None:
    """True once a request's format has compiled (or it has none), None while it compiles."""
    so = getattr(request, "structured_output_request", None)
    return True if so is None or so.grammar is not None else None


def replay_grammar(request: Any, tokens: list[int]) -> bool | None:
    """Advance a waiting request's compiled grammar over `tokens`: True done, False the grammar refused
    them, None not compiled yet (call again next step)."""
    so = getattr(request, "structured_output_request", None)
    if so is None:
        return True
    grammar = so.grammar  # None while compiling (in vLLM's thread pool)
    if grammar is None:
        return None
    if isinstance(grammar, Exception):
        return True  # vLLM fails the request itself
    return bool(grammar.accept_tokens(request.request_id, tokens))

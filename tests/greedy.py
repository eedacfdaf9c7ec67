"""What a greedy stream promises, checked without assuming vLLM is bit-identical anywhere.

vLLM's numerics differ with batch size, prefill vs decode and the CPU's kernels, so two greedy
runs of one prompt may part ways at a near-tie. What must hold is that every token of a stream is
a greedy choice *given exactly the tokens delivered before it*: across a worker crash, a retry
that lost, repeated or altered a token would continue from another context, and its next token
would not be a greedy choice for the context the caller saw. `Float32Judge` reads the whole
stream (prompt + every delivered token) through the model in float32 with `transformers` and
reports each position whose token is not within `tolerance` nats of the best.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# bf16 engines differ from float32 by < 0.01 nats on the tiny model (measured); a token generated
# from another context is within 0.1 nats of the best only by a ~1 % chance per position.
TOLERANCE_NATS = 0.1


@dataclass(frozen=True)
class Violation:
    index: int  # position in the generated tokens
    token: int
    logprob: float
    best: float

    def __str__(self) -> str:
        return f"token {self.index} ({self.token}): log-probability {self.logprob:.3f}, best {self.best:.3f}"


class Float32Judge:
    def __init__(self, folder: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def streamed_text(self, token_ids: list[int]) -> str:
        """The text a stream of these tokens carries: an unfinished character at the end is not sent."""
        return self.decode(token_ids).rstrip("\ufffd")

    def violations(self, prompt_ids: list[int], generated: list[int], tolerance: float = TOLERANCE_NATS) -> list[Violation]:
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([prompt_ids + generated])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        found = []
        for i, token in enumerate(generated):
            row = logprobs[len(prompt_ids) + i - 1]
            lp, best = float(row[token]), float(row.max())
            if lp < best - tolerance:
                found.append(Violation(i, token, lp, best))
        return found

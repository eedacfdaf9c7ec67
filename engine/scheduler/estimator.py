"""Running estimate of a worker's step time as a function of batch size."""

from __future__ import annotations


def _bucket(batch: int) -> int:
    b = 1
    while b < batch:
        b *= 2
    return b


class StepEstimator:
    """EWMA of decode step time per power-of-two batch bucket, plus prefill cost per token."""

    def __init__(self, prior_s: float, prefill_per_token_prior_s: float = 0.0, alpha: float = 0.2):
        self._alpha = alpha
        self._prior = prior_s
        self._step: dict[int, float] = {}
        self.prefill_per_token_s = prefill_per_token_prior_s

    def observe(self, batch: int, prefill_tokens: int, step_s: float) -> None:
        if batch < 1:
            return
        b = _bucket(batch)
        decode = self.step_s(batch)
        if prefill_tokens > 0:
            if b in self._step:
                extra = max(step_s - decode, 0.0) / prefill_tokens
                self.prefill_per_token_s += self._alpha * (extra - self.prefill_per_token_s)
            else:
                self._step[b] = step_s
            return
        old = self._step.get(b)
        self._step[b] = step_s if old is None else old + self._alpha * (step_s - old)

    def step_s(self, batch: int) -> float:
        b = _bucket(max(batch, 1))
        if b in self._step:
            return self._step[b]
        if not self._step:
            return self._prior
        nearest = min(self._step, key=lambda k: abs(k - b))
        return self._step[nearest]

    def first_token_s(self, batch: int, prompt_tokens: int) -> float:
        """Time from admission to the first token: one step plus the prompt's prefill."""
        return self.step_s(batch) + prompt_tokens * self.prefill_per_token_s

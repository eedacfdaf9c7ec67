"""Running estimate of a worker's step time as a function of batch shape.

A step costs about a + b·(sequences in the batch) + c·(prompt tokens it prefills).
The three coefficients are fitted by exponentially weighted least squares over
the worker's step reports, so they follow the machine as it warms up or gets
busier; a small ridge term keeps them at the configured prior until the data
says otherwise (for example b while every step has had the same batch size).
"""

from __future__ import annotations

# Features are scaled so that the ridge weighs the three coefficients alike.
_BATCH_SCALE = 1.0
_PREFILL_SCALE = 100.0


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve a 3×3 linear system (Cramer's rule, written out: it runs once or twice per step report, and the
    systems are the ridge-regularised normal equations, far from singular); None when it is singular."""
    (a, b, c), (d, e, f), (g, h, i) = m
    x, y, z = v
    ei_fh, di_fg, dh_eg = e * i - f * h, d * i - f * g, d * h - e * g
    det = a * ei_fh - b * di_fg + c * dh_eg
    scale = max(abs(a), abs(b), abs(c), abs(d), abs(e), abs(f), abs(g), abs(h), abs(i))
    if det == 0.0 or abs(det) < 1e-12 * scale ** 3:
        return None
    yi_fz, dz_yg = y * i - f * z, d * z - y * g
    return [(x * ei_fh - b * yi_fz + c * (y * h - e * z)) / det,
            (a * yi_fz - x * di_fg + c * dz_yg) / det,
            (a * (e * z - y * h) - b * dz_yg + x * dh_eg) / det]


def _solve_nonnegative(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Least squares with every coefficient ≥ 0: a coefficient the free solution makes negative is
    fixed at 0 and the others are solved again (clamping it alone would leave a fit that misses the
    data: after a long run at one batch size, a + b·24 fitted, b < 0 clamped, a far too high)."""
    free = [0, 1, 2]
    for _ in range(3):
        sub = _solve3(m, v) if len(free) == 3 else _solve_sub(m, v, free)
        if sub is None:
            return None
        coef = [0.0, 0.0, 0.0]
        for i, value in zip(free, sub):
            coef[i] = value
        negative = [i for i in free if coef[i] < 0]
        if not negative:
            return coef
        free = [i for i in free if i not in negative]
        if not free:
            return [0.0, 0.0, 0.0]
    return None


def _solve_sub(m: list[list[float]], v: list[float], free: list[int]) -> list[float] | None:
    """Solve the normal equations for the coefficients in `free` (the others are 0)."""
    n = len(free)
    sub_m = [[m[i][j] for j in free] + [0.0] * (3 - n) for i in free] + [[0.0] * 3 for _ in range(3 - n)]
    sub_v = [v[i] for i in free] + [0.0] * (3 - n)
    for k in range(n, 3):
        sub_m[k][k] = 1.0  # the fixed ones: 1·x = 0
    return None if (x := _solve3(sub_m, sub_v)) is None else x[:n]


class StepEstimator:
    def __init__(self, prior_s: float, prefill_per_token_prior_s: float = 0.0, *, decay: float = 0.98, ridge: float = 0.01):
        self._decay = decay
        self._ridge = ridge
        self._prior = [prior_s, 0.0, prefill_per_token_prior_s * _PREFILL_SCALE]
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._coef = list(self._prior)
        self._batch_sizes: set[int] = set()  # the first two seen; two tell a sequence's cost from the fixed part

    def observe(self, batch: int, prefill_tokens: int, step_s: float) -> None:
        """One step report: `batch` sequences, `prefill_tokens` prompt tokens, `step_s` seconds."""
        if batch < 1 or step_s <= 0:
            return
        if len(self._batch_sizes) < 2:
            self._batch_sizes.add(batch)
        # The normal equations' decayed sums, the symmetric matrix's six entries written out (x0 = 1): twice per
        # step report, where the loops over 3 × 3 and the lists built for them cost ~10 µs (issue 38).
        d, x1, x2 = self._decay, batch / _BATCH_SCALE, prefill_tokens / _PREFILL_SCALE
        (s00, s01, s02), (_, s11, s12), (_, _, s22) = self._xtx
        s00, s01, s02 = d * s00 + 1.0, d * s01 + x1, d * s02 + x2
        s11, s12, s22 = d * s11 + x1 * x1, d * s12 + x1 * x2, d * s22 + x2 * x2
        self._xtx = [[s00, s01, s02], [s01, s11, s12], [s02, s12, s22]]
        y0, y1, y2 = self._xty
        y0, y1, y2 = d * y0 + step_s, d * y1 + x1 * step_s, d * y2 + x2 * step_s
        self._xty = [y0, y1, y2]
        r, (p0, p1, p2) = self._ridge, self._prior
        m = [[s00 + r, s01, s02], [s01, s11 + r, s12], [s02, s12, s22 + r]]
        v = [y0 + r * p0, y1 + r * p1, y2 + r * p2]
        coef = _solve_nonnegative(m, v)
        if coef is not None:
            self._coef = coef

    @property
    def knows_sequence_cost(self) -> bool:
        """Has it seen steps of two batch sizes? Before, what one more sequence costs is its prior (0)."""
        return len(self._batch_sizes) >= 2

    @property
    def prefill_per_token_s(self) -> float:
        return self._coef[2] / _PREFILL_SCALE

    def step_s(self, batch: int) -> float:
        """A decode step (no prompt to prefill) with `batch` sequences."""
        a, b, _ = self._coef
        return max(a + b * max(batch, 1) / _BATCH_SCALE, 1e-6)

    def predict_s(self, batch: int, prefill_tokens: int) -> float:
        """A step with `batch` sequences that prefills `prefill_tokens` prompt tokens."""
        return self.step_s(batch) + prefill_tokens * self.prefill_per_token_s

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) of a + b·batch + c·prefill tokens, in seconds."""
        a, b, c = self._coef
        return a, b / _BATCH_SCALE, c / _PREFILL_SCALE

    def first_token_s(self, batch: int, prompt_tokens: int) -> float:
        """Time from admission to the first token: one step that also prefills the prompt."""
        return self.step_s(batch) + prompt_tokens * self.prefill_per_token_s

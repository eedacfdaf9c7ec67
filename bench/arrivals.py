"""When requests arrive: open-loop arrival processes, computed up front from a seed.

An open-loop schedule does not depend on how fast the server answers, so a slow
server cannot slow the load down (no coordinated omission). Gaps between
arrivals are drawn from

- poisson:  exponential gaps, mean 1/rate
- gamma:    gamma gaps with shape = burstiness and mean 1/rate; burstiness 1 is
            Poisson, below 1 burstier (squared coefficient of variation 1/burstiness),
            above 1 more regular
- constant: exactly 1/rate apart

Closed-loop load (a fixed number of requests in flight) has no schedule; the
runner sends the next request when one finishes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("poisson", "gamma", "constant")


@dataclass(frozen=True)
class ArrivalProcess:
    """Open-loop arrivals at `rate` requests/s."""

    rate: float
    kind: str = "poisson"
    burstiness: float = 1.0  # gamma shape; used by "gamma" only

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"arrival kind {self.kind!r} is unknown: use one of {', '.join(KINDS)}")
        if not self.rate > 0:
            raise ValueError(f"arrival rate must be a positive number of requests/s, got {self.rate!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive (1 = Poisson, lower = burstier), got {self.burstiness!r}")

    def gap(self, rng: random.Random) -> float:
        """One inter-arrival gap in seconds."""
        if self.kind == "constant":
            return 1.0 / self.rate
        if self.kind == "gamma":
            return rng.gammavariate(self.burstiness, 1.0 / (self.rate * self.burstiness))
        return rng.expovariate(self.rate)

    def schedule(self, *, seed: int, duration_s: float | None = None, count: int | None = None) -> list[float]:
        """Arrival times in seconds from 0: those before `duration_s`, at most `count` of them.

        The first arrival comes after one gap, as in a process already running.
        """
        if duration_s is None and count is None:
            raise ValueError("give a duration or a request count for the arrival schedule")
        rng = random.Random(seed)
        times: list[float] = []
        t = 0.0
        while count is None or len(times) < count:
            t += self.gap(rng)
            if duration_s is not None and t >= duration_s:
                break
            times.append(t)
        return times

    def scaled(self, rate: float) -> ArrivalProcess:
        return ArrivalProcess(rate=rate, kind=self.kind, burstiness=self.burstiness)

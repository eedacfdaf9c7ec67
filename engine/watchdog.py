"""The step watchdog: a worker with work in flight that stops reporting steps is declared lost.

A crashed worker announces itself (its pipe closes); a hung one (stopped, deadlocked, swapping)
does not, and its streams would stall while health still says SERVING. A worker that has work
reports after every step, so silence longer than its steps can explain is a failure: the limit is
`factor` times the longer of the longest step seen recently and the step-time model's estimate of
its heaviest possible step (a full batch with a full prefill budget), and never below `floor_s`.
The caller kills a lost worker, which then takes the path of any crash (its runs continue
elsewhere as new attempts).

Pure: the clock is passed in, and the caller says which workers have work in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

RECENT_STEPS = 64  # the longest of the last this-many steps sets the scale of a worker's silence


@dataclass(frozen=True)
class Silence:
    worker_id: int
    silent_s: float
    limit_s: float


@dataclass
class _Heard:
    at: float
    recent_steps: list[float]
    heaviest_step_s: float = 0.0  # the step-time model's estimate for a full step


class StepWatchdog:
    def __init__(self, floor_s: float = 5.0, factor: float = 10.0):
        if floor_s <= 0 or factor <= 0:
            raise ValueError(f"the watchdog needs floor_s > 0 and factor > 0, got {floor_s} and {factor}")
        self.floor_s, self.factor = floor_s, factor
        self._heard: dict[int, _Heard] = {}

    def expect(self, worker_id: int, now: float, heaviest_step_s: float = 0.0) -> None:
        """Work was sent to a worker that had none in flight: its silence counts from now."""
        heard = self._heard.setdefault(worker_id, _Heard(now, []))
        heard.at = now
        heard.heaviest_step_s = max(heard.heaviest_step_s, heaviest_step_s)

    def saw_step(self, worker_id: int, step_s: float, now: float, heaviest_step_s: float = 0.0) -> None:
        heard = self._heard.setdefault(worker_id, _Heard(now, []))
        heard.at = now
        heard.recent_steps.append(step_s)
        del heard.recent_steps[:-RECENT_STEPS]
        heard.heaviest_step_s = heaviest_step_s

    def forget(self, worker_id: int) -> None:
        self._heard.pop(worker_id, None)

    def limit_s(self, worker_id: int) -> float:
        heard = self._heard.get(worker_id)
        if heard is None:
            return self.floor_s
        longest = max(max(heard.recent_steps, default=0.0), heard.heaviest_step_s)
        return max(self.floor_s, self.factor * longest)

    def silent(self, busy_workers: set[int], now: float) -> list[Silence]:
        """Workers with work in flight that have been silent past their limit."""
        out = []
        for wid in sorted(busy_workers):
            heard = self._heard.get(wid)
            if heard is None:
                continue
            limit = self.limit_s(wid)
            if now - heard.at > limit:
                out.append(Silence(wid, now - heard.at, limit))
        return out

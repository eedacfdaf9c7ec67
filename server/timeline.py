"""One request's timeline on the frontend's monotonic clock, and its splits.

Stamps are `time.monotonic()` seconds of this process; worker stamps are
converted when they arrive (never compared across processes). Counts (attempts,
preemptions, tokens) are not kept here: the request's scheduler Entry has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timeline:
    received: float
    validated: float | None = None
    enqueued: float | None = None
    admitted: float | None = None  # first admission to a worker
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    last_byte: float | None = None
    admission_wait_s: float = 0.0
    queueing_s: float = 0.0
    gap_sum_s: float = 0.0  # sum of gaps between consecutive tokens
    gap_count: int = 0
    gaps: list[float] = field(default_factory=list)  # per gap; bounded by max_tokens
    # Preemptions and worker failures: from each interruption to the next token.
    interrupted: tuple[float, str] | None = None  # (since, cause) until the next token
    interruptions: list[tuple[str, float, float]] = field(default_factory=list)  # (cause, since, lost seconds)
    lost_before_first_token_s: float = 0.0

    def interrupt(self, now: float, cause: str) -> None:
        """The run stopped (cause: "preemption" or "retry"); time is lost until its next token."""
        if self.interrupted is not None:
            self._resume(now)
        self.interrupted = (now, cause)

    def _resume(self, now: float) -> None:
        since, cause = self.interrupted
        self.interrupted = None
        lost = max(now - since, 0.0)
        self.interruptions.append((cause, since, lost))
        if self.first_token is None:
            self.lost_before_first_token_s += lost

    def close(self, now: float) -> None:
        """The request ended: an interruption it never recovered from lasts until now."""
        self.finished = now
        if self.interrupted is not None:
            self._resume(now)

    def lost_s(self, cause: str) -> float:
        return sum(lost for c, _, lost in self.interruptions if c == cause)

    def on_tokens(self, now: float, count: int) -> None:
        """`count` tokens arrived at `now` (several in one report count as several gaps)."""
        if count <= 0:
            return
        if self.interrupted is not None:
            self._resume(now)
        if self.first_token is None:
            self.first_token = now
            count -= 1
            self.last_token = now
        if count > 0:
            gap = (now - self.last_token) / count
            self.gaps.extend([gap] * count)
            self.gap_sum_s += now - self.last_token
            self.gap_count += count
            self.last_token = now

    def splits_ms(self) -> dict[str, float]:
        """The bill, in milliseconds: waits, model time, time lost to interruptions, return, totals.

        Every millisecond is in exactly one of intake (received → enqueued), admission wait,
        queueing, prefill, decode, lost and return; they add up to the completion time.
        Waits are those before the first admission; waits after a preemption or a worker
        failure are part of the lost time, not of prefill or decode.
        """
        def span(a: float | None, b: float | None) -> float:
            return max((b - a) * 1000.0, 0.0) if a is not None and b is not None else 0.0

        end = self.last_byte if self.last_byte is not None else self.finished
        lost_ms = sum(lost for _, _, lost in self.interruptions) * 1000.0
        lost_before_ms = self.lost_before_first_token_s * 1000.0
        return {
            "admission_wait_ms": self.admission_wait_s * 1000.0,
            "queueing_ms": self.queueing_s * 1000.0,
            "prefill_ms": max(span(self.admitted, self.first_token) - lost_before_ms, 0.0),
            "decode_ms": max(span(self.first_token, self.last_token) - (lost_ms - lost_before_ms), 0.0),
            "lost_preemption_ms": self.lost_s("preemption") * 1000.0,
            "lost_retry_ms": self.lost_s("retry") * 1000.0,
            "return_ms": span(self.finished, self.last_byte),
            "ttft_ms": span(self.received, self.first_token),
            "itl_mean_ms": (self.gap_sum_s / self.gap_count * 1000.0) if self.gap_count else 0.0,
            "completion_ms": span(self.received, end),
        }

    def stamps_ms(self) -> dict[str, float | None]:
        def rel(t: float | None) -> float | None:
            return None if t is None else (t - self.received) * 1000.0

        return {
            "received_ms": 0.0,
            "validated_ms": rel(self.validated),
            "enqueued_ms": rel(self.enqueued),
            "admitted_ms": rel(self.admitted),
            "first_scheduled_ms": rel(self.first_scheduled),
            "first_token_ms": rel(self.first_token),
            "finished_ms": rel(self.finished),
            "last_byte_ms": rel(self.last_byte),
        }

"""What the bench records about one request, and the latencies derived from it.

Times are seconds from the run's start on the load generator's monotonic clock.
Every latency counts from the request's *scheduled* arrival, not from when it
was actually sent, so a load generator (or server) that falls behind cannot
hide the wait (no coordinated omission); the difference is kept as `send_lag`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# How a request ended.
OK = "ok"  # finished normally (eos, length or stop string)
REFUSED = "refused"  # the server refused it at once (overload, or a deadline it could not meet)
TIMEOUT = "timeout"  # its deadline passed before it finished
CANCELLED = "cancelled"  # the bench abandoned it part-way, on purpose (a user leaving)
ERROR = "error"  # any other failure
UNFINISHED = "unfinished"  # still running when the run ended (drain timeout or early stop)
STATUSES = (OK, REFUSED, TIMEOUT, CANCELLED, ERROR, UNFINISHED)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    stream: str
    traffic_class: str
    scheduled: float
    input_tokens: int
    max_tokens: int
    deadline_s: float | None = None
    sent: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that chunk
    end: float | None = None
    status: str = UNFINISHED
    finish_reason: str | None = None
    error: str | None = None
    retry_after_s: float | None = None
    prompt_tokens: int | None = None  # as the server counted them
    server: dict[str, Any] | None = None  # the server's timeline (ms), from the final chunk

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def send_lag(self) -> float | None:
        return None if self.sent is None else self.sent - self.scheduled

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.scheduled if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        """Completion time: scheduled arrival until the stream ended."""
        return None if self.end is None else self.end - self.scheduled

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last token − first token) / (tokens − 1)."""
        n = self.output_tokens
        if n < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1)

    def itl_gaps(self) -> list[float]:
        return itl_gaps(self.chunk_times, self.chunk_tokens)

    def to_json(self) -> dict[str, Any]:
        """One line of the per-request JSONL file (times in seconds from the run's start)."""
        return {
            "request_id": self.request_id, "stream": self.stream, "class": self.traffic_class,
            "status": self.status, "finish_reason": self.finish_reason, "error": self.error,
            "scheduled_s": self.scheduled, "sent_s": self.sent, "end_s": self.end,
            "send_lag_ms": _ms(self.send_lag), "ttft_ms": _ms(self.ttft), "tpot_ms": _ms(self.tpot),
            "e2e_ms": _ms(self.e2e), "input_tokens": self.input_tokens, "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens, "max_tokens": self.max_tokens, "deadline_s": self.deadline_s,
            "retry_after_s": self.retry_after_s,
            "token_times_s": self.chunk_times, "token_counts": self.chunk_tokens, "server_ms": self.server,
        }  # fmt: skip


def itl_gaps(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """Inter-token gaps, one per token after the first.

    A chunk carrying n tokens counts as n gaps that share the wait before it
    (wait / n each); tokens arriving together in the first chunk add gaps of 0.
    This is the rule `tokenline.client.itl_gaps` uses, so the mean gap is
    (last token − first token) / (tokens − 1) however the server chunked.
    """
    gaps: list[float] = []
    previous: float | None = None
    for t, n in zip(chunk_times, chunk_tokens):
        if n <= 0:
            continue
        if previous is None:
            gaps.extend([0.0] * (n - 1))
        else:
            gaps.extend([(t - previous) / n] * n)
        previous = t
    return gaps


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0

"""Latency of one stream as the client saw it: time to first token, inter-token gaps, total.

Measured from chunk arrival times only, so it includes everything the server's
own timeline cannot see (transport, the client's event loop). A chunk may carry
several tokens; they arrived together, so the wait before the chunk is spread
evenly over its tokens: a 30 ms wait for a 3-token chunk is three 10 ms gaps.
The mean gap therefore is (last token's arrival - first token's arrival) / (tokens - 1),
however the server chunked the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._types import Delta


@dataclass(frozen=True)
class StreamTiming:
    """Client-side timing of one stream, in seconds; None where it cannot be measured."""

    ttft_s: float | None  # send until the first chunk with a token
    itl_mean_s: float | None  # mean gap between tokens (None with fewer than two)
    total_s: float | None  # send until the last chunk
    tokens: int
    chunks: int


def itl_gaps(deltas: Sequence[Delta]) -> list[float]:
    """The gaps between consecutive tokens, one per token after the first.

    Tokens that share the first chunk arrived together (gaps of 0); every later
    chunk of n tokens contributes n gaps of (wait since the previous token) / n.
    Chunks without tokens (such as a final chunk with only the finish reason) add none.
    """
    gaps: list[float] = []
    previous_arrival: float | None = None
    for delta in deltas:
        n = len(delta.token_ids)
        if n == 0:
            continue
        if previous_arrival is None:
            gaps.extend([0.0] * (n - 1))
        else:
            gaps.extend([(delta.received_at - previous_arrival) / n] * n)
        previous_arrival = delta.received_at
    return gaps


def stream_timing(sent_at: float, deltas: Sequence[Delta]) -> StreamTiming:
    """Timing of a stream started at `sent_at` (time.monotonic) whose chunks were `deltas`."""
    first_token = next((d for d in deltas if d.token_ids), None)
    gaps = itl_gaps(deltas)
    return StreamTiming(
        ttft_s=first_token.received_at - sent_at if first_token else None,
        itl_mean_s=sum(gaps) / len(gaps) if gaps else None,
        total_s=deltas[-1].received_at - sent_at if deltas else None,
        tokens=sum(len(d.token_ids) for d in deltas),
        chunks=len(deltas),
    )

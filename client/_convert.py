"""Pure conversions between the caller's arguments, the proto messages and the client's dataclasses.

No I/O here: the clients call these around each RPC, and tests call them directly.
"""

from __future__ import annotations

import dataclasses

from typing import TypedDict

import math
import operator
from collections.abc import Iterable, Mapping, Sequence

from tokenline.v1 import tokenline_pb2 as pb

from ._types import Completion, Delta, ModelInfo, ServerTimeline, Usage

# A chat message as a caller writes it: {"role": ..., "content": ...} or (role, content).
Message = Mapping[str, str] | tuple[str, str]

_TRAFFIC_CLASSES = {"interactive": pb.INTERACTIVE, "bulk": pb.BULK}

_FINISH_REASONS = {
    pb.STOP: "stop",
    pb.LENGTH: "length",
    pb.STOP_STRING: "stop_string",
    pb.CANCELLED: "cancelled",
    pb.DEADLINE: "deadline",
}

_OPTIONAL_STAMPS = ("first_scheduled_ms", "first_token_ms", "finished_ms", "last_byte_ms")


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of `generate()` and `complete()`, on both clients.

    messages / token_ids: the prompt as chat messages or token ids (instead of text);
    model; max_tokens; temperature, top_p, top_k, seed, stop, ignore_eos: sampling;
    traffic_class: "interactive" or "bulk"; request_id; idempotency_key (a retry with
    the same key returns the same run's result; a keyed stream re-attaches after a
    break); deadline_s: seconds from now, bounds the call and tells the server;
    require_completion: with a deadline, refuse unless the whole completion fits;
    itl_target_ms: interactive only, this request's own inter-token latency target;
    timeout: bounds the call only.
    """

    messages: Sequence[Message] | None
    token_ids: Sequence[int] | None
    model: str
    max_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | Iterable[str]
    ignore_eos: bool
    traffic_class: str
    request_id: str
    idempotency_key: str
    deadline_s: float | None
    require_completion: bool
    itl_target_ms: float
    timeout: float | None


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Message] | None = None,
    token_ids: Sequence[int] | None = None,
    model: str = "",
    max_tokens: int = 64,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Iterable[str] = (),
    ignore_eos: bool = False,
    traffic_class: str = "interactive",
    request_id: str = "",
    deadline_unix_ms: int = 0,
    idempotency_key: str = "",
    resume_from_index: int = 0,
    require_completion: bool = False,
    itl_target_ms: float = 0.0,
) -> pb.GenerateRequest:
    """The GenerateRequest for one call. Raises ValueError on arguments no server would accept.

    Exactly one of `prompt` (plain text), `messages` (chat) or `token_ids` must be
    given. Sampling fields left as None are not sent, so the server's defaults apply.
    """
    given = [
        name
        for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "give exactly one of prompt, messages or token_ids"
            + (f" (got {' and '.join(given)})" if given else "")
        )
    if traffic_class not in _TRAFFIC_CLASSES:
        raise ValueError(f"traffic_class must be 'interactive' or 'bulk', not {traffic_class!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")

    request = pb.GenerateRequest(
        model=model,
        traffic_class=_TRAFFIC_CLASSES[traffic_class],
        request_id=request_id,
        idempotency_key=idempotency_key,
        resume_from_index=resume_from_index,
        require_completion_by_deadline=require_completion,
        itl_target_ms=itl_target_ms,
        deadline_unix_ms=deadline_unix_ms,
        sampling=pb.SamplingParams(
            max_tokens=max_tokens,
            # A lone string is one stop string, not a list of characters.
            stop=[stop] if isinstance(stop, str) else list(stop),
            ignore_eos=ignore_eos,
        ),
    )
    for field, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(request.sampling, field, value)

    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        if not messages:
            raise ValueError("messages must hold at least one message")
        request.chat.CopyFrom(pb.ChatMessages(messages=[chat_message(m) for m in messages]))
    else:
        request.token_ids.CopyFrom(pb.TokenIds(ids=_token_ids(token_ids)))
    return request


def _token_ids(token_ids: Sequence[int]) -> list[int]:
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        raise ValueError("token_ids must be integers") from None
    if any(t < 0 or t >= 2**32 for t in ids):
        raise ValueError("token_ids must be in [0, 2**32)")
    return ids


def chat_message(message: Message) -> pb.ChatMessage:
    """A ChatMessage from a {"role", "content"} mapping or a (role, content) pair."""
    if isinstance(message, Mapping):
        try:
            return pb.ChatMessage(role=message["role"], content=message["content"])
        except KeyError as missing:
            raise ValueError(
                f"a chat message needs 'role' and 'content'; {missing} is missing"
            ) from None
    if isinstance(message, (tuple, list)) and len(message) == 2:
        role, content = message
        return pb.ChatMessage(role=role, content=content)
    raise ValueError(
        f"a chat message is a {{'role', 'content'}} dict or a (role, content) pair, not {message!r}"
    )


def call_deadline(
    deadline_s: float | None, timeout: float | None, now_unix_s: float
) -> tuple[float | None, int]:
    """(gRPC timeout in seconds, deadline_unix_ms for the request) for one call.

    `deadline_s` is a deadline relative to now: it bounds the call on the wire and
    is told to the server so it can refuse work it cannot finish in time.
    `timeout` bounds the call on the wire only. The earlier of the two wins.
    """
    for name, value in (("deadline_s", deadline_s), ("timeout", timeout)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    if deadline_s is None:
        return timeout, 0
    grpc_timeout = deadline_s if timeout is None else min(deadline_s, timeout)
    return grpc_timeout, int(math.ceil((now_unix_s + deadline_s) * 1000))


def finish_reason_name(reason: int) -> str | None:
    """ "stop", "length", "stop_string", "cancelled" or "deadline"; None while unfinished."""
    return _FINISH_REASONS.get(reason)


def timeline_from_proto(timeline: pb.Timeline) -> ServerTimeline:
    """The ServerTimeline of a proto Timeline (same field names); stamps the server did not set are None."""
    return ServerTimeline(**{
        f.name: (getattr(timeline, f.name) if f.name not in _OPTIONAL_STAMPS or timeline.HasField(f.name) else None)
        for f in dataclasses.fields(ServerTimeline)
    })


def usage_from_proto(usage: pb.Usage) -> Usage:
    return Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)


def delta_from_chunk(chunk: pb.GenerateChunk, received_at: float) -> Delta:
    """The Delta of one streamed chunk that arrived at `received_at` (time.monotonic)."""
    return Delta(
        request_id=chunk.request_id,
        attempt=chunk.attempt,
        index=chunk.index,
        token_ids=tuple(chunk.token_ids),
        text=chunk.text,
        received_at=received_at,
        finish_reason=finish_reason_name(chunk.finish_reason),
        usage=usage_from_proto(chunk.usage) if chunk.HasField("usage") else None,
        timeline=timeline_from_proto(chunk.timeline) if chunk.HasField("timeline") else None,
    )


def completion_from_response(response: pb.CompleteResponse) -> Completion:
    return Completion(
        request_id=response.request_id,
        text=response.text,
        token_ids=tuple(response.token_ids),
        finish_reason=finish_reason_name(response.finish_reason),
        usage=usage_from_proto(response.usage) if response.HasField("usage") else None,
        timeline=timeline_from_proto(response.timeline) if response.HasField("timeline") else None,
        attempt=response.attempt,
    )


def model_from_proto(model: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        name=model.name,
        version=model.version,
        max_context=model.max_context,
        loaded=model.loaded,
        workers=model.workers,
        dtype=model.dtype,
        attention_kernel=model.attention_kernel,
        self_check=model.self_check,
        execution=model.execution,
    )

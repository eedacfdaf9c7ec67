"""Pure conversions between the caller's arguments, the proto messages and the client's dataclasses.

No I/O here: the clients call these around each RPC, and tests call them directly.
"""

from __future__ import annotations

import dataclasses
import json

from typing import TypedDict

import math
import operator
from collections.abc import Iterable, Mapping, Sequence

from tokenline.v1 import tokenline_pb2 as pb

from ._types import (Completion, Delta, ModelInfo, PositionLogprobs, ServerTimeline, TokenLogprob, ToolCall, ToolCallDelta,
                     Usage)

# A chat message as a caller writes it: {"role": ..., "content": ...} or (role, content).
Message = Mapping[str, str] | tuple[str, str]

_TRAFFIC_CLASSES = {"interactive": pb.INTERACTIVE, "bulk": pb.BULK}

_FINISH_REASONS = {
    pb.STOP: "stop",
    pb.LENGTH: "length",
    pb.STOP_STRING: "stop_string",
    pb.CANCELLED: "cancelled",
    pb.DEADLINE: "deadline",
    pb.TOOL_CALLS: "tool_calls",
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
    min_p, repetition_penalty, presence_penalty, frequency_penalty, min_tokens,
    stop_token_ids, logit_bias ({token id: bias}), include_stop_str_in_output: sampling, as
    vLLM's SamplingParams; logprobs / prompt_logprobs: alternatives per token (0: the token's own
    only); json_schema (a dict or JSON text), json_object, regex, choice, grammar: the output's
    format (at most one); n: independent samples of the prompt (Delta.sample_index,
    Completion.samples).
    tools (with messages): functions the model may call, each {"name", "description", "parameters"}
    (a JSON schema) or OpenAI's {"type": "function", "function": {...}}; tool_choice: "none", "auto",
    "required" or {"name": <function>} (required and a named function are enforced on any model);
    parallel_tool_calls False: at most one call; chat_template_kwargs: extra chat-template variables.
    A message may carry "tool_calls" (assistant: as Completion.tool_calls gave them) or
    "tool_call_id" (role "tool": a call's result).
    max_tokens: left out, the server's default (the rest of the context, capped).
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
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    min_tokens: int
    stop_token_ids: Sequence[int]
    logit_bias: Mapping[int, float]
    include_stop_str_in_output: bool
    logprobs: int | None
    prompt_logprobs: int | None
    json_schema: Mapping | str | None
    json_object: bool
    regex: str | None
    choice: Sequence[str] | None
    grammar: str | None
    n: int
    tools: Sequence[Mapping] | None
    tool_choice: str | Mapping | None
    parallel_tool_calls: bool
    chat_template_kwargs: Mapping | None


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Message] | None = None,
    token_ids: Sequence[int] | None = None,
    model: str = "",
    max_tokens: int | None = None,
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
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_tokens: int = 0,
    stop_token_ids: Sequence[int] = (),
    logit_bias: Mapping[int, float] | None = None,
    include_stop_str_in_output: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    json_schema: Mapping | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    n: int = 1,
    tools: Sequence[Mapping] | None = None,
    tool_choice: str | Mapping | None = None,
    parallel_tool_calls: bool = True,
    chat_template_kwargs: Mapping | None = None,
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
    if max_tokens is not None and max_tokens < 1:
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
            max_tokens=max_tokens or 0,
            # A lone string is one stop string, not a list of characters.
            stop=[stop] if isinstance(stop, str) else list(stop),
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            stop_token_ids=_token_ids(stop_token_ids),
            logit_bias={operator.index(t): float(b) for t, b in (logit_bias or {}).items()},
            include_stop_str_in_output=include_stop_str_in_output,
            n=n if n != 1 else 0,
        ),
    )
    for field, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("min_p", min_p),
        ("repetition_penalty", repetition_penalty),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
        ("logprobs", logprobs),
        ("prompt_logprobs", prompt_logprobs),
    ):
        if value is not None:
            setattr(request.sampling, field, value)
    formats = structured_output(json_schema=json_schema, json_object=json_object, regex=regex, choice=choice,
                                grammar=grammar)
    if formats is not None:
        request.sampling.structured_output.CopyFrom(formats)

    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        if not messages:
            raise ValueError("messages must hold at least one message")
        request.chat.CopyFrom(pb.ChatMessages(messages=[chat_message(m) for m in messages]))
        _chat_tools(request.chat, tools, tool_choice, parallel_tool_calls, chat_template_kwargs)
    else:
        request.token_ids.CopyFrom(pb.TokenIds(ids=_token_ids(token_ids)))
    if request.WhichOneof("prompt") != "chat" and (tools or tool_choice or chat_template_kwargs):
        raise ValueError("tools, tool_choice and chat_template_kwargs go with messages (a chat)")
    return request


_TOOL_CHOICES = {"none": pb.ToolChoice.NONE, "auto": pb.ToolChoice.AUTO, "required": pb.ToolChoice.REQUIRED}


def _chat_tools(chat: pb.ChatMessages, tools: Sequence[Mapping] | None, tool_choice: str | Mapping | None,
                parallel: bool, template_kwargs: Mapping | None) -> None:
    for tool in tools or ():
        f = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if f is None or "name" not in f:
            raise ValueError(f"a tool is {{'name', 'description', 'parameters'}} or OpenAI's function tool, not {tool!r}")
        params = f.get("parameters")
        chat.tools.append(pb.Tool(name=f["name"], description=f.get("description", ""),
                                  parameters_json="" if params is None else
                                  params if isinstance(params, str) else json.dumps(params)))
    if isinstance(tool_choice, str):
        if tool_choice not in _TOOL_CHOICES:
            raise ValueError(f"tool_choice is 'none', 'auto', 'required' or {{'name': <function>}}, not {tool_choice!r}")
        chat.tool_choice.mode = _TOOL_CHOICES[tool_choice]
    elif tool_choice is not None:
        name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
        if not name:
            raise ValueError(f"tool_choice names a function as {{'name': <function>}}, not {tool_choice!r}")
        chat.tool_choice.CopyFrom(pb.ToolChoice(mode=pb.ToolChoice.FUNCTION, function_name=name))
    if not parallel:
        chat.tool_choice.single_call = True
    if template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(dict(template_kwargs))


def tokenize_request(prompt: str | None, messages: Sequence[Message] | None, model: str = "") -> pb.TokenizeRequest:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if prompt is not None:
        return pb.TokenizeRequest(model=model, text=prompt)
    return pb.TokenizeRequest(model=model, chat=pb.ChatMessages(messages=[chat_message(m) for m in messages]))


def structured_output(*, json_schema: Mapping | str | None = None, json_object: bool = False, regex: str | None = None,
                      choice: Sequence[str] | None = None, grammar: str | None = None) -> pb.StructuredOutput | None:
    """The StructuredOutput for at most one format; None when none is given."""
    given = {name: value for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                             ("regex", regex), ("choice", choice), ("grammar", grammar))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one output format, not {' and '.join(given)}")
    if not given:
        return None
    (name, value), = given.items()
    if name == "json_schema":
        import json

        return pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if name == "choice":
        if isinstance(value, str):
            raise ValueError("choice is a list of strings, not one string")
        return pb.StructuredOutput(choice=pb.Choices(choices=list(value)))
    if name == "json_object":
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(**{name: value})


def logprobs_from_proto(positions) -> tuple[PositionLogprobs, ...]:
    def one(t: pb.TokenLogprob) -> TokenLogprob:
        return TokenLogprob(token_id=t.token_id, logprob=t.logprob, rank=t.rank, text=t.text)
    return tuple(PositionLogprobs(one(p.token), tuple(one(t) for t in p.top)) for p in positions)


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
            calls = [pb.ToolCall(id=c["id"], name=c.get("name") or c["function"]["name"],
                                 arguments=c.get("arguments", (c.get("function") or {}).get("arguments", "")))
                     for c in message.get("tool_calls") or ()]
            return pb.ChatMessage(role=message["role"], content=message.get("content") or "" if calls else
                                  message["content"], tool_calls=calls, tool_call_id=message.get("tool_call_id", ""),
                                  name=message.get("name", ""))
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
    return Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 cached_prompt_tokens=usage.cached_prompt_tokens)


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
        logprobs=logprobs_from_proto(chunk.logprobs),
        prompt_logprobs=logprobs_from_proto(chunk.prompt_logprobs),
        sample_index=chunk.sample_index,
        tool_calls=tuple(ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in chunk.tool_calls),
        content=chunk.content,
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
        logprobs=logprobs_from_proto(response.logprobs),
        prompt_logprobs=logprobs_from_proto(response.prompt_logprobs),
        samples=tuple(Completion(
            request_id=response.request_id, text=s.text, token_ids=tuple(s.token_ids),
            finish_reason=finish_reason_name(s.finish_reason),
            usage=usage_from_proto(s.usage) if s.HasField("usage") else None,
            timeline=timeline_from_proto(s.timeline) if s.HasField("timeline") else None,
            attempt=s.timeline.attempts, logprobs=logprobs_from_proto(s.logprobs),
            tool_calls=_calls(s.tool_calls), content=s.content) for s in response.samples),
        tool_calls=_calls(response.tool_calls),
        content=response.content,
    )


def _calls(calls) -> tuple[ToolCall, ...]:  # noqa: ANN001
    return tuple(ToolCall(c.id, c.name, c.arguments) for c in calls)


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
        vocab_size=model.vocab_size,
        eos_token_ids=tuple(model.eos_token_ids),
        has_chat_template=model.has_chat_template,
        default_max_tokens=model.default_max_tokens,
        max_tokens_limit=model.max_tokens_limit,
        max_prompt_tokens=model.max_prompt_tokens,
        structured_output_formats=tuple(model.structured_output_formats),
        chat_template=model.chat_template,
        queued_interactive=model.queued_interactive,
        queued_bulk=model.queued_bulk,
        running=model.running,
        state=model.state,
        current=model.current,
        base_model=model.base_model,
    )

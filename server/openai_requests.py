"""The OpenAI-compatible door's requests (server/openai_api.py serves them): typed pydantic models of
`/v1/chat/completions` and `/v1/completions` bodies, unknown fields refused, and `to_generate_request`, the
one conversion from them (and tokenline's own headers) to the `GenerateRequest` the gRPC door takes.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenline.server import convert
from tokenline.v1 import tokenline_pb2 as pb

# ---------------------------------------------------------------- requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage comes once at the end


class JsonSchema(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Strict):
    """vLLM's own name for a format (`structured_outputs`), for clients written against `vllm serve`."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = ""


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # as the SDK echoes an assistant message back; must be empty


class FunctionDef(_Strict):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # always: arguments are constrained when a call is required or named


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class CommonRequest(_Strict):
    model: str = ""
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # vLLM's extras, so that clients of `vllm serve` work unchanged.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    return_token_ids: bool = False  # vLLM's: each choice carries its token ids (tokenline's bench counts them)
    priority: int | None = None  # vLLM's (lower first): > 0 is bulk here, <= 0 interactive (unless X-Tokenline-Class)


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False


def to_generate_request(req: ChatRequest | CompletionRequest, headers: dict[str, str]) -> pb.GenerateRequest:
    """The GenerateRequest the gRPC door would get for this OpenAI request (one conversion, both doors)."""
    out = pb.GenerateRequest(model=req.model, request_id=headers.get("x-request-id", ""),
                             idempotency_key=headers.get("idempotency-key", ""))
    if isinstance(req, ChatRequest):
        out.chat.CopyFrom(_chat(req))
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise convert.InvalidRequest("top_logprobs needs logprobs: true")
    else:
        if isinstance(req.prompt, str):
            out.text = req.prompt
        else:
            out.token_ids.CopyFrom(pb.TokenIds(ids=req.prompt))
        max_tokens, logprobs = req.max_tokens, req.logprobs
    s = out.sampling
    s.max_tokens = max_tokens or 0
    s.n = req.n if req.n > 1 else 0
    s.stop.extend([req.stop] if isinstance(req.stop, str) else (req.stop or []))
    s.ignore_eos, s.min_tokens, s.include_stop_str_in_output = req.ignore_eos, req.min_tokens, req.include_stop_str_in_output
    s.stop_token_ids.extend(req.stop_token_ids or [])
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit():
            raise convert.InvalidRequest(f"logit_bias keys are token ids (as strings of digits), not {key!r}")
        s.logit_bias[int(key)] = bias
    for name in ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            setattr(s, name, value)
    if logprobs is not None:
        s.logprobs = logprobs
    fmt = _format(req)
    if fmt is not None:
        s.structured_output.CopyFrom(fmt)
    bulk = req.service_tier == "flex" or (req.priority is not None and req.priority > 0)
    cls = headers.get("x-tokenline-class", "bulk" if bulk else "interactive")
    if cls not in ("interactive", "bulk"):
        raise convert.InvalidRequest(f"X-Tokenline-Class is interactive or bulk, not {cls!r}")
    out.traffic_class = pb.BULK if cls == "bulk" else pb.INTERACTIVE
    itl = headers.get("x-tokenline-itl-target-ms")
    if itl is not None:
        out.itl_target_ms = number_header(itl, "X-Tokenline-Itl-Target-Ms")
    return out


_CHOICE = {"none": pb.ToolChoice.NONE, "auto": pb.ToolChoice.AUTO, "required": pb.ToolChoice.REQUIRED}


def _chat(req: ChatRequest) -> pb.ChatMessages:
    chat = pb.ChatMessages()
    for i, m in enumerate(req.messages):
        if m.refusal:
            raise convert.InvalidRequest(f"messages[{i}].refusal is set; tokenline does not send refusals back")
        chat.messages.append(pb.ChatMessage(
            role=_role(m.role), content=_text(m.content), name=m.name or "", tool_call_id=m.tool_call_id or "",
            tool_calls=[pb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                        for c in m.tool_calls or ()]))
    for t in req.tools or ():
        f = t.function
        chat.tools.append(pb.Tool(name=f.name, description=f.description,
                                  parameters_json=json.dumps(f.parameters) if f.parameters is not None else ""))
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        chat.tool_choice.CopyFrom(pb.ToolChoice(mode=pb.ToolChoice.FUNCTION, function_name=choice.function.name))
    elif choice is not None:
        chat.tool_choice.CopyFrom(pb.ToolChoice(mode=_CHOICE[choice]))
    if req.parallel_tool_calls is False:
        chat.tool_choice.single_call = True
    if req.chat_template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(req.chat_template_kwargs)
    return chat


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # OpenAI's newer name for the system role


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _format(req: CommonRequest) -> pb.StructuredOutput | None:
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and so is not None:
        raise convert.InvalidRequest("give response_format or structured_outputs, not both")
    if rf is not None:
        if rf.type == "json_object":
            return pb.StructuredOutput(json_object=True)
        if rf.type == "json_schema":
            if rf.json_schema is None:
                raise convert.InvalidRequest("response_format of type json_schema needs its json_schema")
            return pb.StructuredOutput(json_schema=json.dumps(rf.json_schema.schema_))
        return None
    if so is None:
        return None
    given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
                               ("json_object", so.json_object or None)) if v is not None}
    if len(given) != 1:
        raise convert.InvalidRequest("structured_outputs needs exactly one of json, regex, choice, grammar, json_object")
    (kind, value), = given.items()
    if kind == "json":
        return pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(**{kind: value})


def number_header(text: str, header: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise convert.InvalidRequest(f"{header} is a number of milliseconds, not {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise convert.InvalidRequest(f"{header} must be a positive number of milliseconds, got {text!r}")
    return value


# ---------------------------------------------------------------- answers

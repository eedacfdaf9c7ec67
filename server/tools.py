"""Tool calls: the one layer both doors use to take tools in and give calls back.

In: `spec_of` checks a chat's tools and tool choice; `template_input` gives the chat template its
messages (assistant calls, tool results) and tools, or, for a template that knows nothing of tools,
renders them as text the model can read; `constraint` is the JSON schema that makes a REQUIRED or
FUNCTION choice a structured output, so the arguments are valid on any model (the worker enforces
it, through crashes and preemptions, as any structured output).

Out: a `CallStream` per sample turns the sample's text, piece by piece, into message content and
`ToolCallDelta`s; `annotate` applies the same to a whole result, so a stream and a whole answer
cannot disagree. REQUIRED and FUNCTION outputs are parsed here (they are JSON by construction);
AUTO output is in the model's own format, parsed by vLLM's tool parser for it (`--tool-call-parser`,
imported only when a server names one). Call ids are derived from the request id, the sample and the
call's index, so a replayed or resumed answer has the same ids.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from tokenline.server.errors import InvalidRequest
from tokenline.v1 import tokenline_pb2 as pb

MAX_TOOLS = 128
MAX_TOOL_CALLS_IN_MESSAGE = 64
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict", "chat_template"})
_MODES = {pb.ToolChoice.NONE: "none", pb.ToolChoice.AUTO: "auto", pb.ToolChoice.REQUIRED: "required",
          pb.ToolChoice.FUNCTION: "function"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolSpec:
    """A chat's tools and what the model must do with them."""

    tools: tuple[Tool, ...]
    mode: str  # none | auto | required | function
    function: str = ""
    single_call: bool = False  # REQUIRED: one call, not several

    @property
    def parses(self) -> bool:
        """Results carry calls (parsed from the output) rather than only text."""
        return self.mode != "none" and bool(self.tools)


def spec_of(chat: pb.ChatMessages, auto_parser: str | None = None) -> ToolSpec | None:
    """The chat's tools, checked; None when it has none and no tool choice. `auto_parser`: the server's
    --tool-call-parser (AUTO is refused without one)."""
    choice = chat.tool_choice if chat.HasField("tool_choice") else pb.ToolChoice()
    if not chat.tools and choice.mode in (pb.ToolChoice.MODE_UNSPECIFIED, pb.ToolChoice.NONE):
        if choice.function_name:
            raise InvalidRequest("tool_choice.function_name is set but the mode is not FUNCTION")
        return None
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools are allowed, got {len(chat.tools)}")
    tools, names = [], set()
    for i, t in enumerate(chat.tools):
        if not _NAME.fullmatch(t.name):
            raise InvalidRequest(f"tools[{i}].name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {t.name!r}")
        if t.name in names:
            raise InvalidRequest(f"tools[{i}].name {t.name!r} is given twice; tool names must be unique")
        names.add(t.name)
        tools.append(Tool(t.name, t.description, _parameters(t.parameters_json, f"tools[{i}].parameters_json")))
    if choice.mode not in (pb.ToolChoice.MODE_UNSPECIFIED, *_MODES):
        raise InvalidRequest(f"tool_choice.mode {choice.mode} is not one of NONE, AUTO, REQUIRED, FUNCTION")
    mode = _MODES.get(choice.mode, "auto")
    if mode != "none" and not tools:
        raise InvalidRequest(f"tool_choice {mode.upper()} needs tools; give the functions the model may call")
    if mode == "function":
        if choice.function_name not in names:
            raise InvalidRequest(f"tool_choice.function_name {choice.function_name!r} is not one of the tools "
                                 f"({', '.join(sorted(names))})")
    elif choice.function_name:
        raise InvalidRequest("tool_choice.function_name is set but the mode is not FUNCTION")
    if mode == "auto" and auto_parser is None:
        raise InvalidRequest("tool_choice AUTO needs a tool-call parser for this model's format, and this server has "
                             "none (start it with --tool-call-parser NAME, e.g. hermes); or send tool_choice REQUIRED "
                             "or a named FUNCTION, which work on any model")
    return ToolSpec(tuple(tools), mode, choice.function_name if mode == "function" else "",
                    single_call=choice.single_call and mode == "required")


def _parameters(text: str, where: str) -> dict[str, Any]:
    if not text.strip():
        return {"type": "object", "properties": {}}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"{where} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON schema object, got {type(value).__name__}")
    return value


def template_kwargs(chat: pb.ChatMessages) -> dict[str, Any]:
    """chat_template_kwargs_json, checked."""
    if not chat.chat_template_kwargs_json:
        return {}
    try:
        value = json.loads(chat.chat_template_kwargs_json)
    except ValueError as e:
        raise InvalidRequest(f"chat_template_kwargs_json is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs_json must be a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(reserved)}: the server sets them")
    return value


# ---------------------------------------------------------------- the constraint


def constraint(spec: ToolSpec | None) -> str | None:
    """The JSON schema the output must match (REQUIRED: a list of calls; FUNCTION: its arguments), or None."""
    if spec is None or spec.mode not in ("required", "function"):
        return None
    if spec.mode == "function":
        return json.dumps(next(t.parameters for t in spec.tools if t.name == spec.function))
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.parameters},
              "required": ["name", "parameters"], "additionalProperties": False} for t in spec.tools]
    return json.dumps({"type": "array", "minItems": 1, **({"maxItems": 1} if spec.single_call else {}),
                       "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})


# ---------------------------------------------------------------- the prompt


def template_input(messages: list[dict[str, Any]], spec: ToolSpec | None, template: str) -> tuple[list[dict], list | None]:
    """(messages, tools) for the chat template. A template that never mentions tools gets them as a system
    message, and earlier calls as the assistant's text, so the model sees the conversation either way."""
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
             for t in spec.tools] if spec is not None and spec.tools else None
    knows_tools = "tool" in template
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            if knows_tools:
                m["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": _arguments_value(c["arguments"])}}
                                   for c in calls]
            else:
                m["content"] = (m["content"] + "\n" if m["content"] else "") + "\n".join(
                    json.dumps({"name": c["name"], "arguments": _arguments_value(c["arguments"])}) for c in calls)
        if not knows_tools and m["role"] == "tool":
            m.pop("tool_call_id", None)
        out.append(m)
    if tools and not knows_tools:
        listing = "\n".join(json.dumps(t["function"]) for t in tools)
        note = ("You can call these functions. To call one, answer with a JSON object "
                '{"name": <function name>, "arguments": <its arguments>}.\n' + listing)
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
        tools = None
    return out, tools


def _arguments_value(arguments: str) -> Any:
    """Templates take a call's arguments as an object (Hugging Face's convention); a caller sends them as JSON text."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments


# ---------------------------------------------------------------- calls out


def call_id(request_id: str, sample: int, index: int) -> str:
    digest = hashlib.sha256(f"{request_id}\0{sample}\0{index}".encode()).hexdigest()
    return "call_" + digest[:24]


class CallStream:
    """One sample's text in pieces → (content, tool-call deltas) in pieces."""

    def __init__(self, spec: ToolSpec, request_id: str, sample: int, parser_factory: Any = None):
        self.spec, self.request_id, self.sample = spec, request_id, sample
        self.calls = 0  # calls begun
        if spec.mode == "function":
            self._impl: Any = _Named(spec.function)
        elif spec.mode == "required":
            self._impl = _CallList()
        else:
            self._impl = _Auto(parser_factory(spec))

    def feed(self, text: str) -> tuple[str, list[pb.ToolCallDelta]]:
        return self._deltas(*self._impl.feed(text))

    def finish(self) -> tuple[str, list[pb.ToolCallDelta]]:
        return self._deltas(*self._impl.finish())

    def _deltas(self, content: str, pieces: list[tuple[int, str | None, str]]) -> tuple[str, list[pb.ToolCallDelta]]:
        out = []
        for index, name, arguments in pieces:
            if name is not None:
                self.calls = max(self.calls, index + 1)
                out.append(pb.ToolCallDelta(index=index, id=call_id(self.request_id, self.sample, index), name=name,
                                            arguments=arguments))
            elif arguments:
                out.append(pb.ToolCallDelta(index=index, arguments=arguments))
        return content, out


def merge(deltas: list[pb.ToolCallDelta]) -> list[pb.ToolCall]:
    calls: dict[int, pb.ToolCall] = {}
    for d in deltas:
        call = calls.setdefault(d.index, pb.ToolCall())
        if d.id:
            call.id, call.name = d.id, d.name
        call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def annotate(spec: ToolSpec, result: Any, request_id: str, sample: int, parser_factory: Any = None) -> None:
    """Fill `content` and `tool_calls` of a CompleteResponse or Sample from its text (as a stream would)."""
    stream = CallStream(spec, request_id, sample, parser_factory)
    content, deltas = stream.feed(result.text)
    more, tail = stream.finish()
    del result.tool_calls[:]
    result.tool_calls.extend(merge(deltas + tail))
    result.content = content + more
    if result.tool_calls and result.finish_reason == pb.STOP:
        result.finish_reason = pb.TOOL_CALLS


class _Named:
    """FUNCTION: the output is the arguments."""

    def __init__(self, name: str):
        self.name, self.begun = name, False

    def feed(self, text: str) -> tuple[str, list]:
        if not text:
            return "", []
        first, self.begun = not self.begun, True
        return "", [(0, self.name if first else None, text)]

    def finish(self) -> tuple[str, list]:
        return "", []


class _CallList:
    """REQUIRED: the output is a JSON list of {"name": ..., "parameters": {...}} (the constraint's shape, in
    any key order and spacing). Scanned a character at a time: a call's name is sent once its string is
    complete, its arguments as they come (the raw text of the "parameters" value), held back until the
    name is known."""

    def __init__(self):
        self.depth = 0  # brackets open
        self.in_string = self.escape = False
        self.index = -1  # the call being read
        self.key = ""  # the element's key whose value is being read
        self.token = ""  # text of the string or value being read at depth 2
        self.reading_key = False
        self.name: str | None = None
        self.name_sent = False
        self.args_pending = ""  # arguments read before the name was known
        self.in_args = self.args_started = False

    def feed(self, text: str) -> tuple[str, list]:
        pieces: list[tuple[int, str | None, str]] = []
        args = []
        for ch in text:
            d = self.depth
            if self.in_args:  # inside the parameters value (depth >= 3, or a scalar at depth 2)
                if self.in_string:
                    args.append(ch)
                    if self.escape:
                        self.escape = False
                    elif ch == "\\":
                        self.escape = True
                    elif ch == '"':
                        self.in_string = False
                elif ch.isspace() and d == 2 and not args and not self.args_started:
                    pass  # the spacing before the value is not part of the arguments
                elif ch == '"':
                    self.in_string, self.escape = True, False
                    args.append(ch)
                elif ch in "{[":
                    self.depth += 1
                    args.append(ch)
                elif ch in "}]" and d == 2 or ch == "," and d == 2:  # a scalar value ends with its element
                    self.in_args = False
                    self._flush_args(pieces, args)
                    args = []
                    if ch != ",":
                        self.depth = 1
                    else:
                        self.reading_key = True
                elif ch in "}]":
                    self.depth -= 1
                    args.append(ch)
                    if self.depth == 2:
                        self.in_args = False
                        self._flush_args(pieces, args)
                        args = []
                else:
                    args.append(ch)
                if args:
                    self.args_started = True
                continue
            if self.in_string:  # a key or a string value at depth 2
                if self.escape:
                    self.escape = False
                    self.token += ch
                elif ch == "\\":
                    self.escape = True
                    self.token += ch
                elif ch == '"':
                    self.in_string = False
                    self._string_done(pieces)
                else:
                    self.token += ch
                continue
            if ch == '"' and d == 2:
                self.in_string, self.escape, self.token = True, False, ""
            elif ch == "[" and d == 0:
                self.depth = 1
            elif ch == "{" and d == 1:
                self.depth, self.index, self.name, self.name_sent = 2, self.index + 1, None, False
                self.args_pending, self.reading_key, self.key = "", True, ""
            elif ch == "}" and d == 2:
                self.depth = 1
                self._flush_args(pieces, args)
                args = []
            elif ch == "]" and d == 1:
                self.depth = 0
            elif ch == ":" and d == 2:
                self.reading_key = False
                if self.key == "parameters":
                    self.in_args, self.args_started = True, False
            elif ch == "," and d == 2:
                self.reading_key = True
        self._flush_args(pieces, args)
        return "", pieces

    def _string_done(self, pieces: list) -> None:
        if self.reading_key:
            self.key = json.loads('"' + self.token + '"')
        elif self.key == "name":
            self.name = json.loads('"' + self.token + '"')

    def _flush_args(self, pieces: list, args: list[str]) -> None:
        text = "".join(args)
        if self.name is not None and not self.name_sent:
            pieces.append((self.index, self.name, self.args_pending + text))
            self.name_sent, self.args_pending = True, ""
        elif self.name_sent:
            if text:
                pieces.append((self.index, None, text))
        else:
            self.args_pending += text

    def finish(self) -> tuple[str, list]:
        return "", []


class _Auto:
    """AUTO: vLLM's streaming parser for the model's format, fed the text so far."""

    def __init__(self, parser: Any):
        self.parser, self.text = parser, ""
        self.sent: dict[int, bool] = {}

    def feed(self, text: str) -> tuple[str, list]:
        if not text:
            return "", []
        previous, self.text = self.text, self.text + text
        delta = self.parser.stream(previous, self.text, text)
        if delta is None:
            return "", []
        pieces = []
        for call in delta.tool_calls or ():
            fn = call.function
            name = fn.name if fn is not None and fn.name and not self.sent.get(call.index) else None
            if name is not None:
                self.sent[call.index] = True
            arguments = (fn.arguments or "") if fn is not None else ""
            if name is None and not self.sent.get(call.index):
                continue  # arguments before a name: vLLM's parsers do not do this
            pieces.append((call.index, name, arguments))
        return delta.content or "", pieces

    def finish(self) -> tuple[str, list]:
        rest = self.parser.remaining()
        if rest and self.sent:
            return "", [(max(self.sent), None, rest)]
        return "", []


class ChunkAnnotator:
    """A stream's chunks with their `content` and `tool_calls` filled, one CallStream per sample. A stream that
    begins part-way (resume_from_index) is first fed the text before it: `prime(sample, index)`."""

    def __init__(self, spec: ToolSpec, parser_factory: Any, prime: Any):
        self.spec, self.parser_factory, self.prime = spec, parser_factory, prime
        self.streams: dict[int, CallStream] = {}

    def __call__(self, chunk: pb.GenerateChunk) -> pb.GenerateChunk:
        i = chunk.sample_index
        stream = self.streams.get(i)
        if stream is None:
            stream = self.streams[i] = CallStream(self.spec, chunk.request_id, i, self.parser_factory)
            if chunk.index:
                stream.feed(self.prime(i, chunk.index))
        content, deltas = stream.feed(chunk.text)
        if chunk.finish_reason:
            more, tail = stream.finish()
            content, deltas = content + more, deltas + tail
            if stream.calls and chunk.finish_reason == pb.STOP:
                chunk.finish_reason = pb.TOOL_CALLS
        chunk.content = content
        chunk.tool_calls.extend(deltas)
        return chunk

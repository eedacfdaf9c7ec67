"""Proto → domain conversion, with every check a request must pass before any work (the response messages
the server builds are server/responses.py's).

Pure functions: they raise `InvalidRequest` / `ModelNotFound` with a message
that says what to change, and never touch the engine. `check` is cheap (sizes,
ranges, names) and runs first, on the event loop; `tokenize` is the expensive
part and runs only on a request that passed `check`, off the loop.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass, replace

from tokenline.engine.flagspec import flag
from tokenline.engine.types import STRUCTURED_FORMATS, Sampling, TrafficClass
from tokenline.server import tools
from tokenline.server.catalog import ServedModel
from tokenline.server.tools import ToolSpec
from tokenline.server.errors import InvalidRequest, ModelNotFound
from tokenline.v1 import tokenline_pb2 as pb

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20
MAX_SAMPLES = 16
MAX_STOP_LEN = 256
MAX_REQUEST_ID_LEN = 128
MAX_CHAT_MESSAGES = 256
CHAT_ROLES = ("system", "user", "assistant", "tool")
_PRINTABLE = set(string.printable) - set("\t\n\r\x0b\x0c")


@dataclass(frozen=True)
class Limits:
    """Bounds enforced before any work."""

    max_prompt_tokens: int = 32_768
    max_tokens: int = flag(4096, "--max-tokens-limit", "the most max_tokens a request may ask for")
    max_prompt_chars: int = 1_000_000
    # A request that sets no max_tokens gets the rest of the context after its prompt, at most this.
    default_max_tokens: int = flag(4096, "--default-max-tokens",
                                   "max_tokens of a request that sets none: the rest of the context after its "
                                   "prompt, at most this (default 4096, or --max-tokens-limit if lower)", type=int)

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= self.max_tokens:
            raise ValueError(f"--default-max-tokens must be in [1, {self.max_tokens}] (the max_tokens limit), "
                             f"got {self.default_max_tokens}")


@dataclass
class ValidRequest:
    model: ServedModel
    prompt_ids: list[int]
    sampling: Sampling
    cls: TrafficClass
    request_id: str  # may be empty: the server generates one
    deadline_unix_ms: int
    n: int = 1  # independent samples (SamplingParams.n)


@dataclass(frozen=True)
class ChatInput:
    """What the chat template is given: messages, tools (None: none) and the caller's extra variables."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    kwargs: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class CheckedRequest:
    """A request whose every field is in range and whose prompt is small enough to tokenize."""

    request: pb.GenerateRequest
    model: ServedModel
    sampling: Sampling
    cls: TrafficClass
    request_id: str
    chat: ChatInput | None  # the chat, when the prompt is a chat
    n: int = 1
    tools: ToolSpec | None = None  # the chat's tools and tool choice


def clip(text: str, limit: int = 100) -> str:
    """A caller's string as echoed in an error message: never long enough to break a client's header limit."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def pick_model(name: str, models: dict[str, ServedModel], default: str) -> ServedModel:
    model = models.get(name or default)
    if model is None:
        known = ", ".join(sorted([*models, *(a.name for a in getattr(models, "adapters", list)())])) or "none"
        raise ModelNotFound(f"unknown model {clip(name)!r}; this server serves: {known}")
    return model


def validate(req: pb.GenerateRequest, models: dict[str, ServedModel], default_model: str, limits: Limits) -> ValidRequest:
    """`check` then `tokenize`, in one go (where nothing else waits on the caller's thread)."""
    return tokenize(check(req, models, default_model, limits), limits)


MAX_ITL_TARGET_MS = 60_000.0


def itl_target(req: pb.GenerateRequest, cls: TrafficClass) -> float | None:
    """The request's own inter-token latency target in seconds (None: the server's)."""
    ms = req.itl_target_ms
    if ms == 0:
        return None
    if not math.isfinite(ms) or ms < 0 or ms > MAX_ITL_TARGET_MS:
        raise InvalidRequest(f"itl_target_ms must be a number of milliseconds in (0, {MAX_ITL_TARGET_MS:.0f}], "
                             f"or 0 for the server's target; got {ms}")
    if cls != TrafficClass.INTERACTIVE:
        raise InvalidRequest("itl_target_ms applies to interactive requests; a bulk request has no inter-token target")
    return ms / 1000


def check(req: pb.GenerateRequest, models: dict[str, ServedModel], default_model: str, limits: Limits) -> CheckedRequest:
    """Every check that costs no more than reading the request; refuses a prompt too big to fit the context."""
    model = pick_model(req.model, models, default_model)
    request_id = _request_id(req.request_id)
    cls = _traffic_class(req.traffic_class)
    sampling = _sampling(req.sampling if req.HasField("sampling") else pb.SamplingParams(), limits, model)
    most = sampling.max_tokens or limits.max_tokens  # unset: the server's limit bounds every answer
    if req.resume_from_index > most:
        raise InvalidRequest(f"resume_from_index {req.resume_from_index} is past the end of any answer to this request "
                             f"(at most {most} tokens); resume from the index after the last token you received")
    spec = tool_spec(req, model)
    schema = tools.constraint(spec)
    if schema is not None:  # REQUIRED or a named FUNCTION: the calls are a structured output
        if sampling.structured[0]:
            raise InvalidRequest(f"tool_choice {spec.mode.upper()} constrains the output to tool calls itself; "
                                 "drop structured_output (or use tool_choice AUTO or NONE)")
        sampling = replace(sampling, structured=("json_schema", schema))
    chat = check_prompt_size(req, model, limits)
    return CheckedRequest(req, model, sampling, cls, request_id, chat, _samples(req.sampling, sampling), spec)


def tool_spec(req: pb.GenerateRequest, model: ServedModel) -> tools.ToolSpec | None:
    """The request's tools and tool choice, checked (None without tools)."""
    if req.WhichOneof("prompt") != "chat":
        return None
    return tools.spec_of(req.chat, model.tool_call_parser)


def _samples(s: pb.SamplingParams, sampling: Sampling) -> int:
    n = s.n or 1
    if n > MAX_SAMPLES:
        raise InvalidRequest(f"n must be in [1, {MAX_SAMPLES}] (samples of the prompt), got {n}")
    if n > 1 and sampling.temperature == 0:
        raise InvalidRequest(f"n = {n} samples need sampling (temperature > 0): greedy samples would all be the same")
    if sampling.seed is not None and sampling.seed + n - 1 >= 2**63:
        raise InvalidRequest("seed + n - 1 must be below 2**63 (sample i is seeded with seed + i)")
    return n


def tokenize(checked: CheckedRequest, limits: Limits) -> ValidRequest:
    """The prompt as token ids, and the checks that need them. Blocking: run it off the event loop, unless
    `quick(checked)`."""
    req, model, sampling = checked.request, checked.model, checked.sampling
    prompt_ids = tokenize_prompt_of(req, model, limits, checked.chat)
    room = model.max_context - len(prompt_ids)
    if sampling.structured[0]:
        from tokenline.server.structured import check_format

        check_format(*sampling.structured)
    if not sampling.max_tokens:  # unset: the rest of the context, as vLLM's default, within the server's cap
        if room < 1:
            raise InvalidRequest(f"the prompt ({len(prompt_ids)} tokens) fills the context of {model.name} "
                                 f"({model.max_context} tokens); shorten it")
        sampling = replace(sampling, max_tokens=min(room, limits.default_max_tokens))
        if sampling.min_tokens > sampling.max_tokens:
            raise InvalidRequest(f"min_tokens ({sampling.min_tokens}) is more than the {sampling.max_tokens} tokens "
                                 "left in the context after the prompt")
    if sampling.max_tokens > room:
        raise InvalidRequest(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({sampling.max_tokens}) exceeds the context of "
            f"{model.name} ({model.max_context} tokens); lower max_tokens to at most {max(room, 0)} or shorten the prompt"
        )
    return ValidRequest(model, prompt_ids, sampling, checked.cls, checked.request_id, req.deadline_unix_ms, checked.n)


def quick(checked: CheckedRequest) -> bool:
    """Is `tokenize` quick enough for the event loop? With a prompt of token ids and no structured output it is
    a copy and a range check (C loops over at most max_prompt_tokens ids: ~20 us at 4,096), less than a hop to a
    worker thread and back costs (issue 38)."""
    return checked.request.WhichOneof("prompt") == "token_ids" and not checked.sampling.structured[0]


def _request_id(rid: str, field: str = "request_id") -> str:
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(f"{field} is {len(rid)} characters; at most {MAX_REQUEST_ID_LEN} are allowed")
    if rid and not set(rid) <= _PRINTABLE:
        raise InvalidRequest(f"{field} must be printable ASCII (no control characters or non-ASCII)")
    if rid != rid.strip():
        raise InvalidRequest(f"{field} must not start or end with spaces")
    return rid


def idempotency_key(req: pb.GenerateRequest) -> str:
    key = _request_id(req.idempotency_key, "idempotency_key")
    if req.resume_from_index and not key:
        raise InvalidRequest("resume_from_index needs an idempotency_key (only keyed requests can be resumed)")
    return key


def _traffic_class(value: int) -> TrafficClass:
    if value in (pb.TRAFFIC_CLASS_UNSPECIFIED, pb.INTERACTIVE):
        return TrafficClass.INTERACTIVE
    if value == pb.BULK:
        return TrafficClass.BULK
    raise InvalidRequest(f"traffic_class {value} is not one of INTERACTIVE (1) or BULK (2)")


def _sampling(s: pb.SamplingParams, limits: Limits, model: ServedModel) -> Sampling:
    """Every sampling field in range; max_tokens 0 when unset (`tokenize` sets it from the prompt's length)."""
    max_tokens = s.max_tokens
    if max_tokens > limits.max_tokens:
        raise InvalidRequest(f"max_tokens {max_tokens} is above this server's limit of {limits.max_tokens}")
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise InvalidRequest(f"temperature must be in [0, 2], got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    top_k = s.top_k if s.HasField("top_k") else 0
    if top_k < -1:
        raise InvalidRequest(f"top_k must be -1, 0 (both: off) or positive, got {top_k}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(s.stop)}")
    for stop in s.stop:
        if not stop or len(stop) > MAX_STOP_LEN:
            raise InvalidRequest(f"each stop string must have 1 to {MAX_STOP_LEN} characters")
    seed = s.seed if s.HasField("seed") else None
    if seed is not None and seed >= 2**63:
        raise InvalidRequest("seed must be below 2**63")
    return Sampling(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0),
                    seed=seed, stop=tuple(s.stop), ignore_eos=s.ignore_eos, **_more_sampling(s, model, max_tokens))


def _in_range(s: pb.SamplingParams, name: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    value = getattr(s, name) if s.HasField(name) else default
    ok = math.isfinite(value) and (low < value if open_low else low <= value) and value <= high
    if not ok:
        raise InvalidRequest(f"{name} must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value}")
    return float(value)


def _more_sampling(s: pb.SamplingParams, model: ServedModel, max_tokens: int) -> dict:
    """The fields beyond the first seven: penalties, token constraints, logprobs, structured output."""
    if max_tokens and s.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({s.min_tokens}) must not be more than max_tokens ({max_tokens})")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(s.stop_token_ids)}")
    in_vocabulary("stop_token_ids", s.stop_token_ids, model)
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got {len(s.logit_bias)}")
    in_vocabulary("logit_bias", s.logit_bias.keys(), model)
    for token, bias in s.logit_bias.items():
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise InvalidRequest(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and getattr(s, name) > MAX_LOGPROBS:
            raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {getattr(s, name)}")
    if s.HasField("prompt_logprobs") and model.lora_on:
        raise InvalidRequest(f"prompt_logprobs is not available on {model.name}: it is served with LoRA adapters, and "
                             "vLLM's CPU LoRA kernels fail on prompt log-probabilities (logprobs of the output work)")
    return dict(
        min_p=_in_range(s, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_in_range(s, "repetition_penalty", 1.0, 0.0, 2.0, open_low=True),
        presence_penalty=_in_range(s, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_in_range(s, "frequency_penalty", 0.0, -2.0, 2.0),
        min_tokens=s.min_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items())),
        include_stop_str_in_output=s.include_stop_str_in_output,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        structured=_structured(s),
    )


def in_vocabulary(name: str, ids, model: ServedModel) -> None:
    bad = next((t for t in ids if t >= model.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary of {model.name} (0..{model.vocab_size - 1})")


def _structured(s: pb.SamplingParams) -> tuple[str, str]:
    """(format, its text) for Sampling.structured; the cheap checks only (`tokenize` parses it)."""
    if not s.HasField("structured_output"):
        return ("", "")
    so = s.structured_output
    kind = so.WhichOneof("format")
    if kind is None:
        raise InvalidRequest("structured_output is set but names no format: set one of " + ", ".join(STRUCTURED_FORMATS))
    if kind == "json_object":
        if not so.json_object:
            raise InvalidRequest("structured_output.json_object must be true when set")
        return ("json_object", "")
    if kind == "choice":
        return ("choice", json.dumps(list(so.choice.choices)))
    text = getattr(so, kind)
    if not text.strip():
        raise InvalidRequest(f"structured_output.{kind} is empty")
    return (kind, text)


def max_prompt_tokens(model: ServedModel, limits: Limits) -> int:
    return min(limits.max_prompt_tokens, model.max_context - 1)


def check_prompt_size(req: pb.GenerateRequest, model: ServedModel, limits: Limits) -> ChatInput | None:
    """Refuse, before tokenizing, a prompt that cannot fit: no token is longer than `model.max_token_chars`,
    so more characters than that times the prompt's token limit can only be too many tokens."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("a prompt is required: set one of text, token_ids or chat")
    most_tokens = max_prompt_tokens(model, limits)
    most_chars = min(limits.max_prompt_chars, most_tokens * model.max_token_chars)
    if kind == "token_ids":
        count = len(req.token_ids.ids)
        if not count:
            raise InvalidRequest("token_ids is empty")
        if count > most_tokens:
            raise InvalidRequest(f"the prompt has {count} tokens; at most {most_tokens} are allowed for {model.name}")
        return None
    if kind == "text":
        if len(req.text) > most_chars:
            raise InvalidRequest(f"the prompt text has {len(req.text)} characters; at most {most_chars} fit the "
                                 f"{most_tokens}-token prompt limit of {model.name}")
        if not req.text.strip():
            raise InvalidRequest("the prompt text is empty")
        return None
    messages = _chat(req.chat)
    chars = sum(len(m["content"]) + sum(len(c["arguments"]) for c in m.get("tool_calls", ())) for m in messages) + \
        sum(len(t.name) + len(t.description) + len(t.parameters_json) for t in req.chat.tools)
    if chars > most_chars:
        raise InvalidRequest(f"the chat messages have {chars} characters; at most {most_chars} fit the "
                             f"{most_tokens}-token prompt limit of {model.name}")
    if not model.has_chat_template:
        raise InvalidRequest(f"{model.name} has no chat template; send the prompt as text")
    spec = tools.spec_of(req.chat, "any")  # the prompt does not depend on the parser (checked in `check`)
    rendered, listed = tools.template_input(messages, spec, model.chat_template)
    kwargs = tools.template_kwargs(req.chat)
    return ChatInput(tuple(rendered), None if listed is None else tuple(listed), tuple(kwargs.items()))


def tokenize_prompt_of(req: pb.GenerateRequest, model: ServedModel, limits: Limits, chat: ChatInput | None) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind == "text":
        ids = model.encode(req.text)
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        bad = next((t for t in ids if t >= model.vocab_size), None) if ids and max(ids) >= model.vocab_size else None
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary of {model.name} (0..{model.vocab_size - 1})")
    else:
        assert chat is not None
        ids = model.encode_chat(list(chat.messages), None if chat.tools is None else list(chat.tools), dict(chat.kwargs))
    if not ids:
        raise InvalidRequest("the prompt has no tokens after tokenization")
    if len(ids) > max_prompt_tokens(model, limits):
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens; at most {max_prompt_tokens(model, limits)} are allowed for {model.name}"
        )
    return ids


def _chat(chat: pb.ChatMessages) -> list[dict]:
    if not chat.messages:
        raise InvalidRequest("chat.messages is empty; send at least one message")
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"at most {MAX_CHAT_MESSAGES} chat messages are allowed")
    out = []
    for i, m in enumerate(chat.messages):
        where = f"chat.messages[{i}]"
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role is {m.role!r}; use one of {', '.join(CHAT_ROLES)}")
        message: dict = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequest(f"{where} has tool_calls but role {m.role!r}; only assistant messages call tools")
            if len(m.tool_calls) > tools.MAX_TOOL_CALLS_IN_MESSAGE:
                raise InvalidRequest(f"{where} has {len(m.tool_calls)} tool calls; at most "
                                     f"{tools.MAX_TOOL_CALLS_IN_MESSAGE} are allowed")
            for j, c in enumerate(m.tool_calls):
                if not c.id or not c.name:
                    raise InvalidRequest(f"{where}.tool_calls[{j}] needs its id and name (as the result gave them)")
            message["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequest(f"{where} has role 'tool' but no tool_call_id; say which call it answers")
            message["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id:
            raise InvalidRequest(f"{where} has a tool_call_id but role {m.role!r}; only tool messages answer calls")
        out.append(message)
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise InvalidRequest("every chat message is empty")
    return out


# ----------------------------------------------------------------- parsing


class Unparsable:
    """What the deserializers hand an RPC for bytes that are not a valid request message.

    Not a message: each RPC refuses it first (INVALID_ARGUMENT, naming the message it expected)."""

    def __repr__(self) -> str:
        return "<unparsable request>"


MALFORMED = Unparsable()


def parser(message_type):
    """A deserializer for `message_type` that answers MALFORMED instead of raising."""
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception:  # DecodeError and friends: answered INVALID_ARGUMENT, never INTERNAL
            return MALFORMED
    return parse


def check_parsed(request: object, message: str) -> None:
    if request is MALFORMED:
        raise InvalidRequest(f"the request message could not be parsed as a tokenline.v1.{message}")



"""The plain results the client hands back: stream deltas, completions, timelines.

Frozen dataclasses with no gRPC in them, so callers (and `bench`) can keep,
compare and serialize them with `dataclasses.asdict`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in the engine's prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability: its id, natural-log probability, rank (1 = most likely) and text."""

    token_id: int
    logprob: float
    rank: int
    text: str


@dataclass(frozen=True)
class PositionLogprobs:
    """At one position: the token there, and the most likely tokens (most likely first)."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ServerTimeline:
    """Where one request's time went on the server, in milliseconds.

    Stamps count from when the server received the call (`received_ms` is 0);
    a stamp that did not happen (no token yet, not finished) is None.
    """

    received_ms: float
    validated_ms: float
    enqueued_ms: float
    admitted_ms: float
    first_scheduled_ms: float | None
    first_token_ms: float | None
    finished_ms: float | None
    last_byte_ms: float | None
    # Splits: waiting to be batched, waiting for capacity, model time, return.
    admission_wait_ms: float
    queueing_ms: float
    prefill_ms: float
    decode_ms: float
    return_ms: float
    ttft_ms: float
    itl_mean_ms: float
    completion_ms: float
    attempts: int
    preemptions: int
    # Time lost to preemptions and to worker failures (each: interruption to the next token).
    lost_preemption_ms: float = 0.0
    lost_retry_ms: float = 0.0
    # What served it: the model as ListModels names it (a LoRA adapter's own name) and the version its tokens came from.
    model: str = ""
    model_version: str = ""


@dataclass(frozen=True)
class Delta:
    """One streamed chunk: the tokens and text that are new since the last one.

    `received_at` is the client's `time.monotonic()` when the chunk arrived.
    `finish_reason`, `usage` and `timeline` are set on the last chunk only.
    """

    request_id: str
    attempt: int
    index: int
    token_ids: tuple[int, ...]
    text: str
    received_at: float
    finish_reason: str | None = None
    usage: Usage | None = None
    timeline: ServerTimeline | None = None
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token in token_ids, when asked for
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()  # on the first delta, when asked for
    sample_index: int = 0  # with n > 1: the sample this delta belongs to (index counts within it)
    # With tools: pieces of the calls the model makes (a call's first piece has its id and name) and the part
    # of `text` that is message content, not a call.
    tool_calls: tuple["ToolCallDelta", ...] = ()
    content: str = ""


@dataclass(frozen=True)
class ToolCall:
    """A call of a tool the model made: `arguments` is JSON text (parse it with json.loads)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed tool call: `index` says which call; id and name come on its first piece."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Completion:
    """The whole result of one request."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    timeline: ServerTimeline | None
    attempt: int
    logprobs: tuple[PositionLogprobs, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()
    # With n > 1: every sample as a Completion of its own, by sample index (this one's fields are
    # sample 0's, its usage counts every sample's tokens).
    samples: tuple["Completion", ...] = ()
    # With tools: the calls the model made (finish_reason "tool_calls" when it stopped after them), and the
    # part of `text` that is message content.
    tool_calls: tuple[ToolCall, ...] = ()
    content: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """One model the server serves."""

    name: str
    version: str
    max_context: int
    loaded: bool
    workers: int
    dtype: str = ""  # what its workers run: dtype, attention kernel, and the self-check's verdict
    attention_kernel: str = ""
    self_check: str = ""
    execution: str = ""  # "compiled", "eager", or "mixed: 1 compiled, 1 eager" while compiled workers take over
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    has_chat_template: bool = False
    default_max_tokens: int = 0  # max_tokens of a request that sets none, at most
    max_tokens_limit: int = 0
    max_prompt_tokens: int = 0
    structured_output_formats: tuple[str, ...] = ()
    chat_template: str = ""
    queued_interactive: int = 0  # its requests waiting for one of its workers now
    queued_bulk: int = 0
    running: int = 0  # its requests running on its workers now
    state: str = ""  # "loading", "serving" or "restarting" (its workers died and are being restarted)
    current: bool = True  # the version `name` alone reaches (False: rolled out of service, finishing its streams)
    base_model: str = ""  # a LoRA adapter's: the model it adapts (its requests run on that model's workers)

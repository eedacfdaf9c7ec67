"""Domain → proto: every response message the server builds (chunks, whole results, replays of stored
results, model info). Pure functions over the request's state; the checks on the way in are server/convert.py's.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from tokenline.engine.scheduler.config import model_name
from tokenline.engine.types import STRUCTURED_FORMATS, FinishReason, PositionLogprobs
from tokenline.server.catalog import ModelLoad, ServedModel
from tokenline.server import convert
from tokenline.server.convert import Limits, max_prompt_tokens
from tokenline.server.errors import InvalidRequest, RunLost
from tokenline.server.timeline import Timeline
from tokenline.v1 import tokenline_pb2 as pb

if TYPE_CHECKING:
    from tokenline.engine.types import WorkerSpec
    from tokenline.server.runtime import Chunk, RequestState


_FINISH = {
    FinishReason.STOP: pb.STOP,
    FinishReason.LENGTH: pb.LENGTH,
    FinishReason.STOP_STRING: pb.STOP_STRING,
    FinishReason.CANCELLED: pb.CANCELLED,
    FinishReason.DEADLINE: pb.DEADLINE,
}


def finish_reason(reason: FinishReason | None) -> int:
    return _FINISH.get(reason, pb.FINISH_REASON_UNSPECIFIED) if reason is not None else pb.FINISH_REASON_UNSPECIFIED


def timeline_pb(t: Timeline, *, attempts: int, preemptions: int, model: str = "", version: str = "") -> pb.Timeline:
    msg = pb.Timeline(attempts=attempts, preemptions=preemptions, model=model, model_version=version)
    for name, value in t.stamps_ms().items():
        if value is not None:
            setattr(msg, name, value)
    for name, value in t.splits_ms().items():
        setattr(msg, name, value)
    return msg


def chunk_pb(state: RequestState, chunk: Chunk, *, request_id: str = "", sample_index: int = 0) -> pb.GenerateChunk:
    msg = pb.GenerateChunk()
    fill_chunk(msg, state, chunk, request_id=request_id, sample_index=sample_index)
    return msg


def fill_chunk(msg: pb.GenerateChunk, state: RequestState, chunk: Chunk, *, request_id: str = "",
               sample_index: int = 0) -> None:
    """`chunk` written into an empty message: a new one (chunk_pb), or one already in place in a GenerateMany
    response, which saves the copy into it (issue 38)."""
    msg.request_id = request_id or state.request_id
    msg.attempt = chunk.attempt
    msg.index = chunk.index
    msg.token_ids.extend(chunk.token_ids)
    msg.text = chunk.text
    if sample_index:
        msg.sample_index = sample_index
    if chunk.logprobs:
        msg.logprobs.extend(logprobs_pb(chunk.logprobs))
    if chunk.index == 0 and state.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_pb(state.prompt_logprobs))


def logprobs_pb(positions: Sequence[PositionLogprobs]) -> list[pb.PositionLogprobs]:
    return [pb.PositionLogprobs(token=_token_logprob(token), top=[_token_logprob(t) for t in top])
            for token, top in positions]


def _token_logprob(t: tuple[int, float, int, str]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=t[0], logprob=t[1], rank=t[2], text=t[3])


def final_chunk(state: RequestState, *, request_id: str = "", sample_index: int = 0) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        request_id=request_id or state.request_id, attempt=state.attempt, index=len(state.token_ids),
        sample_index=sample_index,
        finish_reason=finish_reason(state.finish_reason), usage=_usage(state),
        timeline=timeline_pb(state.timeline, attempts=state.attempt, preemptions=state.preemptions,
                              model=model_name(state.served_as), version=state.version),
    )


def complete_response(state: RequestState) -> pb.CompleteResponse:
    return pb.CompleteResponse(
        request_id=state.request_id, attempt=state.attempt, token_ids=state.token_ids, text="".join(state.text),
        finish_reason=finish_reason(state.finish_reason), usage=_usage(state),
        timeline=timeline_pb(state.timeline, attempts=state.attempt, preemptions=state.preemptions,
                              model=model_name(state.served_as), version=state.version),
        logprobs=logprobs_pb(state.logprobs or ()), prompt_logprobs=logprobs_pb(state.prompt_logprobs or ()),
    )


def complete_samples(states: Sequence[RequestState], request_id: str) -> pb.CompleteResponse:
    """n > 1: sample 0's fields, every sample in `samples`, usage over all of them."""
    response = complete_response(states[0])
    response.request_id = request_id
    response.samples.extend(
        pb.Sample(sample_index=i, token_ids=s.token_ids, text="".join(s.text), finish_reason=finish_reason(s.finish_reason),
                  logprobs=logprobs_pb(s.logprobs or ()), usage=_usage(s),
                  timeline=timeline_pb(s.timeline, attempts=s.attempt, preemptions=s.preemptions,
                                     model=model_name(s.served_as), version=s.version))
        for i, s in enumerate(states))
    response.usage.completion_tokens = sum(len(s.token_ids) for s in states)
    response.usage.cached_prompt_tokens = sum(s.cached_tokens for s in states)
    return response


def sample_request_id(request_id: str, index: int) -> str:
    """The id of a request's sample `index` >= 1 inside the server (sample 0 keeps the caller's id)."""
    return f"{request_id}#sample-{index}"


def _usage(state: RequestState) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.token_ids),
                    cached_prompt_tokens=state.cached_tokens)


def replay_chunks(result: pb.CompleteResponse, token_text: tuple[str, ...] | None, resume_from: int) -> Iterator[pb.GenerateChunk]:
    """A stored result as a stream: the tokens after `resume_from` in one chunk, then the final chunk."""
    if resume_from < len(result.token_ids):
        yield pb.GenerateChunk(request_id=result.request_id, attempt=result.attempt, index=resume_from,
                               token_ids=result.token_ids[resume_from:],
                               text=_text_from(result, token_text, resume_from),
                               logprobs=result.logprobs[resume_from:],
                               prompt_logprobs=result.prompt_logprobs if resume_from == 0 else ())
    yield pb.GenerateChunk(request_id=result.request_id, attempt=result.attempt, index=len(result.token_ids),
                           finish_reason=result.finish_reason, usage=result.usage, timeline=result.timeline)


def _text_from(result: pb.CompleteResponse, token_text: tuple[str, ...] | None, index: int) -> str:
    """The text of the tokens from `index` on: the tail of the whole text, always."""
    if index == 0:
        return result.text
    if token_text is not None and len(token_text) == len(result.token_ids):
        return "".join(token_text[index:])
    # A row stored before per-token text was kept: no honest split exists, so refuse rather than guess.
    raise RunLost("this stored result cannot be resumed part-way; send the request again with resume_from_index 0 "
                  "to receive it whole")


def model_info(model: ServedModel, specs: list[WorkerSpec], limits: Limits, load: ModelLoad | None = None, *,
               current: bool = True) -> pb.ModelInfo:
    """A served model, the workers that have it loaded now, and its load (queued, running, state)."""
    first = specs[0] if specs else None
    load = load or ModelLoad()
    return pb.ModelInfo(name=model.name, version=model.version, max_context=model.max_context,
                        queued_interactive=load.queued_interactive, queued_bulk=load.queued_bulk,
                        running=load.running, state=load.state, current=current,
                        loaded=bool(specs), workers=len(specs),
                        dtype=first.dtype if first else "",
                        attention_kernel=first.attention_kernel if first else "",
                        self_check=first.self_check if first else "",
                        execution=execution_of(specs),
                        vocab_size=model.vocab_size, eos_token_ids=model.eos_token_ids,
                        has_chat_template=model.has_chat_template, chat_template=model.chat_template,
                        default_max_tokens=min(limits.default_max_tokens, model.max_context - 1),
                        max_tokens_limit=limits.max_tokens, max_prompt_tokens=max_prompt_tokens(model, limits),
                        structured_output_formats=STRUCTURED_FORMATS, base_model=model.base)


def execution_of(specs: list[WorkerSpec]) -> str:
    """How the workers run the model: "compiled", "eager", or, while compiled workers take over from eager ones
    (--serve-while-compiling), "mixed: 1 compiled, 1 eager"."""
    kinds = collections.Counter(s.execution for s in specs)
    if len(kinds) <= 1:
        return next(iter(kinds), "")
    return "mixed: " + ", ".join(f"{n} {kind or 'unknown'}" for kind, n in sorted(kinds.items()))


# ------------------------------------------------------------- tokenizer RPCs


def tokenize_prompt(req: pb.TokenizeRequest, models: dict[str, ServedModel], default_model: str,
                    limits: Limits) -> pb.TokenizeResponse:
    """A TokenizeRequest's prompt as a GenerateRequest with it would be tokenized. Blocking: off the loop."""
    model = convert.pick_model(req.model, models, default_model)
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("a prompt is required: set text or chat")
    gen = pb.GenerateRequest(model=req.model)
    if kind == "text":
        gen.text = req.text
    else:
        gen.chat.CopyFrom(req.chat)
    chat = convert.check_prompt_size(gen, model, limits)
    ids = convert.tokenize_prompt_of(gen, model, limits, chat)
    pieces = [model.tokenizer.decode([t]) for t in ids]
    return pb.TokenizeResponse(token_ids=ids, pieces=pieces, max_context=model.max_context)


MAX_DETOKENIZE_IDS = 1_000_000


def detokenize_ids(req: pb.DetokenizeRequest, models: dict[str, ServedModel], default_model: str) -> pb.DetokenizeResponse:
    model = convert.pick_model(req.model, models, default_model)
    if len(req.token_ids) > MAX_DETOKENIZE_IDS:
        raise InvalidRequest(f"at most {MAX_DETOKENIZE_IDS} token ids can be detokenized at once, got {len(req.token_ids)}")
    convert.in_vocabulary("token_ids", req.token_ids, model)
    text = model.tokenizer.decode(list(req.token_ids), skip_special_tokens=req.skip_special_tokens)
    return pb.DetokenizeResponse(text=text)

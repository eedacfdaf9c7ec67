"""Our request types in vLLM's terms and back: sampling parameters, structured-output formats, log-probabilities,
finish reasons. Worker side (imports vllm); engine/vllm_backend.py is its user.
"""

from __future__ import annotations

import os
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm reads its settings (as engine/vllm_backend.py)

from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams  # noqa: E402

from tokenline.engine.types import FinishReason, PositionLogprobs, Sampling
from tokenline.engine.vllm_continuation import EARLIER_OUTPUT


def sampling_params(s: Sampling, *, delivered: int = 0, prompt_logprobs: bool = True) -> SamplingParams:
    """vLLM's SamplingParams for a run that continues after `delivered` tokens of the request's output
    (the last `delivered` tokens of its prompt): what counts the output so far counts those too."""
    penalties = {"presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                 "repetition_penalty": s.repetition_penalty}
    extra = None
    if delivered and s.penalised:  # vLLM would not count the delivered tokens as output: ours does, all three
        extra = {EARLIER_OUTPUT: {"delivered": delivered, "presence": s.presence_penalty,
                                  "frequency": s.frequency_penalty, "repetition": s.repetition_penalty}}
        penalties = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=max(s.top_k, 0),  # 0: no top-k
        min_p=s.min_p,
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        min_tokens=max(s.min_tokens - delivered, 0),
        logit_bias=dict(s.logit_bias) or None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs if prompt_logprobs else None,
        structured_outputs=structured_outputs(s),
        extra_args=extra,
        output_kind=RequestOutputKind.DELTA,
        **penalties,
    )


def structured_outputs(s: Sampling) -> StructuredOutputsParams | None:
    kind, spec = s.structured
    if not kind:
        return None
    if kind == "json_schema":
        return StructuredOutputsParams(json=spec)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        import json

        return StructuredOutputsParams(choice=json.loads(spec))
    return StructuredOutputsParams(**{kind: spec})  # regex, grammar


def output_logprobs(token_ids: Any, logprobs: Any, top: int) -> list[PositionLogprobs]:
    """One entry per new token from vLLM's per-position {token id: Logprob} dicts."""
    out = []
    for tid, position in zip(token_ids, logprobs):
        out.append(_position(tid, position, top))
    return out


def prompt_logprobs(prompt_ids: Any, logprobs: Any) -> list[PositionLogprobs]:
    """The prompt's, from its second token (vLLM's first entry is None: nothing precedes the first token)."""
    out = []
    for tid, position in zip(list(prompt_ids)[1:], list(logprobs)[1:]):
        if position:
            out.append(_position(tid, position, _top_count(position, tid)))
    return out


def _top_count(position: Any, tid: int) -> int:
    """How many alternatives were asked for: vLLM adds the chosen token to them when it is not among them."""
    return len(position) - (1 if position[tid].rank > len(position) - 1 else 0)


def _position(tid: int, position: Any, top: int) -> PositionLogprobs:
    chosen = position.get(tid)
    own = (tid, float(chosen.logprob), int(chosen.rank), chosen.decoded_token or "") if chosen is not None else (tid, 0.0, 0, "")
    alternatives = sorted(((t, float(lp.logprob), int(lp.rank), lp.decoded_token or "") for t, lp in position.items()
                           if lp.rank is not None and lp.rank <= top), key=lambda x: x[2])
    return own, tuple(alternatives[:top])


def finish_reason(reason: str | None, stop_reason: int | str | None) -> FinishReason:
    """vLLM's finish reason as ours: "stop" means a stop string when stop_reason is one."""
    if reason == "length":
        return FinishReason.LENGTH
    if reason == "stop" and isinstance(stop_reason, str):
        return FinishReason.STOP_STRING
    return FinishReason.STOP  # eos, a stop token id, or a repetition stop

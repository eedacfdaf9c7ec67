"""Run vLLM's OpenAI-compatible server with AMX enabled in every process: `bench compare`'s baseline.

    python -m tokenline.bench.vllm_serve [--tokenline-attention-kernel auto] --model FOLDER --port 8000 [vLLM api_server flags]

On these CPUs Linux must grant AMX to a process before the attention kernel uses
it, or a short first prompt kills the process with SIGILL (torch.cpu._init_amx asks for it).
This launcher grants it here, and a `sitecustomize` on PYTHONPATH grants it in
every Python process vLLM starts (spawned processes do not inherit it), then it
runs `vllm.entrypoints.openai.api_server` unchanged. Run only as a subprocess:
nothing else in the bench imports vLLM.

`--tokenline-attention-kernel K` (auto, or a kernel name) makes every process choose its CPU
attention kernel as tokenline's worker does (engine/kernels.py): on an AMX CPU vLLM 0.32.0's own
choice answers wrongly when run eagerly (`--enforce-eager`), and a comparison with it would compare
speed at different answers.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
from pathlib import Path

_SITECUSTOMIZE = """\
import os
if os.environ.get("TOKENLINE_INIT_AMX") == "1":
    try:
        import torch
        torch.cpu._init_amx()
    except Exception:
        pass
if os.environ.get("TOKENLINE_VLLM_ATTENTION_KERNEL"):
    try:
        import vllm
        from vllm.v1.attention.backends import cpu_attn
        from tokenline.engine.kernels import wrap_vllm_chooser
        wrap_vllm_chooser(cpu_attn, os.environ["TOKENLINE_VLLM_ATTENTION_KERNEL"], vllm.__version__,
                          compiled=os.environ.get("TOKENLINE_VLLM_EAGER") != "1",
                          on_choice=lambda kernel, why: print(f"tokenline: attention kernel {kernel}" + (f" ({why})" if why else ""),
                                                    flush=True))
    except ImportError:
        pass
"""


def grant_amx() -> None:
    import torch

    if hasattr(torch, "cpu") and hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for key, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"),
                       ("VLLM_HOST_IP", "127.0.0.1")):
        os.environ.setdefault(key, value)
    site_dir = Path(tempfile.mkdtemp(prefix="tokenline-amx-"))
    (site_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(site_dir), os.environ.get("PYTHONPATH"))))
    os.environ["TOKENLINE_INIT_AMX"] = "1"
    grant_amx()
    args = sys.argv[1:]
    if "--tokenline-attention-kernel" in args:
        at = args.index("--tokenline-attention-kernel")
        os.environ["TOKENLINE_VLLM_ATTENTION_KERNEL"] = args[at + 1]
        del args[at:at + 2]
        os.environ["TOKENLINE_VLLM_EAGER"] = "1" if "--enforce-eager" in args else "0"
    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

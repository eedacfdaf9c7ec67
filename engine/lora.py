"""LoRA adapters: light versions of one base model, chosen per request and batched with the base model's requests.

An adapter is a folder as `peft` saves one (adapter_config.json and adapter_model.safetensors). A model's adapters
are given at start (`tokenline serve --lora NAME=FOLDER`, engine/config.py WorkerConfig.lora_adapters); every worker
of the model loads all of them when it starts (a bad adapter stops the start with vLLM's message, not a request), and
a request names an adapter as its model. This module reads what the frontend and the plan need from the folder
without importing vLLM or torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# The ranks vLLM's LoRA kernels take (vllm.config.lora: max_lora_rank must be one of these).
ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterError(ValueError):
    """A folder that is not a LoRA adapter tokenline can serve; the message says what to fix."""


def adapter_config(folder: str | Path) -> dict:
    path = Path(folder) / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise AdapterError(f"{folder}: not a LoRA adapter folder (no readable adapter_config.json: {e.strerror})") from None
    except ValueError as e:
        raise AdapterError(f"{path}: not JSON ({e})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r}, not LORA")
    if not any((Path(folder) / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise AdapterError(f"{folder}: no adapter_model.safetensors (or .bin) beside adapter_config.json")
    return config


def adapter_rank(folder: str | Path) -> int:
    config = adapter_config(folder)
    rank = int(config.get("r", 0))
    if rank < 1:
        raise AdapterError(f"{folder}: adapter_config.json has no rank r >= 1")
    return rank


def engine_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds `rank`."""
    for r in ENGINE_RANKS:
        if r >= rank:
            return r
    raise AdapterError(f"LoRA rank {rank} is above the {ENGINE_RANKS[-1]} vLLM supports")


def adapter_version(folder: str | Path) -> str:
    """A content hash of the adapter's files (its config and weights), as a model's version is of its folder."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        path = Path(folder) / name
        if path.is_file():
            h.update(name.encode())
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:12]

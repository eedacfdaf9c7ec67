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
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenline.engine.config import WorkerConfig

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


def lora_slots(config: WorkerConfig) -> int:
    """vLLM's max_loras for a model's workers: its adapters at most (WorkerConfig.max_loras) and one spare slot
    (engine/vllm_build.py _lora_args says why)."""
    return max(config.max_loras, len(config.lora_adapters)) + 1


def lora_rank(config: WorkerConfig) -> int:
    """vLLM's max_lora_rank for a model's workers: `--max-lora-rank`, raised to the largest rank of the adapters given
    at start; 16 (vLLM's default) when neither says."""
    ranks = [adapter_rank(folder) for _, folder, _ in config.lora_adapters]
    if config.max_lora_rank:
        ranks.append(config.max_lora_rank)
    return engine_rank(max(ranks, default=16))


# The projections vLLM's LoRA layers cover in a Llama-style decoder layer, as (input, output) widths from config.json.
def slot_bytes(model_config: dict, rank: int, dtype_bytes: int = 4) -> int:
    """Memory one LoRA slot takes in a worker: vLLM preallocates A (rank × input) and B (output × rank) for each
    projection of each layer at the engine's max rank, for every slot, whether an adapter fills it or not. An estimate
    from config.json (attention q/k/v/o and the MLP's gate/up/down), for the plan."""
    hidden = int(model_config.get("hidden_size", 0))
    layers = int(model_config.get("num_hidden_layers", 0))
    inter = int(model_config.get("intermediate_size", 0))
    heads = int(model_config.get("num_attention_heads", 1)) or 1
    kv_heads = int(model_config.get("num_key_value_heads", heads)) or heads
    head_dim = int(model_config.get("head_dim", hidden // heads))
    qkv_out = (heads + 2 * kv_heads) * head_dim
    widths = (hidden + qkv_out) + (heads * head_dim + hidden) + (hidden + 2 * inter) + (inter + hidden)
    return layers * rank * widths * dtype_bytes


def check_weights(folder: str | Path, rank: int, hidden_size: int) -> None:
    """The adapter's weights file read as far as its header (no tensor is loaded): LoRA A/B tensors whose rank fits
    `rank` and whose widths include the model's hidden size. AdapterError saying what is wrong, so that a bad adapter is
    refused when it is loaded, not when a request first names it."""
    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        return  # a .bin adapter: vLLM reads it when a worker loads it
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 1024 * 1024:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise AdapterError(f"{path}: not a safetensors file ({e})") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    pairs = [(k, v.get("shape", [])) for k, v in tensors.items() if "lora_A" in k or "lora_B" in k]
    if not pairs:
        raise AdapterError(f"{path}: no lora_A / lora_B tensors (is it a LoRA adapter?)")
    for name, shape in pairs:
        if len(shape) != 2:
            raise AdapterError(f"{path}: {name} has shape {shape}, not a matrix")
        r = shape[0] if "lora_A" in name else shape[1]
        if r > rank:
            raise AdapterError(f"{path}: {name} has rank {r}, above the {rank} this model's workers were started with "
                               "(--max-lora-rank)")
    if hidden_size and not any(hidden_size in shape for _, shape in pairs):
        raise AdapterError(f"{path}: no tensor is {hidden_size} wide, the model's hidden size: an adapter of another "
                           "model")

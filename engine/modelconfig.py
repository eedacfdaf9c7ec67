"""A model folder's config.json, read in one place, and the facts the rest of tokenline takes from it.

Multimodal configs keep the language model's settings under `text_config`; that part is what
is returned. No vllm, torch or transformers here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


def read_config(model_path: str | Path, *, strict: bool = False) -> dict[str, Any]:
    """The language model's part of `model_path`/config.json; {} when there is none (or, strict, raise)."""
    path = Path(model_path) / "config.json"
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        if strict:
            raise ValueError(f"cannot read {path} ({e}); model_path must be a Hugging Face model folder") from e
        return {}
    value = value.get("text_config", value) if isinstance(value, dict) else {}
    return value if isinstance(value, dict) else {}


def context_len(config: dict[str, Any]) -> int | None:
    """The model's own context length (max_model_len may not exceed it); None when it does not say."""
    value = config.get("max_position_embeddings") or config.get("max_sequence_length")
    return int(value) if value else None


def kv_bytes_per_token(config: dict[str, Any], dtype: str = "bfloat16") -> int | None:
    """KV cache bytes one token takes in this model (keys and values, every layer); None when unknown."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)

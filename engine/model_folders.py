"""Model folders built here: where they live, how one is written (weights, tokenizer, config), and building
one once, atomically: in a temporary folder beside its destination, renamed into place with a completion
marker written last, so an interrupted build never leaves a half folder behind.

Only the standard library is imported at module level (safetensors inside the functions that need it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


BUILT_MARKER = ".tokenline-complete"  # written last: the folder is whole and ours


# Bump when what a build writes changes, so folders built by older code are rebuilt.
BUILD_FORMAT = 1


# A temporary build folder older than this is left over from a killed run.
_STALE_BUILD_S = 3600


Log = Callable[[str], Any]


class ModelPrepError(RuntimeError):
    """A model folder cannot be found or built; the message says what to do about it."""


def cache_dir() -> Path:
    """Where built model folders live: `$TOKENLINE_CACHE`, else `~/.cache/tokenline`."""
    configured = os.environ.get("TOKENLINE_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "tokenline"


def llama_config(*, rope_theta: float, **fields: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        **fields,
        # Written both ways on purpose: readers before transformers 5 take `rope_theta` and
        # silently fall back to 10000 without it; transformers 5 and vLLM read `rope_parameters`.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def set_byte_level_pipeline(tokenizer: Any, *, split_digits: bool) -> None:
    from tokenizers import decoders, pre_tokenizers, processors

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    # ByteLevel post-processing only fixes offsets; it adds no BOS or EOS.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)


def llama_weight_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        shapes += [
            (f"{prefix}.input_layernorm.weight", (hidden,)),
            (f"{prefix}.self_attn.q_proj.weight", (q_out, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv_out, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv_out, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, q_out)),
            (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
            (f"{prefix}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def save_weights(tensors: dict[str, Any], out: Path) -> str:
    from safetensors.torch import save_file

    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_tokenizer_and_config(
    out: Path,
    *,
    config: dict[str, Any],
    tokenizer: Any,
    chat_template: str,
    special_tokens: dict[str, str],
) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        # The generic fast tokenizer loads tokenizer.json as written; a model-specific class
        # could rebuild the pipeline from vocab and merges and bring back a BOS.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": special_tokens["bos"],
        "eos_token": special_tokens["eos"],
        "pad_token": special_tokens["pad"],
        "unk_token": special_tokens["unk"],
        # Cleaning up spaces would alter decoded text (" ." -> "."), breaking round-trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": chat_template,
    }
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(out / "generation_config.json", generation_config)
    write_json(out / "config.json", config)


def write_json(path: Path, value: Any) -> None:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


def read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / BUILT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_built(folder: Path, stamp: dict[str, Any]) -> bool:
    marker = read_marker(folder)
    return marker is not None and all(marker.get(k) == v for k, v in stamp.items())


def build_once(
    dest: Path, stamp: dict[str, Any], build: Callable[[Path], dict[str, Any]], log: Log
) -> Path:
    """Return `dest` if built from the same inputs, else build it in a temp folder, swap it in."""
    if _is_built(dest, stamp):
        return dest
    if dest.exists() and read_marker(dest) is None and not _is_empty_dir(dest):
        raise ModelPrepError(
            f"{dest} exists but was not built by tokenline; remove it or choose another folder"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(dest)
    building = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
    try:
        extra = build(building)
        write_json(building / BUILT_MARKER, {**stamp, **extra, "built_at": time.time()})
        _make_readable(building)
        _swap_in(building, dest, stamp)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return dest


def _swap_in(building: Path, dest: Path, stamp: dict[str, Any]) -> None:
    if _is_empty_dir(dest):
        dest.rmdir()
    try:
        os.rename(building, dest)
        return
    except OSError:
        if _is_built(dest, stamp):  # another process finished the same build first
            return
    # dest holds an older tokenline build: move it aside, then swap (two renames, never half).
    retired = Path(tempfile.mkdtemp(prefix=f".{dest.name}.retired-", dir=dest.parent))
    os.rename(dest, retired / dest.name)
    os.rename(building, dest)
    shutil.rmtree(retired, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    # mkdtemp creates 0700 and safetensors writes 0600; a server running as another user
    # must still read the cache, so apply the usual umask instead.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _remove_stale_builds(dest: Path) -> None:
    cutoff = time.time() - _STALE_BUILD_S
    for pattern in (f".{dest.name}.building-*", f".{dest.name}.retired-*"):
        for leftover in dest.parent.glob(pattern):
            try:
                if leftover.stat().st_mtime < cutoff:
                    shutil.rmtree(leftover, ignore_errors=True)
            except OSError:
                pass


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())

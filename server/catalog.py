"""The models this server serves, as the frontend sees them: name, tokenizer, limits.

The frontend tokenizes (and applies chat templates) itself, so workers receive
token ids and a bad prompt is refused before it costs any engine time.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any


@dataclass
class ServedModel:
    name: str
    path: pathlib.Path
    version: str
    max_context: int
    vocab_size: int
    tokenizer: Any  # transformers tokenizer

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
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    context = int(config.get("max_position_embeddings", max_model_len))
    vocab = int(config.get("vocab_size", len(tokenizer)))
    return ServedModel(name=name, path=path, version=version, max_context=min(context, max_model_len), vocab_size=vocab, tokenizer=tokenizer)

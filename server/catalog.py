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
    eos_token_ids: tuple[int, ...] = ()  # the tokens that end generation (tokenizer and generation config)
    # vLLM's tool-call parser for this model's format (serve --tool-call-parser), which tool_choice AUTO needs,
    # and a factory of its per-answer parsers (`tool_parsers.VllmToolParsers`), made when the server starts.
    tool_call_parser: str | None = None
    tool_parsers: Any = None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    kwargs: dict[str, Any] | None = None) -> list[int]:
        from tokenline.server.errors import InvalidRequest

        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                     **(kwargs or {}))
        except Exception as e:  # noqa: BLE001  the template's own refusal (jinja raise_exception, a missing field)
            raise InvalidRequest(f"the chat template of {self.name} refused these messages: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def chat_template(self) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else ""


def load_served_model(name: str, path: pathlib.Path, version: str, max_model_len: int) -> ServedModel:
    from transformers import AutoTokenizer  # heavy: imported only when a server starts

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    config = modelconfig.read_config(path, strict=True)
    context = modelconfig.context_len(config) or max_model_len
    vocab = int(config.get("vocab_size", len(tokenizer)))
    return ServedModel(name=name, path=path, version=version, max_context=min(context, max_model_len), vocab_size=vocab,
                       tokenizer=tokenizer, max_token_chars=longest_token_chars(tokenizer),
                       eos_token_ids=eos_token_ids(path, tokenizer, config))


def eos_token_ids(path: pathlib.Path, tokenizer: Any, config: dict) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence token and those of config.json and generation_config.json (vLLM stops on all)."""
    import json

    ids: list[int] = []
    sources: list[Any] = [tokenizer.eos_token_id, config.get("eos_token_id")]
    try:
        sources.append(json.loads((path / "generation_config.json").read_text()).get("eos_token_id"))
    except (OSError, ValueError):
        pass
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters of text one token covers, so that a prompt's length in
    characters bounds its length in tokens before it is tokenized.

    Taken over the whole vocabulary (added tokens too) from each token's spelling: byte-level BPE
    spells one symbol per byte (a character is at least one byte), SentencePiece one '▁' per space,
    byte fallback '<0x0A>' for one byte; plus one for a space a decoder may add.
    """
    spelled = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(str(t or "")) for t in spelled) + 1


@dataclass(frozen=True)
class ModelLoad:
    """What a model's queues and workers hold now (Runtime.model_load)."""

    queued_interactive: int = 0
    queued_bulk: int = 0
    running: int = 0
    state: str = "serving"

"""Where prompts come from: random tokens of the served model's vocabulary, or a file.

Every prompt ends up as token ids of the served model's tokenizer, so input
lengths are exact and every target (tokenline, an OpenAI-compatible server, the
engine itself) is sent the same tokens. A prompt file is JSON Lines (or one JSON
array) of objects, each one of

    {"prompt": "text"}                                    plain text
    {"messages": [{"role": "user", "content": "..."}]}    chat, rendered with the chat template
    {"conversations": [{"from": "human", "value": ...},   ShareGPT: the first human turn is the
                       {"from": "gpt", "value": ...}]}    prompt, the reply's length the output length

optionally with "max_tokens" (the output length to ask for).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "assistant": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


class PromptError(ValueError):
    """A prompt file or tokenizer cannot be used; the message says why."""


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of a model name tokenline knows ("tiny", the default) or a model folder."""
    from tokenline.engine.models import resolve_model  # builds the folder once if needed

    path = resolve_model(model)
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers comes with vllm
        raise PromptError("synthetic and file prompts need the `transformers` package") from e
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    text: str | None  # the text it came from (None for random tokens)
    output_len_hint: int | None = None  # e.g. the length of the reply in a ShareGPT conversation


class SyntheticPrompts:
    """Random token sequences over the tokenizer's ordinary (non-special) tokens."""

    def __init__(self, tokenizer: Any):
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.vocab = [i for i in range(len(tokenizer)) if i not in special]
        if not self.vocab:
            raise PromptError("the tokenizer has no ordinary tokens to build prompts from")

    def prompt(self, rng: random.Random, length: int) -> Prompt:
        vocab = self.vocab
        return Prompt(tuple(vocab[int(rng.random() * len(vocab))] for _ in range(length)), None)


class FilePrompts:
    """Prompts read from a file, tokenized once; request i takes one chosen by its own seed."""

    def __init__(self, path: str | Path, tokenizer: Any, *, max_input_tokens: int | None = None):
        self.path = Path(path)
        self.prompts = [p for p in (_to_prompt(entry, tokenizer, self.path) for entry in _read_entries(self.path))
                        if p.token_ids and (max_input_tokens is None or len(p.token_ids) <= max_input_tokens)]
        if not self.prompts:
            raise PromptError(f"{self.path}: no usable prompts (empty, or all longer than {max_input_tokens} tokens)")

    def prompt(self, rng: random.Random, length: int | None = None) -> Prompt:
        return self.prompts[int(rng.random() * len(self.prompts))]


def _read_entries(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PromptError(f"cannot read prompt file {path}: {e.strerror}") from e
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as e:
            raise PromptError(f"{path}: not a JSON array ({e.msg}, line {e.lineno})") from e
    else:
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}: line {number} is not JSON ({e.msg}); expected JSON Lines or a JSON array") from e
    bad = next((i for i, e in enumerate(entries) if not isinstance(e, dict)), None)
    if bad is not None:
        raise PromptError(f"{path}: entry {bad + 1} is not a JSON object")
    return entries


def _to_prompt(entry: dict, tokenizer: Any, path: Path) -> Prompt:
    hint = entry.get("max_tokens") or entry.get("output_len")
    if "conversations" in entry:
        messages = [{"role": _SHAREGPT_ROLES.get(str(t.get("from", "")).lower(), "user"), "content": str(t.get("value", ""))}
                    for t in entry["conversations"] if isinstance(t, dict)]
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is None:
            return Prompt((), None)
        reply = next((m for m in messages[first_user + 1:] if m["role"] == "assistant"), None)
        if hint is None and reply is not None:
            hint = len(tokenizer.encode(reply["content"], add_special_tokens=False)) or None
        messages = messages[: first_user + 1]
        return Prompt(_chat_ids(messages, tokenizer), messages[-1]["content"], hint)
    if "messages" in entry:
        messages = [{"role": str(m.get("role", "user")), "content": str(m.get("content", ""))} for m in entry["messages"]]
        return Prompt(_chat_ids(messages, tokenizer), messages[-1]["content"] if messages else None, hint)
    text = entry.get("prompt", entry.get("text"))
    if not isinstance(text, str):
        raise PromptError(f'{path}: an entry has none of "prompt", "messages" or "conversations": {json.dumps(entry)[:80]}')
    return Prompt(tuple(tokenizer.encode(text)), text, hint)


def _chat_ids(messages: list[dict], tokenizer: Any) -> tuple[int, ...]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return tuple(int(i) for i in ids)
    return tuple(tokenizer.encode("\n".join(m["content"] for m in messages)))

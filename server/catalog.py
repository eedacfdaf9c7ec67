"""The models this server serves, as the frontend sees them: name, tokenizer, limits.

The frontend tokenizes (and applies chat templates) itself, so workers receive
token ids and a bad prompt is refused before it costs any engine time.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from tokenline.engine import modelconfig


@dataclass
class ServedModel:
    name: str  # what callers put in GenerateRequest.model
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
    # The runtime's name for this version (its workers, queues, telemetry): the name for the version the server
    # started with, "name@version" for one rolled out since (server/admin.py).
    key: str = ""
    # A LoRA adapter of the model (`tokenline serve --lora`): this is the adapter as callers see it (its name and
    # version; the model's tokenizer, limits and runtime key), and the workers run it with (name, id, folder).
    adapter: tuple[str, int, str] | None = None
    base: str = ""  # an adapter's: the name of the model it adapts
    lora_on: bool = False  # its workers run with LoRA (the model has adapters, or is one)

    def __post_init__(self) -> None:
        self.key = self.key or self.name

    @property
    def pinned(self) -> str:
        """The name that always means this version (GenerateRequest.model "name@version"), whatever is current."""
        return f"{self.name}@{self.version}"

    def asked_as(self, asked: str) -> str:
        """What a caller naming this version `asked` asked for: "name" (whichever version is current when it
        runs) or "name@version" (this one). Two calls are the same request only if they asked the same."""
        return self.name if asked == self.name else self.pinned

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


class ModelCatalog(Mapping[str, ServedModel]):
    """The loaded model versions, looked up by what a caller may name: "name" (its current version),
    "name@version" (that version, while it is loaded), or the runtime's key. Iterating gives each loaded
    version once, by key."""

    def __init__(self) -> None:
        self._loaded: dict[str, ServedModel] = {}
        self._current: dict[str, str] = {}  # name -> key of its current version
        self._adapters: dict[str, tuple[str, int, str, str]] = {}  # adapter name -> (model name, id, folder, version)
        # Adapters unloaded whose requests are still running (server/admin.py): they hold their slots until then.
        self.unloading: dict[str, tuple[str, int, str, str]] = {}
        self.lora_capacity: dict[str, int] = {}  # model name -> adapters it can hold at once (0: LoRA off)
        self._last_lora_id: dict[str, int] = {}  # model name -> the last adapter id given (ids are never reused)

    def add(self, model: ServedModel, *, current: bool) -> None:
        self._loaded[model.key] = model
        model.lora_on = (model.lora_on or any(base == model.name for base, *_ in self._adapters.values())
                         or self.lora_capacity.get(model.name, 0) > 0)
        if current or model.name not in self._current:
            self._current[model.name] = model.key

    def set_current(self, key: str) -> str | None:
        """Make the version `key` its name's current one; returns the key that was current (None: none)."""
        model = self._loaded[key]
        before = self._current.get(model.name)
        self._current[model.name] = key
        return before

    def remove(self, key: str) -> None:
        """Unload a version that is not current."""
        model = self._loaded[key]
        if self._current.get(model.name) == key:
            raise ValueError(f"{model.pinned} is the current version of {model.name!r}")
        del self._loaded[key]

    def current(self, name: str) -> ServedModel | None:
        key = self._current.get(name)
        return self._loaded[key] if key is not None else None

    def is_current(self, model: ServedModel) -> bool:
        if model.adapter is not None:  # an adapter runs on its model's current version
            return model.name in self._adapters
        return self._current.get(model.name) == model.key

    def add_adapter(self, base: str, name: str, lora_id: int, folder: str) -> None:
        """A LoRA adapter of the model `base`, served under `name` (engine/lora.py)."""
        from tokenline.engine.lora import adapter_version

        self._adapters[name] = (base, lora_id, folder, adapter_version(folder))
        self._last_lora_id[base] = max(self._last_lora_id.get(base, 0), lora_id)
        for model in self._loaded.values():
            if model.name == base:
                model.lora_on = True

    def next_lora_id(self, base: str) -> int:
        """An id for the next adapter of `base`: never one an earlier adapter had (a worker may still hold it)."""
        return self._last_lora_id.get(base, 0) + 1

    def remove_adapter(self, name: str) -> tuple[str, int, str, str]:
        """Stop serving the adapter `name` (a request naming it is NOT_FOUND from now on); it is `unloading` until its
        running requests end (server/admin.py). Its (model, id, folder, files' version)."""
        found = self._adapters.pop(name)
        self.unloading[name] = found
        return found

    def adapters_of(self, base: str) -> list[str]:
        """The adapters of `base` that hold a slot: served, or unloaded with requests still running."""
        return [n for n, (b, *_) in [*self._adapters.items(), *self.unloading.items()] if b == base]

    def adapters(self) -> list[ServedModel]:
        """Each adapter, as a request naming it sees it (on its model's current version)."""
        return [m for m in map(self._adapter, self._adapters) if m is not None]

    def _adapter(self, asked: str) -> ServedModel | None:
        name, at, pinned = asked.rpartition("@") if "@" in asked else (asked, "", "")
        found = self._adapters.get(name)
        model = self.current(found[0]) if found is not None else None
        if found is None or model is None:
            return None
        base, lora_id, folder, files = found
        # Its version names its files and the model version it runs on: a job or a key that pins it never continues
        # on another base (server/jobrunner.py).
        version = hashlib.sha256(f"{files}:{model.version}".encode()).hexdigest()[:12]
        if at and pinned != version:
            return None
        return replace(model, name=name, version=version, adapter=(name, lora_id, folder), base=base)

    def __getitem__(self, asked: str) -> ServedModel:
        adapter = self._adapter(asked)
        if adapter is not None:
            return adapter
        if asked in self._current:
            return self._loaded[self._current[asked]]
        if asked in self._loaded:
            return self._loaded[asked]
        name, at, version = asked.rpartition("@")
        if at:
            for model in self._loaded.values():
                if model.name == name and model.version == version:
                    return model
        raise KeyError(asked)

    def __contains__(self, asked: object) -> bool:
        try:
            self[asked]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._loaded))

    def values(self):  # noqa: ANN201  each loaded version once (self[key] would resolve a key that is also a name)
        return list(self._loaded.values())

    def items(self):  # noqa: ANN201
        return list(self._loaded.items())

    def __len__(self) -> int:
        return len(self._loaded)

"""`--model`, `--model-workers`, `--lora` and `--max-loras`: which models a server serves, by what names, on how many workers,
with which LoRA adapters (issue 34).

`--model MODEL` once serves one model under its derived name (or `--model-name`); repeated, each is
`NAME=MODEL` or `MODEL` (named after its folder), and every model runs on workers of its own
(engine/model_plan.py splits the machine). `--model-workers NAME=N` gives one model its own count.
`MODEL@VERSION` labels the version (what `name@version` and ListModels say) instead of a hash of its files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class ModelFlag:
    name: str | None  # None: derived from the model's folder
    model: str | None  # what resolve_model takes: a built-in name, a folder; None: the default model
    workers: int | None = None
    version: str | None = None  # `MODEL@VERSION`: the operator's label; None: a content hash of its files


def model_flags(models: list[str] | None, model_name: str | None, model_workers: list[str] | None) -> list[ModelFlag]:
    """The models asked for, in order; ValueError with what to fix."""
    given = models or [None]
    if model_name is not None and len(given) > 1:
        raise ValueError("--model-name names the one model; with several, name each: --model NAME=MODEL")
    flags = []
    for value in given:
        name, model = model_name, value
        if value is not None and "=" in value:
            name, model = value.split("=", 1)
            if not model:
                raise ValueError(f"--model {value!r}: say which model after '=' (NAME=MODEL)")
        if name is not None and not NAME.match(name):
            raise ValueError(f"model name {name!r}: use letters, digits, '.', '_', ':' or '-' (at most 128, "
                             "starting with a letter or digit)")
        model, version = _version(model)
        flags.append(ModelFlag(name, model, version=version))
    counts = _counts(model_workers or [])
    if counts:
        if len(flags) == 1 and flags[0].name is None:
            raise ValueError("--model-workers names a model: give it a name (--model NAME=MODEL), or use --workers")
        names = {f.name for f in flags}
        unknown = sorted(set(counts) - names)
        if unknown:
            raise ValueError(f"--model-workers names {', '.join(map(repr, unknown))}, not a model given by --model "
                             f"NAME=MODEL (models: {', '.join(sorted(n for n in names if n))})")
        flags = [ModelFlag(f.name, f.model, counts.get(f.name), f.version) for f in flags]
    return flags


VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _version(model: str | None) -> tuple[str | None, str | None]:
    """`MODEL@VERSION` as (MODEL, VERSION); a model whose own path has an '@' in it is not split."""
    if model is None or "@" not in model or Path(model).exists():
        return model, None
    path, _, version = model.rpartition("@")
    if not path or not VERSION.match(version):
        raise ValueError(f"--model {model!r}: a version label after '@' is letters, digits, '.', '_' or '-' (at most "
                         "64, starting with a letter or digit)")
    return path, version


def _counts(values: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        name, _, n = value.partition("=")
        try:
            count = int(n)
        except ValueError:
            count = 0
        if not name or count < 1:
            raise ValueError(f"--model-workers {value!r}: give NAME=N with N at least 1")
        counts[name] = count
    return counts


def lora_flags(values: list[str] | None, models: list[str]) -> dict[str, tuple[tuple[str, str], ...]]:
    """`--lora [MODEL/]NAME=FOLDER`s as each model's (name, folder) adapters; ValueError with what to fix. Without
    MODEL the adapter is the first model's (the only one, usually); adapter names share the models' namespace."""
    out: dict[str, list[tuple[str, str]]] = {m: [] for m in models}
    seen = set(models)
    for value in values or []:
        target, eq, folder = value.partition("=")
        model, slash, name = target.rpartition("/")
        if not eq or not folder or not name:
            raise ValueError(f"--lora {value!r}: give NAME=FOLDER, or MODEL/NAME=FOLDER with several models")
        model = model if slash else models[0]
        if model not in out:
            raise ValueError(f"--lora {value!r}: {model!r} is not a served model (models: {', '.join(models)})")
        if not NAME.match(name) or "@" in name:
            raise ValueError(f"LoRA adapter name {name!r}: use letters, digits, '.', '_', ':' or '-' (at most 128, "
                             "starting with a letter or digit)")
        if name in seen:
            raise ValueError(f"--lora {value!r}: the name {name!r} is taken (by a model or another adapter)")
        seen.add(name)
        out[model].append((name, folder))
    return {m: tuple(a) for m, a in out.items()}


def max_loras_flags(values: list[str] | None, models: list[str]) -> dict[str, int]:
    """`--max-loras [MODEL=]N`s as each model's adapter capacity (0: not given); N without MODEL= is every model's,
    and a MODEL=N after it overrides it for that model. ValueError with what to fix."""
    out = dict.fromkeys(models, 0)
    for value in values or []:
        model, eq, count = value.rpartition("=")
        try:
            n = int(count)
        except ValueError:
            n = -1
        if n < 0 or (eq and not model):
            raise ValueError(f"--max-loras {value!r}: give N, or MODEL=N, with N at least 0")
        if not eq:
            out = dict.fromkeys(models, n)
        elif model not in out:
            raise ValueError(f"--max-loras {value!r}: {model!r} is not a served model (models: {', '.join(models)})")
        else:
            out[model] = n
    return out

"""Flags owned by their configs.

A config dataclass declares each command-line flag that sets one of its fields once, beside the field, in the
field's metadata: `max_seqs: int = flag(64, "--max-seqs", "sequences a worker runs at once")`. `add_flags` builds
argparse arguments from those declarations (defaults shown in the flag's unit, from the dataclass's own defaults)
and `read_flags` reads the parsed values back by field name into an instance. `tokenline serve`
(server/flags.py), the bench and the chaos soak all build their engine and scheduler flags this way, so a flag's
name, unit, help and default are written in one place.

Units: "ms" (the flag in milliseconds, the field in seconds), "MiB" (the field in bytes), "on/off" (a bool field,
the flag takes on or off), "switch" (a bool field, the flag takes no value and turns it on). `none_at_zero`: a
flag value of 0 means the field's None ("off"). A nested config (SchedulerConfig.interactive, .bulk) is a
`section`: its fields' flag names may hold "{cls}" (one flag per section) or not (one flag both sections share);
`only` limits a flag to some sections.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any

MiB = 1 << 20
UNITS = ("", "ms", "MiB", "on/off", "switch")


@dataclass(frozen=True)
class FlagSpec:
    """How one config field is set from the command line."""

    name: str  # "--max-seqs"; in a section's config, "{cls}" is the section's name
    help: str
    unit: str = ""  # one of UNITS
    none_at_zero: bool = False  # the flag's 0 reads back as the field's None (the feature off)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    only: tuple[str, ...] | None = None  # sections this flag exists in (None: all)
    type: Any = None  # the flag's type, where the field's default does not tell it (a None default)

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"flag {self.name}: unit {self.unit!r} is not one of {UNITS}")

    def dest(self, section: str = "") -> str:
        return self.name.format(cls=section).lstrip("-").replace("-", "_")

    def to_flag(self, value: Any) -> Any:
        """A field's value in the flag's unit (a default to show)."""
        if value is None:
            return 0 if self.none_at_zero else None
        if self.unit == "ms":
            return value * 1000
        if self.unit == "MiB":
            return value // MiB
        if self.unit == "on/off":
            return "on" if value else "off"
        return value

    def to_field(self, value: Any) -> Any:
        """A parsed flag value as the field's."""
        if value is None or (self.none_at_zero and value == 0):
            return None
        if self.unit == "ms":
            return value / 1000
        if self.unit == "MiB":
            return int(value) * MiB
        if self.unit == "on/off":
            return value == "on"
        return value


def flag(default: Any = MISSING, name: str = "", help: str = "", *, default_factory: Any = MISSING,
         section: bool = False, **spec: Any) -> Any:
    """A dataclass field with its flag. `section=True` marks a nested config whose own fields carry flags."""
    metadata = {"section": True} if section else {"flag": FlagSpec(name, help, **spec)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def flag_specs(cls: type) -> dict[str, FlagSpec]:
    """The flags of `cls`'s own fields, by field name."""
    return {f.name: f.metadata["flag"] for f in dataclasses.fields(cls) if "flag" in f.metadata}


def _sections(cls: type) -> list[tuple[str, type]]:
    return [(f.name, _field_type(cls, f)) for f in dataclasses.fields(cls) if f.metadata.get("section")]


def _field_type(cls: type, f: dataclasses.Field) -> type:
    import typing

    return typing.get_type_hints(cls)[f.name]


def _default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              only: tuple[str, ...] | None = None, defaults: dict[str, Any] | None = None,
              helps: dict[str, str] | None = None) -> None:
    """Add the flags of `cls` (and of its sections) to `parser`.

    `only`: these fields alone (by field name). `defaults`: field values (in the field's unit) that replace the
    dataclass's defaults for this command; a None stands for "decided at run time" and shows no default.
    `helps`: help texts that replace the declared ones, by field name.
    """
    defaults, helps = defaults or {}, helps or {}
    for name, spec in flag_specs(cls).items():
        if only is None or name in only:
            value = defaults[name] if name in defaults else _default(cls, name)
            _add(parser, spec, "", value, helps.get(name, spec.help))
    added: set[str] = set()
    instance = None
    for section, sub in _sections(cls):
        for name, spec in flag_specs(sub).items():
            key = f"{section}.{name}"
            if (spec.only is not None and section not in spec.only) or (only is not None and key not in only and name not in only):
                continue
            dest = spec.dest(section)
            if dest in added:
                continue  # a flag both sections share
            added.add(dest)
            if instance is None:
                instance = cls()
            value = defaults.get(key, getattr(getattr(instance, section), name))
            _add(parser, spec, section, value, helps.get(key, helps.get(name, spec.help)).format(cls=section))


def _add(parser: Any, spec: FlagSpec, section: str, value: Any, help: str) -> None:
    default = spec.to_flag(value)
    name = spec.name.format(cls=section)
    if spec.unit == "switch":
        parser.add_argument(name, action="store_true", default=bool(value), help=help)
        return
    kwargs: dict[str, Any] = {"default": default, "metavar": spec.metavar}
    if spec.unit == "on/off":
        kwargs["choices"] = ("on", "off")
    elif spec.choices:
        kwargs["choices"] = spec.choices
    else:
        kind = spec.type or (type(default) if default is not None else None)
        if kind in (int, float):
            kwargs["type"] = kind
    shown = "" if default is None or "(default" in help else " (default %(default)s)"
    parser.add_argument(name, help=help + shown, **kwargs)


def read_flags(args: argparse.Namespace, cls: type, **fields: Any) -> Any:
    """An instance of `cls` from parsed flags: every field whose flag `args` holds, its sections built the same
    way, the dataclass's defaults for the rest, and `fields` (set by the caller) over all of them."""
    return cls(**flag_values(args, cls, **fields))


def flag_values(args: argparse.Namespace, cls: type, **fields: Any) -> dict[str, Any]:
    """The field values `read_flags` would build `cls` from."""
    values: dict[str, Any] = {}
    for name, spec in flag_specs(cls).items():
        if hasattr(args, spec.dest()):
            values[name] = spec.to_field(getattr(args, spec.dest()))
    if _sections(cls):
        instance = cls()
        for section, sub in _sections(cls):
            own = {}
            for name, spec in flag_specs(sub).items():
                dest = spec.dest(section)
                if (spec.only is None or section in spec.only) and hasattr(args, dest):
                    own[name] = spec.to_field(getattr(args, dest))
            values[section] = dataclasses.replace(getattr(instance, section), **own)
    values.update(fields)
    return values

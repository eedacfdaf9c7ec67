"""The server's log format: one record is one line, whatever a caller put in the values.

Request ids, keys, tenant names and prompts come from callers; a newline or control
character in one of them must not be able to start a forged line. `SafeFormatter`
escapes the whole record (message and any traceback) in one place, so no call site
has to remember to.
"""

from __future__ import annotations

import logging
import re
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: anything a reader
# (a terminal, a log shipper splitting lines) could take for the end of a record.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    """`text` on one line: control characters as Python-style escapes.

    Backslashes are left alone, so a value escaped once (logfmt quoting) is not escaped again;
    values that must read back exactly are quoted where they are written (telemetry's logfmt).
    """
    return _UNSAFE.sub(_escaped, text)


def _escaped(m: re.Match) -> str:
    c = m.group()
    if c == "\n":
        return "\\n"
    if c == "\r":
        return "\\r"
    if c == "\t":
        return "\\t"
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


class SafeFormatter(logging.Formatter):
    """The stdlib formatter, with the record's text escaped onto one line (tracebacks as `\\n`)."""

    def format(self, record: logging.LogRecord) -> str:
        return escape(super().format(record))


def configure(level: str) -> None:
    """Log to stderr through `SafeFormatter` at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def snake_case(name: str) -> str:
    """Outcome labels: "DeadlineUnmeetable" → "deadline_unmeetable"; "stop" stays."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def logfmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    if not text or any(c in text for c in ' ="\\') or escape(text) != text:
        # Quoted, with control characters escaped: a caller's id can never end the line or the field.
        return '"' + escape(text.replace("\\", "\\\\")).replace('"', '\\"') + '"'
    return text

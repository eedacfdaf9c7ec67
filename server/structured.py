"""Structured output as the frontend checks it: a format is refused before any work is queued.

The worker's engine compiles a format against the vocabulary (vLLM's "auto" backend: xgrammar,
and guidance for JSON schemas xgrammar cannot serve). Here the same libraries only parse it, which
takes milliseconds and needs no tokenizer, so a bad schema, regex or grammar is an INVALID_ARGUMENT
with the library's own message instead of a failure after the request waited in a queue. Blocking
(C++ parsers): called off the event loop, from `convert.tokenize`.
"""

from __future__ import annotations

import json
import re

from tokenline.server.errors import InvalidRequest

MAX_SCHEMA_CHARS = 65_536
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024

# xgrammar's messages start "[09:01:57] /project/cpp/regex_converter.cc:83: ": its clock and
# source position say nothing to a caller (and are internals).
_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")


def check_format(kind: str, spec: str) -> None:
    """Raise InvalidRequest unless `spec` is a valid format of `kind` (convert.STRUCTURED_FORMATS)."""
    if kind == "json_object":
        return
    import xgrammar as xgr  # heavy: only when a request asks for structured output

    if kind == "json_schema":
        if len(spec) > MAX_SCHEMA_CHARS:
            raise InvalidRequest(f"json_schema has {len(spec)} characters; at most {MAX_SCHEMA_CHARS} are allowed")
        try:
            json.loads(spec)
        except ValueError as e:
            raise InvalidRequest(f"json_schema is not valid JSON: {e}") from None
        try:
            xgr.Grammar.from_json_schema(spec)
            return
        except Exception as e:  # xgrammar cannot serve it; vLLM would try guidance next
            xgrammar_says = _message(e)
        if not _guidance_accepts("json", spec):
            raise InvalidRequest(f"json_schema is not a schema the engine can enforce: {xgrammar_says}")
    elif kind == "regex":
        if len(spec) > MAX_REGEX_CHARS:
            raise InvalidRequest(f"regex has {len(spec)} characters; at most {MAX_REGEX_CHARS} are allowed")
        try:
            xgr.Grammar.from_regex(spec)
        except Exception as e:
            raise InvalidRequest(f"regex is not valid: {_message(e)}") from None
    elif kind == "grammar":
        if len(spec) > MAX_SCHEMA_CHARS:
            raise InvalidRequest(f"grammar has {len(spec)} characters; at most {MAX_SCHEMA_CHARS} are allowed")
        try:
            xgr.Grammar.from_ebnf(spec)
        except Exception as e:
            if not _guidance_accepts("lark", spec):
                raise InvalidRequest(f"grammar is not valid EBNF: {_message(e)}") from None
    elif kind == "choice":
        choices = json.loads(spec)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidRequest(f"choice needs 1 to {MAX_CHOICES} strings, got {len(choices)}")
        if any(not c or len(c) > MAX_CHOICE_CHARS for c in choices):
            raise InvalidRequest(f"each choice must have 1 to {MAX_CHOICE_CHARS} characters")
    else:
        raise InvalidRequest(f"unknown structured output format {kind!r}")


def _guidance_accepts(kind: str, spec: str) -> bool:
    try:
        import llguidance
    except ImportError:
        return False
    try:
        return not llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(kind, spec))
    except Exception:
        return False


def _message(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _PREFIX.sub("", text)[:500]

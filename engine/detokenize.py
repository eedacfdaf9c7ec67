"""Streamed text that is the text of the streamed tokens, across attempts.

vLLM turns each sequence's tokens into text with tokenizers' DecodeStream, primed with the prompt.
A continuation (after a crash or a preemption) sends the tokens already delivered back as part of
the prompt, and they may stop inside a multi-byte character; the native priming then emits the
whole prompt's text with the next token. This module holds the fix; it imports neither vLLM nor
torch (tokenizers only, when installed), so it is tested without an engine.
"""

from __future__ import annotations

from typing import Any


class DecodeStreamPrimedAtACharacter:
    """tokenizers' DecodeStream, primed so that a prompt ending inside a character leaks no prompt text.

    vLLM detokenizes each request with a DecodeStream primed with the prompt's token ids. When the
    prompt ends inside a multi-byte character (a continuation after a crash or preemption whose
    delivered tokens stop between the bytes of an emoji), the native priming emits the *whole
    prompt's text* with the next token (tokenizers 0.23; shown by tests/test_failures.py).
    Priming natively up to the last whole character, then stepping the rest, gives just the
    completed character. vLLM looks the class up on `tokenizers.decoders`: `install` puts this one there.
    """

    _native: Any = None

    def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = False):
        self._ids = list(ids or ())
        self._skip = skip_special_tokens
        self._stream: Any = None

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        if self._stream is None:
            self._stream = self._prime(tokenizer)
        return self._stream.step(tokenizer, token_id)

    def _prime(self, tokenizer: Any) -> Any:
        ids, cut = self._ids, len(self._ids)
        # Back to the last whole character: an unfinished one, or bytes that never make one, decode
        # to U+FFFD. However far back that is: an uninterrupted stream holds a run of such bytes until
        # a character follows it, and primed inside the run the native stream would emit the whole
        # prompt (a bound of 32 tokens leaked it after a longer run). Cost: one short decode per token
        # of the run, and the run stepped again, as the uninterrupted stream stepped it.
        while cut > 0 and tokenizer.decode(ids[max(cut - 8, 0):cut], skip_special_tokens=self._skip).endswith("\ufffd"):
            cut -= 1
        stream = self._native(ids=ids[:cut], skip_special_tokens=self._skip)
        for token_id in ids[cut:]:
            stream.step(tokenizer, token_id)
        return stream

    @classmethod
    def install(cls) -> None:
        import tokenizers.decoders

        if cls._native is None:
            cls._native = tokenizers.decoders.DecodeStream
            tokenizers.decoders.DecodeStream = cls


def delivered_text(prompt_ids: list[int], delivered_ids: list[int], tokenizer: Any, skip_special_tokens: bool = True) -> str:
    """The text vLLM made of `delivered_ids` when it generated them after `prompt_ids` (same priming, same steps)."""
    stream = DecodeStreamPrimedAtACharacter(ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    return "".join(stream.step(tokenizer, t) or "" for t in delivered_ids)


class StopAcrossAttempts:
    """Stop strings for a continuation whose text starts with text the earlier attempts held back.

    While a stop string could still begin in the last characters of the text, vLLM holds them back;
    when the run is interrupted there, they belong to tokens already delivered. The continuation's
    engine request knows nothing of them, so the backend checks the stop strings itself: `held`
    first, then each step's new text, shown as soon as no stop string can begin in it. The result
    is the uninterrupted rule: the text of the tokens, cut before the stop string that completes
    first (ties: the first listed), as vLLM's check_stop_strings picks.

    With `include` (include_stop_str_in_output) nothing is held back: the stop string stays in the
    text, which ends after it; `tail`, the end of the text already shown, lets a stop string that
    began there complete in the new text.
    """

    def __init__(self, held: str, stops: tuple[str, ...], *, include: bool = False, tail: str = ""):
        self.pending = held
        self.stops = stops
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.include = include
        self.tail = tail if include else ""

    def feed(self, text: str, *, finished: bool) -> tuple[str, bool]:
        """(text to show now, whether a stop string ended the sequence)."""
        if self.include:
            return self._feed_shown(text)
        self.pending += text
        hits = [(i + len(s), n, i) for n, s in enumerate(self.stops) if (i := self.pending.find(s)) >= 0]
        if hits:
            _, _, start = min(hits)
            shown, self.pending = self.pending[:start], ""
            return shown, True
        cut = len(self.pending) if finished else max(len(self.pending) - self.keep, 0)
        shown, self.pending = self.pending[:cut], self.pending[cut:]
        return shown, False

    def _feed_shown(self, text: str) -> tuple[str, bool]:
        seen = self.tail + self.pending + text
        start = len(self.tail)  # seen[start:] is not shown yet
        ends = [(j + len(s), n) for n, s in enumerate(self.stops)
                if (j := seen.find(s, max(start - len(s) + 1, 0))) >= 0]
        self.pending = ""
        if ends:
            end, _ = min(ends)
            return seen[start:end], True
        self.tail = seen[len(seen) - self.keep:] if self.keep else ""
        return seen[start:], False

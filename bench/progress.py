"""The live progress line of a bench run, on stderr.

On a terminal one line is redrawn in place; otherwise (a log, CI) a line is
printed every few seconds, so long runs still show they are alive.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, label: str = "", *, stream: TextIO | None = None, log_interval_s: float = 5.0):
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.log_interval_s = log_interval_s
        self._last_log = 0.0
        self._last_tokens = (0.0, 0)
        self._rate = 0.0

    def update(self, state: Any, *, final: bool = False) -> None:
        now = state.elapsed()
        t_prev, tok_prev = self._last_tokens
        if final:  # the whole run's average
            self._rate = state.output_tokens / now if now > 0 else 0.0
        elif now - t_prev >= 1.0:
            self._rate = (state.output_tokens - tok_prev) / (now - t_prev)
            self._last_tokens = (now, state.output_tokens)
        line = self.line(state, now)
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
            self.stream.flush()
        elif final or time.monotonic() - self._last_log >= self.log_interval_s:
            self._last_log = time.monotonic()
            self.stream.write(line + "\n")
            self.stream.flush()

    def line(self, state: Any, now: float) -> str:
        total = f"/{state.duration_s:g}" if state.duration_s else ""
        planned = f"/{state.planned}" if state.planned else ""
        s = state.by_status
        parts = [f"{self.label + ' ' if self.label else ''}[{now:6.1f}{total} s]",
                 f"sent {state.sent}{planned}", f"in flight {state.in_flight}", f"ok {s['ok']}"]
        for key in ("refused", "timeout", "cancelled", "error"):
            if s[key]:
                parts.append(f"{key} {s[key]}")
        parts.append(f"{self._rate:,.0f} tok/s")
        return " · ".join(parts)

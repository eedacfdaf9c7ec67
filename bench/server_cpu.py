"""A server process's CPU per streamed token: its user + system time from /proc/<pid>/stat over a run,
divided by the output tokens the run received.

The frontend's own cost per token (tokenline serve's process; vllm serve's API server process): the
figure that says whether a serving layer keeps up with an engine that steps faster than this one.
Linux only; elsewhere, or for a process that is gone, it is None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def process_cpu_s(pid: int) -> float | None:
    """`pid`'s CPU seconds so far (utime + stime, its own threads; not its children's)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: fields are counted after it.
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # fields 14 and 15 of proc(5): utime, stime


@dataclass
class ServerCpu:
    """Started before a run's load, read after it."""

    pid: int
    start_s: float | None = None

    @classmethod
    def start(cls, pid: int) -> ServerCpu:
        return cls(pid, process_cpu_s(pid))

    def result(self, output_tokens: int) -> dict[str, Any] | None:
        end = process_cpu_s(self.pid)
        if self.start_s is None or end is None:
            return None
        cpu_s = end - self.start_s
        return {"pid": self.pid, "cpu_s": round(cpu_s, 3), "output_tokens": output_tokens,
                "us_per_output_token": cpu_s * 1e6 / output_tokens if output_tokens else None}

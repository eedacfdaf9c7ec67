"""`tokenline serve` with the event loop's CPU counted per function: where a served frontend's loop spends it.

    python -m tokenline.bench.loop_cpu [--out loop_cpu.txt] serve --model tiny ...   (then load it)
    kill -USR1 <pid>    # appends a table to --out and starts counting afresh; once at the start of the
                        # window, once at its end

Each function named in FUNCTIONS is wrapped: on the loop's thread it adds its own thread CPU time
(`time.thread_time_ns`, which a busy machine's preemption does not inflate, unlike a sampling profiler's
wall time) and its calls. Nested ones count inside their callers (on_step inside _on_message). The table
gives each one's CPU, its share of the loop thread's CPU over the window, its calls and CPU per call: the
step report's handling per report, the scheduler's dispatch per call. How it found issue 38's cuts:
docs/performance.md.

Only for measuring: the wrappers cost ~1 µs a call.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# (module, class or None, function): sync functions the loop runs per step report, per timer and per request.
FUNCTIONS = [
    ("tokenline.engine.loop_pipe", "LoopPipe", "_readable"),
    ("tokenline.engine.supervisor", "Supervisor", "_on_message"),
    ("tokenline.server.runtime", "Runtime", "_step_reported"),
    ("tokenline.engine.scheduler.core", "Scheduler", "on_step"),
    ("tokenline.engine.scheduler.core", "Scheduler", "_learn"),
    ("tokenline.engine.scheduler.core", "Scheduler", "_dispatch"),
    ("tokenline.engine.scheduler.core", "Scheduler", "_expire_overdue"),
    ("tokenline.engine.scheduler.core", "Scheduler", "_admit_queued"),
    ("tokenline.engine.scheduler.core", "Scheduler", "_note_capacity"),
    ("tokenline.engine.scheduler.core", "Scheduler", "_compose"),
    ("tokenline.engine.scheduler.preemption", "Preemption", "for_interactive"),
    ("tokenline.engine.scheduler.pace", "WorkerPace", "observe"),
    ("tokenline.engine.scheduler.core", "Scheduler", "submit"),
    ("tokenline.engine.scheduler.planner", "StepPlanner", "plan"),
    ("tokenline.server.runtime", "Runtime", "_handle"),
    ("tokenline.server.runtime", "Runtime", "_finish"),
    ("tokenline.server.runtime", "Runtime", "_on_timer"),
    ("tokenline.server.runtime", "Runtime", "_dispatch_submitted"),
    ("tokenline.server.runtime", "Runtime", "submit"),
    ("tokenline.engine.worker", "WorkerHandle", "send"),
    ("tokenline.server.servicer", "_Outbox", "take"),
    ("tokenline.server.telemetry", "Telemetry", "record_step"),
    ("tokenline.server.telemetry", "Telemetry", "on_request_done"),
]


class LoopCpu:
    """Thread CPU per wrapped function, counted on one thread (the loop's), since the last `reset`."""

    def __init__(self, thread: threading.Thread | None = None):
        self.thread = thread or threading.main_thread()
        self.counts: dict[str, list[int]] = {}  # name -> [CPU ns, calls]
        self.reset()

    def reset(self) -> None:
        self.counts.clear()
        self._since_cpu, self._since_wall = time.thread_time_ns(), time.monotonic()

    def wrap(self, owner: Any, name: str, label: str | None = None) -> None:
        """Count `owner.name` (a function on a class or module) from now on."""
        f: Callable = getattr(owner, name)
        label = label or f"{getattr(owner, '__name__', owner)}.{name}"
        thread, counts = self.thread, self.counts

        @functools.wraps(f)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not thread:
                return f(*args, **kwargs)
            start = time.thread_time_ns()
            try:
                return f(*args, **kwargs)
            finally:
                row = counts.get(label)
                if row is None:
                    row = counts[label] = [0, 0]
                row[0] += time.thread_time_ns() - start
                row[1] += 1
        setattr(owner, name, counted)

    def table(self) -> str:
        """The counts since the last reset (read on the counted thread: its CPU is the share's base)."""
        cpu = max(time.thread_time_ns() - self._since_cpu, 1)
        wall = max(time.monotonic() - self._since_wall, 1e-9)
        lines = [f"--- {wall:.1f} s, the loop's thread {cpu / 1e6:.0f} ms of CPU ({100 * cpu / 1e9 / wall:.1f} % of a core)"]
        for label, (ns, calls) in sorted(self.counts.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"{label:34s} {ns / 1e6:9.1f} ms {100 * ns / cpu:5.1f} % {calls:8d} calls "
                         f"{ns / max(calls, 1) / 1e3:8.1f} µs a call")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenline.bench.loop_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="loop_cpu.txt", help="file the tables are appended to on each SIGUSR1")
    args, serve_argv = parser.parse_known_args(argv)
    counter = LoopCpu()
    for module, cls, name in FUNCTIONS:
        owner = importlib.import_module(module)
        counter.wrap(getattr(owner, cls) if cls else owner, name)

    def dump(*_: object) -> None:
        with open(args.out, "a") as out:
            print(counter.table(), file=out)
        counter.reset()
    signal.signal(signal.SIGUSR1, dump)
    from tokenline.server.cli import main as tokenline_main

    return tokenline_main(serve_argv)


if __name__ == "__main__":
    sys.exit(main())

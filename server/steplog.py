"""The step log: one JSON line per worker step (`tokenline serve --step-log FILE`), for the bench's step plots.

Each line: unix (wall-clock seconds), worker, batch (sequences in the step), paused (bulk sequences the
step plan held back), prefill (prompt tokens computed), step_ms, interactive (interactive requests
running on that worker), plan_bulk (the bulk decode limit of the plan this step ran under, as the worker
applied it; null: none applied), bulk_decoded (bulk sequences that decoded a token in it), next_plan_bulk
(the limit the scheduler planned after reading this step; it reaches the worker a step or more later),
stalled (prompt tokens waiting for their structured-output format to compile). Lines are small and
line-buffered: a write per step costs microseconds, no fsync.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tokenline.engine.scheduler.records import StepResult


class StepLog:
    def __init__(self, path: str):
        self._file = Path(path).open("a", buffering=1)

    def __call__(self, result: StepResult) -> None:
        report = result.report
        interactive = result.interactive
        next_plan_bulk = result.plan.bulk_decode if result.plan is not None else None
        self._file.write(json.dumps({
            "unix": round(time.time(), 6), "worker": report.worker_id, "batch": report.batch_size,
            "paused": report.paused, "prefill": report.prefill_tokens, "step_ms": round(report.step_s * 1000, 3),
            "interactive": interactive, "plan_bulk": report.plan_bulk_decode, "bulk_decoded": report.bulk_decoded,
            "next_plan_bulk": next_plan_bulk, "stalled": report.stalled_prompt_tokens,
        }) + "\n")

    def close(self) -> None:
        self._file.close()

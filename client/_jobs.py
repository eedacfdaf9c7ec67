"""Durable jobs on the client side: the request for SubmitJob and the dataclasses its answers become.

A job's tokens are read with `watch_job(job_id, from_index)`; a watcher that lost
its stream (or its process) resumes from the next index it wants, and receives
every remaining token once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenline.v1 import tokenline_pb2 as pb

from ._convert import build_request

JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled", "expired")
FINAL_JOB_STATES = ("succeeded", "failed", "cancelled", "expired")
_STATE_NAMES = {pb.JOB_QUEUED: "queued", pb.JOB_RUNNING: "running", pb.JOB_SUCCEEDED: "succeeded",
                pb.JOB_FAILED: "failed", pb.JOB_CANCELLED: "cancelled", pb.JOB_EXPIRED: "expired"}
_STATE_VALUES = {v: k for k, v in _STATE_NAMES.items()}


@dataclass(frozen=True)
class Job:
    """A job as the server last stored it (`token_ids` and `text` from get_job only)."""

    job_id: str
    state: str  # one of JOB_STATES
    model: str
    idempotency_key: str
    attempts: int
    tokens_stored: int
    finish_reason: str | None
    error: str
    created_unix_ms: int
    finished_unix_ms: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    model_version: str = ""  # the version of `model` its tokens come from ("" while queued with none named)

    @property
    def final(self) -> bool:
        return self.state in FINAL_JOB_STATES


@dataclass(frozen=True)
class JobChunk:
    """Stored tokens of a watched job from `index` on; the last chunk has `state` (its end state) set."""

    job_id: str
    index: int
    token_ids: list[int]
    text: str
    state: str | None = None
    finish_reason: str | None = None
    error: str = ""
    received_at: float = 0.0  # time.monotonic() when it arrived


def submit_request(prompt: str | None, options: dict[str, Any]) -> pb.SubmitJobRequest:
    """The SubmitJobRequest: options as for generate(); bulk unless said otherwise; deadline_s becomes the
    job's deadline (a job past it ends "expired")."""
    fields = dict(options)
    fields.setdefault("traffic_class", "bulk")
    deadline_s = fields.pop("deadline_s", None)
    fields.pop("timeout", None)
    deadline_unix_ms = int((time.time() + deadline_s) * 1000) if deadline_s is not None else 0
    return pb.SubmitJobRequest(request=build_request(prompt, deadline_unix_ms=deadline_unix_ms, **fields))


def list_request(states: tuple[str, ...] | list[str], page_size: int, page_token: str) -> pb.ListJobsRequest:
    unknown = [s for s in states if s not in _STATE_VALUES]
    if unknown:
        raise ValueError(f"unknown job state {unknown[0]!r}; use one of {', '.join(JOB_STATES)}")
    return pb.ListJobsRequest(states=[_STATE_VALUES[s] for s in states], page_size=page_size, page_token=page_token)


def _finish(value: int) -> str | None:
    return pb.FinishReason.Name(value).lower() if value else None


def job_from_proto(job: pb.Job) -> Job:
    return Job(job_id=job.job_id, state=_STATE_NAMES.get(job.state, "unknown"), model=job.model,
               idempotency_key=job.idempotency_key, attempts=job.attempts, tokens_stored=job.tokens_stored,
               finish_reason=_finish(job.finish_reason), error=job.error, created_unix_ms=job.created_unix_ms,
               finished_unix_ms=job.finished_unix_ms, token_ids=list(job.token_ids), text=job.text,
               model_version=job.model_version)


def chunk_from_proto(chunk: pb.JobChunk) -> JobChunk:
    return JobChunk(job_id=chunk.job_id, index=chunk.index, token_ids=list(chunk.token_ids), text=chunk.text,
                    state=_STATE_NAMES.get(chunk.state), finish_reason=_finish(chunk.finish_reason), error=chunk.error,
                    received_at=time.monotonic())

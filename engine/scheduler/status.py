"""Request status in the scheduler, and the one function that changes it."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # deadline passed
    REFUSED = "refused"  # never accepted
    FAILED = "failed"  # accepted, then gave up (attempts spent, quarantined)


FINAL = frozenset({Status.FINISHED, Status.CANCELLED, Status.EXPIRED, Status.REFUSED, Status.FAILED})

ALLOWED: dict[Status, frozenset[Status]] = {
    Status.QUEUED: frozenset({Status.RUNNING, Status.CANCELLED, Status.EXPIRED, Status.REFUSED, Status.FAILED}),
    # RUNNING -> QUEUED: preempted, or its worker died and it gets another attempt.
    Status.RUNNING: frozenset({Status.QUEUED, Status.FINISHED, Status.CANCELLED, Status.EXPIRED, Status.FAILED}),
}


class InvalidTransition(RuntimeError):
    pass


def transition(entry, new: Status) -> None:
    """Move `entry.status` to `new`, or raise if the lifecycle forbids it."""
    if new not in ALLOWED.get(entry.status, frozenset()):
        raise InvalidTransition(f"{entry.key}: {entry.status.value} -> {new.value} is not allowed")
    entry.status = new

"""Errors the frontend answers with, and the one place they become gRPC statuses.

    ServingError                      (any refusal or failure a caller is told about)
    ├── InvalidRequest                INVALID_ARGUMENT: fix the request
    ├── ModelNotFound                 NOT_FOUND: unknown model
    ├── RequestNotFound               NOT_FOUND: unknown (or another tenant's) request id
    ├── DuplicateRequest              ALREADY_EXISTS: request id already in flight
    ├── Overloaded                    RESOURCE_EXHAUSTED: queue or quota full; carries a retry hint
    ├── DeadlineUnmeetable            DEADLINE_EXCEEDED: cannot finish in time / deadline passed
    ├── Unavailable                   UNAVAILABLE: draining, no worker, attempts spent
    ├── Quarantined                   FAILED_PRECONDITION: this request keeps crashing workers
    ├── IdempotencyMismatch           FAILED_PRECONDITION: key reused for different work
    ├── RunLost                       ABORTED: a resumed stream's run is gone; start again from token 0
    ├── Unauthenticated               UNAUTHENTICATED: missing or wrong credentials
    └── JobsOff                       UNIMPLEMENTED: this server keeps no job store

Messages are for the caller: they say what to change, never how the server is built.
"""

from __future__ import annotations

import asyncio

import grpc


class ServingError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidRequest(ServingError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND


class RequestNotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND


class DuplicateRequest(ServingError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Overloaded(ServingError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineUnmeetable(ServingError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServingError):
    code = grpc.StatusCode.UNAVAILABLE


class Quarantined(ServingError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class IdempotencyMismatch(ServingError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class RunLost(ServingError):
    code = grpc.StatusCode.ABORTED


class Unauthenticated(ServingError):
    code = grpc.StatusCode.UNAUTHENTICATED


class JobsOff(ServingError):
    code = grpc.StatusCode.UNIMPLEMENTED


RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


def retry_after_ms(err: ServingError) -> int:
    """The retry hint in whole milliseconds, at least 1; 0 when there is none."""
    return max(int(err.retry_after_s * 1000), 1) if err.retry_after_s is not None else 0


def trailing_metadata(err: ServingError) -> tuple[tuple[str, str], ...]:
    """gRPC's retry pushback: how long the caller should wait before trying again."""
    if err.retry_after_s is None:
        return ()
    return ((RETRY_PUSHBACK_KEY, str(retry_after_ms(err))),)


async def abort_with(context: grpc.aio.ServicerContext, err: ServingError) -> None:
    """End the call with `err`'s status, message and retry hint (unless the call already ended)."""
    if context.done() or context.cancelled():
        # The caller's deadline passed or it went away: nobody is left to tell; end quietly.
        raise asyncio.CancelledError
    md = trailing_metadata(err)
    if md:
        context.set_trailing_metadata(md)
    await context.abort(err.code, fit_message(err.message))


MAX_MESSAGE_CHARS = 2000  # grpc-message is a header: clients refuse headers over 8-16 KiB by default


def fit_message(message: str) -> str:
    """The message as sent: whatever a caller's input made it, short enough for every client to read."""
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "… (message truncated)"

"""The errors the tokenline client raises, one class per gRPC status a caller acts on.

Every failed call, including one that fails while a stream is being read, raises
a subclass of `TokenlineError`; the original `grpc.RpcError` is its `__cause__`.

    TokenlineError
     ├── InvalidRequest      INVALID_ARGUMENT, OUT_OF_RANGE: fix the request
     ├── NotFound            NOT_FOUND: unknown model or request id
     ├── AlreadyExists       ALREADY_EXISTS: request id already in flight
     ├── Unauthenticated     UNAUTHENTICATED: missing or wrong API key
     ├── PermissionDenied    PERMISSION_DENIED: key may not do this
     ├── Overloaded          RESOURCE_EXHAUSTED: refused at once; see .retry_after_s
     ├── DeadlineExceeded    DEADLINE_EXCEEDED
     ├── Unavailable         UNAVAILABLE: server down or draining (already retried)
     ├── Cancelled           CANCELLED
     ├── RunLost             ABORTED: the run a resumed stream followed is gone; send again from the start
     ├── Refused             FAILED_PRECONDITION: this work is quarantined (it kept crashing workers),
     │                       or its idempotency key was used for different work; change the request or the key
     └── ServerError         any other status (INTERNAL, UNKNOWN, UNIMPLEMENTED, ...)

Each carries `.code` (a `grpc.StatusCode`), `.details` (the server's message) and
`.retry_after_s`: the server's retry hint (`grpc-retry-pushback-ms` trailer) in
seconds, or None when it sent none.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class TokenlineError(Exception):
    """A call to the tokenline server failed."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s
        super().__init__(code, details)

    def __str__(self) -> str:
        # One line: gRPC details may span lines (connection errors do).
        message = " ".join(self.details.split()) or "(no details)"
        hint = f" (retry after {self.retry_after_s:g} s)" if self.retry_after_s is not None else ""
        return f"{message} [{self.code.name}]{hint}"


class InvalidRequest(TokenlineError):
    """The server rejected the request as malformed or out of range."""


class NotFound(TokenlineError):
    """An unknown model, or a request id that is not (or no longer) in flight."""


class AlreadyExists(TokenlineError):
    """A request with this id is already in flight."""


class Unauthenticated(TokenlineError):
    """No API key, or one the server does not know."""


class PermissionDenied(TokenlineError):
    """The API key is known but may not do this."""


class Overloaded(TokenlineError):
    """Refused at once because queues are full or the deadline cannot be met.

    `retry_after_s` is when the server suggests trying again (None: no hint).
    """


class DeadlineExceeded(TokenlineError):
    """The deadline passed before the call finished."""


class Unavailable(TokenlineError):
    """The server cannot be reached or is draining; gRPC has already retried."""


class Cancelled(TokenlineError):
    """The call was cancelled."""


class RunLost(TokenlineError):
    """ABORTED: a broken stream could not be resumed because the run it followed is gone
    (it failed, or another run of the same idempotency key replaced it). Tokens already
    received belong to that lost run; send the request again from the start."""


class Refused(TokenlineError):
    """FAILED_PRECONDITION: retrying the same call will not help. The request (same model, prompt
    and sampling) kept crashing workers and is quarantined for a while, or its idempotency key
    was already used for a different request; change the request, or use a new key."""


class ServerError(TokenlineError):
    """Any other failure status (INTERNAL, UNKNOWN, UNIMPLEMENTED, ...)."""


_ERROR_BY_CODE: dict[grpc.StatusCode, type[TokenlineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.ABORTED: RunLost,
    grpc.StatusCode.FAILED_PRECONDITION: Refused,
}


def error_from_rpc(error: grpc.RpcError) -> TokenlineError:
    """The TokenlineError for a failed call (sync or asyncio), with the retry hint.

    Raise it with `raise error_from_rpc(e) from e` to keep the gRPC error as cause.
    """
    code = _call_attr(error, "code") or grpc.StatusCode.UNKNOWN
    details = _call_attr(error, "details") or ""
    retry_after_s = retry_after_from_metadata(_call_attr(error, "trailing_metadata") or ())
    return _ERROR_BY_CODE.get(code, ServerError)(code, details, retry_after_s)


def retry_after_from_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> float | None:
    """Seconds from a `grpc-retry-pushback-ms` entry; None if absent or not a valid hint.

    gRPC defines a negative or malformed pushback as "do not retry", which a
    caller cannot act on as a delay, so it reads as no hint.
    """
    for key, value in metadata:
        if key.lower() != RETRY_PUSHBACK_KEY:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
        try:
            millis = int(text.strip())
        except ValueError:
            return None
        return millis / 1000.0 if millis >= 0 else None
    return None


def _call_attr(error: grpc.RpcError, name: str):
    # A plain grpc.RpcError (not a grpc.Call) has none of these methods.
    method = getattr(error, name, None)
    return method() if callable(method) else None


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def error_from_status(code: int, details: str, retry_after_ms: int = 0) -> TokenlineError:
    """The TokenlineError for a status given as its number (a GenerateMany stream's StreamError)."""
    status = _STATUS_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    return _ERROR_BY_CODE.get(status, ServerError)(status, details, retry_after_ms / 1000.0 if retry_after_ms else None)

"""Python client for a tokenline server: blocking and asyncio, streaming and whole results.

    from tokenline.client import Client

    with Client("127.0.0.1:50051") as client:
        for delta in client.generate(messages=[("user", "Hi!")], max_tokens=32):
            print(delta.text, end="", flush=True)

Failures raise `TokenlineError` subclasses (see `tokenline.client.errors`).
"""

from ._async_client import AsyncClient, AsyncDeltaStream
from ._channel import DEFAULT_TARGET, SERVICE_CONFIG, channel_options, service_config_json
from ._convert import GenerateOptions
from ._client import Client, DeltaStream
from ._jobs import Job, JobChunk
from ._multiplex import Multiplex, MultiplexedStream
from ._timing import StreamTiming, itl_gaps, stream_timing
from ._types import (Completion, Delta, ModelInfo, PositionLogprobs, ServerTimeline, TokenLogprob, ToolCall, ToolCallDelta,
                     Usage)
from .errors import (
    AlreadyExists,
    Cancelled,
    RunLost,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    PermissionDenied,
    Refused,
    ServerError,
    TokenlineError,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
)

__all__ = [
    "GenerateOptions",
    "DEFAULT_TARGET",
    "SERVICE_CONFIG",
    "AlreadyExists",
    "AsyncClient",
    "AsyncDeltaStream",
    "Cancelled",
    "RunLost",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "Delta",
    "DeltaStream",
    "InvalidRequest",
    "Job",
    "JobChunk",
    "ModelInfo",
    "Multiplex",
    "MultiplexedStream",
    "PositionLogprobs",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "Refused",
    "ServerError",
    "ServerTimeline",
    "StreamTiming",
    "TokenlineError",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "channel_options",
    "error_from_rpc",
    "itl_gaps",
    "service_config_json",
    "stream_timing",
]

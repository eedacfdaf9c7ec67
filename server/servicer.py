"""The gRPC servicer: thin. Converts, hands work to the runtime, streams results back."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from tokenline.server import convert
from tokenline.server.catalog import ServedModel
from tokenline.server.errors import (
    DeadlineUnmeetable,
    InvalidRequest,
    RequestNotFound,
    ServingError,
    Unavailable,
    abort_with,
)
from tokenline.server.runtime import RequestState, Runtime
from tokenline.server.timeline import Timeline
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

log = logging.getLogger("tokenline.requests")

DEFAULT_TENANT = "default"


class TokenlineServicer(pb_grpc.TokenlineServicer):
    def __init__(self, runtime: Runtime, models: dict[str, ServedModel], default_model: str, limits: convert.Limits,
                 *, fault_marker: str | None = None, on_done: Callable[[RequestState, str], None] | None = None,
                 on_refused: Callable[[pb.GenerateRequest, ServingError, str], None] | None = None):
        self.runtime = runtime
        self.models = models
        self.default_model = default_model
        self.limits = limits
        self.draining = False
        self.fault_marker = fault_marker
        self.on_done = on_done
        self.on_refused = on_refused  # a call that ended before it reached the runtime
        self.inflight = 0

    # ---------------------------------------------------------------- RPCs

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        received = time.monotonic()
        self.inflight += 1
        state: RequestState | None = None
        outcome = "error"
        try:
            state = self._start(request, context, received)
            async for chunk in self.runtime.events(state):
                yield pb.GenerateChunk(request_id=state.request_id, attempt=chunk.attempt, index=chunk.index,
                                       token_ids=chunk.token_ids, text=chunk.text)
            state.timeline.last_byte = time.monotonic()
            yield self._final_chunk(state)
            state.timeline.last_byte = time.monotonic()
            outcome = _outcome(state)
        except ServingError as err:
            outcome = type(err).__name__
            if state is None and self.on_refused is not None:
                self.on_refused(request, err, DEFAULT_TENANT)
            await abort_with(context, err)
        except asyncio.CancelledError:
            outcome = "disconnected"
            if state is not None:
                self.runtime.cancel(state.key)
            raise
        finally:
            self.inflight -= 1
            if state is not None and self.on_done is not None:
                self.on_done(state, outcome)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        received = time.monotonic()
        self.inflight += 1
        state: RequestState | None = None
        outcome = "error"
        try:
            state = self._start(request, context, received)
            async for _ in self.runtime.events(state):
                pass
            state.timeline.last_byte = time.monotonic()
            outcome = _outcome(state)
            return pb.CompleteResponse(
                request_id=state.request_id, attempt=state.attempt, token_ids=state.token_ids, text="".join(state.text),
                finish_reason=convert.finish_reason(state.finish_reason),
                usage=pb.Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.token_ids)),
                timeline=convert.timeline_pb(state.timeline),
            )
        except ServingError as err:
            outcome = type(err).__name__
            if state is None and self.on_refused is not None:
                self.on_refused(request, err, DEFAULT_TENANT)
            await abort_with(context, err)
        except asyncio.CancelledError:
            outcome = "disconnected"
            if state is not None:
                self.runtime.cancel(state.key)
            raise
        finally:
            self.inflight -= 1
            if state is not None and self.on_done is not None:
                self.on_done(state, outcome)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        if request is MALFORMED:
            await abort_with(context, InvalidRequest("the request message could not be parsed as a tokenline.v1.CancelRequest"))
        key = _key(DEFAULT_TENANT, request.request_id)
        if not request.request_id or not self.runtime.cancel(key):
            await abort_with(context, RequestNotFound(f"no request {request.request_id!r} is queued or running"))
        return pb.CancelResponse(cancelled=True)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        if request is MALFORMED:
            await abort_with(context, InvalidRequest("the request message could not be parsed as a tokenline.v1.ListModelsRequest"))
        out = []
        for m in self.models.values():
            workers = sum(1 for s in self.runtime.specs.values() if s.model == m.name)
            out.append(pb.ModelInfo(name=m.name, version=m.version, max_context=m.max_context,
                                    loaded=workers > 0, workers=workers))
        return pb.ListModelsResponse(models=out)

    # ------------------------------------------------------------- helpers

    def _start(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, received: float) -> RequestState:
        if request is MALFORMED:
            raise InvalidRequest("the request message could not be parsed as a tokenline.v1.GenerateRequest")
        if self.draining:
            raise Unavailable("the server is draining for shutdown; retry on another instance")
        valid = convert.validate(request, self.models, self.default_model, self.limits)
        now = time.monotonic()
        deadline = _deadline(context, valid.deadline_unix_ms, now)
        if deadline is not None and deadline <= now:
            raise DeadlineUnmeetable("the request's deadline has already passed")
        request_id = valid.request_id or uuid.uuid4().hex
        timeline = Timeline(received=received, validated=now)
        marker = bool(self.fault_marker) and request.WhichOneof("prompt") == "text" and self.fault_marker in request.text
        state = RequestState(key=_key(DEFAULT_TENANT, request_id), request_id=request_id, tenant=DEFAULT_TENANT,
                             model=valid.model.name, cls=valid.cls, prompt_ids=valid.prompt_ids, sampling=valid.sampling,
                             timeline=timeline, deadline=deadline, fault_marker=marker)
        self.runtime.submit(state)
        return state

    def _final_chunk(self, state: RequestState) -> pb.GenerateChunk:
        return pb.GenerateChunk(
            request_id=state.request_id, attempt=state.attempt, index=len(state.token_ids),
            finish_reason=convert.finish_reason(state.finish_reason),
            usage=pb.Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.token_ids)),
            timeline=convert.timeline_pb(state.timeline),
        )


class _Malformed:
    """Stands for a request message whose bytes did not parse."""

    model = ""
    request_id = ""
    traffic_class = 0

    def WhichOneof(self, _):  # noqa: N802 - mirrors the protobuf API
        return None


MALFORMED = _Malformed()


def _parse(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception:  # DecodeError and friends: answered INVALID_ARGUMENT, never INTERNAL
            return MALFORMED
    return parse


def add_to_server(servicer: TokenlineServicer, server: grpc.aio.Server) -> None:
    """Register the service with deserializers that turn unparsable bytes into INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(servicer.Generate, request_deserializer=_parse(pb.GenerateRequest),
                                                         response_serializer=pb.GenerateChunk.SerializeToString),
        "Complete": grpc.unary_unary_rpc_method_handler(servicer.Complete, request_deserializer=_parse(pb.GenerateRequest),
                                                        response_serializer=pb.CompleteResponse.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(servicer.Cancel, request_deserializer=_parse(pb.CancelRequest),
                                                      response_serializer=pb.CancelResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(servicer.ListModels, request_deserializer=_parse(pb.ListModelsRequest),
                                                          response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    service = pb.DESCRIPTOR.services_by_name["Tokenline"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


def _key(tenant: str, request_id: str) -> str:
    return f"{tenant}/{request_id}"


def _deadline(context: grpc.aio.ServicerContext, deadline_unix_ms: int, now: float) -> float | None:
    candidates = []
    remaining = context.time_remaining()
    if remaining is not None:
        candidates.append(now + remaining)
    if deadline_unix_ms:
        candidates.append(now + (deadline_unix_ms / 1000.0 - time.time()))
    return min(candidates, default=None)


def _outcome(state: RequestState) -> str:
    return state.finish_reason.name.lower() if state.finish_reason is not None else "ok"

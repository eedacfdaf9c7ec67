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
                 *, fault_marker: str | None = None, on_done: Callable[[RequestState, str], None] | None = None):
        self.runtime = runtime
        self.models = models
        self.default_model = default_model
        self.limits = limits
        self.draining = False
        self.fault_marker = fault_marker
        self.on_done = on_done
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
        key = _key(DEFAULT_TENANT, request.request_id)
        if not request.request_id or not self.runtime.cancel(key):
            await abort_with(context, RequestNotFound(f"no request {request.request_id!r} is queued or running"))
        return pb.CancelResponse(cancelled=True)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        out = []
        for m in self.models.values():
            workers = sum(1 for s in self.runtime.specs.values() if s.model == m.name)
            out.append(pb.ModelInfo(name=m.name, version=m.version, max_context=m.max_context,
                                    loaded=workers > 0, workers=workers))
        return pb.ListModelsResponse(models=out)

    # ------------------------------------------------------------- helpers

    def _start(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, received: float) -> RequestState:
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

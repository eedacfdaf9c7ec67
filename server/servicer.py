"""The gRPC servicer: thin. Converts, hands work to the runtime, streams results back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from tokenline.engine.types import FinishReason
from tokenline.server import convert
from tokenline.server.auth import DEFAULT_TENANT, Authenticator
from tokenline.server.catalog import ServedModel
from tokenline.server.errors import (
    DeadlineUnmeetable,
    IdempotencyMismatch,
    InvalidRequest,
    RequestNotFound,
    RunLost,
    ServingError,
    Unavailable,
    abort_with,
)
from tokenline.server.idempotency import IdempotencyStore
from tokenline.server.jobrpcs import JobRpcs
from tokenline.server.runtime import RequestKey, RequestState, Runtime, fingerprint
from tokenline.server.timeline import Timeline
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

log = logging.getLogger("tokenline.requests")


class TokenlineServicer(JobRpcs, pb_grpc.TokenlineServicer):
    def __init__(self, runtime: Runtime, models: dict[str, ServedModel], default_model: str, limits: convert.Limits,
                 *, fault_marker: str | None = None, on_done: Callable[[RequestState, str], None] | None = None,
                 on_refused: Callable[[pb.GenerateRequest, ServingError, str], None] | None = None,
                 auth: Authenticator | None = None, idempotency: IdempotencyStore | None = None,
                 on_shared: Callable[[pb.GenerateRequest, str, str], None] | None = None,
                 request_work_threads: int = 2):
        self.runtime = runtime
        self.models = models
        self.default_model = default_model
        self.limits = limits
        self.draining = False
        self.fault_marker = fault_marker
        self.on_done = on_done
        self.on_refused = on_refused  # a call that ended before it reached the runtime
        self.on_shared = on_shared  # a call served by another call's run (replayed or attached)
        self.auth = auth or Authenticator()
        self.idempotency = idempotency
        self._live_keys: dict[tuple[str, str], RequestState] = {}  # (tenant, idempotency key) -> running request
        # One call at a time per idempotency key decides between attach, replay and a new run.
        self._key_locks: dict[tuple[str, str], _KeyLock] = {}
        # Tokenizing and chat templating: blocking work, never on the event loop.
        self._request_work = ThreadPoolExecutor(request_work_threads, thread_name_prefix="tokenline-tokenize")
        self.inflight = 0
        runtime.on_finished.append(self._store_result)

    # ---------------------------------------------------------------- RPCs

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        received = time.monotonic()
        self.inflight += 1
        call: _Call | None = None
        outcome = "error"
        tenant = DEFAULT_TENANT
        try:
            tenant = self._tenant(context)
            call = await self._start(request, context, received, tenant)
            if call.replay is not None:
                for chunk in _replay_chunks(call.replay, call.replay_text, request.resume_from_index):
                    yield chunk
                outcome = "replayed"
                return
            state = call.state
            async for chunk in self.runtime.events(state, call.mailbox, request.resume_from_index):
                yield pb.GenerateChunk(request_id=state.request_id, attempt=chunk.attempt, index=chunk.index,
                                       token_ids=chunk.token_ids, text=chunk.text)
            state.timeline.last_byte = time.monotonic()
            yield _final_chunk(state)
            state.timeline.last_byte = time.monotonic()
            outcome = _outcome(state)
        except ServingError as err:
            outcome = type(err).__name__
            if call is None and self.on_refused is not None:
                self.on_refused(request, err, tenant)
            await abort_with(context, err)
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: the caller left while a chunk was pending
            outcome = "disconnected"
            if call is not None and call.state is not None:
                self.runtime.leave(call.state, call.mailbox)
            raise
        finally:
            self.inflight -= 1
            if call is not None and call.owner and self.on_done is not None:
                self.on_done(call.state, outcome)
            elif call is not None and not call.owner and self.on_shared is not None:
                self.on_shared(request, "replayed" if call.replay is not None else "attached", tenant)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        received = time.monotonic()
        self.inflight += 1
        call: _Call | None = None
        outcome = "error"
        tenant = DEFAULT_TENANT
        try:
            tenant = self._tenant(context)
            call = await self._start(request, context, received, tenant)
            if call.replay is not None:
                outcome = "replayed"
                return call.replay
            state = call.state
            async for _ in self.runtime.events(state, call.mailbox):
                pass
            state.timeline.last_byte = time.monotonic()
            outcome = _outcome(state)
            return _complete_response(state)
        except ServingError as err:
            outcome = type(err).__name__
            if call is None and self.on_refused is not None:
                self.on_refused(request, err, tenant)
            await abort_with(context, err)
        except asyncio.CancelledError:
            outcome = "disconnected"
            if call is not None and call.state is not None:
                self.runtime.leave(call.state, call.mailbox)
            raise
        finally:
            self.inflight -= 1
            if call is not None and call.owner and self.on_done is not None:
                self.on_done(call.state, outcome)
            elif call is not None and not call.owner and self.on_shared is not None:
                self.on_shared(request, "replayed" if call.replay is not None else "attached", tenant)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        if request is MALFORMED:
            await abort_with(context, InvalidRequest("the request message could not be parsed as a tokenline.v1.CancelRequest"))
        try:
            tenant = self._tenant(context)
        except ServingError as err:
            await abort_with(context, err)
        # Another tenant's request is indistinguishable from no request at all.
        key = RequestKey(tenant, request.request_id)
        if not request.request_id or not self.runtime.cancel(key):
            await abort_with(context, RequestNotFound(f"no request {request.request_id!r} is queued or running"))
        return pb.CancelResponse(cancelled=True)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        if request is MALFORMED:
            await abort_with(context, InvalidRequest("the request message could not be parsed as a tokenline.v1.ListModelsRequest"))
        try:
            self._tenant(context)
        except ServingError as err:
            await abort_with(context, err)
        out = []
        for m in self.models.values():
            specs = [s for s in self.runtime.specs.values() if s.model == m.name]
            first = specs[0] if specs else None
            out.append(pb.ModelInfo(name=m.name, version=m.version, max_context=m.max_context,
                                    loaded=bool(specs), workers=len(specs),
                                    dtype=first.dtype if first else "",
                                    attention_kernel=first.attention_kernel if first else "",
                                    self_check=first.self_check if first else ""))
        return pb.ListModelsResponse(models=out)

    # ------------------------------------------------------------- helpers

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        if not self.auth.enabled:
            return DEFAULT_TENANT
        common_name = None
        if self.auth.client_certs:
            names = context.auth_context().get("x509_common_name") or []
            common_name = names[0].decode() if names else None
        return self.auth.tenant(tuple(context.invocation_metadata() or ()), common_name)

    async def _start(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, received: float, tenant: str) -> _Call:
        if request is MALFORMED:
            raise InvalidRequest("the request message could not be parsed as a tokenline.v1.GenerateRequest")
        if self.draining:
            raise Unavailable("the server is draining for shutdown; retry on another instance")
        checked = convert.check(request, self.models, self.default_model, self.limits)  # cheap: sizes first
        key = convert.idempotency_key(request)
        loop = asyncio.get_running_loop()
        valid = await loop.run_in_executor(self._request_work, convert.tokenize, checked, self.limits)
        if not key:
            return self._run(request, context, received, tenant, valid, key)
        async with self._key_lock(tenant, key):
            print_ = fingerprint(valid.model.name, valid.sampling, valid.prompt_ids)
            found = await self._find_keyed(tenant, key, print_, request)
            if found is not None:
                return found
            if self.idempotency is not None:
                await self.idempotency.begin(tenant, key, print_)
            try:
                return self._run(request, context, received, tenant, valid, key)
            except ServingError:
                if self.idempotency is not None:
                    _in_background(self.idempotency.abandon(tenant, key))
                raise

    def _run(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, received: float, tenant: str,
             valid: convert.ValidRequest, key: str) -> _Call:
        """Submit a new run; raises a ServingError when it is refused at once."""
        now = time.monotonic()
        deadline = _deadline(context, valid.deadline_unix_ms, now)
        if deadline is not None and deadline <= now:
            raise DeadlineUnmeetable("the request's deadline has already passed")
        if request.require_completion_by_deadline and deadline is None:
            raise InvalidRequest("require_completion_by_deadline needs a deadline: a gRPC timeout or deadline_unix_ms")
        request_id = valid.request_id or uuid.uuid4().hex
        timeline = Timeline(received=received, validated=now)
        marker = bool(self.fault_marker) and request.WhichOneof("prompt") == "text" and self.fault_marker in request.text
        state = RequestState(key=RequestKey(tenant, request_id),
                             model=valid.model.name, cls=valid.cls, prompt_ids=valid.prompt_ids, sampling=valid.sampling,
                             timeline=timeline, deadline=deadline, fault_marker=marker, idempotency_key=key,
                             must_complete_by_deadline=request.require_completion_by_deadline)
        mailbox = state.subscribe()
        self.runtime.submit(state)
        if key:
            self._live_keys[(tenant, key)] = state
        return _Call(state=state, mailbox=mailbox, owner=True)

    async def _find_keyed(self, tenant: str, key: str, print_: str, request: pb.GenerateRequest) -> _Call | None:
        """A run or a stored result for this idempotency key, or None to generate.

        A resumed stream (resume_from_index > 0) continues only the run it followed (named by its
        request_id when the caller sends it): it is never stitched onto a different run.
        """
        resume_from = request.resume_from_index
        live = self._live_keys.get((tenant, key))
        if live is not None:
            if live.fingerprint != print_:
                raise IdempotencyMismatch(_mismatch(key))
            if resume_from:
                _same_run(request, live.request_id)
            return _Call(state=live, mailbox=live.subscribe(resume_from), owner=False)
        stored = await self.idempotency.lookup(tenant, key) if self.idempotency is not None else None
        if stored is not None and stored.fingerprint != print_:
            raise IdempotencyMismatch(_mismatch(key))
        if stored is not None and stored.status == "done" and stored.result is not None:
            result = pb.CompleteResponse.FromString(stored.result)
            if resume_from:
                _same_run(request, result.request_id)
            return _Call(replay=result, replay_text=stored.token_text)
        if resume_from:  # the run it followed ended without a result: a new run would be spliced on
            raise RunLost(f"the run of idempotency key {key!r} that this stream followed ended without a result; "
                          "nothing can be resumed: send the request again with resume_from_index 0")
        return None  # no run, or one that died with an earlier server process: generate again

    @contextlib.asynccontextmanager
    async def _key_lock(self, tenant: str, key: str):
        lock = self._key_locks.setdefault((tenant, key), _KeyLock())
        lock.users += 1
        try:
            async with lock.lock:
                yield
        finally:
            lock.users -= 1
            if not lock.users:
                del self._key_locks[(tenant, key)]

    def _store_result(self, state: RequestState) -> None:
        if not state.idempotency_key:
            return
        self._live_keys.pop((state.tenant, state.idempotency_key), None)
        if self.idempotency is None:
            return
        # Queued to the store's thread now (a later lookup is queued after it); failures are logged there.
        if state.error is None and state.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP_STRING):
            _in_background(self.idempotency.complete(state.tenant, state.idempotency_key, state.fingerprint,
                                                     _complete_response(state).SerializeToString(), state.text))
        else:
            _in_background(self.idempotency.abandon(state.tenant, state.idempotency_key))



@dataclass
class _Call:
    """What a Generate/Complete call follows: a live run (its own or attached), or a stored result."""

    state: RequestState | None = None
    mailbox: asyncio.Queue | None = None
    owner: bool = False
    replay: pb.CompleteResponse | None = None
    replay_text: tuple[str, ...] | None = None  # the stored result's text per token


@dataclass
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


def _same_run(request: pb.GenerateRequest, run_request_id: str) -> None:
    if request.request_id and request.request_id != run_request_id:
        raise RunLost(f"the run this stream followed (request id {request.request_id!r}) is gone and another run of "
                      f"the same idempotency key took its place; nothing can be resumed: send the request again "
                      "with resume_from_index 0")


def _in_background(future: asyncio.Future) -> None:
    """A store write nobody waits for: its failure was logged where it happened."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


def _mismatch(key: str) -> str:
    return (f"idempotency key {key!r} was used for a different request (model, prompt or sampling differ); "
            "use a new key for new work")


def _final_chunk(state: RequestState) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        request_id=state.request_id, attempt=state.attempt, index=len(state.token_ids),
        finish_reason=convert.finish_reason(state.finish_reason),
        usage=pb.Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.token_ids)),
        timeline=convert.timeline_pb(state.timeline, attempts=state.attempt, preemptions=state.preemptions),
    )


def _complete_response(state: RequestState) -> pb.CompleteResponse:
    return pb.CompleteResponse(
        request_id=state.request_id, attempt=state.attempt, token_ids=state.token_ids, text="".join(state.text),
        finish_reason=convert.finish_reason(state.finish_reason),
        usage=pb.Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.token_ids)),
        timeline=convert.timeline_pb(state.timeline, attempts=state.attempt, preemptions=state.preemptions),
    )


def _replay_chunks(result: pb.CompleteResponse, token_text: tuple[str, ...] | None, resume_from: int):
    """A stored result as a stream: the tokens after `resume_from` in one chunk, then the final chunk."""
    if resume_from < len(result.token_ids):
        yield pb.GenerateChunk(request_id=result.request_id, attempt=result.attempt, index=resume_from,
                               token_ids=result.token_ids[resume_from:],
                               text=_text_from(result, token_text, resume_from))
    yield pb.GenerateChunk(request_id=result.request_id, attempt=result.attempt, index=len(result.token_ids),
                           finish_reason=result.finish_reason, usage=result.usage, timeline=result.timeline)


def _text_from(result: pb.CompleteResponse, token_text: tuple[str, ...] | None, index: int) -> str:
    """The text of the tokens from `index` on: the tail of the whole text, always."""
    if index == 0:
        return result.text
    if token_text is not None and len(token_text) == len(result.token_ids):
        return "".join(token_text[index:])
    # A row stored before per-token text was kept: no honest split exists, so refuse rather than guess.
    raise RunLost("this stored result cannot be resumed part-way; send the request again with resume_from_index 0 "
                  "to receive it whole")


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
        # Durable jobs (server/jobrpcs.py).
        "SubmitJob": grpc.unary_unary_rpc_method_handler(servicer.SubmitJob, request_deserializer=_parse(pb.SubmitJobRequest),
                                                         response_serializer=pb.Job.SerializeToString),
        "WatchJob": grpc.unary_stream_rpc_method_handler(servicer.WatchJob, request_deserializer=_parse(pb.WatchJobRequest),
                                                         response_serializer=pb.JobChunk.SerializeToString),
        "GetJob": grpc.unary_unary_rpc_method_handler(servicer.GetJob, request_deserializer=_parse(pb.GetJobRequest),
                                                      response_serializer=pb.Job.SerializeToString),
        "CancelJob": grpc.unary_unary_rpc_method_handler(servicer.CancelJob, request_deserializer=_parse(pb.CancelJobRequest),
                                                         response_serializer=pb.Job.SerializeToString),
        "ListJobs": grpc.unary_unary_rpc_method_handler(servicer.ListJobs, request_deserializer=_parse(pb.ListJobsRequest),
                                                        response_serializer=pb.ListJobsResponse.SerializeToString),
    }
    service = pb.DESCRIPTOR.services_by_name["Tokenline"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))




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

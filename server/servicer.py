"""The gRPC servicer: thin. Checks and converts (convert.py), hands work to the runtime,
streams results back; keyed calls go through `Idempotency` (idempotency.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import grpc

from tokenline.server import convert, responses, tools
from tokenline.server.auth import DEFAULT_TENANT, Authenticator
from tokenline.server.catalog import ServedModel
from tokenline.server.errors import (DeadlineUnmeetable, InvalidRequest, Overloaded, RequestNotFound, ServingError,
                                     Unavailable, abort_with, fit_message, retry_after_ms)
from tokenline.server.idempotency import Attach, Idempotency, IdempotencyStore, Replay
from tokenline.server.jobrpcs import JobRpcs
from tokenline.server.runtime import Chunk, RequestKey, RequestState, Runtime, fingerprint
from tokenline.server.timeline import Timeline
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

log = logging.getLogger("tokenline.requests")


class TokenlineServicer(pb_grpc.TokenlineServicer):
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
        self.keys = Idempotency(idempotency)  # keyed calls: attach, replay, or a new run
        # Tokenizing and chat templating: blocking work, never on the event loop.
        self._request_work = ThreadPoolExecutor(request_work_threads, thread_name_prefix="tokenline-tokenize")
        self.inflight = 0
        self.max_response_bytes = MAX_RESPONSE_BYTES  # a GenerateMany response larger than this is split
        self.attached: collections.Counter[str] = collections.Counter()  # streams attached to a run, per tenant
        runtime.on_finished.append(self.keys.finished)
        # Durable jobs (server/jobrpcs.py); its runner is set by the app when the server keeps a job store.
        self.job_rpcs = JobRpcs(None, models=models, default_model=default_model, limits=limits,
                                request_work=self._request_work, tenant=self._tenant, draining=lambda: self.draining)

    # ---------------------------------------------------------------- RPCs

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       alone: bool = False, direct: Callable[[], pb.GenerateChunk] | None = None,
                       ) -> AsyncIterator[pb.GenerateChunk]:
        """`alone`: a stream of a GenerateMany call, which ends with a ServingError of its own instead of
        ending the call with its status. `direct`: a plain run's chunks, once those queued before are
        yielded, are written as the step report makes them (Runtime.events) into the empty message each call
        of it gives; the end and its last chunk still come from here."""
        async with self._call(request, context, alone) as call:
            out = self._tool_chunks(call)
            if call.replay is not None:
                for chunk in responses.replay_chunks(call.replay.result, call.replay.token_text, request.resume_from_index):
                    yield out(chunk)
                call.outcome = "replayed"
                return
            if call.samples:
                async for chunk in self._sample_chunks(call):
                    yield out(chunk)
                call.outcome = _outcome(call.state)
                return
            state = call.state
            hand: Callable[[Chunk], None] | None = None
            if direct is not None and (call.tools is None or not call.tools.parses):  # tools annotate chunks here
                hand = lambda chunk: responses.fill_chunk(direct(), state, chunk)  # noqa: E731
            async for chunk in self.runtime.events(state, call.mailbox, request.resume_from_index, hand):
                yield out(responses.chunk_pb(state, chunk))
            state.timeline.last_byte = time.monotonic()
            yield out(responses.final_chunk(state))
            state.timeline.last_byte = time.monotonic()
            call.outcome = _outcome(state)

    async def GenerateMany(self, requests: AsyncIterator[pb.GenerateManyRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateManyResponse]:
        """Many Generate streams on one call. Each stream runs `Generate` itself (every check, key and
        path as a call of its own); what they yield is gathered, and one response carries all that is
        ready: the streams woken by one step report append their chunks before this task runs again."""
        box = _Outbox()
        streams: dict[int, asyncio.Task] = {}

        async def follow(number: int, request: pb.GenerateRequest) -> None:
            me = asyncio.current_task()

            def direct() -> pb.GenerateChunk:  # called from the step report, not this task
                if streams.get(number) is me:
                    return box.chunk(number)
                return pb.GenerateChunk()  # the caller has left this stream (its number may be in use again): dropped

            try:
                async for chunk in self.Generate(request, context, alone=True, direct=direct):
                    box.chunk(number).CopyFrom(chunk)
            except ServingError as failed:
                err: ServingError | None = failed
            except Exception:  # a fault of ours: this stream fails, the call and its other streams go on
                log.exception("stream %s of a GenerateMany call failed", number)
                err = ServingError("the server failed while serving this stream; try again")
            else:
                err = None
            finally:
                if streams.get(number) is asyncio.current_task():
                    del streams[number]
            if err is not None:
                box.response.errors.add(stream=number, code=err.code.value[0], message=fit_message(err.message),
                                        retry_after_ms=retry_after_ms(err))
            else:
                box.response.ended.append(number)
            box.wake()

        async def read() -> None:
            try:
                async for message in requests:
                    convert.check_parsed(message, "GenerateManyRequest")
                    for action in message.streams:
                        act(action)
            finally:
                box.wake()

        def act(action: pb.StreamRequest) -> None:
            if action.HasField("generate"):
                if action.leave:
                    raise InvalidRequest(f"stream {action.stream}: set generate or leave, not both")
                if action.stream in streams:
                    raise InvalidRequest(f"stream {action.stream} is already open on this call: number each "
                                         "stream uniquely until it has ended")
                streams[action.stream] = asyncio.create_task(follow(action.stream, action.generate))
            elif action.leave:
                task = streams.pop(action.stream, None)
                if task is not None:
                    task.cancel()
            else:
                raise InvalidRequest(f"stream {action.stream}: a StreamRequest sets generate or leave")

        reader = asyncio.create_task(read())
        try:
            while True:
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception()  # the caller broke the protocol: the call ends
                if not box.empty():
                    for response in box.take(self.max_response_bytes):
                        yield response
                elif reader.done() and not streams:
                    break  # the caller half-closed and every stream has ended
                else:
                    box.ready.clear()
                    await box.ready.wait()
        except ServingError as err:
            await abort_with(context, err)
        finally:
            reader.cancel()
            for task in list(streams.values()):
                task.cancel()
            await asyncio.gather(reader, *streams.values(), return_exceptions=True)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        async with self._call(request, context) as call:
            if call.replay is not None:
                call.outcome = "replayed"
                return self._tool_calls(call, call.replay.result)
            if call.samples:
                for state, mailbox in call.samples:
                    async for _ in self.runtime.events(state, mailbox):
                        pass
                    state.timeline.last_byte = time.monotonic()
                call.outcome = _outcome(call.state)
                return self._tool_calls(call, responses.complete_samples([s for s, _ in call.samples], call.state.request_id))
            state = call.state
            async for _ in self.runtime.events(state, call.mailbox):
                pass
            state.timeline.last_byte = time.monotonic()
            call.outcome = _outcome(state)
            return self._tool_calls(call, responses.complete_response(state))

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        try:
            convert.check_parsed(request, "CancelRequest")
            tenant = self._tenant(context)
        except ServingError as err:
            await abort_with(context, err)
        # Another tenant's request is indistinguishable from no request at all.
        keys = [RequestKey(tenant, request.request_id)] + [  # and the samples of an n > 1 request
            RequestKey(tenant, responses.sample_request_id(request.request_id, i)) for i in range(1, convert.MAX_SAMPLES)]
        if not request.request_id or not any([self.runtime.cancel(key) for key in keys]):
            await abort_with(context, RequestNotFound(f"no request {request.request_id!r} is queued or running"))
        return pb.CancelResponse(cancelled=True)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        try:
            convert.check_parsed(request, "ListModelsRequest")
            self._tenant(context)
        except ServingError as err:
            await abort_with(context, err)
        specs = list(self.runtime.specs.values())
        return pb.ListModelsResponse(models=[responses.model_info(m, [s for s in specs if s.model == m.key], self.limits,
                                                                  self.runtime.model_load(m.key), current=self._current(m))
                                             for m in [*self.models.values(), *self._adapters()]])

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        return await self._tokenizer_call(request, context, "TokenizeRequest", responses.tokenize_prompt, self.limits)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        return await self._tokenizer_call(request, context, "DetokenizeRequest", responses.detokenize_ids)

    async def _tokenizer_call(self, request, context: grpc.aio.ServicerContext, message: str, work, *extra):  # noqa: ANN001
        """A tokenizer RPC: checked and authenticated here, the tokenizer's work off the event loop."""
        try:
            convert.check_parsed(request, message)
            self._tenant(context)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._request_work, work, request, self.models, self.default_model, *extra)
        except ServingError as err:
            await abort_with(context, err)

    # ------------------------------------------------------------- helpers

    def _tool_chunks(self, call: _Call) -> Callable[[pb.GenerateChunk], pb.GenerateChunk]:
        """With tools: each chunk with its content and tool-call pieces (tools.ChunkAnnotator); else as it is."""
        if call.tools is None or not call.tools.parses:
            return lambda chunk: chunk

        def prime(sample: int, index: int) -> str:  # the text before a resumed stream's first chunk
            if call.replay is not None:
                text = call.replay.token_text
                return "".join(text[:index]) if text is not None else ""
            return "".join(call.followed()[sample][0].text[:index])

        return tools.ChunkAnnotator(call.tools, self._tool_parsers(call), prime)

    def _tool_calls(self, call: _Call, response: pb.CompleteResponse) -> pb.CompleteResponse:
        """With tools: the response (and each sample) with its content and tool calls."""
        if call.tools is None or not call.tools.parses:
            return response
        out = pb.CompleteResponse()
        out.CopyFrom(response)
        factory = self._tool_parsers(call)
        tools.annotate(call.tools, out, out.request_id, 0, factory)
        for sample in out.samples:
            tools.annotate(call.tools, sample, out.request_id, sample.sample_index, factory)
        return out

    def _tool_parsers(self, call: _Call):  # noqa: ANN202
        return self.models[call.model].tool_parsers if call.tools.mode == "auto" else None

    def _adapters(self) -> list[ServedModel]:
        """The LoRA adapters served (server/catalog.py ModelCatalog.adapters)."""
        adapters = getattr(self.models, "adapters", None)
        return adapters() if adapters is not None else []

    def _current(self, model: ServedModel) -> bool:
        """Is `model` the version its name resolves to (server/catalog.py ModelCatalog)?"""
        is_current = getattr(self.models, "is_current", None)
        return is_current(model) if is_current is not None else True

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        if not self.auth.enabled:
            return DEFAULT_TENANT
        common_name = None
        if self.auth.client_certs:
            names = context.auth_context().get("x509_common_name") or []
            common_name = names[0].decode() if names else None
        return self.auth.tenant(tuple(context.invocation_metadata() or ()), common_name)

    @contextlib.asynccontextmanager
    async def _call(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                    alone: bool = False) -> AsyncIterator[_Call]:
        """What Generate and Complete share around their work: the caller's tenant, starting or
        joining the run, errors as statuses (or, `alone`, raised on: they end only this stream of a
        GenerateMany call), a caller who leaves, and telling telemetry how it went."""
        received = time.monotonic()
        self.inflight += 1
        call: _Call | None = None
        tenant = DEFAULT_TENANT
        outcome = "error"
        try:
            tenant = self._tenant(context)
            call = await self._start(request, context, received, tenant)
            yield call
            outcome = call.outcome
        except ServingError as err:
            outcome = type(err).__name__
            if call is None and self.on_refused is not None:
                self.on_refused(request if request is not MALFORMED else pb.GenerateRequest(), err, tenant)
            for state, mailbox in call.samples if call is not None else ():  # one sample failed: the rest stop too
                self.runtime.leave(state, mailbox)
            if alone:
                raise
            await abort_with(context, err)
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: the caller left while a chunk was pending
            outcome = "disconnected"
            for state, mailbox in call.followed() if call is not None else ():
                self.runtime.leave(state, mailbox)
            raise
        finally:
            self.inflight -= 1
            if call is not None and call.attached_by is not None:
                self.attached[call.attached_by] -= 1
                if not self.attached[call.attached_by]:
                    del self.attached[call.attached_by]
            if call is not None and call.owner and self.on_done is not None:
                for state, _ in call.followed():
                    self.on_done(state, outcome)
            elif call is not None and not call.owner and self.on_shared is not None:
                self.on_shared(request, "replayed" if call.replay is not None else "attached", tenant)

    async def _start(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, received: float, tenant: str) -> _Call:
        convert.check_parsed(request, "GenerateRequest")
        if self.draining:
            raise Unavailable("the server is draining for shutdown; retry on another instance")
        checked = convert.check(request, self.models, self.default_model, self.limits)  # cheap: sizes first
        key = convert.idempotency_key(request)
        if convert.quick(checked):
            valid = convert.tokenize(checked, self.limits)
        else:
            valid = await asyncio.get_running_loop().run_in_executor(self._request_work, convert.tokenize, checked,
                                                                     self.limits)
        tooled = {"tools": checked.tools, "model": checked.model.name}
        if valid.n > 1:
            if key:
                raise InvalidRequest("n > 1 cannot be combined with an idempotency key yet: send n requests with a key "
                                     "each, or n > 1 without one")
            return replace(self._run_samples(request, context, received, tenant, valid), **tooled)
        if not key:
            return replace(self._run(request, context, received, tenant, valid, key), **tooled)
        asked = valid.model.asked_as(request.model or self.default_model)  # "name", or a pinned "name@version"
        async with self.keys.decide(tenant, key, fingerprint(asked, valid.sampling, valid.prompt_ids), request) as found:
            if isinstance(found, Attach):
                self._may_attach(tenant, found.state)
                self.attached[tenant] += 1
                return _Call(state=found.state, mailbox=found.state.subscribe(request.resume_from_index),
                             attached_by=tenant, **tooled)
            if isinstance(found, Replay):
                return _Call(replay=found, **tooled)
            call = replace(self._run(request, context, received, tenant, valid, key), **tooled)
            found.started(call.state)
            return call

    def _may_attach(self, tenant: str, state: RequestState) -> None:
        """A stream attached to a running key costs what any stream costs (a chunk per token): it counts
        against its tenant's max_concurrent, beside the tenant's requests, and a run is followed by at most
        MAX_FOLLOWERS_PER_RUN streams (a client re-attaches after a broken stream; it needs one)."""
        followers = len(state.subscribers)
        if followers >= MAX_FOLLOWERS_PER_RUN:
            raise Overloaded(f"{followers} streams already follow this idempotency key's run (the limit); "
                             "retry once some have ended", retry_after_s=1.0)
        sched = self.runtime.scheduler
        limit = sched.config.for_tenant(tenant).max_concurrent
        busy = sched.tenant_inflight(tenant) + self.attached[tenant]
        if busy + 1 > limit:
            raise Overloaded(f"tenant {tenant!r} has {busy} requests and attached streams in flight, its limit is "
                             f"{limit}", retry_after_s=1.0)

    def _run(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, received: float, tenant: str,
             valid: convert.ValidRequest, key: str, group: str | None = None) -> _Call:
        """Submit a new run; raises a ServingError when it is refused at once. `group`: n > 1, the call's key,
        shared by its samples (they prefer one worker: engine/scheduler/placement.py)."""
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
                             model=valid.model.key, cls=valid.cls, prompt_ids=valid.prompt_ids, sampling=valid.sampling,
                             timeline=timeline, deadline=deadline, fault_marker=marker, idempotency_key=key,
                             must_complete_by_deadline=request.require_completion_by_deadline,
                             itl_target_s=convert.itl_target(request, valid.cls), group=group, lora=valid.model.adapter,
                             version=valid.model.version)
        mailbox = state.subscribe()
        self.runtime.submit(state)
        return _Call(state=state, mailbox=mailbox, owner=True)


    def _run_samples(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, received: float,
                     tenant: str, valid: convert.ValidRequest) -> _Call:
        """n > 1: n runs of the one prompt, submitted together so that their prompts share the prefix
        cache's blocks, on one worker while it has room (the scheduler places a call's samples together:
        engine/scheduler/placement.py); sample i is seeded seed + i, as vLLM seeds its n children. All or none."""
        request_id = valid.request_id or uuid.uuid4().hex
        group = str(RequestKey(tenant, request_id))
        samples: list[tuple[RequestState, asyncio.Queue]] = []
        try:
            for i in range(valid.n):
                seed = valid.sampling.seed
                one = replace(valid, request_id=request_id if i == 0 else responses.sample_request_id(request_id, i),
                              sampling=valid.sampling if seed is None else replace(valid.sampling, seed=seed + i))
                run = self._run(request, context, received, tenant, one, "", group)
                samples.append((run.state, run.mailbox))
        except ServingError:
            for state, mailbox in samples:
                self.runtime.leave(state, mailbox)
            raise
        return _Call(state=samples[0][0], mailbox=samples[0][1], owner=True, samples=samples)

    async def _sample_chunks(self, call: _Call) -> AsyncIterator[pb.GenerateChunk]:
        """Every sample's chunks, as they come, each tagged with its sample index; each sample's last chunk
        when it ends. A sample that fails fails the call (the others are then stopped by `_call`)."""
        merged: asyncio.Queue = asyncio.Queue()
        request_id = call.state.request_id

        async def follow(i: int, state: RequestState, mailbox: asyncio.Queue) -> None:
            try:
                async for chunk in self.runtime.events(state, mailbox):
                    merged.put_nowait(responses.chunk_pb(state, chunk, request_id=request_id, sample_index=i))
                state.timeline.last_byte = time.monotonic()
                merged.put_nowait(responses.final_chunk(state, request_id=request_id, sample_index=i))
                merged.put_nowait(None)
            except ServingError as err:
                merged.put_nowait(err)

        tasks = [asyncio.create_task(follow(i, s, m)) for i, (s, m) in enumerate(call.samples)]
        try:
            running = len(tasks)
            while running:
                item = await merged.get()
                if item is None:
                    running -= 1
                elif isinstance(item, ServingError):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()


@dataclass
class _Call:
    """What a Generate/Complete call follows: a live run (its own or attached), or a stored result."""

    state: RequestState | None = None
    mailbox: asyncio.Queue | None = None
    owner: bool = False
    replay: Replay | None = None
    outcome: str = "error"  # how it ended, for telemetry: set by the call once it has answered
    # n > 1: every sample's run and mailbox, sample 0 (also `state`, `mailbox`) first.
    samples: list[tuple[RequestState, asyncio.Queue]] = field(default_factory=list)
    tools: tools.ToolSpec | None = None  # a chat's tools: results carry the calls
    model: str = ""
    attached_by: str | None = None  # the tenant, when this call is attached to another call's run

    def followed(self) -> list[tuple[RequestState, asyncio.Queue]]:
        """The runs this call follows: its samples, or its one run (none for a replay)."""
        if self.samples:
            return self.samples
        return [(self.state, self.mailbox)] if self.state is not None else []


class _Outbox:
    """What a GenerateMany call has ready to send, built in place in its next response, and the event that
    wakes its sender."""

    def __init__(self) -> None:
        self.response = pb.GenerateManyResponse()
        self.ready = asyncio.Event()

    def chunk(self, stream: int) -> pb.GenerateChunk:
        """A new, empty chunk of `stream` in the next response, to write the chunk into."""
        self.ready.set()
        return self.response.chunks.add(stream=stream).chunk

    def wake(self) -> None:
        self.ready.set()

    def empty(self) -> bool:
        r = self.response
        return not (r.chunks or r.errors or r.ended)

    def take(self, max_bytes: int) -> list[pb.GenerateManyResponse]:
        """All that is ready, in one response, or in several in order when one would pass `max_bytes` (the
        channel's message limit: chunks with logprobs for hundreds of streams can); a single chunk larger
        than that goes alone, as a Generate call would send it."""
        response, self.response = self.response, pb.GenerateManyResponse()
        if len(response.chunks) < 2 or response.ByteSize() <= max_bytes:
            return [response]
        out, part, size = [], pb.GenerateManyResponse(), 0
        for item in response.chunks:
            n = item.ByteSize() + 8  # with its tag and length
            if part.chunks and size + n > max_bytes:
                out.append(part)
                part, size = pb.GenerateManyResponse(), 0
            part.chunks.add().CopyFrom(item)
            size += n
        part.errors.extend(response.errors)  # ends and errors after the chunks, as the stream's order needs
        part.ended.extend(response.ended)
        out.append(part)
        return out


# Under every client's default receive limit (4 MiB), with room: a GenerateMany response is split above it.
MAX_RESPONSE_BYTES = 1 << 20
MAX_FOLLOWERS_PER_RUN = 16  # streams following one keyed run, its own included
MALFORMED = convert.MALFORMED  # what an RPC gets for bytes that did not parse (convert.parser)
_parse = convert.parser


def add_to_server(servicer: TokenlineServicer, server: grpc.aio.Server) -> None:
    """Register the service with deserializers that turn unparsable bytes into INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(servicer.Generate, request_deserializer=_parse(pb.GenerateRequest),
                                                         response_serializer=pb.GenerateChunk.SerializeToString),
        "GenerateMany": grpc.stream_stream_rpc_method_handler(
            servicer.GenerateMany, request_deserializer=_parse(pb.GenerateManyRequest),
            response_serializer=pb.GenerateManyResponse.SerializeToString),
        "Complete": grpc.unary_unary_rpc_method_handler(servicer.Complete, request_deserializer=_parse(pb.GenerateRequest),
                                                        response_serializer=pb.CompleteResponse.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(servicer.Cancel, request_deserializer=_parse(pb.CancelRequest),
                                                      response_serializer=pb.CancelResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(servicer.ListModels, request_deserializer=_parse(pb.ListModelsRequest),
                                                          response_serializer=pb.ListModelsResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(servicer.Tokenize, request_deserializer=_parse(pb.TokenizeRequest),
                                                        response_serializer=pb.TokenizeResponse.SerializeToString),
        "Detokenize": grpc.unary_unary_rpc_method_handler(servicer.Detokenize, request_deserializer=_parse(pb.DetokenizeRequest),
                                                          response_serializer=pb.DetokenizeResponse.SerializeToString),
        # Durable jobs (server/jobrpcs.py).
        "SubmitJob": grpc.unary_unary_rpc_method_handler(servicer.job_rpcs.SubmitJob, request_deserializer=_parse(pb.SubmitJobRequest),
                                                         response_serializer=pb.Job.SerializeToString),
        "WatchJob": grpc.unary_stream_rpc_method_handler(servicer.job_rpcs.WatchJob, request_deserializer=_parse(pb.WatchJobRequest),
                                                         response_serializer=pb.JobChunk.SerializeToString),
        "GetJob": grpc.unary_unary_rpc_method_handler(servicer.job_rpcs.GetJob, request_deserializer=_parse(pb.GetJobRequest),
                                                      response_serializer=pb.Job.SerializeToString),
        "CancelJob": grpc.unary_unary_rpc_method_handler(servicer.job_rpcs.CancelJob, request_deserializer=_parse(pb.CancelJobRequest),
                                                         response_serializer=pb.Job.SerializeToString),
        "ListJobs": grpc.unary_unary_rpc_method_handler(servicer.job_rpcs.ListJobs, request_deserializer=_parse(pb.ListJobsRequest),
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

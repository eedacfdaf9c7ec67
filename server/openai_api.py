"""The OpenAI-compatible door: `/v1/chat/completions`, `/v1/completions` and `/v1/models` on the web port.

Not a proxy and not a second API: a request is parsed by typed pydantic models, turned into the
`GenerateRequest` the gRPC door takes (`to_generate_request` in server/openai_requests.py, the one conversion layer), and served by
the same servicer instance through the same call (`TokenlineServicer.Generate` / `Complete` with the
gRPC-Web door's context), in the same event loop. Validation, bearer keys and tenants, deadlines,
idempotency keys, traffic classes, n, logprobs and formats therefore mean the same on both doors;
`GenerateChunk`s become OpenAI chunks (`Answer`), and gRPC statuses OpenAI's error shape with the
matching HTTP status (`http_error`).

tokenline's own headers: `Idempotency-Key`, `X-Request-Id` (the request id), `X-Tokenline-Deadline-Ms`
(milliseconds from now), `X-Tokenline-Class` (interactive | bulk; or `service_tier: "flex"` for bulk),
`X-Tokenline-Itl-Target-Ms`. Each choice's last chunk (and a whole response) carries `timeline`: the
server's split of the request's time, the fields of the gRPC `Timeline`, in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pydantic import ValidationError

from tokenline.server import convert
from tokenline.server.errors import RETRY_PUSHBACK_KEY
from tokenline.server.openai_requests import ChatRequest, CompletionRequest, CommonRequest, number_header, to_generate_request
from tokenline.v1 import tokenline_pb2 as pb

MAX_BODY_BYTES = 4 * 1024 * 1024

_FINISH = {pb.STOP: "stop", pb.LENGTH: "length", pb.STOP_STRING: "stop", pb.CANCELLED: "abort", pb.DEADLINE: "abort",
           pb.TOOL_CALLS: "tool_calls"}


def tool_call_json(call: pb.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_delta_json(delta: pb.ToolCallDelta) -> dict[str, Any]:
    if delta.id:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


def timeline_json(timeline: pb.Timeline) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(timeline, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def usage_json(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs(positions) -> dict[str, Any]:  # noqa: ANN001
    def one(t: pb.TokenLogprob) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
    return {"content": [one(p.token) | {"top_logprobs": [one(t) for t in p.top]} for p in positions]}


def completion_logprobs(positions, offset: int) -> dict[str, Any]:  # noqa: ANN001
    tokens, offsets = [], []
    for p in positions:
        offsets.append(offset)
        offset += len(p.token.text)
        tokens.append(p.token.text)
    return {"tokens": tokens, "token_logprobs": [p.token.logprob for p in positions],
            "top_logprobs": [{t.text: t.logprob for t in p.top} for p in positions], "text_offset": offsets}


class Answer:
    """One OpenAI response being built from GenerateChunks: a chat or a completion, streamed or whole."""

    def __init__(self, chat: bool, model: str, want_logprobs: bool, want_token_ids: bool = False, tools: bool = False):
        self.chat, self.model, self.want_logprobs, self.want_token_ids = chat, model, want_logprobs, want_token_ids
        self.tools = tools  # the message is `content` and `tool_calls`, not the whole text
        self.created = int(time.time())
        self.id = ""
        self.started: set[int] = set()
        self.text_offset: dict[int, int] = {}
        self.usage = [0, 0, 0]  # prompt, completion (all choices), cached

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, chunk: pb.GenerateChunk) -> dict[str, Any]:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + chunk.request_id
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.model}

    def events(self, chunk: pb.GenerateChunk) -> list[dict[str, Any]]:
        """The stream's events for one GenerateChunk."""
        i = chunk.sample_index
        choice: dict[str, Any] = {"index": i}
        if self.chat:
            delta: dict[str, Any] = {}
            if i not in self.started:
                self.started.add(i)
                delta["role"] = "assistant"
            text = chunk.content if self.tools else chunk.text
            if text or "role" in delta:
                delta["content"] = text
            if chunk.tool_calls:
                delta["tool_calls"] = [tool_delta_json(d) for d in chunk.tool_calls]
            choice["delta"] = delta
        else:
            choice["text"] = chunk.text
        if self.want_logprobs:
            choice["logprobs"] = (chat_logprobs(chunk.logprobs) if self.chat else
                                  completion_logprobs(chunk.logprobs, self.text_offset.get(i, 0))) if chunk.logprobs else None
            self.text_offset[i] = self.text_offset.get(i, 0) + len(chunk.text)
        if self.want_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
        choice["finish_reason"] = _FINISH.get(chunk.finish_reason) if chunk.finish_reason else None
        event = self._head(chunk) | {"choices": [choice]}
        if chunk.finish_reason:
            event["timeline"] = timeline_json(chunk.timeline)
            self.usage[0] = chunk.usage.prompt_tokens
            self.usage[1] += chunk.usage.completion_tokens
            self.usage[2] = max(self.usage[2], chunk.usage.cached_prompt_tokens)
        if not chunk.text and not chunk.token_ids and not chunk.finish_reason and not self.chat:
            return []
        return [event]

    def usage_event(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.model, "choices": [], "usage": usage_json(*self.usage)}

    def whole(self, response: pb.CompleteResponse) -> dict[str, Any]:
        samples = list(response.samples) or [pb.Sample(sample_index=0, token_ids=response.token_ids, text=response.text,
                                                       finish_reason=response.finish_reason, logprobs=response.logprobs,
                                                       timeline=response.timeline, tool_calls=response.tool_calls,
                                                       content=response.content)]
        choices = []
        for s in samples:
            choice: dict[str, Any] = {"index": s.sample_index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": s.content or None if self.tools else s.text}
                if s.tool_calls:
                    choice["message"]["tool_calls"] = [tool_call_json(c) for c in s.tool_calls]
            else:
                choice["text"] = s.text
            if self.want_logprobs:
                choice["logprobs"] = chat_logprobs(s.logprobs) if self.chat else completion_logprobs(s.logprobs, 0)
            if self.want_token_ids:
                choice["token_ids"] = list(s.token_ids)
            choice["finish_reason"] = _FINISH.get(s.finish_reason, "stop")
            choices.append(choice)
        u = response.usage
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + response.request_id, "object": self.object,
                "created": self.created, "model": self.model, "choices": choices,
                "usage": usage_json(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
                "timeline": timeline_json(response.timeline)}


# ---------------------------------------------------------------- errors

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.ABORTED: (409, "invalid_request_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented"),
}


def http_error(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> tuple[int, dict, dict]:
    """(HTTP status, OpenAI error body, headers) for a gRPC status."""
    status, kind = _HTTP.get(code, (500, "server_error"))
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s else {}
    return status, {"error": {"message": message, "type": kind, "param": None, "code": code.name.lower()}}, headers


def validation_message(error: ValidationError) -> str:
    parts = []
    for e in error.errors()[:5]:
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            parts.append(f"{where} is not a field tokenline takes")
        else:
            parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


# ---------------------------------------------------------------- the door


class OpenAIDoor:
    """An ASGI app for the /v1 routes, serving through `servicer` with `context_factory(timeout, metadata, peer)`."""

    def __init__(self, servicer: Any, context_factory: Any, read_timeout_s: float = 15.0):
        self.servicer, self.context_factory, self.read_timeout_s = servicer, context_factory, read_timeout_s

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        method, path = scope["method"], scope["path"].rstrip("/")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if path == "/v1/models" and method == "GET":
            return await self._models(scope, headers, send)
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return await _json(send, 404, {"error": {"message": f"no route {path}; this server has /v1/chat/completions, "
                                                     "/v1/completions and /v1/models", "type": "not_found_error",
                                                     "param": None, "code": "not_found"}})
        if method != "POST":
            return await _json(send, 405, http_error(grpc.StatusCode.UNIMPLEMENTED, f"{path} takes POST")[1])
        body = await _read_body(receive, headers, self.read_timeout_s)
        if isinstance(body, tuple):
            return await _json(send, *body)
        chat = path == "/v1/chat/completions"
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate_json(body)
        except ValidationError as e:
            status, err, _ = http_error(grpc.StatusCode.INVALID_ARGUMENT, validation_message(e))
            return await _json(send, status, err)
        try:
            request = to_generate_request(req, headers)
            timeout = number_header(headers["x-tokenline-deadline-ms"], "X-Tokenline-Deadline-Ms") / 1000 \
                if "x-tokenline-deadline-ms" in headers else None
        except convert.InvalidRequest as e:
            status, err, _ = http_error(grpc.StatusCode.INVALID_ARGUMENT, e.message)
            return await _json(send, status, err)
        metadata = [(k, v) for k, v in headers.items() if k in ("authorization", "x-api-key", "traceparent", "host")]
        client = scope.get("client") or ("", 0)
        context = self.context_factory(timeout, metadata, f"ipv4:{client[0]}:{client[1]}")
        tools = chat and bool(req.tools) and req.tool_choice != "none"
        answer = Answer(chat, req.model or self.servicer.default_model, req.logprobs not in (None, False),
                        req.return_token_ids, tools)
        if req.stream:
            await self._stream(request, context, answer, req, receive, send)
        else:
            await self._whole(request, context, answer, send)

    async def _models(self, scope, headers: dict[str, str], send) -> None:  # noqa: ANN001
        metadata = [(k, v) for k, v in headers.items() if k in ("authorization", "x-api-key", "host")]
        context = self.context_factory(None, metadata, "")
        try:
            listed = await self.servicer.ListModels(pb.ListModelsRequest(), context)
        except grpc.RpcError:
            status, err, extra = http_error(context.code, context.details or "")
            return await _json(send, status, err, extra)
        created = int(time.time())
        await _json(send, 200, {"object": "list", "data": [
            {"id": m.name if m.current else f"{m.name}@{m.version}",  # a version finishing its streams after a rollout
             "object": "model", "created": created, "owned_by": "tokenline", "root": m.name,
             "max_model_len": m.max_context, "version": m.version, "loaded": m.loaded,
             **({"parent": m.base_model} if m.base_model else {})}  # a LoRA adapter: its model, as vllm serve says
            for m in listed.models]})

    async def _whole(self, request: pb.GenerateRequest, context: Any, answer: Answer, send) -> None:  # noqa: ANN001
        try:
            async with asyncio.timeout(context.time_remaining()):
                response = await self.servicer.Complete(request, context)
        except grpc.RpcError:
            return await _json(send, *self._failure(context))
        except TimeoutError:
            context._cancelled = True
            return await _json(send, *http_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")[:2])
        finally:
            context._done = True
        await _json(send, 200, answer.whole(response))

    async def _stream(self, request: pb.GenerateRequest, context: Any, answer: Answer, req: CommonRequest, receive,
                      send) -> None:  # noqa: ANN001
        chunks = self.servicer.Generate(request, context).__aiter__()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # The first chunk before the response starts: a refusal is an HTTP status, not a broken stream.
        first = asyncio.ensure_future(_next(chunks, context))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({first, watch}, return_when=asyncio.FIRST_COMPLETED)
            if first not in done:  # the caller left before anything was produced
                context._cancelled = True
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                return
            try:
                chunk = first.result()
            except grpc.RpcError:
                return await _json(send, *self._failure(context))
            except TimeoutError:
                return await _json(send, *http_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")[:2])
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                    (b"x-accel-buffering", b"no")]})
            pump = asyncio.ensure_future(self._pump(chunk, chunks, context, answer, include_usage, send))
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump not in done:  # the caller went away mid-stream: stop its call, as grpc core does
                context._cancelled = True
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
                await chunks.aclose()
                return
            pump.result()
        finally:
            watch.cancel()
            context._done = True

    async def _pump(self, chunk: pb.GenerateChunk | None, chunks: AsyncIterator, context: Any, answer: Answer,
                    include_usage: bool, send) -> None:  # noqa: ANN001
        try:
            while chunk is not None:
                for event in answer.events(chunk):
                    await _sse(send, event)
                chunk = await _next(chunks, context)
            if include_usage:
                await _sse(send, answer.usage_event())
        except grpc.RpcError:  # failed after the stream began: the error as one last event, as vLLM does
            await _sse(send, self._failure(context)[1])
        except TimeoutError:
            await _sse(send, http_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")[1])
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    def _failure(self, context: Any) -> tuple[int, dict, dict]:
        retry = dict(getattr(context, "_trailing_metadata", None) or ()).get(RETRY_PUSHBACK_KEY)
        return http_error(context.code or grpc.StatusCode.UNKNOWN, context.details or "the request failed",
                          int(retry) / 1000 if retry else None)


async def _next(chunks: AsyncIterator, context: Any) -> pb.GenerateChunk | None:
    try:
        async with asyncio.timeout(context.time_remaining()):
            return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def _disconnected(receive) -> None:  # noqa: ANN001
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(receive, headers: dict[str, str], timeout_s: float) -> bytes | tuple[int, dict]:  # noqa: ANN001
    declared = headers.get("content-length")
    too_big = (413, http_error(grpc.StatusCode.INVALID_ARGUMENT, f"the body is larger than {MAX_BODY_BYTES} bytes")[1])
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return too_big
    body = bytearray()
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s  # the whole body, not each piece: a byte a second must not hold a request open
    while True:
        try:
            async with asyncio.timeout_at(until):
                event = await receive()
        except TimeoutError:
            return (408, {"error": {"message": f"the request body did not arrive within {timeout_s:g} s; send it at once",
                                    "type": "invalid_request_error", "param": None, "code": "request_timeout"}})
        if event["type"] == "http.disconnect":
            return (499, {})
        body += event.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            return too_big
        if not event.get("more_body"):
            return bytes(body)


async def _sse(send, event: dict) -> None:  # noqa: ANN001
    await send({"type": "http.response.body", "body": b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n",
                "more_body": True})


async def _json(send, status: int, body: dict, headers: dict | None = None) -> None:  # noqa: ANN001
    data = json.dumps(body, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]})
    await send({"type": "http.response.body", "body": data})

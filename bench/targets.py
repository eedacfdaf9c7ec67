"""The servers a bench run can drive: tokenline over gRPC, or any OpenAI-compatible HTTP server.

A target sends one planned request and fills in its RequestRecord as chunks
arrive: chunk arrival times and token counts, how it ended, and (tokenline only)
the server's own timeline from the final chunk. A target never raises for a
failed request; the failure is the record's status.

    tokenline://127.0.0.1:50051   or  127.0.0.1:50051       gRPC, the tokenline client
    http://127.0.0.1:8000                                   POST /v1/completions, SSE stream
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Protocol

from tokenline.bench.records import CANCELLED, ERROR, OK, REFUSED, TIMEOUT, RequestRecord
from tokenline.bench.workload import PlannedRequest

# Lower runs first on a server started with priority scheduling (as `bench compare` starts vLLM).
CLASS_PRIORITY = {"interactive": 0, "bulk": 1}


class Target(Protocol):
    name: str  # "tokenline" | "openai"
    address: str

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def send(self, request: PlannedRequest, record: RequestRecord, t0: float) -> None: ...


def make_target(address: str, *, model: str = "", api_key: str | None = None, openai_priority: bool = False,
                connections: int = 1, multiplex: bool = False) -> Target:
    """The target for an address: http(s):// is OpenAI-compatible, anything else tokenline gRPC."""
    if address.startswith(("http://", "https://")):
        if multiplex:
            raise ValueError("--multiplex is a tokenline gRPC call (GenerateMany); an OpenAI-compatible server has none")
        return OpenAITarget(address, model=model, api_key=api_key, send_priority=openai_priority)
    return TokenlineTarget(address.removeprefix("tokenline://"), model=model, api_key=api_key, connections=connections,
                           multiplex=multiplex)


async def probe_model_folder(address: str, api_key: str | None = None, timeout_s: float = 5.0) -> str | None:
    """The served model's folder, when it is on this machine: the bench tokenizes with it.

    tokenline names a model after its folder in tokenline's model cache; vLLM
    reports the folder it loaded as the model's `root`.
    """
    if address.startswith(("http://", "https://")):
        import aiohttp

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(f"{address.rstrip('/')}/v1/models") as response:
                models = (await response.json()).get("data") or []
        candidates = [m.get("root") or m.get("id") for m in models]
    else:
        from tokenline.client import AsyncClient
        from tokenline.engine.models import cache_dir

        async with AsyncClient(address.removeprefix("tokenline://"), api_key=api_key) as client:
            models = await client.list_models(timeout=timeout_s)
        candidates = [str(cache_dir() / "models" / m.name) for m in models]
    folder = next((c for c in candidates if c and Path(c, "config.json").is_file()), None)
    return folder


def _remaining(request: PlannedRequest, record: RequestRecord, t0: float) -> float | None:
    """Seconds left until the request's deadline (counted from its scheduled arrival)."""
    if request.deadline_s is None:
        return None
    return record.scheduled + request.deadline_s - (time.monotonic() - t0)


class TokenlineTarget:
    name = "tokenline"

    def __init__(self, address: str, *, model: str = "", api_key: str | None = None, connections: int = 1,
                 multiplex: bool = False):
        self.address, self.model, self.api_key = address, model, api_key
        self.connections = max(1, connections)
        self.multiplex = multiplex  # each connection's streams on one GenerateMany call
        self._clients: list[Any] = []
        self._muxes: list[Any] = []
        self._next = 0

    async def open(self) -> None:
        from tokenline.client import AsyncClient

        # Retries off: the bench must see every refusal and failure as it happened.
        # A local subchannel pool gives each client its own connection.
        self._clients = [AsyncClient(self.address, api_key=self.api_key,
                                     options=[("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1)])
                         for i in range(self.connections)]
        from tokenline.client import TokenlineError

        try:
            await self._clients[0].list_models(timeout=30)
        except TokenlineError as e:
            await self.close()
            raise ConnectionError(f"cannot reach tokenline at {self.address}: {e}") from e
        if self.multiplex:
            self._muxes = [client.multiplex() for client in self._clients]

    async def close(self) -> None:
        for mux in self._muxes:
            await mux.aclose()
        for client in self._clients:
            await client.close()

    async def send(self, request: PlannedRequest, record: RequestRecord, t0: float) -> None:
        from tokenline.client import DeadlineExceeded, Overloaded, TokenlineError

        remaining = _remaining(request, record, t0)
        if remaining is not None and remaining <= 0:
            record.status, record.end, record.error = TIMEOUT, time.monotonic() - t0, "deadline passed before sending"
            return
        client = (self._muxes or self._clients)[self._next]
        self._next = (self._next + 1) % len(self._clients)
        stream = client.generate(
            request.prompt_text, token_ids=None if request.prompt_text is not None else request.prompt_ids,
            model=request.model or self.model, max_tokens=request.max_tokens, temperature=request.temperature, seed=request.seed,
            ignore_eos=request.ignore_eos, traffic_class=request.traffic_class, deadline_s=remaining,
            require_completion=request.require_completion,
            logprobs=request.logprobs, n=request.n, json_schema=request.json_schema,
        )  # fmt: skip
        record.sent = stream.sent_at - t0
        times, counts = record.chunk_times, record.chunk_tokens
        produced = 0
        try:
            async for delta in stream:
                n = len(delta.token_ids)
                if n:
                    times.append(delta.received_at - t0)
                    counts.append(n)
                    produced += n
                if delta.timeline is not None:
                    record.server = dataclasses.asdict(delta.timeline)
                if delta.usage is not None:
                    record.prompt_tokens = delta.usage.prompt_tokens
                if delta.finish_reason is not None:
                    record.finish_reason = delta.finish_reason
                if request.cancel_after is not None and produced >= request.cancel_after:
                    stream.cancel()
                    record.status = CANCELLED
                    break
            else:
                record.status = {"deadline": TIMEOUT, "cancelled": ERROR}.get(record.finish_reason or "", OK)
                if record.finish_reason == "cancelled":
                    record.error = "the server cancelled the request"
        except Overloaded as e:
            record.status, record.error, record.retry_after_s = REFUSED, str(e), e.retry_after_s
        except DeadlineExceeded as e:
            # Told before any token and before the deadline itself: the server refused it up front
            # (it could not meet the deadline), which is a refusal, not a timeout.
            early = not counts and remaining is not None and (time.monotonic() - t0) - record.sent < remaining * 0.9
            record.status, record.error = (REFUSED if early else TIMEOUT), str(e)
        except TokenlineError as e:
            record.status, record.error = ERROR, str(e)
        finally:
            if record.status not in (OK, REFUSED, TIMEOUT, CANCELLED, ERROR):
                stream.cancel()  # the task was cancelled (run stopped): free the server's work
        record.end = time.monotonic() - t0


class OpenAITarget:
    """Streaming completions (`/v1/completions`, server-sent events) of an OpenAI-compatible server.

    Asks for `return_token_ids` (vLLM) to count the tokens in each chunk; without
    them each chunk counts as one token and the final usage settles the total.
    """

    name = "openai"

    def __init__(self, address: str, *, model: str = "", api_key: str | None = None, send_priority: bool = False):
        self.address, self.model, self.api_key, self.send_priority = address.rstrip("/"), model, api_key, send_priority
        self._session: Any = None

    async def open(self) -> None:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        if not self.model:
            try:
                async with self._session.get(f"{self.address}/v1/models") as response:
                    response.raise_for_status()
                    self.model = (await response.json())["data"][0]["id"]
            except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
                await self.close()
                raise ConnectionError(f"cannot list the models of {self.address}: {e}") from e

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _body(self, request: PlannedRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.model or self.model,
            "prompt": request.prompt_text if request.prompt_text is not None else list(request.prompt_ids),
            "max_tokens": request.max_tokens, "temperature": request.temperature, "ignore_eos": request.ignore_eos,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
        }  # fmt: skip
        if self.send_priority:
            body["priority"] = CLASS_PRIORITY[request.traffic_class]
        if request.seed is not None:
            body["seed"] = request.seed
        if request.logprobs is not None:
            body["logprobs"] = request.logprobs
        if request.n > 1:
            body["n"] = request.n
        if request.json_schema is not None:
            body["structured_outputs"] = {"json": json.loads(request.json_schema)}
        return body

    async def send(self, request: PlannedRequest, record: RequestRecord, t0: float) -> None:
        remaining = _remaining(request, record, t0)
        if remaining is not None and remaining <= 0:
            record.status, record.end, record.error = TIMEOUT, time.monotonic() - t0, "deadline passed before sending"
            return
        body = json.dumps(self._body(request))
        record.sent = time.monotonic() - t0
        try:
            if remaining is None:
                await self._stream(request, record, body, t0)
            else:
                await asyncio.wait_for(self._stream(request, record, body, t0), remaining)
        except (TimeoutError, asyncio.TimeoutError):
            record.status, record.error = TIMEOUT, "deadline passed (the client closed the stream)"
        except Exception as e:  # connection failures and bad responses are the request's result, not the run's
            record.status, record.error = ERROR, f"{type(e).__name__}: {e}"
        record.end = time.monotonic() - t0

    async def _stream(self, request: PlannedRequest, record: RequestRecord, body: str, t0: float) -> None:
        url = f"{self.address}/v1/completions"
        async with self._session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            if response.status in (429, 503):
                record.status, record.error = REFUSED, f"HTTP {response.status}"
                retry = response.headers.get("Retry-After")
                record.retry_after_s = float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
                return
            if response.status != 200:
                text = (await response.text())[:200]
                record.status, record.error = ERROR, f"HTTP {response.status}: {' '.join(text.split())}"
                return
            times, counts = record.chunk_times, record.chunk_tokens
            produced, counted_ids = 0, False
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = time.monotonic() - t0
                event = json.loads(payload)
                usage = event.get("usage")
                for choice in event.get("choices") or ():
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                    counted_ids |= ids is not None
                    if n:
                        times.append(now)
                        counts.append(n)
                        produced += n
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens")
                    total = usage.get("completion_tokens") or 0
                    if not counted_ids and counts and total > produced:
                        counts[-1] += total - produced  # chunks without ids: let the usage settle the count
                if request.cancel_after is not None and produced >= request.cancel_after:
                    record.status = CANCELLED
                    return  # leaving the block closes the connection: the server aborts the request
            record.status = OK

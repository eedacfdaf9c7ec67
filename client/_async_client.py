"""The asyncio client: the same calls as `Client`, on a grpc.aio channel.

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.generate("Hello", max_tokens=16):
            print(delta.text, end="", flush=True)

Create it inside a running event loop (grpc.aio binds the channel to it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

from ._channel import DEFAULT_TARGET, auth_metadata, channel_credentials, channel_options
from ._client import MAX_REATTACH, prepare_call, reattach_backoff_s, resumed
from ._convert import GenerateOptions, Message, completion_from_response, delta_from_chunk, model_from_proto, tokenize_request
from ._multiplex import Multiplex
from ._jobs import Job, JobChunk, chunk_from_proto, job_from_proto, list_request, submit_request
from ._types import Completion, Delta, ModelInfo
from .errors import NotFound, error_from_rpc

if TYPE_CHECKING:
    from typing_extensions import Unpack


class AsyncDeltaStream(AsyncIterator[Delta]):
    """The chunks of one Generate call, as Deltas, in order (see `DeltaStream`).

    `cancel()` (or leaving an `async with` block early) stops the call and the
    stream ends without an error.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall, sent_at: float,
                 restart: Callable[[int, str], grpc.aio.UnaryStreamCall] | None = None) -> None:
        self._call = call
        self._cancelled = False
        self.sent_at = sent_at
        self._restart = restart  # re-attach a keyed stream after a break (see DeltaStream)
        self._next_index = 0
        self.reattached = 0
        self._request_id = ""  # the run followed, as its chunks name it

    def __aiter__(self) -> AsyncDeltaStream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            try:
                chunk = await self._call.read()
            except asyncio.CancelledError:
                # grpc.aio reports a call we cancelled ourselves as CancelledError; a
                # cancelled task must still see its CancelledError.
                if self._cancelled:
                    raise StopAsyncIteration from None
                raise
            except grpc.RpcError as error:
                if self._cancelled and error.code() == grpc.StatusCode.CANCELLED:
                    raise StopAsyncIteration from None
                if (self._restart is not None and self._next_index > 0 and self.reattached < MAX_REATTACH
                        and error.code() == grpc.StatusCode.UNAVAILABLE):
                    await asyncio.sleep(reattach_backoff_s(self.reattached))
                    self.reattached += 1
                    self._call = self._restart(self._next_index, self._request_id)
                    continue
                raise error_from_rpc(error) from error
            if chunk is grpc.aio.EOF:
                raise StopAsyncIteration
            self._next_index = chunk.index + len(chunk.token_ids)
            self._request_id = chunk.request_id
            return delta_from_chunk(chunk, time.monotonic())

    def cancel(self) -> None:
        """Stop the call: the server sees the stream closed and frees the request."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncDeltaStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._call.done():
            self.cancel()


class AsyncClient:
    """An asyncio client for one tokenline server. Arguments as for `Client`."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        options: Sequence[tuple[str, Any]] = (),
        channel: grpc.aio.Channel | None = None,
        load_balancing: str | None = None,
    ) -> None:
        if channel is None:
            credentials = channel_credentials(
                tls, root_certificates, private_key, certificate_chain
            )
            if credentials is None:
                channel = grpc.aio.insecure_channel(target, options=channel_options(options, load_balancing))
            else:
                channel = grpc.aio.secure_channel(
                    target, credentials, options=channel_options(options, load_balancing)
                )
        self.target = target
        self._channel = channel
        self._stub = pb_grpc.TokenlineStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._metadata = auth_metadata(api_key)

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> AsyncDeltaStream:
        """Start generating; iterate the result with `async for`. Arguments as for `Client.generate`."""
        request, grpc_timeout = prepare_call(prompt, options)
        sent_at = time.monotonic()
        call = self._stub.Generate(request, timeout=grpc_timeout, metadata=self._metadata)
        restart = None
        if request.idempotency_key:
            def restart(index: int, request_id: str) -> grpc.aio.UnaryStreamCall:
                return self._stub.Generate(resumed(request, index, request_id), timeout=grpc_timeout, metadata=self._metadata)
        return AsyncDeltaStream(call, sent_at, restart)

    def multiplex(self) -> Multiplex:
        """A GenerateMany call for many streams at once (`async with client.multiplex() as streams`):
        `streams.generate(...)` takes `generate`'s arguments; one message per engine step carries every
        stream's chunks. See `tokenline.client.Multiplex`."""
        return Multiplex(self._stub, self._metadata)

    async def complete(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Completion:
        """Generate and return the whole result at once. Arguments as for `Client.generate`."""
        request, grpc_timeout = prepare_call(prompt, options)
        try:
            response = await self._stub.Complete(
                request, timeout=grpc_timeout, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return completion_from_response(response)

    async def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stop a queued or running request. False if it was unknown or already finished."""
        try:
            response = await self._stub.Cancel(
                pb.CancelRequest(request_id=request_id), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as error:
            mapped = error_from_rpc(error)
            if isinstance(mapped, NotFound):
                return False
            raise mapped from error
        return response.cancelled

    async def tokenize(self, prompt: str | None = None, *, messages: Sequence[Message] | None = None, model: str = "",
                 timeout: float | None = 30.0) -> list[int]:
        """The token ids of a text or chat prompt, exactly as generate() would send them to the model."""
        request = tokenize_request(prompt, messages, model)
        try:
            response = await self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return list(response.token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, model: str = "", skip_special_tokens: bool = False,
                   timeout: float | None = 30.0) -> str:
        """The text of some token ids."""
        request = pb.DetokenizeRequest(model=model, token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        try:
            response = await self._stub.Detokenize(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return response.text

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served models. Waits for the server to become reachable (up to `timeout`)."""
        try:
            response = await self._stub.ListModels(
                pb.ListModelsRequest(), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return [model_from_proto(m) for m in response.models]

    # ------------------------------------------------------------ durable jobs

    async def submit_job(self, prompt: str | None = None, *, timeout: float | None = 30.0,
                   **options: Unpack[GenerateOptions]) -> Job:
        """Record a generation as a durable job and return it once the server stored it.

        Options as for `generate` (bulk unless `traffic_class` says otherwise); `deadline_s` is
        the job's deadline; `idempotency_key` makes the submission safe to retry.
        """
        request = submit_request(prompt, options)
        try:
            return job_from_proto(await self._stub.SubmitJob(request, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    async def watch_job(self, job_id: str, from_index: int = 0, *, timeout: float | None = None) -> AsyncIterator[JobChunk]:
        """The job's stored tokens from `from_index` on, as they are stored; the last chunk has its end state."""
        call = self._stub.WatchJob(pb.WatchJobRequest(job_id=job_id, from_index=from_index), timeout=timeout,
                                   metadata=self._metadata)
        try:
            async for chunk in call:
                yield chunk_from_proto(chunk)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        finally:
            call.cancel()

    async def get_job(self, job_id: str, *, timeout: float | None = 30.0) -> Job:
        """The job's state, with the tokens stored so far (its whole result once it ended)."""
        try:
            return job_from_proto(await self._stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=timeout,
                                                    metadata=self._metadata))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    async def cancel_job(self, job_id: str, *, timeout: float | None = 30.0) -> Job:
        """Cancel a queued or running job; a finished one comes back unchanged."""
        try:
            return job_from_proto(await self._stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=timeout,
                                                       metadata=self._metadata))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    async def list_jobs(self, states: Sequence[str] = (), *, page_size: int = 100, page_token: str = "",
                  timeout: float | None = 30.0) -> tuple[list[Job], str]:
        """One page of your jobs, oldest first, and the token of the next page ("" after the last)."""
        try:
            response = await self._stub.ListJobs(list_request(tuple(states), page_size, page_token), timeout=timeout,
                                           metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return [job_from_proto(j) for j in response.jobs], response.next_page_token

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN"."""
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self, grace: float | None = None) -> None:
        """Close the channel; calls still in flight after `grace` seconds are cancelled."""
        await self._channel.close(grace)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

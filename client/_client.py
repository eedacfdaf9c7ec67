"""The blocking client: one gRPC channel to a tokenline server, calls that return dataclasses.

    with Client("127.0.0.1:50051") as client:
        for delta in client.generate("Hello", max_tokens=16):
            print(delta.text, end="", flush=True)

Every failure raises a `tokenline.client.errors.TokenlineError` subclass.
Retries on UNAVAILABLE are gRPC's own, declared in the channel's service config
(see `_channel`); a streaming call is retried only until its first chunk arrives.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

from ._channel import DEFAULT_TARGET, auth_metadata, channel_credentials, channel_options
from ._convert import (
    GenerateOptions,
    build_request,
    call_deadline,
    completion_from_response,
    delta_from_chunk,
    model_from_proto,
    Message,
    tokenize_request,
)
from ._jobs import Job, JobChunk, chunk_from_proto, job_from_proto, list_request, submit_request
from ._types import Completion, Delta, ModelInfo
from .errors import NotFound, error_from_rpc

if TYPE_CHECKING:
    from typing_extensions import Unpack


MAX_REATTACH = 5


def reattach_backoff_s(attempt: int) -> float:
    """Full-jitter exponential backoff before re-attaching a broken stream."""
    return random.uniform(0, min(0.1 * 2**attempt, 2.0))


def resumed(request: pb.GenerateRequest, index: int, request_id: str = "") -> pb.GenerateRequest:
    """The same keyed request, asking only for tokens from `index` on of the run `request_id`
    (the one the stream followed: the server refuses to continue it with a different run)."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    again.resume_from_index = index
    again.request_id = request_id or request.request_id
    return again


def prepare_call(prompt: str | None, options: GenerateOptions) -> tuple[pb.GenerateRequest, float | None]:
    """(request, gRPC timeout) for one Generate or Complete call, with the deadline stamped now."""
    fields = dict(options)
    deadline_s, timeout = fields.pop("deadline_s", None), fields.pop("timeout", None)
    grpc_timeout, deadline_unix_ms = call_deadline(deadline_s, timeout, time.time())
    request = build_request(prompt, deadline_unix_ms=deadline_unix_ms, **fields)
    return request, grpc_timeout


class DeltaStream(Iterator[Delta]):
    """The chunks of one Generate call, as Deltas, in order.

    The call is already on its way when you get this object; `sent_at` is the
    `time.monotonic()` at which it was started (for time to first token).
    `cancel()` (or leaving a `with` block early) stops the call; the stream then
    ends without an error. Any other failure raises a TokenlineError.
    """

    def __init__(self, call: Any, sent_at: float, restart: Callable[[int, str], Any] | None = None) -> None:
        self._call = call
        self._cancelled = False
        self.sent_at = sent_at
        # With an idempotency key, a stream that breaks after it started re-attaches
        # to the same run from the next token index: no token twice, none missing.
        self._restart = restart
        self._next_index = 0
        self.reattached = 0
        self._request_id = ""  # the run followed, as its chunks name it

    def __iter__(self) -> DeltaStream:
        return self

    def __next__(self) -> Delta:
        while True:
            try:
                chunk = next(self._call)
            except grpc.RpcError as error:
                if self._cancelled and error.code() == grpc.StatusCode.CANCELLED:
                    raise StopIteration from None
                if self._can_reattach(error):
                    time.sleep(reattach_backoff_s(self.reattached))
                    self.reattached += 1
                    self._call = self._restart(self._next_index, self._request_id)
                    continue
                raise error_from_rpc(error) from error
            self._next_index = chunk.index + len(chunk.token_ids)
            self._request_id = chunk.request_id
            return delta_from_chunk(chunk, time.monotonic())

    def _can_reattach(self, error: grpc.RpcError) -> bool:
        return (self._restart is not None and self._next_index > 0 and self.reattached < MAX_REATTACH
                and error.code() == grpc.StatusCode.UNAVAILABLE)

    def cancel(self) -> None:
        """Stop the call: the server sees the stream closed and frees the request."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> DeltaStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._call.is_active():
            self.cancel()


class Client:
    """A blocking client for one tokenline server.

    `target` is "host:port", or any gRPC target: "dns:///tokenline.example:50051" with
    `load_balancing="round_robin"` spreads calls over every frontend the name resolves to
    ("ipv4:10.0.0.1:50051,10.0.0.2:50051" lists them). `api_key` is sent as `authorization: Bearer <key>`.
    TLS is on when `tls` is true or any certificate is given (PEM bytes);
    `private_key` with `certificate_chain` is a client certificate for mutual TLS.
    `options` are extra gRPC channel options (they override ours by name).
    `channel` uses an existing channel instead (our service config then does
    not apply unless it was built with `channel_options()`); close() closes it.
    """

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
        channel: grpc.Channel | None = None,
        load_balancing: str | None = None,
    ) -> None:
        if channel is None:
            credentials = channel_credentials(
                tls, root_certificates, private_key, certificate_chain
            )
            if credentials is None:
                channel = grpc.insecure_channel(target, options=channel_options(options, load_balancing))
            else:
                channel = grpc.secure_channel(target, credentials, options=channel_options(options, load_balancing))
        self.target = target
        self._channel = channel
        self._stub = pb_grpc.TokenlineStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._metadata = auth_metadata(api_key)

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> DeltaStream:
        """Start generating and stream the result as Deltas; the last one has the finish reason,
        usage and server timeline.

        Give exactly one of `prompt` (plain text), `messages` (chat: {"role", "content"}
        dicts or (role, content) pairs) or `token_ids`. `deadline_s` (seconds from now)
        bounds the call and tells the server the deadline; `timeout` bounds the call only.
        Raises ValueError for arguments no server would accept.
        """
        request, grpc_timeout = prepare_call(prompt, options)
        sent_at = time.monotonic()
        call = self._stub.Generate(request, timeout=grpc_timeout, metadata=self._metadata)
        restart = None
        if request.idempotency_key:
            def restart(index: int, request_id: str) -> Any:
                return self._stub.Generate(resumed(request, index, request_id), timeout=grpc_timeout, metadata=self._metadata)
        return DeltaStream(call, sent_at, restart)

    def complete(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Completion:
        """Generate and return the whole result at once. Arguments as for `generate`."""
        request, grpc_timeout = prepare_call(prompt, options)
        try:
            response = self._stub.Complete(request, timeout=grpc_timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return completion_from_response(response)

    def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stop a queued or running request. False if it was unknown or already finished."""
        try:
            response = self._stub.Cancel(
                pb.CancelRequest(request_id=request_id), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as error:
            mapped = error_from_rpc(error)
            if isinstance(mapped, NotFound):
                return False
            raise mapped from error
        return response.cancelled

    def tokenize(self, prompt: str | None = None, *, messages: Sequence[Message] | None = None, model: str = "",
                 timeout: float | None = 30.0) -> list[int]:
        """The token ids of a text or chat prompt, exactly as generate() would send them to the model."""
        request = tokenize_request(prompt, messages, model)
        try:
            response = self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return list(response.token_ids)

    def detokenize(self, token_ids: Sequence[int], *, model: str = "", skip_special_tokens: bool = False,
                   timeout: float | None = 30.0) -> str:
        """The text of some token ids."""
        request = pb.DetokenizeRequest(model=model, token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        try:
            response = self._stub.Detokenize(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return response.text

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served models. Waits for the server to become reachable (up to `timeout`)."""
        try:
            response = self._stub.ListModels(
                pb.ListModelsRequest(), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return [model_from_proto(m) for m in response.models]

    def roll_out(self, name: str, model: str, *, workers: int = 0, timeout: float | None = 900.0) -> dict[str, Any]:
        """Admin: roll model `name` out to the version in `model` (a folder or built-in name) without dropping a
        stream; returns once it is current: {"name", "version", "previous_version", "workers"}."""
        request = pb.RollOutRequest(name=name, model=model, workers=workers)
        try:
            response = pb_grpc.TokenlineAdminStub(self._channel).RollOut(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return {"name": response.name, "version": response.version, "previous_version": response.previous_version,
                "workers": response.workers}

    def load_adapter(self, model: str, name: str, folder: str, *, timeout: float | None = 120.0) -> dict[str, Any]:
        """Admin: serve the LoRA adapter in `folder` (on the server's machine) of `model` as model `name`; returns
        {"name", "model", "version", "folder", "adapters_held", "max_adapters", "draining"}."""
        return self._adapter_call("LoadAdapter", pb.LoadAdapterRequest(model=model, name=name, folder=folder), timeout)

    def unload_adapter(self, name: str, *, wait: bool = False, timeout: float | None = 900.0) -> dict[str, Any]:
        """Admin: stop serving the adapter `name` (its running requests finish on it); with `wait`, return once its
        slot is free. Returns as load_adapter does ("draining": requests of it still run)."""
        return self._adapter_call("UnloadAdapter", pb.UnloadAdapterRequest(name=name, wait=wait), timeout)

    def _adapter_call(self, method: str, request: Any, timeout: float | None) -> dict[str, Any]:
        try:
            r = getattr(pb_grpc.TokenlineAdminStub(self._channel), method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return {"name": r.name, "model": r.model, "version": r.version, "folder": r.folder,
                "adapters_held": r.adapters_held, "max_adapters": r.max_adapters, "draining": r.draining}

    # ------------------------------------------------------------ durable jobs

    def submit_job(self, prompt: str | None = None, *, timeout: float | None = 30.0,
                   **options: Unpack[GenerateOptions]) -> Job:
        """Record a generation as a durable job and return it once the server stored it.

        Options as for `generate` (bulk unless `traffic_class` says otherwise); `deadline_s` is
        the job's deadline; `idempotency_key` makes the submission safe to retry.
        """
        request = submit_request(prompt, options)
        try:
            return job_from_proto(self._stub.SubmitJob(request, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    def watch_job(self, job_id: str, from_index: int = 0, *, timeout: float | None = None) -> Iterator[JobChunk]:
        """The job's stored tokens from `from_index` on, as they are stored; the last chunk has its end state."""
        call = self._stub.WatchJob(pb.WatchJobRequest(job_id=job_id, from_index=from_index), timeout=timeout,
                                   metadata=self._metadata)
        try:
            for chunk in call:
                yield chunk_from_proto(chunk)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        finally:
            call.cancel()

    def get_job(self, job_id: str, *, timeout: float | None = 30.0) -> Job:
        """The job's state, with the tokens stored so far (its whole result once it ended)."""
        try:
            return job_from_proto(self._stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=timeout,
                                                    metadata=self._metadata))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    def cancel_job(self, job_id: str, *, timeout: float | None = 30.0) -> Job:
        """Cancel a queued or running job; a finished one comes back unchanged."""
        try:
            return job_from_proto(self._stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=timeout,
                                                       metadata=self._metadata))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    def list_jobs(self, states: Sequence[str] = (), *, page_size: int = 100, page_token: str = "",
                  timeout: float | None = 30.0) -> tuple[list[Job], str]:
        """One page of your jobs, oldest first, and the token of the next page ("" after the last)."""
        try:
            response = self._stub.ListJobs(list_request(tuple(states), page_size, page_token), timeout=timeout,
                                           metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return [job_from_proto(j) for j in response.jobs], response.next_page_token

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN".

        `service` "" asks about the server as a whole.
        """
        try:
            response = self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

"""The admin service (TokenlineAdmin): roll a model out to a new version while it serves (issue 34).

A rollout starts the new version's workers beside the current ones (its own runtime model, keyed
"name@version", with its own queues), waits until all are ready, then moves the name to it
(server/catalog.py ModelCatalog): requests naming the model go to the new version from then on, while
those already running or queued finish on the version they were sent to. The old version closes (no new
request), runs what it has queued, then retires: its workers take no new work and stop as their streams end (engine/supervisor.py retire_model), a request of it whose
worker dies fails rather than continue on another version (Runtime._fail_stranded), and once its last
worker has gone it is unloaded. A request naming "name@version" reaches that version while it is current or
before the rollout; once it is retired such a request is refused (UNAVAILABLE), never queued for a worker that
will not come.

Who may call: a tenant with "admin": true in the keys file; with authentication off, a caller on this
machine only (loopback), as with anything else a loopback-bound server answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from tokenline.server.auth import Authenticator
from tokenline.server.catalog import ModelCatalog, load_served_model
from tokenline.server.errors import ServingError, abort_with
from tokenline.server.runtime import Runtime
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

log = logging.getLogger("tokenline.server")

READY_TIMEOUT_S = 600.0  # the longest a new version's workers may take to start (a cold compile is minutes)
UNLOAD_CHECK_S = 0.2


class Forbidden(ServingError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotPossible(ServingError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class UnknownModel(ServingError):
    code = grpc.StatusCode.NOT_FOUND


class AdminServicer(pb_grpc.TokenlineAdminServicer):
    def __init__(self, runtime: Runtime, catalog: ModelCatalog, auth: Authenticator, *, ready_timeout_s: float = READY_TIMEOUT_S):
        self.runtime = runtime
        self.catalog = catalog
        self.auth = auth
        self.ready_timeout_s = ready_timeout_s
        self._rolling: set[str] = set()  # names with a rollout under way
        self._unloads: set[asyncio.Task] = set()

    async def RollOut(self, request: pb.RollOutRequest, context: grpc.aio.ServicerContext) -> pb.RollOutResponse:
        try:
            self._authorize(context)
            return await self._roll_out(request)
        except ServingError as err:
            await abort_with(context, err)

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if not self.auth.enabled:
            peer = context.peer() or ""
            if not peer.startswith(("ipv4:127.", "ipv6:[::1]", "unix:")):
                raise Forbidden("the admin service answers only callers on this machine while authentication is off "
                                "(give --api-keys with an admin tenant to operate it from elsewhere)")
            return
        common_name = None
        if self.auth.client_certs:
            names = context.auth_context().get("x509_common_name") or []
            common_name = names[0].decode() if names else None
        tenant = self.auth.tenant(tuple(context.invocation_metadata() or ()), common_name)
        if not self.auth.is_admin(tenant):
            raise Forbidden(f"tenant {tenant!r} may not operate this server: give it \"admin\": true in the keys file")

    async def _roll_out(self, request: pb.RollOutRequest) -> pb.RollOutResponse:
        from tokenline.engine.models import ModelPrepError, model_version, resolve_model

        current = self.catalog.current(request.name)
        if current is None:
            raise UnknownModel(f"no model is named {request.name!r}; this server serves: "
                               f"{', '.join(sorted({m.name for m in self.catalog.values()})) or 'none'}")
        if not request.model:
            raise NotPossible("say which model to roll out: RollOutRequest.model (a model folder or a built-in name)")
        if request.name in self._rolling:
            raise NotPossible(f"a rollout of {request.name!r} is under way; wait for it to end")
        self._rolling.add(request.name)
        try:
            loop = asyncio.get_running_loop()
            try:
                path = await loop.run_in_executor(None, resolve_model, request.model)
            except (ModelPrepError, ValueError, OSError) as err:
                raise NotPossible(f"cannot load {request.model!r}: {err}") from None
            version = await loop.run_in_executor(None, model_version, path)
            if version == current.version:
                raise NotPossible(f"{request.name!r} already serves version {version} ({request.model})")
            key = f"{request.name}@{version}"
            if key in self.runtime.worker_configs:
                raise NotPossible(f"version {version} of {request.name!r} is still loaded (draining); roll out once "
                                  "ListModels no longer shows it")
            config, count = self.runtime.worker_configs[current.key]
            count = request.workers or count
            config = dataclasses.replace(config, model_path=str(path), model_name=key, model_version=version)
            try:
                served = await loop.run_in_executor(None, load_served_model, request.name, path, version,
                                                    config.max_model_len)
            except Exception as err:  # noqa: BLE001  a folder the tokenizer or config reader refuses
                raise NotPossible(f"cannot load {request.model!r}: {err}") from None
            served = dataclasses.replace(served, key=key, tool_call_parser=current.tool_call_parser)
            if current.tool_call_parser:
                from tokenline.server.tool_parsers import VllmToolParsers

                served.tool_parsers = await loop.run_in_executor(None, VllmToolParsers, current.tool_call_parser,
                                                                 served.tokenizer)
            self.catalog.add(served, current=False)
            log.warning("rollout: starting %d worker(s) of %s version %s (%s)", count, request.name, version, path)
            self.runtime.add_model(key, config, count)
            error = await self._ready(key, count)
            if error is not None:
                self._unload_when_gone(key)
                raise NotPossible(f"version {version} of {request.name!r} did not start: {error}; "
                                  f"{request.name!r} still serves version {current.version}")
            previous = self.catalog.set_current(key)
            log.warning("rollout: %s now serves version %s; version %s takes no new requests and stops as its "
                        "streams end", request.name, version, current.version)
            if previous is not None:
                self.runtime.close_model(previous)
                self._unload_when_gone(previous, drain_queue=True)
            return pb.RollOutResponse(name=request.name, version=version, previous_version=current.version,
                                      workers=count)
        finally:
            self._rolling.discard(request.name)

    async def _ready(self, key: str, count: int) -> str | None:
        """Wait until `count` workers of `key` are ready; the reason when they cannot start."""
        until = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < until:
            error = self.runtime.start_errors.get(key)
            if error:
                return error
            if sum(1 for s in self.runtime.specs.values() if s.model == key) >= count:
                return None
            await asyncio.sleep(UNLOAD_CHECK_S)
        return f"its workers were not ready within {self.ready_timeout_s:.0f} s"

    def _unload_when_gone(self, key: str, *, drain_queue: bool = False) -> None:
        """Once what `key` has queued has started (`drain_queue`), retire its workers; once they are gone, unload it."""
        async def unload() -> None:
            while drain_queue and self.runtime.queued(key):
                await asyncio.sleep(UNLOAD_CHECK_S)
            self.runtime.retire_model(key)
            while self.runtime.workers.workers_of(key):
                await asyncio.sleep(UNLOAD_CHECK_S)
            self.runtime.worker_configs.pop(key, None)
            try:
                self.catalog.remove(key)
            except (KeyError, ValueError):  # gone already, or made current again meanwhile
                pass
            log.warning("rollout: %s unloaded (its last worker stopped)", key)

        task = asyncio.get_running_loop().create_task(unload())
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

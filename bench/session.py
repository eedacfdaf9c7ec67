"""One bench run end to end: build the plan, open the target, warm it up, run the load, write the results.

`bench run`, the capacity search and `bench compare` all go through `run_once`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenline.bench.progress import Progress
from tokenline.bench.prompts import FilePrompts, SyntheticPrompts, load_tokenizer
from tokenline.bench.records import RequestRecord
from tokenline.bench.report import build_results
from tokenline.bench.runner import RunOptions, RunResult, RunState, run_load
from tokenline.bench.server_cpu import ServerCpu
from tokenline.bench.targets import Target, make_target
from tokenline.bench.workload import PlannedRequest, RequestFactory, StreamSpec, open_loop_plan

RESULTS_FORMAT = 1


@dataclass(frozen=True)
class BenchSpec:
    """Everything that decides what a run sends and to whom."""

    target: str
    streams: tuple[StreamSpec, ...]
    seed: int = 0
    duration_s: float | None = 30.0
    num_requests: int | None = None
    model: str = ""  # model name sent with each request ("" = the server's default)
    tokenizer: str | None = None  # tokenizer's model: a name tokenline knows or a folder (None: the default model)
    send_text: bool = False  # send prompt text instead of token ids
    warmup: int = 4  # unrecorded requests before the run
    max_lag_ms: float = 50.0
    drain_s: float = 120.0
    connections: int = 1
    multiplex: bool = False  # tokenline: each connection's streams on one GenerateMany call
    api_key: str | None = None
    openai_priority: bool = False
    max_input_tokens: int | None = None  # prompt files: skip longer prompts

    def __post_init__(self) -> None:
        if not self.streams:
            raise ValueError("a bench run needs at least one stream")
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            raise ValueError(f"stream names must differ: {', '.join(names)}")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("give a duration (--duration-s) or a request count (--num-requests)")

    @property
    def offered_rate(self) -> float:
        return sum(s.arrival.rate for s in self.streams if s.arrival is not None)

    def at_rate(self, rate: float) -> BenchSpec:
        """The same mix of open-loop streams with the total arrival rate scaled to `rate`."""
        total = self.offered_rate
        if total <= 0:
            raise ValueError("scaling the rate needs at least one open-loop stream (rate=...)")
        return replace(self, streams=tuple(s.with_rate(s.arrival.rate * rate / total) if s.arrival else s
                                           for s in self.streams))

    def describe(self) -> dict[str, Any]:
        return {"target": self.target, "seed": self.seed, "duration_s": self.duration_s,
                "num_requests": self.num_requests, "model": self.model, "tokenizer": self.tokenizer,
                "send_text": self.send_text, "streams": [s.describe() for s in self.streams]}


_TOKENIZERS: dict[str | None, Any] = {}


def tokenizer_for(name: str | None) -> Any:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = load_tokenizer(name)
    return _TOKENIZERS[name]


def factories(spec: BenchSpec) -> list[RequestFactory]:
    tokenizer = tokenizer_for(spec.tokenizer)
    sources: dict[str | None, Any] = {}
    out = []
    for index, stream in enumerate(spec.streams):
        if stream.prompts not in sources:
            sources[stream.prompts] = (SyntheticPrompts(tokenizer) if stream.prompts is None else
                                       FilePrompts(stream.prompts, tokenizer, max_input_tokens=spec.max_input_tokens))
        out.append(RequestFactory(stream, index, spec.seed, sources[stream.prompts], send_text=spec.send_text, tokenizer=tokenizer))
    return out


def plan(spec: BenchSpec) -> tuple[list[PlannedRequest], list[RequestFactory]]:
    """(open-loop requests in arrival order, the factories of every stream)."""
    fs = factories(spec)
    open_fs = [f for f in fs if f.stream.open_loop]
    planned = open_loop_plan(open_fs, seed=spec.seed, duration_s=spec.duration_s, num_requests=spec.num_requests) if open_fs else []
    return planned, fs


@dataclass
class Outcome:
    spec: BenchSpec
    run: RunResult
    results: dict[str, Any]


async def warm_up(target: Target, fs: Sequence[RequestFactory], n: int) -> None:
    """A few short unrecorded requests, so connection set-up and first-call costs stay out of the run."""
    for i in range(n):
        request = replace(fs[i % len(fs)].make(10**9 + i, 0.0), max_tokens=4, deadline_s=None, cancel_after=None)
        await target.send(request, RequestRecord("warmup", "warmup", request.traffic_class, 0.0, 0, 4), time.monotonic())


async def run_once(spec: BenchSpec, *, target: Target | None = None, label: str = "", quiet: bool = False,
                   stop_check: Callable[[RunState], str | None] | None = None, server_pid: int | None = None) -> Outcome:
    """Run `spec` against its target (or an already open `target`) and summarize it. `server_pid`: the
    server's frontend process on this machine, whose CPU per output token the results then carry."""
    open_plan, fs = plan(spec)
    closed = [f for f in fs if not f.stream.open_loop]
    own = target is None
    if target is None:
        target = make_target(spec.target, model=spec.model, api_key=spec.api_key,
                             openai_priority=spec.openai_priority, connections=spec.connections,
                             multiplex=spec.multiplex)
        await target.open()
    try:
        if spec.warmup:
            await warm_up(target, fs, spec.warmup)
        options = RunOptions(duration_s=spec.duration_s, num_requests=spec.num_requests, drain_s=spec.drain_s,
                             max_lag_ms=spec.max_lag_ms, progress=None if quiet else Progress(label),
                             stop_check=stop_check)
        cpu = ServerCpu.start(server_pid) if server_pid is not None else None
        result = await run_load(target, open_plan, closed, options)
    finally:
        if own:
            await target.close()
    results = build_results(result.records, result.duration_s, spec.streams)
    results["stopped_early"] = result.stopped
    results["loadgen"] = result.loadgen
    if cpu is not None:
        results["server_cpu"] = cpu.result(sum(r.output_tokens for r in result.records))
    return Outcome(spec, result, results)


def results_document(outcome: Outcome, **extra: Any) -> dict[str, Any]:
    """The JSON file's content: the run's settings, then its results (vLLM-style keys at the top level)."""
    spec = outcome.spec
    return {
        "tokenline_bench": RESULTS_FORMAT,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(outcome.run.started_unix)),
        "backend": "tokenline" if not spec.target.startswith("http") else "openai",
        **spec.describe(),
        "request_rate": spec.offered_rate or math.inf,
        "max_concurrency": sum(s.concurrency or 0 for s in spec.streams) or None,
        "burstiness": next((s.arrival.burstiness for s in spec.streams if s.arrival), None),
        **extra,
        **outcome.results,
    }


def write_outputs(outcome: Outcome, out_dir: Path, *, plots: bool = True, summary: str = "", **extra: Any) -> list[Path]:
    """results.json, requests.jsonl, summary.txt and (with matplotlib) latency_cdf.png and timeline.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "requests.jsonl"]
    written[0].write_text(json.dumps(jsonable(results_document(outcome, **extra)), indent=2) + "\n")
    with written[1].open("w") as f:
        for record in outcome.run.records:
            f.write(json.dumps(jsonable(record.to_json())) + "\n")
    if summary:
        (out_dir / "summary.txt").write_text(summary + "\n")
        written.append(out_dir / "summary.txt")
    if plots:
        from tokenline.bench import plots as p

        written.append(p.latency_cdfs({"run": outcome.run.records}, out_dir / "latency_cdf.png"))
        written.append(p.timeline(outcome.run.records, outcome.run.backlog, out_dir / "timeline.png"))
    return written


def jsonable(value: Any) -> Any:
    """NaN and infinity become null: strict JSON readers reject them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value

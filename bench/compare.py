"""`bench compare`: tokenline against `vllm serve` and against the engine itself, on one machine, in one run.

Servers run one at a time (the machine's cores are shared), each started here
with the same model and engine settings on a free loopback port:

1. engine ceiling: the saturation and concurrency-1 workloads through vLLM in-process, with the
   settings of one tokenline worker (its threads and KV cache)
2. the box's best engine: the same workloads through vLLM in-process using every usable CPU, as one
   engine with that many threads and as that many 1-thread engines side by side; the better counts
3. tokenline: saturation (all requests at once), concurrency 1
4. vllm serve: saturation, concurrency 1, then the mixed interactive + bulk load
5. tokenline: the mixed load

tokenline runs with `tokenline serve`'s defaults (workers, threads and KV sized from the machine)
unless settings are given; vllm serve with its own defaults, given only what it needs to start
here (the same total KV cache as tokenline's workers), unless `vllm_same_settings`.

With `rounds` > 1 the saturation figures are measured that many times, each round with
fresh prompts (no prefix cache helps any round), fresh in-process engines and fresh servers, in
alternating order; the throughput ratios are the median of the rounds' own ratios, with their
range. A 2-core machine shared with the load generator varies by ±5 % from one run to the next,
more than the differences the ratios are read for.

The mixed load offers `mixed_load` × the lower of the two servers' saturation
output throughput, a `interactive_share` of its tokens interactive. Its
interactive SLO, unless given, is derived from the engine's own
concurrency-1 latency (TTFT ≤ max(200 ms, 4×), ITL ≤ max(50 ms, 2.5×)).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenline.bench.arrivals import ArrivalProcess
from tokenline.bench.report import fmt, format_results, table
from tokenline.bench.runner import LoadGeneratorBehind
from tokenline.bench.servers import (
    EngineSettings,
    ServerProcess,
    run_ceiling,
    run_ceiling_engines,
    start_tokenline,
    start_vllm,
)
from tokenline.bench.session import BenchSpec, Outcome, jsonable, plan, run_once, write_outputs
from tokenline.bench.workload import LengthDist, Slo, StreamSpec

STEPS = ("ceiling", "best", "tokenline", "vllm", "mixed")


@dataclass(frozen=True)
class CompareSpec:
    settings: EngineSettings = field(default_factory=EngineSettings)
    requests: int = 64
    input_len: int = 256
    output_len: int = 128
    c1_requests: int = 8
    c1_output_len: int = 64
    mixed_duration_s: float = 30.0
    mixed_load: float = 0.9
    interactive_share: float = 0.3  # of the mixed load's output tokens
    interactive_lengths: tuple[int, int] = (128, 32)  # input, output
    bulk_lengths: tuple[int, int] = (512, 256)
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    seed: int = 0
    rounds: int = 1  # saturation measured this many times over (box's best, tokenline, vllm serve)
    skip: frozenset[str] = frozenset()
    tokenline_engine: str = "vllm"
    vllm_same_settings: bool = False  # True: vllm serve gets tokenline's engine settings, not its own defaults
    vllm_attention_kernel: str = "vllm"  # vllm serve's CPU attention kernel: its own choice, or tokenline's policy ("auto")
    multiplex: bool = False  # tokenline's streams on GenerateMany calls (one message per step for all of them)

    def __post_init__(self) -> None:
        unknown = set(self.skip) - set(STEPS)
        if unknown:
            raise ValueError(f"cannot skip {', '.join(sorted(unknown))}: steps are {', '.join(STEPS)}")
        if not 0 < self.interactive_share < 1:
            raise ValueError("interactive_share must be between 0 and 1")
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")

    def saturation(self, target: str, round_: int = 0) -> BenchSpec:
        """All requests at once. Each round its own prompts (round 0: the seed; the concurrency-1
        run has seed + 1): a server measured again must not find the last round's prompts cached."""
        stream = StreamSpec("saturation", concurrency=self.requests, input_len=LengthDist("fixed", self.input_len),
                            output_len=LengthDist("fixed", self.output_len))
        return self._spec(target, (stream,), num_requests=self.requests, seed=self.seed + 1 + round_ if round_ else None)

    def concurrency1(self, target: str) -> BenchSpec:
        stream = StreamSpec("c1", concurrency=1, input_len=LengthDist("fixed", self.input_len),
                            output_len=LengthDist("fixed", self.c1_output_len))
        # Its own seed: the saturation run's first prompts would otherwise come back, and every
        # engine here caches prompt prefixes, so TTFT would be measured on a cache hit.
        return self._spec(target, (stream,), num_requests=self.c1_requests, seed=self.seed + 1)

    def mixed(self, target: str, output_tok_s: float, slo: Slo) -> BenchSpec:
        (i_in, i_out), (b_in, b_out) = self.interactive_lengths, self.bulk_lengths
        offered = self.mixed_load * output_tok_s
        interactive = StreamSpec("interactive", "interactive", ArrivalProcess(self.interactive_share * offered / i_out),
                                 input_len=LengthDist("fixed", i_in), output_len=LengthDist("fixed", i_out), slo=slo)
        bulk = StreamSpec("bulk", "bulk", ArrivalProcess((1 - self.interactive_share) * offered / b_out),
                          input_len=LengthDist("fixed", b_in), output_len=LengthDist("fixed", b_out))
        return self._spec(target, (interactive, bulk), duration_s=self.mixed_duration_s)

    def _spec(self, target: str, streams: tuple[StreamSpec, ...], *, num_requests: int | None = None,
              duration_s: float | None = None, seed: int | None = None) -> BenchSpec:
        return BenchSpec(target=target, streams=streams, seed=self.seed if seed is None else seed, num_requests=num_requests,
                         duration_s=duration_s, tokenizer=self.settings.model, openai_priority=True,
                         max_lag_ms=1000.0, multiplex=self.multiplex and not target.startswith(("http://", "https://")))


def ceiling_requests(spec: CompareSpec, round_: int = 0) -> dict[str, list[dict]]:
    """The exact requests of the saturation and concurrency-1 runs, for the engine-ceiling process;
    after the first round only that round's saturation run."""
    out = {}
    runs = [("throughput", spec.saturation("", round_))] + ([("sequential", spec.concurrency1(""))] if round_ == 0 else [])
    for name, bench in runs:
        (factory,) = plan(bench)[1]
        out[name] = [{"prompt_ids": list(r.prompt_ids), "max_tokens": r.max_tokens, "ignore_eos": r.ignore_eos}
                     for r in (factory.make(i, None) for i in range(bench.num_requests or 0))]
    return out


async def compare(spec: CompareSpec, out_dir: Path, *, log=print) -> dict[str, Any]:  # noqa: ANN001
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Outcome] = {}
    ceiling: dict[str, Any] | None = None
    slo: Slo | None = None

    failed: dict[str, str] = {}

    async def measure(server: ServerProcess, name: str, bench: BenchSpec) -> Outcome | None:
        log(f"-- {server.kind}: {name.replace('-', ' ')}")
        try:
            outcome = await run_once(bench, label=f"{server.kind} {name}", server_pid=server.process.pid)
        except LoadGeneratorBehind as e:  # this run cannot be trusted; the others still can
            failed[f"{server.kind}/{name}"] = str(e)
            log(f"   not measured: {e}")
            return None
        runs[f"{server.kind}/{name}"] = outcome
        summary = format_results(outcome.results, title=f"{server.kind} · {name}")
        write_outputs(outcome, out_dir / server.kind / name, summary=summary)
        log(summary)
        return outcome

    plan = spec.settings.plan()
    shape = f"{plan.describe()}, {'compiled' if spec.settings.compile else 'eager'}"
    log(f"-- this machine, as tokenline serve sizes it: {shape}")
    requests_path = out_dir / "ceiling-requests.json"
    requests_path.write_text(json.dumps(ceiling_requests(spec)))
    if "ceiling" not in spec.skip:
        log(f"-- engine ceiling (vLLM in-process, one tokenline worker's settings: {plan.threads} thread(s))")
        ceiling = run_ceiling(spec.settings, requests_path, out_dir / "ceiling.json", out_dir / "logs" / "ceiling.log",
                              threads=plan.threads)
        log(f"   attention kernel {ceiling.get('attention_kernel', '?')}; {ceiling['throughput']['output_throughput']:.0f} output tok/s; concurrency 1: ttft p50 "
            f"{ceiling['sequential']['median_ttft_ms']:.1f} ms, itl p50 {ceiling['sequential']['median_itl_ms']:.2f} ms")
    best: dict[str, Any] | None = None
    if "best" not in spec.skip:
        best = box_best(spec, plan, requests_path, out_dir, log)

    servers = [k for k in ("tokenline", "vllm") if k not in spec.skip]
    for kind in servers:
        with _start(kind, spec, out_dir) as server:
            await measure(server, "saturation", spec.saturation(server.address))
            await measure(server, "c1", spec.concurrency1(server.address))
            saturated = [runs[f"{k}/saturation"].results["output_throughput"] for k in servers if f"{k}/saturation" in runs]
            if kind == servers[-1] and "mixed" not in spec.skip and saturated:
                slo = mixed_slo(spec, ceiling, runs)
                mixed = spec.mixed(server.address, min(saturated), slo)
                await measure(server, "mixed", mixed)
    if slo is not None and len(servers) == 2:
        with _start(servers[0], spec, out_dir) as server:
            await measure(server, "mixed", replace(mixed, target=server.address))

    rounds = [{"box_best": best["output_throughput"] if best else None, "best_config": best["config"] if best else None,
               **{kind: _saturation_figures(runs.get(f"{kind}/saturation")) for kind in servers}}]
    for round_ in range(1, spec.rounds):
        folder = out_dir / f"round-{round_}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "ceiling-requests.json"
        path.write_text(json.dumps(ceiling_requests(spec, round_)))
        figures: dict[str, Any] = {"box_best": None, "best_config": None}
        steps = (["best"] if best is not None else []) + servers
        log(f"-- round {round_ + 1} of {spec.rounds}")
        for step in reversed(steps) if round_ % 2 else steps:  # alternating, so that a drifting machine favours no one
            if step == "best":
                b = box_best(spec, plan, path, folder, log)
                figures.update(box_best=b["output_throughput"], best_config=b["config"])
                continue
            with _start(step, spec, folder) as server:
                outcome = await measure(server, f"saturation-round-{round_ + 1}", spec.saturation(server.address, round_))
                figures[step] = _saturation_figures(outcome)
        rounds.append(figures)

    report = {"settings": spec.settings.__dict__, "plan": shape, "ceiling": ceiling, "box_best": best,
              "mixed_slo": slo.as_dict() if slo else None,
              "runs": {name: outcome.results for name, outcome in runs.items()}, "not_measured": failed,
              "rounds": rounds, "ratios": ratios(ceiling, runs, best, rounds)}
    (out_dir / "compare.json").write_text(json.dumps(jsonable(report), indent=2) + "\n")
    text = format_comparison(report)
    (out_dir / "compare.txt").write_text(text + "\n")
    _plots(runs, out_dir)
    log(text)
    return report


def box_best(spec: CompareSpec, plan: Any, requests_path: Path, out_dir: Path, log: Any) -> dict[str, Any]:
    """The box's best in-process engine: all usable CPUs as one engine's threads, or as 1-thread engines side by side."""
    cpus = plan.machine.cpus
    total_kv_mb = plan.kv_cache_bytes * plan.workers // (1 << 20)
    log(f"-- the box's best engine: 1 engine × {cpus} threads (KV {total_kv_mb} MiB)")
    one = run_ceiling(spec.settings, requests_path, out_dir / f"ceiling-1x{cpus}.json",
                      out_dir / "logs" / f"ceiling-1x{cpus}.log", threads=cpus, kv_cache_mb=total_kv_mb)
    configs = {f"1 engine × {cpus} threads": one["throughput"]["output_throughput"]}
    log(f"   {configs[f'1 engine × {cpus} threads']:.0f} output tok/s")
    if cpus > 1:
        log(f"-- the box's best engine: {cpus} engines × 1 thread, side by side")
        many = run_ceiling_engines(spec.settings, requests_path, out_dir, cpus, kv_cache_mb=max(total_kv_mb // cpus, 64))
        configs[f"{cpus} engines × 1 thread"] = many["output_throughput"]
        log(f"   {many['output_throughput']:.0f} output tok/s")
    name = max(configs, key=configs.get)
    return {"config": name, "output_throughput": configs[name], "configs": configs, "sequential_all_threads": one.get("sequential"),
            "attention_kernel": one.get("attention_kernel", "")}


def _start(kind: str, spec: CompareSpec, out_dir: Path) -> ServerProcess:
    log_path = out_dir / "logs" / f"{kind}.log"
    if kind == "tokenline":
        return start_tokenline(spec.settings, log_path, engine=spec.tokenline_engine)
    plan = spec.settings.plan()
    return start_vllm(spec.settings, log_path, own_defaults=not spec.vllm_same_settings,
                      kv_cache_mb=None if spec.vllm_same_settings else plan.kv_cache_bytes * plan.workers // (1 << 20),
                      attention_kernel=spec.vllm_attention_kernel)


def mixed_slo(spec: CompareSpec, ceiling: dict | None, runs: dict[str, Outcome]) -> Slo:
    if ceiling is not None:
        ttft, itl = ceiling["sequential"]["median_ttft_ms"], ceiling["sequential"]["median_itl_ms"]
    else:  # no engine figures: the better server at concurrency 1
        c1 = [o.results for name, o in runs.items() if name.endswith("/c1")]
        ttft, itl = min(r["median_ttft_ms"] for r in c1), min(r["median_itl_ms"] for r in c1)
    return Slo(ttft_ms=spec.slo_ttft_ms or max(200.0, 4 * ttft), itl_ms=spec.slo_itl_ms or max(50.0, 2.5 * itl))


def _saturation_figures(outcome: Outcome | None) -> dict[str, float] | None:
    if outcome is None:
        return None
    return {key: outcome.results[key] for key in ("output_throughput", "p99_ttft_ms")}


def round_ratios(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's own ratios, and their median and range over the rounds that measured both sides:
    served throughput over the box's best engine (per server), and tokenline over vllm serve
    (throughput, TTFT p99)."""
    def figure(r: dict[str, Any], side: str, key: str) -> float | None:
        return r.get("box_best") if side == "box_best" else (r.get(side) or {}).get(key)

    def per_round(num: str, den: str, key: str = "output_throughput") -> list[float]:
        pairs = [(figure(r, num, key), figure(r, den, key)) for r in rounds]
        return [a / b for a, b in pairs if a and b]

    out: dict[str, Any] = {}
    for name, values in (("tokenline_throughput_over_box_best", per_round("tokenline", "box_best")),
                         ("vllm_throughput_over_box_best", per_round("vllm", "box_best")),
                         ("tokenline_over_vllm_throughput", per_round("tokenline", "vllm")),
                         ("tokenline_over_vllm_p99_ttft", per_round("tokenline", "vllm", "p99_ttft_ms"))):
        if values:
            out[name] = {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}
    return out


def ratios(ceiling: dict | None, runs: dict[str, Outcome], best: dict | None = None,
           rounds: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    def get(run: str, key: str, cls: str | None = None) -> float:
        outcome = runs.get(run)
        if outcome is None:
            return math.nan
        results = outcome.results if cls is None else outcome.results["classes"].get(cls, {})
        return results.get(key, math.nan)

    out: dict[str, Any] = {}
    for kind in ("tokenline", "vllm"):
        if not any(run.startswith(f"{kind}/") for run in runs):
            continue  # skipped (or failed before any run): no ratios to print as "-"
        if ceiling is not None:
            out[f"{kind}_throughput_over_ceiling"] = get(f"{kind}/saturation", "output_throughput") / ceiling["throughput"]["output_throughput"]
            out[f"{kind}_ttft_overhead_ms_c1"] = get(f"{kind}/c1", "median_ttft_ms") - ceiling["sequential"]["median_ttft_ms"]
            out[f"{kind}_itl_overhead_ms_c1"] = get(f"{kind}/c1", "median_itl_ms") - ceiling["sequential"]["median_itl_ms"]
        if best is not None:
            out[f"{kind}_throughput_over_box_best"] = get(f"{kind}/saturation", "output_throughput") / best["output_throughput"]
        out[f"{kind}_interactive_goodput_mixed"] = get(f"{kind}/mixed", "goodput", "interactive")
    out["tokenline_over_vllm"] = {
        run: {key: get(f"tokenline/{run}", key) / get(f"vllm/{run}", key)
              for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")}
        for run in ("c1", "saturation", "mixed")
    }
    if rounds and len(rounds) > 1:  # several rounds: their medians stand for the throughput ratios
        out["rounds"] = round_ratios(rounds)
        for kind in ("tokenline", "vllm"):
            if f"{kind}_throughput_over_box_best" in out["rounds"]:
                out[f"{kind}_throughput_over_box_best"] = out["rounds"][f"{kind}_throughput_over_box_best"]["median"]
        for name, key in (("tokenline_over_vllm_throughput", "output_throughput"), ("tokenline_over_vllm_p99_ttft", "p99_ttft_ms")):
            if name in out["rounds"]:
                out["tokenline_over_vllm"]["saturation"][key] = out["rounds"][name]["median"]
    return out


def format_comparison(report: dict[str, Any]) -> str:
    runs, ceiling, r = report["runs"], report["ceiling"] or {}, report["ratios"]

    rounds = report.get("rounds") or []
    several = len(rounds) > 1

    def value(run: str, key: str, spec: str = ".1f", cls: str | None = None) -> str:
        kind, _, name = run.partition("/")
        if several and name == "saturation" and key in ("output_throughput", "p99_ttft_ms"):
            measured = [r[kind][key] for r in rounds if r.get(kind)]
            return fmt(statistics.median(measured) if measured else None, spec)
        results = runs.get(run)
        if results is not None and cls is not None:
            results = results["classes"].get(cls)
        return fmt(results.get(key) if results else None, spec)

    rows = []
    for run, key, label, spec in (("saturation", "output_throughput", "saturation: output tok/s", ",.0f"),
                                  ("saturation", "median_ttft_ms", "saturation: ttft p50 ms", ".1f"),
                                  ("saturation", "p99_ttft_ms", "saturation: ttft p99 ms", ".1f"),
                                  ("saturation", "median_itl_ms", "saturation: itl p50 ms", ".2f"),
                                  ("saturation", "p99_itl_ms", "saturation: itl p99 ms", ".2f"),
                                  ("c1", "median_ttft_ms", "concurrency 1: ttft p50 ms", ".1f"),
                                  ("c1", "p99_ttft_ms", "concurrency 1: ttft p99 ms", ".1f"),
                                  ("c1", "median_itl_ms", "concurrency 1: itl p50 ms", ".2f"),
                                  ("c1", "p99_itl_ms", "concurrency 1: itl p99 ms", ".2f")):
        engine = {"output_throughput": ceiling.get("throughput", {}).get("output_throughput")}.get(key) if run == "saturation" \
            else ceiling.get("sequential", {}).get(key)
        ratio = r["tokenline_over_vllm"].get(run, {}).get(key)
        rows.append((label, value(f"tokenline/{run}", key, spec), value(f"vllm/{run}", key, spec), fmt(engine, spec), fmt(ratio, ".2f")))
    rows.append(("mixed: interactive goodput", value("tokenline/mixed", "goodput", ".3f", "interactive"),
                 value("vllm/mixed", "goodput", ".3f", "interactive"), "-", "-"))
    rows.append(("mixed: interactive ttft p99 ms", value("tokenline/mixed", "p99_ttft_ms", ".1f", "interactive"),
                 value("vllm/mixed", "p99_ttft_ms", ".1f", "interactive"), "-", "-"))
    rows.append(("mixed: bulk output tok/s", value("tokenline/mixed", "output_throughput", ",.0f", "bulk"),
                 value("vllm/mixed", "output_throughput", ",.0f", "bulk"), "-", "-"))
    cpu = [(runs[f"{k}/saturation"].get("server_cpu") or {}).get("us_per_output_token") if f"{k}/saturation" in runs else None
           for k in ("tokenline", "vllm")]
    rows.append(("saturation: frontend CPU µs/token", fmt(cpu[0], ".1f"), fmt(cpu[1], ".1f"), "-",
                 fmt(cpu[0] / cpu[1] if cpu[0] and cpu[1] else None, ".2f")))
    for run in ("saturation", "c1", "mixed"):
        lags = [runs[f"{k}/{run}"]["send_lag_ms"]["p99"] if f"{k}/{run}" in runs else None for k in ("tokenline", "vllm")]
        rows.append((f"{run}: bench send lag p99 ms", fmt(lags[0], ".1f"), fmt(lags[1], ".1f"), "-", "-"))
    lines = [table(("", "tokenline", "vllm serve", "engine", "tokenline ÷ vllm"), rows), ""]
    for name, why in (report.get("not_measured") or {}).items():
        lines.append(f"{name}: not measured: {why}")
    if report.get("plan"):
        lines.append(f"tokenline's plan on this machine: {report['plan']}")
    best = report.get("box_best")
    if best:
        measured = "; ".join(f"{k}: {v:,.0f}" for k, v in best["configs"].items())
        kernel = f", attention kernel {best['attention_kernel']}" if best.get("attention_kernel") else ""
        lines.append(f"the box's best engine: {best['config']}, {best['output_throughput']:,.0f} output tok/s ({measured}){kernel}")
        for kind, name in (("tokenline", "tokenline"), ("vllm", "vllm serve")):
            if f"{kind}_throughput_over_box_best" in r:
                spread = r.get("rounds", {}).get(f"{kind}_throughput_over_box_best")
                of = f" (median of {len(spread['rounds'])} rounds, {spread['min']:.2f}–{spread['max']:.2f})" if spread else ""
                lines.append(f"{name}: served throughput ÷ the box's best engine {fmt(r[f'{kind}_throughput_over_box_best'], '.2f')}{of}")
    if several:
        lines.append(f"saturation measured in {len(rounds)} rounds (fresh prompts, engines and servers each); the table's "
                     "saturation throughput and ttft p99 are the rounds' medians, their ratios the medians of each round's ratio:")
        for i, rnd in enumerate(rounds, 1):
            parts = [f"box's best {fmt(rnd.get('box_best'), ',.0f')}" + (f" ({rnd['best_config']})" if rnd.get("best_config") else "")]
            for kind, name in (("tokenline", "tokenline"), ("vllm", "vllm serve")):
                if kind in rnd:
                    fig = rnd[kind] or {}
                    ratio = fig.get("output_throughput") / rnd["box_best"] if fig.get("output_throughput") and rnd.get("box_best") else None
                    parts.append(f"{name} {fmt(fig.get('output_throughput'), ',.0f')}"
                                 + (f" ({ratio:.2f} of the best)" if ratio else "") + f", ttft p99 {fmt(fig.get('p99_ttft_ms'), ',.0f')} ms")
            lines.append(f"  round {i}: " + "; ".join(parts))
    for kind, name in (("tokenline", "tokenline"), ("vllm", "vllm serve")):
        if f"{kind}_throughput_over_ceiling" in r:
            lines.append(f"{name}: served throughput ÷ engine with one worker's settings {fmt(r[f'{kind}_throughput_over_ceiling'], '.2f')}; "
                         f"over the engine at concurrency 1: ttft +{fmt(r[f'{kind}_ttft_overhead_ms_c1'], '.1f')} ms, "
                         f"itl +{fmt(r[f'{kind}_itl_overhead_ms_c1'], '.2f')} ms")
    if report.get("mixed_slo"):
        slo = ", ".join(f"{k.removesuffix('_ms')} ≤ {v:.0f} ms" for k, v in report["mixed_slo"].items())
        lines.append(f"mixed load: interactive SLO {slo}; goodput = requests meeting it ÷ requests offered")
    return "\n".join(lines)


def _plots(runs: dict[str, Outcome], out_dir: Path) -> None:
    from tokenline.bench import plots

    for name in ("saturation", "c1", "mixed"):
        pair = {kind: runs[f"{kind}/{name}"].run.records for kind in ("tokenline", "vllm") if f"{kind}/{name}" in runs}
        if pair:
            plots.latency_cdfs(pair, out_dir / f"latency_cdf_{name}.png")

"""`bench mixed`: interactive streams inside a bulk flood: do they keep their targets, and what does bulk keep?

tokenline runs first with its targets off (`tokenline serve`'s are on by default), for the references:
1. bulk alone: a closed loop of `bulk_concurrency` streams (bulk-only throughput, and the step-period
   curve from its step log);
2. interactive alone: one stream at a time (its single-sequence ITL, which sets the targets).
Then, for each ITL target T (`itl_target_steps` × that ITL), a fresh tokenline with `--interactive-itl-target-ms T`
and `--interactive-ttft-target-ms`:
3. bulk alone again (what the targets cost bulk when no interactive stream comes: ÷ run 1);
4. the mix: the same bulk loop plus Poisson interactive arrivals.
Then, unless skipped, tokenline with its own defaults (no target flag: the targets `tokenline serve` sets
itself) runs 3 and 4, scored at T = its default multiple (server/flags.py ITL_TARGET_STEPS) of that ITL, and
again at the ITL target it named as it began serving (that multiple of the single step its worker timed alone).
`vllm serve` runs 1, 2 and 4 once; its mix is scored against each T (in its own single-sequence ITLs).
Reported per server and T: interactive attainment of TTFT ≤ target, of ITL ≤ T, of both; bulk in the mix over
bulk alone; and, for tokenline, the most bulk throughput any schedule could give under T: from the step-time
curve of run 1 (step = a + b·batch, least squares on the step periods in tokenline's step log) and the share
of time each number of interactive streams ran in run 4, bulk can decode at most
k(n) = ⌊(T − a − b·n)/(b + c·r)⌋ sequences per step while n interactive streams run, where each such step
also computes the prompts replacing the bulk sequences that end (c seconds a prompt token, from run 1's
prompt steps; r bulk prompt tokens per output token), and its whole batch while none do. The plot shows
per-step batch size and step time over each mixed run with interactive arrivals marked.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenline.bench.arrivals import ArrivalProcess
from tokenline.bench.records import OK
from tokenline.bench.servers import EngineSettings, ServerProcess, start_tokenline, start_vllm
from tokenline.bench.session import BenchSpec, Outcome, jsonable, run_once, write_outputs
from tokenline.bench.report import format_results
from tokenline.bench.workload import LengthDist, Slo, StreamSpec


@dataclass(frozen=True)
class MixedSpec:
    settings: EngineSettings = EngineSettings(max_seqs=48)
    bulk_concurrency: int = 48
    bulk_lengths: tuple[int, int] = (256, 256)  # input, output
    interactive_rate: float = 1.0  # arrivals per second
    interactive_lengths: tuple[int, int] = (64, 64)
    duration_s: float = 60.0
    itl_target_steps: tuple[float, ...] = (2.0, 2.5, 3.0)  # ITL targets, in single-sequence ITLs
    # ITL targets in ms, instead of itl_target_steps: the same T for every run and server, so that two
    # configurations (or two days) compare at one target however their interactive-alone references came out.
    itl_targets_ms: tuple[float, ...] = ()
    ttft_target_ms: float = 500.0
    servers: tuple[str, ...] = ("tokenline", "vllm")
    defaults_run: bool = True  # also tokenline with no target flag, scored at its default T
    tokenline_engine: str = "vllm"
    seed: int = 0

    def targets(self, solo_itl_ms: float) -> list[tuple[float, float]]:
        """(T in single-sequence ITLs, T in ms) for each run: from itl_targets_ms where given, else from itl_target_steps."""
        if self.itl_targets_ms:
            return [(ms / solo_itl_ms if solo_itl_ms else math.nan, ms) for ms in self.itl_targets_ms]
        return [(steps, steps * solo_itl_ms) for steps in self.itl_target_steps]

    def bulk(self) -> StreamSpec:
        return StreamSpec("bulk", "bulk", concurrency=self.bulk_concurrency,
                          input_len=LengthDist("fixed", self.bulk_lengths[0]), output_len=LengthDist("fixed", self.bulk_lengths[1]))

    def interactive(self, slo: Slo) -> StreamSpec:
        return StreamSpec("interactive", "interactive", ArrivalProcess(self.interactive_rate),
                          input_len=LengthDist("fixed", self.interactive_lengths[0]),
                          output_len=LengthDist("fixed", self.interactive_lengths[1]), slo=slo)

    def bench(self, target: str, *streams: StreamSpec, num_requests: int | None = None) -> BenchSpec:
        return BenchSpec(target=target, streams=streams, seed=self.seed, tokenizer=self.settings.model,
                         duration_s=None if num_requests else self.duration_s, num_requests=num_requests,
                         openai_priority=True, max_lag_ms=1000.0, warmup=2)


async def mixed(spec: MixedSpec, out_dir: Path, *, log=print) -> dict[str, Any]:  # noqa: ANN001
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"spec": jsonable({**spec.__dict__, "settings": spec.settings.__dict__}), "servers": {}, "runs": []}

    async def run(label: str, out: Path, bench: BenchSpec) -> Outcome:
        log(f"-- {label}")
        outcome = await run_once(bench, label=label)
        write_outputs(outcome, out, summary=format_results(outcome.results, title=label))
        return outcome

    async def references(kind: str, server: ServerProcess, out: Path) -> tuple[Outcome, float]:
        bulk_alone = await run(f"{kind} · bulk alone", out / "bulk-alone", spec.bench(server.address, spec.bulk()))
        solo = await run(f"{kind} · interactive alone", out / "interactive-alone",
                         spec.bench(server.address, replace(spec.interactive(Slo()), arrival=None, concurrency=1), num_requests=5))
        return bulk_alone, statistics.median(r.tpot * 1000 for r in solo.run.records if r.status == OK and r.tpot)

    if "tokenline" in spec.servers:
        base = out_dir / "tokenline" / "no-target"
        step_log = _fresh(base / "steps.jsonl")
        with _start_tokenline(spec, out_dir, "no-target", step_log) as server:
            bulk_alone, solo_itl_ms = await references("tokenline, no target", server, base)
        alone_tok_s = steady_tok_s(bulk_alone, "bulk", spec.duration_s)
        reference_steps = _read_steps(step_log)
        curve = fit_step_curve(reference_steps)
        prompt_cost_s = fit_prompt_cost(reference_steps, curve)
        report["servers"]["tokenline"] = {"solo_itl_ms": solo_itl_ms, "bulk_alone_tok_s": alone_tok_s,
                                          "step_curve_ms": {"a": curve[0] * 1000, "b": curve[1] * 1000,
                                                            "c_per_prompt_token": prompt_cost_s * 1000}}
        runs = [(steps, itl_ms, f"itl-{itl_ms:g}ms" if spec.itl_targets_ms else f"itl-{steps:g}x", True)
                for steps, itl_ms in spec.targets(solo_itl_ms)]
        if spec.defaults_run:
            from tokenline.server.flags import ITL_TARGET_STEPS

            runs.append((ITL_TARGET_STEPS, ITL_TARGET_STEPS * solo_itl_ms, "defaults", False))
        for steps, itl_ms, name, flagged in runs:
            slo = Slo(ttft_ms=spec.ttft_target_ms, itl_ms=itl_ms)
            out = out_dir / "tokenline" / name
            step_log = _fresh(out / "steps.jsonl")
            what = f"ITL target {slo.itl_ms:.1f} ms" if flagged else "its default targets"
            with _start_tokenline(spec, out_dir, name, step_log, slo if flagged else "defaults") as server:
                own_ms = None if flagged else named_itl_target_ms(server.log_path.read_text(errors="replace"))
                unused = await run(f"tokenline, {what} · bulk alone", out / "bulk-alone", spec.bench(server.address, spec.bulk()))
                mix_start = _log_len(step_log)
                mix = await run(f"tokenline, {what} · mixed", out / "mixed",
                                spec.bench(server.address, spec.bulk(), spec.interactive(slo)))
            result = _scored("tokenline" if flagged else "tokenline (defaults)", steps, slo, mix, alone_tok_s, spec.duration_s)
            if own_ms is not None:  # the defaults also against the target the server named: what it promised itself
                own = attainment(mix, Slo(ttft_ms=spec.ttft_target_ms, itl_ms=own_ms))
                result.update(own_itl_target_ms=own_ms, **{f"{k}_own": own[k] for k in ("attain_ttft", "attain_itl", "attain_both")})
            result["bulk_alone_targeted_tok_s"] = steady_tok_s(unused, "bulk", spec.duration_s)
            result["unused_target_cost"] = result["bulk_alone_targeted_tok_s"] / alone_tok_s
            mixed_steps = _read_steps(step_log)[mix_start:]
            t0 = mix.run.started_unix
            bound = bulk_bound(curve, [x for x in mixed_steps if x.get("unix", t0) < t0 + spec.duration_s],
                               spec.bulk_concurrency, slo.itl_ms / 1000, t0 + spec.duration_s / 6, alone_tok_s,
                               prompt_cost_s, spec.bulk_lengths[0] / spec.bulk_lengths[1])
            result.update(bound)
            if bound.get("bound_tok_s"):
                result["bulk_mixed_over_bound"] = result["bulk_mixed_tok_s"] / bound["bound_tok_s"]
            if mixed_steps:
                _plot(mixed_steps, mix, out / "steps.png", slo)
            report["runs"].append(result)

    if "vllm" in spec.servers:
        out = out_dir / "vllm"
        with start_vllm(spec.settings, out_dir / "logs" / "vllm.log") as server:
            bulk_alone, solo_itl_ms = await references("vllm serve", server, out)
            slo = Slo(ttft_ms=spec.ttft_target_ms, itl_ms=spec.targets(solo_itl_ms)[0][1])
            mix = await run("vllm serve · mixed", out / "mixed", spec.bench(server.address, spec.bulk(), spec.interactive(slo)))
        alone_tok_s = steady_tok_s(bulk_alone, "bulk", spec.duration_s)
        report["servers"]["vllm"] = {"solo_itl_ms": solo_itl_ms, "bulk_alone_tok_s": alone_tok_s}
        for steps, itl_ms in spec.targets(solo_itl_ms):
            report["runs"].append(_scored("vllm", steps, Slo(ttft_ms=spec.ttft_target_ms, itl_ms=itl_ms),
                                          mix, alone_tok_s, spec.duration_s))

    text = format_mixed(report)
    (out_dir / "mixed.json").write_text(json.dumps(jsonable(report), indent=2) + "\n")
    (out_dir / "mixed.txt").write_text(text + "\n")
    log(text)
    return report


def steady_tok_s(outcome: Outcome, cls: str, duration_s: float) -> float:
    """Output tokens per second of class `cls` while its closed loop ran whole: from a sixth of the
    run (the first wave of prompts is in) to its end, before the drain, whose ever fewer streams
    would make the figure depend on how the last requests happen to end."""
    start = duration_s / 6
    tokens = sum(n for r in outcome.run.records if r.traffic_class == cls
                 for t, n in zip(r.chunk_times, r.chunk_tokens) if start <= t < duration_s)
    return tokens / (duration_s - start)


def _scored(kind: str, steps: float, slo: Slo, mix: Outcome, bulk_alone_tok_s: float, duration_s: float) -> dict[str, Any]:
    bulk = steady_tok_s(mix, "bulk", duration_s)
    return {"server": kind, "itl_target_steps": steps, "slo": slo.as_dict(), "bulk_mixed_tok_s": bulk,
            "bulk_mixed_over_alone": bulk / bulk_alone_tok_s if bulk_alone_tok_s else None, **attainment(mix, slo)}


def named_itl_target_ms(server_log: str) -> float | None:
    """The ITL target a tokenline with no target flag named as it began serving (server/app.py), in ms; None if none.
    Where its workers timed different single steps it names a range, each worker keeping its own: the upper end."""
    match = re.search(r"tokenline: serving on .*interactive ITL target ([\d.]+)(?:-([\d.]+))? ms", server_log)
    return float(match.group(2) or match.group(1)) if match else None


def attainment(outcome: Outcome, slo: Slo) -> dict[str, Any]:
    chats = [r for r in outcome.run.records if r.traffic_class == "interactive"]
    ok_ttft = [r.status == OK and r.ttft is not None and r.ttft * 1000 <= slo.ttft_ms for r in chats]
    ok_itl = [r.status == OK and r.tpot is not None and r.tpot * 1000 <= slo.itl_ms for r in chats]
    n = max(len(chats), 1)
    itls = sorted(r.tpot * 1000 for r in chats if r.tpot)
    return {"interactive_requests": len(chats), "attain_ttft": sum(ok_ttft) / n, "attain_itl": sum(ok_itl) / n,
            "attain_both": sum(a and b for a, b in zip(ok_ttft, ok_itl)) / n,
            "interactive_itl_p50_ms": _pct(itls, 50), "interactive_itl_p99_ms": _pct(itls, 99)}


def fit_step_curve(steps: list[dict]) -> tuple[float, float]:
    """(a, b) seconds of step period = a + b·batch, least squares over back-to-back decode steps.

    The period (report to report, as the frontend received them) is what a stream sees between
    its tokens: the engine step plus the worker loop, the pipe and the frontend's share of the cores.
    """
    pts = [(s["batch"], s["unix"] - prev["unix"]) for prev, s in zip(steps, steps[1:])
           if s["batch"] and prev["batch"] and not s["prefill"] and s["unix"] - prev["unix"] < 4 * s["step_ms"] / 1000 + 0.05]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        y = statistics.median(v for _, v in pts) if pts else math.nan
        return y, 0.0
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - b * mx, max(b, 0.0)


def fit_prompt_cost(steps: list[dict], curve: tuple[float, float]) -> float:
    """Seconds per prompt token: the median, over steps that computed 64 prompt tokens or more, of what
    their period took beyond the decode line a + b·batch, per prompt token (0 without such steps)."""
    a, b = curve
    costs = [(s["unix"] - prev["unix"] - a - b * s["batch"]) / s["prefill"] for prev, s in zip(steps, steps[1:])
             if s.get("prefill", 0) >= 64 and s["unix"] - prev["unix"] < 4 * s["step_ms"] / 1000 + 0.05]
    return max(statistics.median(costs), 0.0) if costs else 0.0


def bulk_bound(curve: tuple[float, float], steps: list[dict], bulk: int, target_s: float, since_unix: float,
               bulk_alone_tok_s: float, prompt_cost_s: float = 0.0, prompt_per_output: float = 0.0) -> dict[str, Any]:
    """The most bulk tokens/s any schedule could give under the ITL target, weighted by time with n interactive.

    With no interactive stream running, the bound is bulk's measured throughput alone; with n running,
    k(n) bulk sequences at most, in steps that also compute the prompts replacing the bulk sequences
    that end (`prompt_per_output` prompt tokens a bulk token, `prompt_cost_s` each): a step of
    a + b·(n + k) + c·r·k seconds, no longer than the target. (Leaving the prompts out, as this bound
    first did, calls a schedule possible that would stop bulk once its prefilled sequences end.)
    """
    a, b = curve
    per_bulk = b + prompt_cost_s * prompt_per_output
    steps = [s for s in steps if s.get("unix", since_unix) >= since_unix]
    if not steps or b <= 0:
        return {}
    time_with: dict[int, float] = {}
    for s in steps:
        time_with[s["interactive"]] = time_with.get(s["interactive"], 0.0) + s["step_ms"] / 1000
    total = sum(time_with.values())

    def rate(n: int) -> float:
        if n == 0:
            return bulk_alone_tok_s
        k = max(min(math.floor((target_s - a - b * n) / per_bulk + 1e-9), bulk), 0)
        return min(k / (a + b * n + per_bulk * k), bulk_alone_tok_s) if k else 0.0

    bound = sum(t / total * rate(n) for n, t in time_with.items())
    return {"bound_tok_s": bound, "share_of_time_by_interactive": {n: t / total for n, t in sorted(time_with.items())}}


def format_mixed(report: dict[str, Any]) -> str:
    from tokenline.bench.report import fmt, table

    servers = report["servers"]
    lines = []
    refs = [(k, v) for k, v in servers.items()]
    if refs:
        lines.append(table(("no target", *(("vllm serve" if k == "vllm" else k) for k, _ in refs)),
                           [("interactive alone: ITL p50 ms", *(fmt(v.get("solo_itl_ms"), ".1f") for _, v in refs)),
                            ("bulk alone: output tok/s", *(fmt(v.get("bulk_alone_tok_s"), ",.0f") for _, v in refs))]))
    rows = []
    for r in report["runs"]:
        rows.append(("vllm serve" if r["server"] == "vllm" else r["server"],
                     f"{r['itl_target_steps']:g}× = {r['slo'].get('itl_ms', math.nan):.1f} ms",
                     fmt(r.get("attain_ttft"), ".3f"), fmt(r.get("attain_itl"), ".3f"), fmt(r.get("attain_both"), ".3f"),
                     f"{fmt(r.get('interactive_itl_p50_ms'), '.1f')} / {fmt(r.get('interactive_itl_p99_ms'), '.1f')}",
                     fmt(r.get("bulk_mixed_tok_s"), ",.0f"), fmt(r.get("bulk_mixed_over_alone"), ".2f"),
                     fmt(r.get("bound_tok_s"), ",.0f"), fmt(r.get("bulk_mixed_over_bound"), ".2f"),
                     fmt(r.get("unused_target_cost"), ".2f")))
        if r.get("own_itl_target_ms") is not None:  # the defaults run, scored at the target the server named too
            rows.append((f"{r['server']}, at its own T", f"named {r['own_itl_target_ms']:.1f} ms",
                         fmt(r.get("attain_ttft_own"), ".3f"), fmt(r.get("attain_itl_own"), ".3f"),
                         fmt(r.get("attain_both_own"), ".3f"), *("",) * 6))
    if rows:
        ttft = report["spec"]["ttft_target_ms"]
        lines.append(table(("server", "ITL target T", f"TTFT ≤ {ttft:g} ms", "ITL ≤ T", "both", "interactive ITL p50 / p99 ms",
                            "bulk tok/s in the mix", "÷ bulk alone", "bound under T", "÷ bound",
                            "bulk alone with targets ÷ without"), rows))
        lines.append("attainment: share of interactive requests in the mix meeting the target (per-request mean ITL); "
                     + ("T as given in ms, the same for every server; the multiple is of each server's own interactive-alone ITL"
                        if report["spec"].get("itl_targets_ms") else "T is a multiple of each server's own interactive-alone ITL"))
    return "\n\n".join(lines)


TARGETS_OFF = ("--interactive-itl-target-steps", "0", "--interactive-ttft-target-first-tokens", "0")


def _start_tokenline(spec: MixedSpec, out_dir: Path, name: str, step_log: Path, slo: Slo | str | None = None) -> ServerProcess:
    """tokenline with the targets of `slo`; None: its targets off (the references); "defaults": no target flag."""
    if slo == "defaults":
        targets: tuple[str, ...] = ()
    elif isinstance(slo, Slo):
        targets = ("--interactive-itl-target-ms", f"{slo.itl_ms:.3f}", "--interactive-ttft-target-ms", f"{slo.ttft_ms:g}")
    else:
        targets = TARGETS_OFF
    return start_tokenline(spec.settings, out_dir / "logs" / f"tokenline-{name}.log", engine=spec.tokenline_engine,
                           extra_args=("--workers", "1", *targets, "--step-log", str(step_log)))


def _fresh(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path


def _log_len(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _read_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def _plot(steps: list[dict], mix: Outcome, path: Path, slo: Slo) -> None:
    from tokenline.bench.plots import _pyplot

    plt = _pyplot()
    t0 = mix.run.started_unix
    steps = [s for s in steps if "unix" in s and s["unix"] >= t0]
    if not steps:
        return
    ts = [s["unix"] - t0 for s in steps]
    fig, (ax_b, ax_t) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    ax_b.plot(ts, [s["batch"] for s in steps], lw=0.7, color="tab:green", label="sequences in the step")
    ax_b.plot(ts, [s["paused"] for s in steps], lw=0.7, color="tab:orange", label="bulk paused (KV kept)")
    ax_b.plot(ts, [s["interactive"] for s in steps], lw=0.9, color="tab:blue", label="interactive running")
    ax_t.plot(ts, [s["step_ms"] for s in steps], lw=0.7, color="black", label="step time")
    ax_t.axhline(slo.itl_ms, color="red", ls="--", lw=1, label=f"ITL target {slo.itl_ms:.0f} ms")
    for r in mix.run.records:
        if r.traffic_class == "interactive":
            for ax in (ax_b, ax_t):
                ax.axvline(r.scheduled, color="tab:blue", alpha=0.25, lw=0.8)
    ax_b.set(ylabel="sequences", title="tokenline, mixed run: per-step batch and step time (blue lines: interactive arrivals)")
    ax_t.set(ylabel="step ms", xlabel="seconds from start")
    for ax in (ax_b, ax_t):
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

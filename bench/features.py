"""`bench features`: what each request feature costs, tokenline and `vllm serve` side by side.

Each server is started once (as `bench compare` starts it: tokenline with its defaults, vllm serve
with its own) and driven at saturation (all requests at once, closed loop) by the same plan four
times: plain requests, then each with one feature on every request: logprobs (the top 5 with each
token), n = 4 samples (sampled at temperature 1; the others are greedy), a JSON schema. The variants run in alternating order from one server to the
next, so that a drifting machine favours no variant, each with prompts of its own (no variant finds
another's in the prefix cache), after an unrecorded warm-up. A feature's cost is its output throughput as a
ratio to the same server's plain requests, measured in the same run; the two servers' ratios are
printed side by side.

One run's ratios on a shared 2-core machine swing by more than the costs they are read for (the JSON
variant's: 0.95×, 0.66×, 1.13× in three runs of the same code). With `rounds` > 1 everything is measured
that many times on fresh servers, the servers' order alternating from one round to the next, each round
with prompts of its own; a feature's cost is the median of the rounds' own ratios, printed with their range.

JSON-constrained requests stop when the value is complete (their end-of-sequence token is not
ignored), so they produce fewer tokens than the plain ones: their ratio is of tokens per second.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenline.bench.compare import CompareSpec, _start
from tokenline.bench.report import format_results, table
from tokenline.bench.runner import LoadGeneratorBehind
from tokenline.bench.session import jsonable, run_once, write_outputs
from tokenline.bench.workload import LengthDist

VARIANTS = ("plain", "logprobs", "n4", "json")

# A schema with the shapes a service asks for: strings, bounded numbers, an enum, a short array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "designer", "manager"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}


def variant_stream(stream: Any, variant: str, schema_path: Path) -> Any:
    if variant == "logprobs":
        return replace(stream, logprobs=5)
    if variant == "n4":  # sampled: vLLM refuses n > 1 greedy samples (they would all be the same), and so does tokenline
        return replace(stream, n=4, temperature=1.0)
    if variant == "json":
        return replace(stream, json_schema=str(schema_path), ignore_eos=False)
    return stream


async def features(spec: CompareSpec, out_dir: Path, *, servers: tuple[str, ...] = ("tokenline", "vllm"),
                   rounds: int = 1, log=print) -> dict[str, Any]:  # noqa: ANN001
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    out_dir.mkdir(parents=True, exist_ok=True)
    schema_path = out_dir / "schema.json"
    schema_path.write_text(json.dumps(SCHEMA, indent=2) + "\n")
    per_round: list[dict[str, dict[str, float | None]]] = []
    for round_ in range(rounds):
        if rounds > 1:
            log(f"-- round {round_ + 1} of {rounds}")
        folder = out_dir if round_ == 0 else out_dir / f"round-{round_ + 1}"
        figures: dict[str, dict[str, float | None]] = {}
        # Alternating from one round to the next (and the variants from one server to the next), so that a
        # drifting machine favours no server and no variant.
        order = servers if round_ % 2 == 0 else tuple(reversed(servers))
        for turn, kind in enumerate(order):
            figures[kind] = await _measure_server(kind, spec, folder, schema_path, round_, flip=(turn + round_) % 2 == 1,
                                                  log=log)
        per_round.append({kind: figures[kind] for kind in servers})
    report = summarize(spec, per_round)
    (out_dir / "features.json").write_text(json.dumps(jsonable(report), indent=2) + "\n")
    text = format_features(report)
    (out_dir / "features.txt").write_text(text + "\n")
    log(text)
    return report


async def _measure_server(kind: str, spec: CompareSpec, out_dir: Path, schema_path: Path, round_: int, *, flip: bool,
                          log) -> dict[str, float | None]:  # noqa: ANN001
    """One fresh server: an unrecorded warm-up, then every variant at saturation; its output tok/s per variant."""
    figures: dict[str, float | None] = {}
    seeds = round_ * (len(VARIANTS) + 1)  # each round its own prompts, as each variant: none finds another's cached
    with _start(kind, spec, out_dir) as server:
        # Unrecorded: a fresh server's first run meets batch shapes it has not run before.
        log(f"-- {kind}: warm-up at saturation (not recorded)")
        warm = spec.saturation(server.address, seeds + len(VARIANTS) + 1)
        warm = replace(warm, streams=tuple(replace(s, output_len=LengthDist("fixed", 16)) for s in warm.streams))
        await run_once(warm, label=f"{kind} warm-up", quiet=True)
        order = (VARIANTS[0], *reversed(VARIANTS[1:])) if flip else VARIANTS
        for variant in order:
            # Each variant its own prompts (the same on both servers): with one plan for all, every run
            # after the first found the prompts in the prefix cache (measured: logprobs 165 tok/s
            # against plain's 143, the opposite of the work each does).
            base = spec.saturation(server.address, seeds + VARIANTS.index(variant) + 1)
            bench = replace(base, streams=tuple(variant_stream(s, variant, schema_path) for s in base.streams))
            log(f"-- {kind}: {variant}")
            try:
                outcome = await run_once(bench, label=f"{kind} {variant}")
            except LoadGeneratorBehind as e:
                log(f"   not measured: {e}")
                figures[variant] = None
                continue
            summary = format_results(outcome.results, title=f"{kind} · {variant}")
            write_outputs(outcome, out_dir / kind / variant, summary=summary, plots=False)
            figures[variant] = outcome.results["output_throughput"]
            log(f"   {outcome.results['output_throughput']:.0f} output tok/s")
    return figures


def summarize(spec: CompareSpec, per_round: list[dict[str, dict[str, float | None]]]) -> dict[str, Any]:
    """Throughput per server and variant (the rounds' median) and each feature's ratio to the same server's
    plain requests: the median of each round's own ratio (a round's variants ran minutes apart on one server;
    rounds ran on fresh servers, further apart), with the rounds' range."""
    def ratio(f: dict[str, float | None], v: str) -> float | None:
        return f[v] / f["plain"] if f.get(v) and f.get("plain") else None

    servers = list(per_round[0])
    throughput: dict[str, dict[str, float | None]] = {}
    ratios: dict[str, dict[str, float | None]] = {}
    spread: dict[str, dict[str, list[float]]] = {}
    for kind in servers:
        measured = {v: [r[kind][v] for r in per_round if r[kind].get(v)] for v in VARIANTS}
        throughput[kind] = {v: statistics.median(xs) if xs else None for v, xs in measured.items()}
        spread[kind] = {v: [x for r in per_round if (x := ratio(r[kind], v)) is not None] for v in VARIANTS[1:]}
        ratios[kind] = {v: statistics.median(xs) if xs else None for v, xs in spread[kind].items()}
    return {"settings": spec.settings.__dict__, "requests": spec.requests, "input_len": spec.input_len,
            "output_len": spec.output_len, "rounds": per_round, "throughput": throughput, "ratio_to_plain": ratios,
            "ratio_rounds": spread}


def format_features(report: dict[str, Any]) -> str:
    kinds = list(report["throughput"])
    spread = report.get("ratio_rounds") or {}
    several = len(report.get("rounds") or ()) > 1
    rows = []
    for variant in VARIANTS:
        row = [variant]
        for kind in kinds:
            tok_s = report["throughput"][kind].get(variant)
            ratio = report["ratio_to_plain"][kind].get(variant) if variant != "plain" else 1.0
            xs = spread.get(kind, {}).get(variant) or []
            of = f", {min(xs):.2f}–{max(xs):.2f}" if several and len(xs) > 1 else ""
            row.append("-" if tok_s is None else f"{tok_s:.0f} tok/s" + ("" if ratio is None else f" ({ratio:.2f}×{of})"))
        rows.append(row)
    head = ["requests with"] + [f"{k} (÷ its plain)" for k in kinds]
    rounds = len(report.get("rounds") or ())
    how = f"; the medians of {rounds} rounds on fresh servers, each ratio with its range" if rounds > 1 else ""
    return (f"feature cost at saturation: {report['requests']} requests × {report['input_len']} in / "
            f"{report['output_len']} out, all at once{how}\n" + table(head, rows))

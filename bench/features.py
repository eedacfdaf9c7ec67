"""`bench features`: what each request feature costs, tokenline and `vllm serve` side by side.

Each server is started once (as `bench compare` starts it: tokenline with its defaults, vllm serve
with its own) and driven at saturation (all requests at once, closed loop) by the same plan four
times: plain requests, then each with one feature on every request: logprobs (the top 5 with each
token), n = 4 samples (sampled at temperature 1; the others are greedy), a JSON schema. The variants run in alternating order from one server to the
next, so that a drifting machine favours no variant, each with prompts of its own (no variant finds
another's in the prefix cache), after an unrecorded warm-up. A feature's cost is its output throughput as a
ratio to the same server's plain requests, measured in the same run; the two servers' ratios are
printed side by side.

JSON-constrained requests stop when the value is complete (their end-of-sequence token is not
ignored), so they produce fewer tokens than the plain ones: their ratio is of tokens per second.
"""

from __future__ import annotations

import json
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
                   log=print) -> dict[str, Any]:  # noqa: ANN001
    out_dir.mkdir(parents=True, exist_ok=True)
    schema_path = out_dir / "schema.json"
    schema_path.write_text(json.dumps(SCHEMA, indent=2) + "\n")
    figures: dict[str, dict[str, float | None]] = {}
    for turn, kind in enumerate(servers):
        figures[kind] = {}
        with _start(kind, spec, out_dir) as server:
            # Unrecorded: a fresh server's first run meets batch shapes it has not run before.
            log(f"-- {kind}: warm-up at saturation (not recorded)")
            warm = spec.saturation(server.address, len(VARIANTS) + 1)
            warm = replace(warm, streams=tuple(replace(s, output_len=LengthDist("fixed", 16)) for s in warm.streams))
            await run_once(warm, label=f"{kind} warm-up", quiet=True)
            order = VARIANTS if turn % 2 == 0 else (VARIANTS[0], *reversed(VARIANTS[1:]))
            for variant in order:
                # Each variant its own prompts (the same on both servers): with one plan for all, every run
                # after the first found the prompts in the prefix cache (measured: logprobs 165 tok/s
                # against plain's 143, the opposite of the work each does).
                base = spec.saturation(server.address, VARIANTS.index(variant) + 1)
                bench = replace(base, streams=tuple(variant_stream(s, variant, schema_path) for s in base.streams))
                log(f"-- {kind}: {variant}")
                try:
                    outcome = await run_once(bench, label=f"{kind} {variant}")
                except LoadGeneratorBehind as e:
                    log(f"   not measured: {e}")
                    figures[kind][variant] = None
                    continue
                summary = format_results(outcome.results, title=f"{kind} · {variant}")
                write_outputs(outcome, out_dir / kind / variant, summary=summary, plots=False)
                figures[kind][variant] = outcome.results["output_throughput"]
                log(f"   {outcome.results['output_throughput']:.0f} output tok/s")
    ratios = {kind: {v: (f[v] / f["plain"] if f.get(v) and f.get("plain") else None) for v in VARIANTS[1:]}
              for kind, f in figures.items()}
    report = {"settings": spec.settings.__dict__, "requests": spec.requests, "input_len": spec.input_len,
              "output_len": spec.output_len, "throughput": figures, "ratio_to_plain": ratios}
    (out_dir / "features.json").write_text(json.dumps(jsonable(report), indent=2) + "\n")
    text = format_features(report)
    (out_dir / "features.txt").write_text(text + "\n")
    log(text)
    return report


def format_features(report: dict[str, Any]) -> str:
    kinds = list(report["throughput"])
    rows = []
    for variant in VARIANTS:
        row = [variant]
        for kind in kinds:
            tok_s = report["throughput"][kind].get(variant)
            ratio = report["ratio_to_plain"][kind].get(variant) if variant != "plain" else 1.0
            row.append("-" if tok_s is None else f"{tok_s:.0f} tok/s" + ("" if ratio is None else f" ({ratio:.2f}×)"))
        rows.append(row)
    head = ["requests with"] + [f"{k} (÷ its plain)" for k in kinds]
    return (f"feature cost at saturation: {report['requests']} requests × {report['input_len']} in / "
            f"{report['output_len']} out, all at once\n" + table(head, rows))

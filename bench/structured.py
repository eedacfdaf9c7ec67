"""`bench structured`: structured output that holds through failure — every output parses and validates.

One tokenline server (started here with as many sequences per worker as the preempted phase needs, no slot
held for interactive streams and no bulk floor, so that an interactive arrival preempts any bulk run, and no
interactive ITL target, so that every stream of a phase runs at once) serves `requests` JSON-schema requests, each
with a schema drawn from a fixed set, half greedy and half sampled:
1. the plain share, `concurrency` at a time;
2. `killed` at once, whose workers are SIGKILLed once every one of them has streamed tokens: each
   continues as a new attempt from the tokens delivered, its grammar advanced over them;
3. `preempted` bulk ones at once, and, once every one has streamed tokens, a burst of twice as many
   interactive requests that take their slots: the bulk runs stopped mid-output continue afterwards.
Each output must end with the model's stop (the value complete) and validate against its schema
(jsonschema); the report counts what did, and how many outputs were actually interrupted.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40}}, "required": ["name", "age"], "additionalProperties": False},
    "verdict": {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no", "unsure"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"},
                                                "label": {"type": "string", "maxLength": 20}},
              "required": ["x", "y"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "item": {"type": "string", "maxLength": 24}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "express": {"type": "boolean"}}, "required": ["item", "quantity", "express"], "additionalProperties": False},
}

TOPICS = ("a librarian", "whether the sea is salty", "a red bicycle", "a point on a map", "ordering three books",
          "a chess player", "whether it rains in the desert", "a list of fruits", "a garden", "a train ticket")


@dataclass
class Outcome:
    phase: str
    schema: str
    greedy: bool
    text: str = ""
    finish: str | None = None
    attempts: int = 1
    preemptions: int = 0
    error: str = ""
    valid: bool = False


@dataclass
class Plan:
    requests: int = 200
    killed: int = 20
    preempted: int = 20
    concurrency: int = 16
    max_tokens: int = 256
    seed: int = 0
    greedy_share: float = 0.5  # of the requests, greedy (the rest sampled at temperature 0.8, seeded)
    outcomes: list[Outcome] = field(default_factory=list)


def validate(outcome: Outcome) -> None:
    import jsonschema

    if outcome.error:
        return
    if outcome.finish != "stop":
        outcome.error = f"ended {outcome.finish!r}, not with the value complete"
        return
    try:
        # strict=False: vLLM's JSON grammar lets a string hold raw control characters (docs/request-surface.md).
        jsonschema.validate(json.loads(outcome.text, strict=False), SCHEMAS[outcome.schema])
        outcome.valid = True
    except (ValueError, jsonschema.ValidationError) as e:
        outcome.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _request(rng: random.Random, plan: Plan, phase: str) -> tuple[dict[str, Any], Outcome]:
    name = rng.choice(sorted(SCHEMAS))
    greedy = rng.random() < plan.greedy_share
    max_tokens = plan.max_tokens
    topic = rng.choice(TOPICS)
    kwargs = dict(messages=[{"role": "user", "content": f"Describe {topic} as JSON with these fields: "
                                                        f"{', '.join(SCHEMAS[name]['properties'])}."}],
                  json_schema=SCHEMAS[name], max_tokens=max_tokens,
                  temperature=0.0 if greedy else 0.8, **({} if greedy else {"seed": rng.randrange(1 << 30)}))
    return kwargs, Outcome(phase, name, greedy)


async def _follow(client: Any, kwargs: dict, outcome: Outcome, progress: list[int], slot: int, cls: str) -> None:
    from tokenline.client import TokenlineError

    try:
        async for d in client.generate(traffic_class=cls, **kwargs):
            outcome.text += d.text
            progress[slot] += len(d.token_ids)
            if d.finish_reason is not None:
                outcome.finish = d.finish_reason
                outcome.attempts = d.timeline.attempts if d.timeline else 1
                outcome.preemptions = d.timeline.preemptions if d.timeline else 0
    except TokenlineError as e:
        outcome.error = str(e)


def worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes (spawned Python children)."""
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout
    pids = []
    for pid in map(int, out.split()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            pids.append(pid)
    return pids


async def run(plan: Plan, address: str, server_pid: int, *, log=print) -> list[Outcome]:  # noqa: ANN001
    from tokenline.client import AsyncClient

    rng = random.Random(plan.seed)
    plain = plan.requests - plan.killed - plan.preempted
    async with AsyncClient(address) as client:
        log(f"-- {plain} requests, {plan.concurrency} at a time")
        gate = asyncio.Semaphore(plan.concurrency)
        progress = [0] * max(plain, plan.killed, plan.preempted)

        async def one(i: int) -> None:
            kwargs, outcome = _request(rng, plan, "plain")
            plan.outcomes.append(outcome)
            async with gate:
                await _follow(client, kwargs, outcome, progress, i, "interactive")
        await asyncio.gather(*(one(i) for i in range(plain)))

        for phase, count in (("killed", plan.killed), ("preempted", plan.preempted)):
            if not count:
                continue
            log(f"-- {count} requests, {phase} mid-output")
            progress = [0] * count
            cls = "bulk" if phase == "preempted" else "interactive"
            batch = [_request(rng, plan, phase) for _ in range(count)]
            plan.outcomes.extend(o for _, o in batch)
            tasks = [asyncio.create_task(_follow(client, k, o, progress, i, cls)) for i, (k, o) in enumerate(batch)]
            while min(progress) < 4 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            if phase == "killed":
                for pid in worker_pids(server_pid):
                    os.kill(pid, signal.SIGKILL)
            else:
                people = [_follow(client, dict(messages=[{"role": "user", "content": f"Hello {i}"}], max_tokens=4),
                                  Outcome("person", "", True), [0], 0, "interactive") for i in range(2 * count)]
                await asyncio.gather(*people)
            await asyncio.gather(*tasks)
    for outcome in plan.outcomes:
        validate(outcome)
    return plan.outcomes


def summarise(outcomes: list[Outcome]) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    for phase in ("plain", "killed", "preempted"):
        mine = [o for o in outcomes if o.phase == phase]
        phases[phase] = {"requests": len(mine), "valid": sum(o.valid for o in mine),
                         "greedy": sum(o.greedy for o in mine),
                         "continued_after_a_crash": sum(o.attempts > 1 for o in mine),
                         "preempted": sum(o.preemptions > 0 for o in mine)}
    failures = [{"phase": o.phase, "schema": o.schema, "greedy": o.greedy, "error": o.error, "text": o.text[:300]}
                for o in outcomes if not o.valid]
    return {"requests": len(outcomes), "valid": sum(o.valid for o in outcomes), "phases": phases, "failures": failures}


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"structured output: {summary['valid']} of {summary['requests']} outputs complete and valid against "
             "their schema"]
    for phase, p in summary["phases"].items():
        lines.append(f"  {phase:9} {p['valid']:4} of {p['requests']:4} valid ({p['greedy']} greedy); "
                     f"continued after a SIGKILL: {p['continued_after_a_crash']}, preempted mid-output: {p['preempted']}")
    for f in summary["failures"][:10]:
        lines.append(f"  FAILED {f['phase']} {f['schema']} ({'greedy' if f['greedy'] else 'sampled'}): {f['error']}")
    return "\n".join(lines)


async def structured(settings: Any, plan: Plan, out_dir: Path, *, log=print) -> dict[str, Any]:  # noqa: ANN001
    """Start tokenline with `settings`, run the plan, write structured.json; the summary."""
    from tokenline.bench.servers import start_tokenline

    out_dir.mkdir(parents=True, exist_ok=True)
    # No bulk floor: with serve's default (a tenth of the slots kept for bulk) one bulk run per worker is never
    # preempted, and the preempted phase interrupted 18 of its 20. No ITL target: the default (a multiple of the
    # measured single step) admits only as many interactive streams as keep it, so on a busy box the killed phase's
    # later streams waited for its first to end, which then ended before the kill (2 of 6 continued, in a CI run).
    extra = ("--bulk-floor", "0", "--interactive-itl-target-steps", "0")
    with start_tokenline(settings, out_dir / "logs" / "tokenline.log", extra_args=extra) as server:
        outcomes = await run(plan, server.address, server.process.pid, log=log)
    summary = summarise(outcomes)
    (out_dir / "structured.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = format_summary(summary)
    (out_dir / "structured.txt").write_text(text + "\n")
    log(text)
    return summary

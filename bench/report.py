"""From a run's records to its results: latency summaries, goodput, the server's split, and tables.

Results are one flat dict per class and for the total. Keys follow vLLM's
`vllm bench serve` where the meaning is the same (mean_ttft_ms, p99_itl_ms,
output_throughput, request_throughput, completed, ...); completion time is
vLLM's "e2el". Latencies count from each request's scheduled arrival.

Goodput counts a request as good when it finished normally, within its
deadline, and met its stream's SLO; it divides by every request offered,
refused and timed-out ones included. Requests the bench abandoned on purpose
(`cancel=`) are left out of both sides: they say nothing about the server.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from tokenline.bench.records import CANCELLED, ERROR, OK, REFUSED, TIMEOUT, UNFINISHED, RequestRecord
from tokenline.bench.stats import SUMMARY_PERCENTILES, percentile_word, summarize
from tokenline.bench.workload import Slo, StreamSpec

SERVER_SPLITS = ("admission_wait", "queueing", "prefill", "decode", "return")


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Finished normally, inside its deadline, and within every bound of the SLO."""
    if record.status != OK:
        return False
    e2e = record.e2e
    if record.deadline_s is not None and e2e is not None and e2e > record.deadline_s:
        return False
    checks = ((slo.ttft_ms, record.ttft), (slo.itl_ms, record.tpot), (slo.e2e_ms, e2e))
    return all(bound is None or value is None or value * 1000 <= bound for bound, value in checks)


def missed_deadline(record: RequestRecord) -> bool:
    if record.status == TIMEOUT:
        return True
    return record.status == OK and record.deadline_s is not None and (record.e2e or 0.0) > record.deadline_s


def _vllm_keys(metric: str, values_s: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pNN keys for one metric, in ms, named as vLLM names them."""
    s = summarize([v * 1000 for v in values_s])
    out = {f"mean_{metric}_ms": s["mean"], f"median_{metric}_ms": s["p50"], f"std_{metric}_ms": s["std"]}
    for q in SUMMARY_PERCENTILES:
        w = percentile_word(q)
        out[f"p{w}_{metric}_ms"] = s[f"p{w}"]
    out[f"{metric}_count"] = s["count"]
    return out


def summarize_records(records: Sequence[RequestRecord], duration_s: float, slos: dict[str, Slo]) -> dict[str, Any]:
    """The results of one group of requests (a class, or all) over a run of `duration_s`."""
    by = {status: [r for r in records if r.status == status] for status in (OK, REFUSED, TIMEOUT, CANCELLED, ERROR, UNFINISHED)}
    ok = by[OK]
    offered = [r for r in records if r.status != CANCELLED]
    good = [r for r in offered if meets_slo(r, slos.get(r.stream, Slo()))]
    wasted = [r for r in records if r.status in (CANCELLED, UNFINISHED) or missed_deadline(r)]
    duration = duration_s if duration_s > 0 else math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or r.input_tokens for r in ok)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "offered": len(offered),
        "good": len(good),
        "goodput": len(good) / len(offered) if offered else math.nan,
        "refused": len(by[REFUSED]),
        "refusal_rate": len(by[REFUSED]) / len(offered) if offered else math.nan,
        "timed_out": len(by[TIMEOUT]),
        "cancelled": len(by[CANCELLED]),
        "failed": len(by[ERROR]),
        "unfinished": len(by[UNFINISHED]),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": len(good) / duration,
        "output_throughput": out_tokens / duration,
        # Every streamed token, finished request or not: what the server actually produced.
        "streamed_output_throughput": sum(r.output_tokens for r in records) / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "wasted_output_tokens": sum(r.output_tokens for r in wasted),
        "wasted_prompt_tokens": sum(r.prompt_tokens or r.input_tokens for r in wasted if r.output_tokens),
    }
    result.update(_vllm_keys("ttft", [r.ttft for r in ok if r.ttft is not None]))
    result.update(_vllm_keys("tpot", [r.tpot for r in ok if r.tpot is not None]))
    result.update(_vllm_keys("itl", [g for r in ok for g in r.itl_gaps()]))
    result.update(_vllm_keys("e2el", [r.e2e for r in ok if r.e2e is not None]))
    result["time_to_refuse_ms"] = summarize([r.e2e * 1000 for r in by[REFUSED] if r.e2e is not None])
    result["send_lag_ms"] = summarize([r.send_lag * 1000 for r in records if r.send_lag is not None])
    result["server_split_ms"] = server_split(ok)
    errors: dict[str, int] = {}
    for r in by[ERROR]:
        errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    result["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])
    return result


def server_split(records: Iterable[RequestRecord]) -> dict[str, dict[str, float]]:
    """Where the time went on the server (from the final chunk's timeline), and transport.

    transport = client-side time − server-side time of the same span: from send
    to the last chunk (against the server's completion time), and from send to
    the first token (against the server's time to first token).
    """
    with_timeline = [r for r in records if r.server is not None and r.sent is not None]
    out = {name: summarize([r.server[f"{name}_ms"] for r in with_timeline]) for name in SERVER_SPLITS}
    out["server_ttft"] = summarize([r.server["ttft_ms"] for r in with_timeline])
    out["server_completion"] = summarize([r.server["completion_ms"] for r in with_timeline])
    out["transport"] = summarize([(r.end - r.sent) * 1000 - r.server["completion_ms"] for r in with_timeline])
    out["transport_ttft"] = summarize([(r.chunk_times[0] - r.sent) * 1000 - r.server["ttft_ms"]
                                       for r in with_timeline if r.chunk_times])
    return out


def build_results(records: Sequence[RequestRecord], duration_s: float, streams: Sequence[StreamSpec]) -> dict[str, Any]:
    """Totals (top level, vLLM-style keys) plus the same per class under "classes"."""
    slos = {s.name: s.slo for s in streams}
    results = summarize_records(records, duration_s, slos)
    classes = sorted({r.traffic_class for r in records} | {s.traffic_class for s in streams})
    results["classes"] = {c: summarize_records([r for r in records if r.traffic_class == c], duration_s, slos)
                          for c in classes}
    models = sorted({s.model for s in streams if s.model})
    if models:  # streams that name models: the same per model (a stream without one: the run's, "default")
        named = {s.name: s.model or "default" for s in streams}
        results["models"] = {m: summarize_records([r for r in records if named.get(r.stream) == m], duration_s, slos)
                             for m in sorted(set(named.values()))}
    return results


# --- Tables ------------------------------------------------------------------------------------


def table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [tuple(head), *(tuple(r) for r in rows)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def fmt(value: float | None, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_results(results: dict[str, Any], *, title: str = "") -> str:
    """The summary tables: latency and goodput per class and in total, then the server's split."""
    groups = [*results["classes"].items(), ("total", results)] if len(results["classes"]) > 1 else [("total", results)]
    groups[-1:-1] = [(f"model {m}", g) for m, g in results.get("models", {}).items()]
    lat = table(
        ("class", "ok/offered", "goodput", "refused", "ttft p50", "ttft p99", "tpot p50", "itl p50", "itl p99",
         "e2e p50", "e2e p99", "out tok/s", "req/s"),
        [(name, f"{g['completed']}/{g['offered']}", fmt(100 * g["goodput"], ".1f") + "%", str(g["refused"]),
          fmt(g["p50_ttft_ms"]), fmt(g["p99_ttft_ms"]), fmt(g["p50_tpot_ms"], ".2f"), fmt(g["p50_itl_ms"], ".2f"),
          fmt(g["p99_itl_ms"], ".2f"), fmt(g["p50_e2el_ms"], ".0f"), fmt(g["p99_e2el_ms"], ".0f"),
          fmt(g["output_throughput"], ",.0f"), fmt(g["request_throughput"], ".2f")) for name, g in groups],
    )
    lines = [title] if title else []
    lines += [lat, "latencies in ms from each request's scheduled arrival; tpot = mean gap per request, itl = every gap"]
    split_rows = []
    for name, g in groups:
        split = g["server_split_ms"]
        if split["server_completion"]["count"]:
            split_rows.append((name, *(f"{fmt(split[k]['p50'], '.2f')} / {fmt(split[k]['p99'], '.1f')}"
                                       for k in (*SERVER_SPLITS, "transport", "transport_ttft"))))
    if split_rows:
        lines += ["", "server-side split, ms (p50 / p99); transport = client-side − server-side time",
                  table(("class", *SERVER_SPLITS, "transport", "transport ttft"), split_rows)]
    refused = results["time_to_refuse_ms"]
    extra = []
    if refused["count"]:
        extra.append(f"refused {results['refused']} ({100 * results['refusal_rate']:.1f}%), "
                     f"time to refuse p50 {refused['p50']:.1f} ms, p99 {refused['p99']:.1f} ms")
    if results["wasted_output_tokens"] or results["timed_out"] or results["cancelled"]:
        extra.append(f"timed out {results['timed_out']}, cancelled {results['cancelled']}: "
                     f"{results['wasted_output_tokens']} output and {results['wasted_prompt_tokens']} prompt tokens spent on them")
    if results["failed"] or results["unfinished"]:
        extra.append(f"failed {results['failed']}, unfinished {results['unfinished']}"
                     + (f"; errors: {results['errors']}" if results["errors"] else ""))
    lag = results["send_lag_ms"]
    if lag["count"]:
        extra.append(f"send lag (actual − scheduled send) p50 {lag['p50']:.2f} ms, p99 {lag['p99']:.2f} ms, "
                     f"p99.9 {lag['p99.9']:.2f} ms")
    cpu = results.get("server_cpu")
    if cpu and cpu["us_per_output_token"] is not None:
        extra.append(f"server frontend (pid {cpu['pid']}): {cpu['cpu_s']:.1f} CPU s, "
                     f"{cpu['us_per_output_token']:.1f} µs per output token")
    gen = results.get("loadgen")
    if gen:
        extra.append(f"load generator: {100 * gen['cpu_share']:.0f}% of one core, event-loop lag p99 "
                     f"{fmt(gen['loop_lag_ms']['p99'], '.1f')} ms, peak {gen['peak_in_flight']} in flight")
        if gen["cpu_share"] > 0.8:
            extra.append("WARNING: the load generator was nearly saturated; latencies may include its own delays "
                         "(see `tokenline bench loadgen`)")
    return "\n".join(lines + ([""] + extra if extra else []))

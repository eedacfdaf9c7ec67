"""PNG plots of bench results: latency CDFs per class, goodput and p99 TTFT against offered rate, a run's timeline.

matplotlib is imported inside each function (with the Agg backend), so the rest
of the bench works without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenline.bench.records import OK, REFUSED, RequestRecord
from tokenline.bench.stats import ecdf

CLASS_COLORS = {"interactive": "tab:blue", "bulk": "tab:orange"}
STYLE = ("-", "--", ":", "-.")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_axis(axis: Any, set_scale: Any) -> None:
    """A log axis (linear below 0.1 ms, so zero gaps still show) labelled 1, 2, 5, 10, ... (1, 10, 100 when wide)."""
    import math

    from matplotlib.ticker import FuncFormatter, SymmetricalLogLocator

    set_scale("symlog", linthresh=0.1, linscale=0.3)
    low, high = axis.get_view_interval()
    decades = math.log10(max(high, 1.0) / max(low, 0.1))
    subs = (1.0, 2.0, 5.0) if decades <= 3.5 else (1.0,)
    axis.set_major_locator(SymmetricalLogLocator(base=10, linthresh=0.1, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> Path:
    """TTFT, inter-token latency and completion time CDFs, one line per (run, class)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = (("time to first token", lambda r: [r.ttft] if r.ttft is not None else []),
               ("inter-token latency (every gap)", lambda r: r.itl_gaps()),
               ("completion time", lambda r: [r.e2e] if r.e2e is not None else []))
    for ax, (title, values_of) in zip(axes, metrics):
        for i, (run_name, records) in enumerate(runs.items()):
            for cls in sorted({r.traffic_class for r in records}):
                values = [1000 * v for r in records if r.traffic_class == cls and r.status == OK for v in values_of(r)]
                if not values:
                    continue
                xs, ys = ecdf(values)
                label = f"{run_name} {cls}" if len(runs) > 1 else cls
                ax.plot(xs, ys, STYLE[i % len(STYLE)], color=CLASS_COLORS.get(cls), label=label, lw=1.5)
        _log_axis(ax.xaxis, ax.set_xscale)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rate_curves(points: Sequence[Mapping[str, Any]], path: Path, *, attainment: float | None = None) -> Path:
    """Goodput and p99 TTFT per class against offered rate.

    Each point: {"rate": offered req/s, "classes": {class: results of that class}}.
    """
    plt = _pyplot()
    fig, (ax_g, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    ordered = sorted(points, key=lambda p: p["rate"])
    classes = sorted({c for p in ordered for c in p["classes"]})
    for cls in classes:
        pts = [(p["rate"], p["classes"][cls]) for p in ordered if cls in p["classes"]]
        rates = [r for r, _ in pts]
        ax_g.plot(rates, [100 * g["goodput"] for _, g in pts], "o-", color=CLASS_COLORS.get(cls), label=cls)
        ax_t.plot(rates, [g["p99_ttft_ms"] for _, g in pts], "o-", color=CLASS_COLORS.get(cls), label=cls)
    if attainment is not None:
        ax_g.axhline(100 * attainment, color="grey", ls="--", lw=1, label=f"target {100 * attainment:g}%")
    ax_g.set(title="goodput (good ÷ offered)", xlabel="offered rate, requests/s", ylabel="%", ylim=(0, 105))
    ax_t.set(title="p99 time to first token", xlabel="offered rate, requests/s", ylabel="ms")
    _log_axis(ax_t.yaxis, ax_t.set_yscale)
    for ax in (ax_g, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline(records: Sequence[RequestRecord], backlog: Sequence[tuple[float, int]], path: Path) -> Path:
    """One run: every request as a bar (waiting for the first token, then streaming), and requests in flight."""
    plt = _pyplot()
    from matplotlib.collections import LineCollection

    fig, (ax_r, ax_b) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, height_ratios=(3, 1))
    ordered = sorted(records, key=lambda r: r.scheduled)
    for cls in sorted({r.traffic_class for r in ordered}):
        color = CLASS_COLORS.get(cls)
        waiting, streaming, refused = [], [], []
        for y, r in enumerate(ordered):
            if r.traffic_class != cls:
                continue
            first = r.chunk_times[0] if r.chunk_times else r.end
            if r.status == REFUSED:
                refused.append((r.end if r.end is not None else r.scheduled, y))
                continue
            if first is not None:
                waiting.append([(r.scheduled, y), (first, y)])
            if r.chunk_times and r.end is not None:
                streaming.append([(r.chunk_times[0], y), (r.end, y)])
        ax_r.add_collection(LineCollection(waiting, colors=color, alpha=0.25, linewidths=1))
        ax_r.add_collection(LineCollection(streaming, colors=color, alpha=0.9, linewidths=1, label=cls))
        if refused:
            ax_r.scatter(*zip(*refused), marker="x", s=8, color="red", label=f"{cls} refused")
    ax_r.autoscale()
    ax_r.set(title="requests: faint = scheduled arrival → first token, solid = streaming", ylabel="request (by arrival)")
    ax_r.legend(fontsize=8, loc="upper left")
    if backlog:
        ax_b.plot(*zip(*backlog), color="black", lw=1)
    ax_b.set(xlabel="seconds from start", ylabel="in flight")
    for ax in (ax_r, ax_b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

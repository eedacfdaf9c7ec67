"""The capacity question measured for real on Ray, beside the virtual-time simulator's prediction.

`tokenline bench simulate` answers "how many workers for 1,000 requests/s, in
batches of 32 that take 100 ms each?" in virtual time. This command asks the
same question of real parts: a tokenline server whose workers are Ray actors
spread over the nodes of a Ray cluster, each running the simulated engine with
a fixed cost per batch, under open-loop Poisson load over real gRPC.

One 2-core machine cannot generate 1,000 gRPC streams a second and serve them,
so the whole system runs slowed down by `--scale`: batches take scale × cost,
arrivals come at rate ÷ scale, windows last scale × window. Queueing behaves
the same at every time scale, so measured times divided by the scale are the
times at full speed, and are set beside the simulator's figures for the same
workers, rate, batch, cost and window.

With no --ray-address, a local Ray cluster is started for each worker count
(`ray.cluster_utils.Cluster`: one node per worker), which is also how the tests
run Ray; with one, the workers go to that cluster.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenline.bench.records import OK
from tokenline.bench.runner import run
from tokenline.bench.servers import EngineSettings, start_tokenline
from tokenline.bench.session import BenchSpec, run_once
from tokenline.bench.simulate import simulate_capacity
from tokenline.bench.stats import percentiles
from tokenline.bench.workload import parse_stream

QS = (50.0, 99.0, 99.9)


@dataclass(frozen=True)
class RayCapacityRow:
    workers: int
    offered: int
    completed: int
    refused: int
    wait_ms: dict[str, float]  # measured, at full speed: arrival at the server → its batch starts
    e2e_ms: dict[str, float]  # measured, at full speed: the client's send → the stream's end
    predicted_wait_ms: dict[str, float]
    predicted_e2e_ms: dict[str, float]
    predicted_stable: bool
    nodes: int  # distinct Ray nodes the workers ran on


@contextlib.contextmanager
def local_cluster(nodes: int, cpus_per_node: float = 1.0) -> Iterator[str]:
    """A Ray cluster on this machine: a head with no CPUs (no worker lands there) and `nodes` worker nodes."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=cpus_per_node)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def measure(workers: int, *, ray_address: str | None, rate: float, batch: int, cost_ms: float, window_ms: float,
            duration_s: float, scale: float, seed: int, log_dir: Path, quiet: bool = True) -> RayCapacityRow:
    with contextlib.ExitStack() as stack:
        address = ray_address or stack.enter_context(local_cluster(workers))
        settings = EngineSettings(model="tiny", max_seqs=batch, interactive_slots=0, prefill_budget=max(512, batch * 8))
        server = stack.enter_context(start_tokenline(
            settings, log_dir / f"tokenline-ray-{workers}.log", engine="sim", timeout_s=300,
            extra_args=("--workers", str(workers), "--ray-address", address,
                        "--sim-step-ms", f"{cost_ms * scale:g}", "--sim-fixed-batch",
                        "--interactive-window-ms", f"{window_ms * scale:g}", "--bulk-window-ms", f"{window_ms * scale:g}",
                        "--queue-requests", "1000000", "--queue-tokens", "100000000", "--log-level", "INFO",
                        "--request-log-level", "OFF")))
        stream = parse_stream(f"name=cap,class=bulk,rate={rate / scale:g},input=4,output=1")
        spec = BenchSpec(target=server.address, streams=(stream,), seed=seed, duration_s=duration_s * scale,
                         tokenizer="tiny", warmup=2, drain_s=60.0 * scale)
        outcome = run(run_once(spec, quiet=quiet))
        nodes = _nodes_used(server.log_path)
    records = outcome.run.records
    warm = duration_s * scale * 0.1  # the first 10 % is warm-up, as in the simulator
    steady = [r for r in records if r.scheduled >= warm]
    done = [r for r in steady if r.status == OK and r.server is not None]
    # The simulator's wait is arrival → the batch's start. A worker reports a batch when it ends, and every
    # batch takes exactly the fixed cost: so the start is the first token's time less that cost.
    waits = [max(0.0, r.server["first_token_ms"] - cost_ms * scale) / scale for r in done]
    e2e = [1000 * r.e2e / scale for r in done if r.e2e is not None]
    predicted = simulate_capacity(workers=workers, rate=rate, window_ms=window_ms, max_batch=batch,
                                  batch_cost_ms=cost_ms, duration_s=duration_s, seed=seed + 1)
    return RayCapacityRow(workers=workers, offered=len(steady), completed=len(done),
                          refused=sum(1 for r in steady if r.status != OK),
                          wait_ms=percentiles(waits, QS), e2e_ms=percentiles(e2e, QS),
                          predicted_wait_ms=predicted.wait_ms, predicted_e2e_ms=predicted.e2e_ms,
                          predicted_stable=predicted.stable, nodes=nodes)


def _nodes_used(log_path: Path) -> int:
    """Distinct Ray nodes named in the server's 'worker N ready … on node X' lines."""
    nodes = set()
    for line in log_path.read_text(errors="replace").splitlines():
        if " on Ray node " in line:
            nodes.add(line.rsplit(" on Ray node ", 1)[1].split()[0])
    return len(nodes)


def format_table(rows: list[RayCapacityRow]) -> str:
    head = ("workers", "nodes", "done", "wait p50", "p99", "p99.9", "sim wait p50", "p99", "p99.9",
            "e2e p50", "p99", "p99.9", "sim e2e p50", "p99", "p99.9", "sim: stable")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("--:" for _ in head) + "|"]
    for r in rows:
        cells = [str(r.workers), str(r.nodes), f"{r.completed}/{r.offered}",
                 *(f"{r.wait_ms[f'p{q:g}']:.0f}" for q in QS), *(f"{r.predicted_wait_ms[f'p{q:g}']:.0f}" for q in QS),
                 *(f"{r.e2e_ms[f'p{q:g}']:.0f}" for q in QS), *(f"{r.predicted_e2e_ms[f'p{q:g}']:.0f}" for q in QS),
                 "yes" if r.predicted_stable else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cmd_ray_capacity(args: Any) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="ray-capacity-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for workers in args.workers:
        row = measure(workers, ray_address=args.ray_address, rate=args.rate, batch=args.batch, cost_ms=args.cost_ms,
                      window_ms=args.window_ms, duration_s=args.duration_s, scale=args.scale, seed=args.seed,
                      log_dir=out, quiet=args.quiet)
        rows.append(row)
        print(format_table([row]).splitlines()[-1], flush=True)
    table = format_table(rows)
    (out / "ray-capacity.json").write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    print(f"\n{args.rate:g} req/s, batches of {args.batch} at {args.cost_ms:g} ms, window {args.window_ms:g} ms, "
          f"run {args.scale:g}× slower and shown at full speed (ms)\n")
    print(table)
    print(f"\nwrote {out / 'ray-capacity.json'}")
    return 0

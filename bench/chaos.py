"""Chaos soak: mixed traffic against a real server while its workers are killed and stopped.

Starts `tokenline serve` (tiny model, 2 workers and a standby, a step watchdog, metrics on, its
idempotency and job stores in SQLite files) on loopback and, for the chosen time, drives it with
complete streams, cancelled streams, keyed streams broken and resumed, durable jobs watched to the
end, malformed and oversized requests, while worker processes get SIGKILL or SIGSTOP at random and
both stores go away now and then (another process holds them locked for seconds). Then it reports what a caller could have lost: requests that ended with no
status, streams with a gap or a repeat in their indexes, completed streams short of max_tokens,
UNKNOWN or INTERNAL answers, and what the server still holds once traffic stops (in-flight
requests, running sequences, KV in use, queued requests), with the server's RSS over time.

    python -m tokenline.bench.chaos --minutes 10        # exit status 0 when everything is zero and flat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc

from tokenline.bench.chaos_traffic import Tally, Traffic
from tokenline.bench.servers import SERVER_GROUP
from tokenline.engine.config import WorkerConfig
from tokenline.engine.flagspec import add_flags
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

LEAK_GAUGES = ("tokenline_requests_in_flight", "tokenline_worker_running_sequences", "tokenline_worker_waiting_sequences",
               "tokenline_worker_kv_usage_ratio", "tokenline_queue_requests")


class Server:
    """`tokenline serve` on loopback in its own process group, output kept for the report."""

    def __init__(self, args: list[str]):
        self.metrics_port = _free_port()
        cmd = [sys.executable, "-m", "tokenline.server.cli", "serve", "--port", "0", "--metrics-port", str(self.metrics_port), *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     **SERVER_GROUP)
        self.lines: list[str] = []
        self.address: str | None = None
        self.ready_pids: set[int] = set()  # workers that said they are loaded (active or standby)
        self.ray_pids: dict[int, str] = {}  # on a Ray cluster: worker actor pid -> its node id
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if len(self.lines) < 5000:
                self.lines.append(line.rstrip("\n"))
            ready = re.search(r"worker \d+ ready: model \S+, pid (\d+)", line)
            if ready:
                self.ready_pids.add(int(ready.group(1)))
            placed = re.search(r"worker \d+ ready: model \S+ on Ray node ([0-9a-f]+) \(host \S+, pid (\d+)\)", line)
            if placed:
                self.ray_pids[int(placed.group(2))] = placed.group(1)
            m = re.search(r"tokenline: serving on (\S+):(\d+)", line)
            if m:
                self.address = f"{m.group(1)}:{m.group(2)}"
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or self.address is None:
            raise RuntimeError("server did not become ready:\n" + "\n".join(self.lines[-40:]))

    def ready_workers(self) -> list[int]:
        """Loaded workers still running."""
        if self.ray_pids:
            return [pid for pid in self.ray_pids if os.path.exists(f"/proc/{pid}")]
        return [pid for pid in self.workers() if pid in self.ready_pids]

    def workers(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        pids = []
        for pid in map(int, out.split()):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"spawn" in cmd and b"resource_tracker" not in cmd:
                pids.append(pid)
        return pids

    def rss_mb(self) -> float:
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def gauges(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in LEAK_GAUGES:
                out[line.rpartition(" ")[0]] = float(line.rpartition(" ")[2])
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def inject_faults(server: Server, tally: Tally, rng: random.Random, until: float, every_s: tuple[float, float],
                        watchdog_s: float, stores: tuple[str, ...] = (), cluster=None) -> None:
    """SIGKILL or SIGSTOP a random loaded worker now and then, while at least two are loaded; a stopped worker the
    watchdog spared (it had no work) is continued after twice the watchdog's limit. With `stores`, the first
    fault and one in four after the first worker fault is an outage of them instead: another process holds
    the SQLite files locked for 2-6 s."""
    first = True
    while time.monotonic() < until:
        await asyncio.sleep(rng.uniform(*every_s))
        # The first fault is an outage; the next is a worker's (an outage comes again, one time in four,
        # only once a worker fault has been injected, so a short run sees both kinds).
        worker_faulted = any(tally.faults[k] for k in ("sigkill", "sigstop", "partition"))
        outage, first = bool(stores) and (first or (worker_faulted and rng.random() < 0.25)), False
        if outage and time.monotonic() < until:
            tally.faults["store_outage"] += 1
            await asyncio.to_thread(_lock_stores, stores, rng.uniform(2.0, 6.0))
            continue
        pids = server.ready_workers()
        if len(pids) < 2 or time.monotonic() >= until:
            continue  # one loaded worker left (the others loading): a fault that leaves none measures only restarts
        pid = rng.choice(pids)
        try:
            if cluster is not None and rng.random() < 0.4:
                # A partition: the worker's node (its raylet) and the actor alive but silent, then back.
                node = next((n for n in cluster.list_all_nodes() if n.node_id == server.ray_pids.get(pid)), None)
                silent = [pr.process.pid for pr in (node.all_processes.get("raylet", []) if node else [])] + [pid]
                tally.faults["partition"] += 1
                for p in silent:
                    os.kill(p, signal.SIGSTOP)
                await asyncio.sleep(2 * watchdog_s)
                for p in silent:
                    if os.path.exists(f"/proc/{p}"):
                        os.kill(p, signal.SIGCONT)
            elif rng.random() < 0.6:
                os.kill(pid, signal.SIGKILL)
                tally.faults["sigkill"] += 1
            else:
                os.kill(pid, signal.SIGSTOP)
                tally.faults["sigstop"] += 1
                await asyncio.sleep(2 * watchdog_s)
                if os.path.exists(f"/proc/{pid}"):
                    os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _ray_cluster(nodes: int):
    """Ray's own test cluster on this machine: a head with no CPUs, `nodes` worker nodes of one CPU each."""
    from ray import cluster_utils

    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(nodes):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


def _lock_stores(paths: tuple[str, ...], seconds: float) -> None:
    """A store outage: each file held in an exclusive transaction by this process (writers there get busy)."""
    import sqlite3

    held = []
    try:
        for path in paths:
            db = sqlite3.connect(path, isolation_level=None, timeout=10)
            db.execute("BEGIN EXCLUSIVE")
            held.append(db)
        time.sleep(seconds)
    finally:
        for db in held:
            db.execute("ROLLBACK")
            db.close()


async def soak(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    tally = Tally()
    folder = tempfile.mkdtemp(prefix="tokenline-chaos-")
    cluster = _ray_cluster(args.ray_nodes) if args.ray_nodes else None
    placement = ["--ray-address", cluster.address] if cluster is not None else []
    stores = (os.path.join(folder, "idempotency.sqlite3"), os.path.join(folder, "jobs.sqlite3"))
    # Compiled workers from the start (--serve-while-compiling off): the soak kills workers, not swaps them in.
    server = Server(["--model", args.model, "--compile", args.compile, "--serve-while-compiling", "off", "--workers", "2", "--threads", "1", "--standby-workers", "1",
                     "--step-watchdog-s", str(args.watchdog_s), "--kv-cache-mb", "64", "--max-seqs", "16",
                     "--max-model-len", "1024", "--log-level", "INFO", "--request-log-level", "WARNING",
                     "--idempotency-db", stores[0], "--job-store", stores[1], "--job-lease-s", "3", *placement])
    rss: list[tuple[float, float]] = []
    try:
        server.wait_ready(args.start_timeout_s)
        # The clock starts once both workers have loaded: on a loaded machine they load for
        # tens of seconds after the server serves, and a short run would otherwise end before a worker fault
        # could be injected (faults need two loaded workers).
        loaded_by = time.monotonic() + args.start_timeout_s
        while len(server.ready_workers()) < 2 and time.monotonic() < loaded_by:
            await asyncio.sleep(0.2)
        start = time.monotonic()
        until = start + args.minutes * 60
        async with grpc.aio.insecure_channel(server.address) as channel:
            traffic = Traffic(channel, tally, rng)

            async def caller() -> None:
                sent = 0
                while time.monotonic() < until and sent < args.max_requests:
                    sent += 1
                    await traffic.one()

            async def sample_rss() -> None:
                while time.monotonic() < until:
                    rss.append((round(time.monotonic() - start, 1), round(server.rss_mb(), 1)))
                    if not args.quiet:
                        print(f"chaos: {time.monotonic() - start:5.0f} s, {sum(tally.requests.values())} requests, "
                              f"faults {dict(tally.faults)}, server RSS {rss[-1][1]:.0f} MB", file=sys.stderr)
                    await asyncio.sleep(args.sample_s)

            await asyncio.gather(*(caller() for _ in range(args.concurrency)), sample_rss(),
                                 inject_faults(server, tally, rng, until, (args.fault_min_s, args.fault_max_s), args.watchdog_s,
                                               stores if args.store_outages == "on" else (), cluster))
            for pid in server.workers() + list(server.ray_pids):  # leave no worker stopped
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            leaked = await _wait_drained(server)
            alive = await _alive(channel)
        rss.append((round(time.monotonic() - start, 1), round(server.rss_mb(), 1)))
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
        if cluster is not None:
            cluster.shutdown()
    return _report(args, tally, leaked, alive, rss)


async def _wait_drained(server: Server, timeout: float = 90.0) -> dict[str, float]:
    """What the server still holds once no request is left: nothing, once broken keyed runs have finished."""
    end = time.monotonic() + timeout
    while True:
        held = {k: v for k, v in (await asyncio.to_thread(server.gauges)).items() if v}
        if not held or time.monotonic() > end:
            return held
        await asyncio.sleep(1.0)


async def _alive(channel: grpc.aio.Channel) -> bool:
    req = pb.GenerateRequest(text="still there", sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(30):  # a worker may still be restarting after the last fault
        try:
            return len((await pb_grpc.TokenlineStub(channel).Complete(req, timeout=30)).token_ids) == 4
        except grpc.aio.AioRpcError:
            await asyncio.sleep(1.0)
    return False


def _report(args: argparse.Namespace, tally: Tally, leaked: dict[str, float], alive: bool, rss: list[tuple[float, float]]) -> dict:
    values = [mb for _, mb in rss]
    third = max(len(values) // 3, 1)
    early, late = statistics.median(values[:third]), statistics.median(values[-third:])
    growth_mb = late - early
    judged_rss = args.minutes * 60 >= 120  # a short run is mostly warm-up: RSS is reported, not judged
    rss_flat = not judged_rss or growth_mb <= max(0.1 * early, 30.0)
    ok = (alive and not leaked and tally.lost == 0 and tally.index_errors == 0 and tally.truncated == 0
          and tally.replay_mismatch == 0 and tally.bad_answers == 0 and tally.stuck_jobs == 0 and rss_flat)
    return {
        "ok": ok, "minutes": args.minutes, "requests": sum(tally.requests.values()), "by_kind": dict(tally.requests),
        "answers": dict(tally.codes), "faults": dict(tally.faults), "lost": tally.lost, "index_errors": tally.index_errors,
        "truncated": tally.truncated, "replay_mismatch": tally.replay_mismatch, "unknown_or_internal": tally.bad_answers,
        "stuck_jobs": tally.stuck_jobs,
        "leaked_after_drain": leaked, "alive_after": alive,
        "server_rss_mb": {"early_median": early, "late_median": late, "growth": round(growth_mb, 1), "flat": rss_flat,
                          "judged": judged_rss, "samples": rss},
        "examples": tally.examples,
    }


EXAMPLES = """examples:
  python -m tokenline.bench.chaos                       # 10 minutes; exit status 0 when all is zero and flat
  tokenline bench chaos --minutes 2 --concurrency 4 --json > soak.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long the traffic and faults run (default %(default)s)")
    p.add_argument("--model", default="tiny", help="model to serve (default %(default)s)")
    add_flags(p, WorkerConfig, only=("compile",),
              helps={"compile": "the server's --compile (default %(default)s: a killed worker is back in seconds)"})
    p.add_argument("--concurrency", type=int, default=8, help="callers sending at once (default %(default)s)")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="per caller, a bound besides time")
    p.add_argument("--fault-min-s", type=float, default=5.0, help="least time between faults (default %(default)s)")
    p.add_argument("--fault-max-s", type=float, default=20.0, help="most time between faults (default %(default)s)")
    p.add_argument("--ray-nodes", type=int, default=0,
                   help="run the workers as Ray actors on a local Ray test cluster of this many one-CPU nodes, and "
                        "partition nodes (raylet and actor silent for twice the watchdog) among the faults "
                        "(default 0: local worker processes; 4 leaves room for replacements)")
    p.add_argument("--store-outages", choices=("on", "off"), default="on",
                   help="one fault in four locks the idempotency and job stores for 2-6 s (default %(default)s)")
    p.add_argument("--watchdog-s", type=float, default=3.0, help="the server's --step-watchdog-s (default %(default)s)")
    p.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period (default %(default)s)")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="wait this long for the workers to load")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tokenline.bench.chaos", description=__doc__.split("\n\n")[0],
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p.parse_args(argv)


def main_report(args: argparse.Namespace) -> dict:
    """Run the soak; the report as a dict (see _report)."""
    return asyncio.run(soak(args))


def main(argv: list[str] | None = None) -> int:
    return run_command(parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run the soak and print its report; 0 when everything is zero and flat, 1 otherwise."""
    report = main_report(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        brief = {k: v for k, v in report.items() if k not in ("server_rss_mb", "examples")}
        print(json.dumps(brief, indent=None))
        r = report["server_rss_mb"]
        print(f"server RSS: {r['early_median']:.0f} MB early, {r['late_median']:.0f} MB late (growth {r['growth']} MB)"
              f"{'' if r['judged'] else ', not judged on a run this short'}")
        for example in report["examples"]:
            print(f"  problem: {example}")
        print("chaos soak: " + ("everything zero and flat" if report["ok"] else "PROBLEMS FOUND"))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

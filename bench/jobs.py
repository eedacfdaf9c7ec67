"""bench jobs: durable jobs through a frontend SIGKILL.

Starts `tokenline serve` frontends on one job store (default: two frontends sharing a SQLite
file; `--store postgresql://…` for PostgreSQL; `--frontends 1` restarts the killed one instead),
submits N jobs, follows every job with a watcher that reconnects (to a live frontend, from the
next index it wants) whenever its stream breaks, and SIGKILLs the process group of the first
frontend (frontend and workers) once half of the jobs have ended. Then it reports:

- jobs lost: accepted (SubmitJob answered) but not ended `succeeded` with all their tokens;
- jobs completed twice: ended by more than one frontend (each frontend logs "job … ended" only
  after its fenced end-state write succeeded), or a watcher that saw a gap or a repeat;
- takeover: the time from the kill to the first new token of a job taken over (attempt >= 2).

    tokenline bench jobs                      # 200 jobs, two frontends on one SQLite file
    tokenline bench jobs --jobs 50 --frontends 1 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import grpc

from tokenline.bench.chaos import Server
from tokenline.engine.config import WorkerConfig
from tokenline.engine.flagspec import add_flags
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

ENDED = re.compile(r"job (\w+) ended (\w+)")
CLAIMED = re.compile(r"job (\w+) claimed")
EXAMPLES = """examples:
  tokenline bench jobs                                  # 200 jobs, a frontend SIGKILLed half-way
  tokenline bench jobs --jobs 50 --max-tokens 32 --frontends 1 --json
  tokenline bench jobs --store postgresql://user@host/db --frontends 2
"""


@dataclass
class Watch:
    job_id: str
    tokens: list[int] = field(default_factory=list)
    state: str = ""
    index_errors: int = 0
    reconnects: int = 0
    after_kill: list[tuple[int, float]] = field(default_factory=list)  # (end index, time.monotonic()) of chunks after the kill

    def first_new_token_at(self, stored_at_kill: int) -> float | None:
        """When the first token the killed frontend had not stored arrived."""
        return next((t for end, t in self.after_kill if end > stored_at_kill), None)


@dataclass
class Report:
    jobs: int
    max_tokens: int
    accepted: int
    lost: int
    completed_twice: int
    index_errors: int
    taken_over: int
    kill_to_first_new_token_s: float | None
    kill_to_first_new_token_median_s: float | None
    kill_at_jobs_ended: int
    frontends: int
    store: str
    lease_s: float
    wall_s: float
    end_states: dict = field(default_factory=dict)
    watcher_reconnects: int = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, default=200, help="jobs to submit (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per job (default %(default)s)")
    p.add_argument("--model", default="tiny", help="model to serve (default %(default)s)")
    add_flags(p, WorkerConfig, only=("compile",),
              helps={"compile": "the servers' --compile (default %(default)s: a restarted frontend is back in seconds)"})
    p.add_argument("--frontends", type=int, default=2, choices=(1, 2),
                   help="2: another frontend takes the killed one's jobs over; 1: the killed one is restarted "
                        "on the same store (default %(default)s)")
    p.add_argument("--store", default=None, help="job store: SQLite file or postgresql://… (default: a fresh SQLite file)")
    p.add_argument("--kill-after", type=float, default=0.5,
                   help="share of the jobs ended before the SIGKILL (default %(default)s: half-way)")
    p.add_argument("--lease-s", type=float, default=2.0, help="job lease of the frontends (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up waiting for the jobs after this long")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run_command(args: argparse.Namespace) -> int:
    report = asyncio.run(bench(args))
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(describe(report))
    return 0 if report.lost == 0 and report.completed_twice == 0 and report.index_errors == 0 else 1


def describe(r: Report) -> str:
    fmt = lambda s: "n/a" if s is None else f"{s:.2f} s"  # noqa: E731
    return "\n".join([
        f"jobs {r.jobs} of {r.max_tokens} tokens on {r.frontends} frontend(s), store {r.store}, "
        f"lease {r.lease_s:g} s; frontend 0 SIGKILLed after {r.kill_at_jobs_ended} jobs ended",
        f"  accepted {r.accepted}   lost {r.lost}   completed twice {r.completed_twice}   index gaps/repeats {r.index_errors}",
        f"  taken over {r.taken_over}   kill -> first new token of a taken-over job: {fmt(r.kill_to_first_new_token_s)} "
        f"(median over taken-over jobs {fmt(r.kill_to_first_new_token_median_s)})",
        f"  end states {r.end_states}   watcher reconnects {r.watcher_reconnects}   wall {r.wall_s:.1f} s",
    ])


async def bench(args: argparse.Namespace) -> Report:
    started = time.monotonic()
    store = args.store or os.path.join(tempfile.mkdtemp(prefix="tokenline-bench-jobs-"), "jobs.sqlite3")
    # Each frontend runs at most its share of the jobs at once, so the one to be killed surely runs some:
    # with room for all, whichever frontend polls first may claim every job (seen on a slow 2-core box),
    # and the kill would take nothing over.
    share = -(-args.jobs // args.frontends)
    serve_args = ["--model", args.model, "--compile", getattr(args, "compile", "off"), "--workers", "1", "--threads", "1", "--kv-cache-mb", "128",
                  "--max-model-len", "1024", "--job-store", store, "--job-lease-s", str(args.lease_s),
                  "--jobs-running", str(share)]
    servers = [Server(serve_args) for _ in range(args.frontends)]
    retired: list[Server] = []
    try:
        for s in servers:
            await asyncio.to_thread(s.wait_ready, 600)
        live = [s.address for s in servers]
        channels = {a: grpc.aio.insecure_channel(a) for a in live}
        stub = pb_grpc.TokenlineStub(channels[live[0]])
        job_ids = []
        for i in range(args.jobs):
            sampling = pb.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0)
            job = await pb_grpc.TokenlineStub(channels[live[i % len(live)]]).SubmitJob(
                pb.SubmitJobRequest(request=pb.GenerateRequest(text=f"bench job {i}", sampling=sampling)), timeout=60)
            job_ids.append(job.job_id)
        watches = {j: Watch(j) for j in job_ids}
        kill = {"at": None}
        tasks = [asyncio.ensure_future(_watch(w, live, channels, kill)) for w in watches.values()]
        # Once --kill-after of the jobs ended (by the frontends' own logs: watchers may lag behind), at a
        # moment the victim runs jobs; if every job ends first, the kill takes nothing over.
        victim = servers[0]
        while True:
            kill_at_ended = sum(sum(_logged(s).values()) for s in servers)
            if (kill_at_ended >= int(args.jobs * args.kill_after) and _running_on(victim)) or kill_at_ended >= args.jobs:
                break
            await asyncio.sleep(0.05)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        kill["at"] = time.monotonic()
        live.remove(victim.address)
        # What was stored at the kill (a SIGKILLed frontend writes nothing more): tokens past it are new.
        survivor = pb_grpc.TokenlineStub(channels[live[0]]) if live else None
        open_jobs = [w.job_id for w in watches.values() if not w.state]
        stored_at_kill = {}
        if survivor is not None:
            got = await asyncio.gather(*(survivor.GetJob(pb.GetJobRequest(job_id=j), timeout=30) for j in open_jobs))
            stored_at_kill = {j: g.tokens_stored for j, g in zip(open_jobs, got)}
        retired.append(victim)
        servers.remove(victim)
        if args.frontends == 1:
            # Nobody can be asked while no frontend runs: the count is read once the restarted one is ready
            # (it may have stored a few tokens by then, so the delay measured is, if anything, too long).
            again = Server(serve_args)
            servers.append(again)
            await asyncio.to_thread(again.wait_ready, 600)
            channels[again.address] = grpc.aio.insecure_channel(again.address)
            live.append(again.address)
            survivor = pb_grpc.TokenlineStub(channels[again.address])
            got = await asyncio.gather(*(survivor.GetJob(pb.GetJobRequest(job_id=j), timeout=30) for j in open_jobs))
            stored_at_kill = {j: g.tokens_stored for j, g in zip(open_jobs, got)}
        done, pending = await asyncio.wait(tasks, timeout=args.timeout_s)
        for t in pending:
            t.cancel()
        stub = pb_grpc.TokenlineStub(channels[live[0]])
        attempts = {}
        for j in job_ids:
            attempts[j] = (await stub.GetJob(pb.GetJobRequest(job_id=j), timeout=30)).attempts
    finally:
        for s in servers:
            s.stop()
    ended: Counter = sum((_logged(s) for s in servers + retired), Counter())
    lost = sum(1 for w in watches.values() if w.state != "succeeded" or len(w.tokens) != args.max_tokens)
    taken = [w for w in watches.values() if attempts.get(w.job_id, 0) >= 2 and w.job_id in stored_at_kill]
    firsts = [w.first_new_token_at(stored_at_kill[w.job_id]) for w in taken]
    delays = sorted(t - kill["at"] for t in firsts if t is not None)
    return Report(jobs=args.jobs, max_tokens=args.max_tokens, accepted=len(job_ids), lost=lost,
                  completed_twice=sum(1 for n in ended.values() if n > 1),
                  index_errors=sum(w.index_errors for w in watches.values()), taken_over=len(taken),
                  kill_to_first_new_token_s=delays[0] if delays else None,
                  kill_to_first_new_token_median_s=statistics.median(delays) if delays else None,
                  kill_at_jobs_ended=kill_at_ended, frontends=args.frontends,
                  store="PostgreSQL" if store.startswith("postgres") else "SQLite", lease_s=args.lease_s,
                  wall_s=time.monotonic() - started, end_states=dict(Counter(w.state or "none" for w in watches.values())),
                  watcher_reconnects=sum(w.reconnects for w in watches.values()))


def _logged(server: Server) -> Counter:
    """job id -> times this frontend logged it ended."""
    return Counter(m.group(1) for m in map(ENDED.search, list(server.lines)) if m)


def _running_on(server: Server) -> set[str]:
    claimed = {m.group(1) for m in map(CLAIMED.search, list(server.lines)) if m}
    return claimed - set(_logged(server))


async def _watch(w: Watch, live: list[str], channels: dict, kill: dict) -> None:
    """Follow one job to its end, reconnecting from the next index whenever the stream breaks."""
    turn = int(w.job_id, 16) % 997  # watchers spread over the frontends, as callers would be
    while True:
        if not live:
            await asyncio.sleep(0.1)
            continue
        address = live[turn % len(live)]
        turn += 1
        call = pb_grpc.TokenlineStub(channels[address]).WatchJob(
            pb.WatchJobRequest(job_id=w.job_id, from_index=len(w.tokens)), timeout=600)
        try:
            async for chunk in call:
                if chunk.index != len(w.tokens):
                    w.index_errors += 1
                if chunk.token_ids and kill["at"] is not None:
                    w.after_kill.append((chunk.index + len(chunk.token_ids), time.monotonic()))
                w.tokens.extend(chunk.token_ids)
                if chunk.state:
                    w.state = pb.JobState.Name(chunk.state).removeprefix("JOB_").lower()
                    return
        except grpc.aio.AioRpcError:
            w.reconnects += 1
            await asyncio.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenline.bench.jobs", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

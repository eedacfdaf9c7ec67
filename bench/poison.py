"""bench poison: what one poison request costs the requests batched with it, and newcomers.

Starts `tokenline serve` with fault injection (`--fault-marker`: a worker crashes on a prompt holding
the marker) and runs the same batch twice on it, side by side in one run:

- crash-free: N streams of M tokens submitted together;
- poisoned: the same, with one of the N replaced by a prompt holding the marker. Its worker dies; the
  batch reruns (a second crash makes the runs suspects, which rerun in halves, apart from other work,
  until one crashing alone is quarantined) while the N-1 innocents must all complete whole.

During both batches a newcomer (a short interactive request) arrives every --newcomer-every-s, and
its time to first token is measured: while suspects rerun, one worker is kept for other work.

Reported: the innocents' completion time as a ratio to the crash-free batch's, newcomers' TTFT in both,
the poison's answer (FAILED_PRECONDITION, quarantined), worker crashes, and innocents lost or cut.

    tokenline bench poison                    # 16 streams of 128 tokens on 2 workers
    tokenline bench poison --workers 4 --streams 32 --json
    tokenline bench poison --standby-workers 1    # a loaded spare replaces each crashed worker at once
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import grpc

from tokenline.bench.chaos import Server
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

MARKER = "POISON-PILL"
EXAMPLES = """examples:
  tokenline bench poison                                # 16 streams of 128 tokens on 2 workers, one poisoned
  tokenline bench poison --workers 4 --streams 32 --json
"""


@dataclass
class Batch:
    wall_s: float  # first submission to the last innocent's end
    completed: int  # innocents that ended with all their tokens
    innocents: int
    poison: str  # the poison's gRPC status ("" in the crash-free batch)
    poison_message: str
    newcomer_ttft_s: list[float] = field(default_factory=list)
    newcomer_errors: int = 0
    errors: dict = field(default_factory=dict)  # status -> count, of innocents and newcomers that did not end OK
    crashes: int = 0  # workers that died during the batch (from the server's log)


@dataclass
class Report:
    streams: int
    max_tokens: int
    workers: int
    standby_workers: int
    crash_free: Batch
    poisoned: Batch
    innocents_time_ratio: float  # poisoned innocents' wall / crash-free wall
    newcomer_ttft_p50_s: tuple[float | None, float | None]  # (crash-free, poisoned)
    newcomer_ttft_max_s: tuple[float | None, float | None]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=16, help="requests in the batch, one of them poisoned (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="workers of the server (default %(default)s)")
    p.add_argument("--model", default="tiny", help="model to serve (default %(default)s)")
    p.add_argument("--standby-workers", type=int, default=0,
                   help="loaded spare workers that take a crashed one's place at once (default %(default)s)")
    p.add_argument("--newcomer-every-s", type=float, default=0.5,
                   help="a short interactive request arrives this often during each batch (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up on a batch after this long")
    p.add_argument("--server-log", default=None, metavar="FILE", help="write the server's output here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run_command(args: argparse.Namespace) -> int:
    report = asyncio.run(bench(args))
    print(json.dumps(asdict(report), indent=2) if args.json else describe(report))
    p = report.poisoned
    ok = (report.crash_free.completed == report.crash_free.innocents and p.completed == p.innocents
          and p.poison == "FAILED_PRECONDITION" and "quarantined" in p.poison_message)
    return 0 if ok else 1


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1000:.0f} ms"


def describe(r: Report) -> str:
    c, p = r.crash_free, r.poisoned
    return "\n".join([
        f"poison: {r.streams} streams of {r.max_tokens} tokens on {r.workers} workers ({r.standby_workers} standby); newcomers "
        f"{len(c.newcomer_ttft_s)} / {len(p.newcomer_ttft_s)}",
        f"  crash-free batch   {c.wall_s:6.1f} s   completed {c.completed}/{c.innocents}",
        f"  poisoned batch     {p.wall_s:6.1f} s   innocents completed {p.completed}/{p.innocents}   "
        f"worker crashes {p.crashes}   poison: {p.poison} ({p.poison_message[:80]})",
        f"  innocents' time    {r.innocents_time_ratio:.2f}x the crash-free batch",
        f"  newcomer TTFT p50  {_ms(r.newcomer_ttft_p50_s[0])} crash-free, {_ms(r.newcomer_ttft_p50_s[1])} poisoned; "
        f"max {_ms(r.newcomer_ttft_max_s[0])} / {_ms(r.newcomer_ttft_max_s[1])}; "
        f"newcomer errors {c.newcomer_errors} / {p.newcomer_errors}",
        *(f"  not OK ({name}): {errors}" for name, errors in (("crash-free", c.errors), ("poisoned", p.errors)) if errors),
    ])


async def _stream(stub: pb_grpc.TokenlineStub, text: str, max_tokens: int, cls: int, timeout: float
                  ) -> tuple[list[int], float | None, str, str]:
    """(token ids, seconds to the first token, status name, message) of one Generate."""
    req = pb.GenerateRequest(text=text, traffic_class=cls,
                             sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    t0, first, tokens = time.monotonic(), None, []
    try:
        async for chunk in stub.Generate(req, timeout=timeout):
            if chunk.token_ids and first is None:
                first = time.monotonic() - t0
            tokens.extend(chunk.token_ids)
        return tokens, first, "OK", ""
    except grpc.aio.AioRpcError as err:
        return tokens, first, err.code().name, err.details() or ""


async def _batch(server: Server, stub: pb_grpc.TokenlineStub, args: argparse.Namespace, poisoned: bool) -> Batch:
    crashes_before = _crashes(server)
    texts = [f"batch stream {i} tells of rivers and of {'a ' * (i % 5)}hills" for i in range(args.streams)]
    if poisoned:
        texts[args.streams // 2] = f"{MARKER} stream {args.streams // 2}"
    started = time.monotonic()
    tasks = [asyncio.ensure_future(_stream(stub, t, args.max_tokens, pb.BULK, args.timeout_s)) for t in texts]
    newcomers: list[asyncio.Future] = []
    innocent = [t for i, t in enumerate(tasks) if not (poisoned and i == args.streams // 2)]
    while not all(t.done() for t in innocent):
        newcomers.append(asyncio.ensure_future(_stream(stub, f"newcomer {len(newcomers)}", 8, pb.INTERACTIVE, args.timeout_s)))
        await asyncio.wait(innocent, timeout=args.newcomer_every_s)
    wall = time.monotonic() - started
    results = await asyncio.gather(*tasks)
    arrived = await asyncio.gather(*newcomers)
    kept = [r for i, r in enumerate(results) if not (poisoned and i == args.streams // 2)]
    bad = results[args.streams // 2] if poisoned else None
    return Batch(wall_s=wall, completed=sum(1 for toks, _, code, _ in kept if code == "OK" and len(toks) == args.max_tokens),
                 innocents=len(kept), poison=bad[2] if bad else "", poison_message=bad[3] if bad else "",
                 newcomer_ttft_s=[first for _, first, code, _ in arrived if code == "OK" and first is not None],
                 newcomer_errors=sum(1 for _, _, code, _ in arrived if code != "OK"),
                 errors=dict(Counter(f"{code}: {msg[:120]}" for _, _, code, msg in kept + arrived if code != "OK")),
                 crashes=_crashes(server) - crashes_before)


def _crashes(server: Server) -> int:
    return sum(1 for line in server.lines if re.search(r"worker \d+ \(model \S+\) exited with code", line))


async def _all_workers_ready(server: Server, workers: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while len(server.ready_workers()) < workers:
        if time.monotonic() > end:
            raise RuntimeError("workers did not come back:\n" + "\n".join(server.lines[-30:]))
        await asyncio.sleep(0.2)


async def bench(args: argparse.Namespace) -> Report:
    server = Server(["--model", args.model, "--compile", "off", "--workers", str(args.workers), "--threads", "1",
                     "--kv-cache-mb", "128", "--max-model-len", "1024", "--max-seqs", str(max(8, args.streams)),
                     "--standby-workers", str(args.standby_workers), "--fault-marker", MARKER])
    try:
        await asyncio.to_thread(server.wait_ready, 600)
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.TokenlineStub(channel)
            await _all_workers_ready(server, args.workers + args.standby_workers, 600)
            await _stream(stub, "warm up", 4, pb.INTERACTIVE, 120)
            clean = await _batch(server, stub, args, poisoned=False)
            await _all_workers_ready(server, args.workers + args.standby_workers, 600)
            bad = await _batch(server, stub, args, poisoned=True)
    finally:
        server.stop()
        if args.server_log:
            with open(args.server_log, "w") as f:
                f.write("\n".join(server.lines) + "\n")

    def p50(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return Report(streams=args.streams, max_tokens=args.max_tokens, workers=args.workers,
                  standby_workers=args.standby_workers, crash_free=clean, poisoned=bad,
                  innocents_time_ratio=bad.wall_s / clean.wall_s,
                  newcomer_ttft_p50_s=(p50(clean.newcomer_ttft_s), p50(bad.newcomer_ttft_s)),
                  newcomer_ttft_max_s=(max(clean.newcomer_ttft_s, default=None), max(bad.newcomer_ttft_s, default=None)))

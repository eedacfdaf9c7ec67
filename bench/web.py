"""What the gRPC-Web port adds: the same requests streamed over native gRPC and over gRPC-Web, side by side.

One request at a time, alternating the two paths (A B B A ...) so that drift in the machine's load
falls on both alike. Each request is measured at the caller (send to first token, the gap before
each later token, total) and read from the server's final chunk (its own TTFT), so the report can
separate the transport's share. The gRPC-Web caller is httpx over HTTP/1.1, as a browser's fetch
would be, without the browser's own costs.

    tokenline bench web --model tiny --requests 40            # starts a server itself
    tokenline bench web --target 127.0.0.1:50051 --web-url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from tokenline.bench.servers import SERVER_GROUP
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

EXAMPLES = """examples:
  tokenline bench web --model tiny                  # start a tiny-model server with --web-port, 40 requests
  tokenline bench web --requests 20 --max-tokens 32 # the default model (minutes to start on a small CPU box)
  tokenline bench web --target 127.0.0.1:50051 --web-url http://127.0.0.1:8080   # a running server
"""
PROMPT = "Tell me about the sea, the wind and the boats that cross it."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="start a server here on this model ('tiny', a folder, or 'default'); omit with --target")
    p.add_argument("--target", default=None, help="a running server's gRPC address, host:port")
    p.add_argument("--web-url", default=None, help="the same server's gRPC-Web address, http://host:port")
    p.add_argument("--api-key", default=None, help="bearer key, if the server wants one")
    p.add_argument("--requests", type=int, default=40, help="requests per path (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests per path first (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


@dataclass
class Sample:
    ttft_ms: float
    gaps_ms: list[float]
    total_ms: float
    server_ttft_ms: float
    tokens: int


@dataclass
class PathResult:
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        ttft = np.array([s.ttft_ms for s in self.samples])
        gaps = np.array([g for s in self.samples for g in s.gaps_ms] or [np.nan])
        transport = np.array([s.ttft_ms - s.server_ttft_ms for s in self.samples])
        return {
            "requests": len(self.samples),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p90_ms": float(np.percentile(ttft, 90)),
            "itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p90_ms": float(np.percentile(gaps, 90)),
            "total_p50_ms": float(np.percentile([s.total_ms for s in self.samples], 50)),
            "ttft_beyond_server_p50_ms": float(np.percentile(transport, 50)),
        }


def _request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


class _Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.tokens = 0
        self.server_ttft = 0.0

    def chunk(self, chunk: pb.GenerateChunk) -> None:
        now = time.perf_counter()
        if chunk.token_ids:
            if self.first is None:
                self.first = now
            else:
                self.gaps.append((now - self.last) * 1000)
            self.last = now
            self.tokens += len(chunk.token_ids)
        if chunk.finish_reason:
            self.server_ttft = chunk.timeline.ttft_ms

    def sample(self) -> Sample:
        if self.first is None:
            raise RuntimeError("a stream ended without tokens")
        return Sample((self.first - self.start) * 1000, self.gaps, (time.perf_counter() - self.start) * 1000,
                      self.server_ttft, self.tokens)


async def native(stub: pb_grpc.TokenlineStub, request: pb.GenerateRequest, metadata: tuple) -> Sample:
    timer = _Timer()
    async for chunk in stub.Generate(request, metadata=metadata, timeout=300):
        timer.chunk(chunk)
    return timer.sample()


async def web(client, url: str, request: pb.GenerateRequest, headers: dict) -> Sample:
    data = request.SerializeToString()
    timer = _Timer()
    buffer = b""
    status = None
    async with client.stream("POST", url + "/tokenline.v1.Tokenline/Generate", content=struct.pack(">BI", 0, len(data)) + data,
                             headers=headers) as reply:
        status = reply.headers.get("grpc-status")
        async for piece in reply.aiter_raw():
            buffer += piece
            while len(buffer) >= 5:
                flags, n = struct.unpack(">BI", buffer[:5])
                if len(buffer) < 5 + n:
                    break
                message, buffer = buffer[5:5 + n], buffer[5 + n:]
                if flags & 0x80:
                    status = re.search(rb"grpc-status:\s*(\d+)", message).group(1).decode()
                else:
                    timer.chunk(pb.GenerateChunk.FromString(message))
    if status != "0":
        raise RuntimeError(f"gRPC-Web call ended with grpc-status {status}")
    return timer.sample()


async def measure(target: str, web_url: str, args: argparse.Namespace) -> dict[str, PathResult]:
    import httpx

    request = _request(args.max_tokens)
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    headers = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1", "grpc-timeout": "300S", **dict(metadata)}
    results = {"grpc": PathResult(), "grpc-web": PathResult()}
    async with grpc.aio.insecure_channel(target) as channel, httpx.AsyncClient(timeout=300) as client:
        stub = pb_grpc.TokenlineStub(channel)
        paths = {"grpc": lambda: native(stub, request, metadata), "grpc-web": lambda: web(client, web_url, request, headers)}
        for _ in range(args.warmup):
            for run in paths.values():
                await run()
        for i in range(args.requests):
            order = ("grpc", "grpc-web") if i % 2 == 0 else ("grpc-web", "grpc")  # A B B A: drift falls on both
            for name in order:
                results[name].samples.append(await paths[name]())
            print(f"\r  {i + 1}/{args.requests} pairs", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return results


def _start_server(model: str) -> tuple[subprocess.Popen, str, str]:
    # Eager: the two transports are compared, not the model's speed, and the server starts in seconds.
    args = ["--port", "0", "--web-port", "0", "--workers", "1", "--threads", "1", "--compile", "off", "--idempotency-db", "off"]
    if model != "default":
        args += ["--model", model]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenline.server.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **SERVER_GROUP)
    found: dict[str, str] = {}
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if m := re.search(r"gRPC-Web and the page on (https?://\S+:\d+)/", line):
                found["web"] = m.group(1)
            if m := re.search(r"tokenline: serving on (\S+:\d+)", line):
                found["grpc"] = m.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(900) or "grpc" not in found:
        proc.terminate()
        raise RuntimeError("the server did not start:\n" + "".join(lines[-30:]))
    return proc, found["grpc"], found["web"]


def report(results: dict[str, PathResult]) -> dict:
    native_, web_ = results["grpc"].summary(), results["grpc-web"].summary()
    return {"grpc": native_, "grpc-web": web_,
            "ratio_ttft_p50": web_["ttft_p50_ms"] / native_["ttft_p50_ms"],
            "ratio_itl_p50": web_["itl_p50_ms"] / native_["itl_p50_ms"]}


def run_command(args: argparse.Namespace) -> int:
    proc = None
    try:
        if args.model:
            print(f"starting a server on {args.model} with --web-port …", file=sys.stderr, flush=True)
            proc, target, web_url = _start_server(args.model)
        elif args.target and args.web_url:
            target, web_url = args.target, args.web_url.rstrip("/")
        else:
            print("tokenline bench web: give --model (start a server here) or --target and --web-url", file=sys.stderr)
            return 2
        out = report(asyncio.run(measure(target, web_url, args)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    n, w = out["grpc"], out["grpc-web"]
    print(f"{args.requests} requests per path, {args.max_tokens} tokens each, one at a time, alternating")
    print(f"{'':28}{'gRPC':>10}{'gRPC-Web':>10}{'ratio':>8}")
    for key, label in (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p90_ms", "TTFT p90 (ms)"), ("itl_p50_ms", "ITL p50 (ms)"),
                       ("itl_p90_ms", "ITL p90 (ms)"), ("total_p50_ms", "total p50 (ms)"),
                       ("ttft_beyond_server_p50_ms", "TTFT beyond server's (ms)")):
        print(f"{label:28}{n[key]:>10.2f}{w[key]:>10.2f}{w[key] / n[key] if n[key] else float('nan'):>8.2f}")
    return 0


__all__ = ["add_arguments", "run_command", "measure", "report"]

"""Servers the bench starts itself, one at a time, on free loopback ports: tokenline and `vllm serve`.

Both get the same model and the same engine settings as tokenline's vLLM
worker (engine/config.py WorkerConfig and engine/vllm_backend.py: bf16, eager,
explicit KV cache size, block size, sequence and batch-token budgets, priority
scheduling), and the environment a CPU engine process needs (ENGINE_ENV). Each server runs in its
own session and is stopped as a process group (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tokenline.engine.config import MiB, WorkerConfig

# What every engine process on these CPU machines needs: one OpenMP thread (the bench sizes workers),
# no hub or telemetry traffic, and a loopback address for vLLM's own sockets.
ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}


class ServerStartError(RuntimeError):
    """A server did not come up; the message names its log file."""


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings shared by tokenline, `vllm serve` and the engine-ceiling run."""

    model: str | None = None  # a model name tokenline knows ("tiny"; None = the default) or a folder
    kv_cache_mb: int | None = None  # per tokenline worker; None: tokenline's plan from the machine
    max_seqs: int = WorkerConfig.max_seqs
    # tokenline's slots beyond max_seqs for interactive streams only; `vllm serve` and the engine
    # ceiling get max_seqs + these, so that every server runs as many sequences at once.
    interactive_slots: int = WorkerConfig.interactive_slots
    max_model_len: int = 4096
    block_size: int = 128
    prefill_budget: int = 512
    dtype: str = "auto"  # resolved as tokenline resolves it (engine/machine.py choose_dtype), for every server
    # The engine ceiling's CPU attention kernel: tokenline's policy (auto: never a kernel known to
    # answer wrongly), so that "the box's best" is the best engine that answers right.
    attention_kernel: str = "auto"
    # tokenline's workers and OpenMP threads per worker; None: `tokenline serve`'s plan from the machine.
    workers: int | None = None
    threads: int | None = None
    # Compile the model (`tokenline serve --compile on`, its default) in tokenline's workers and in the
    # in-process engines it is measured against (the ceiling, the box's best), so that "the box's best"
    # runs the same forward pass; False: all of them eager.
    compile: bool = True

    def resolved_dtype(self) -> str:
        from tokenline.engine.machine import choose_dtype, visible_gpus

        return choose_dtype(self.dtype, gpus=visible_gpus())[0]

    def model_path(self) -> Path:
        from tokenline.engine.models import resolve_model

        return resolve_model(self.model)

    def plan(self):  # noqa: ANN201 - engine.machine.WorkerPlan
        """What `tokenline serve` with these settings runs on this machine: workers, threads, KV per worker."""
        from tokenline.engine.machine import kv_bytes_per_token, plan_workers, read_machine

        return plan_workers(read_machine(), workers=self.workers, threads=self.threads,
                            kv_cache_bytes=self.kv_cache_mb * MiB if self.kv_cache_mb else None,
                            kv_bytes_per_token=kv_bytes_per_token(self.model_path(), self.resolved_dtype()),
                            max_seqs=self.engine_seqs, max_model_len=self.max_model_len)

    @property
    def engine_seqs(self) -> int:
        return self.max_seqs + self.interactive_slots

    def worker_kv_mb(self) -> int:
        return self.kv_cache_mb or self.plan().kv_cache_bytes // MiB

    def context_len(self) -> int:
        """max_model_len clipped to the model's own context, as tokenline's worker clips it."""
        config = json.loads((self.model_path() / "config.json").read_text())
        config = config.get("text_config", config)
        own = int(config.get("max_position_embeddings") or config.get("max_sequence_length") or self.max_model_len)
        return min(self.max_model_len, own)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_env() -> dict[str, str]:
    return {**os.environ, **ENGINE_ENV}


class ServerProcess:
    """A started server: its address, its log, and how to stop it."""

    def __init__(self, kind: str, process: subprocess.Popen, address: str, log_path: Path):
        self.kind, self.process, self.address, self.log_path = kind, process, address, log_path

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait(10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the server's own process group: its engine processes too
    except ProcessLookupError:
        pass


def _launch(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """A server or engine in a process group of its own (so that it and its children are stopped
    together), in the bench's session (SERVER_GROUP)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=engine_env(), **SERVER_GROUP)


# A new process group, not a new session: with Linux's autogroup on (the default on desktops and
# these boxes), a new session is a scheduling group of its own, and beside a server's busy
# workers the load generator's group then waited for a CPU for seconds at a time. Measured at
# saturation on a 2-core box, default model, 64 streams: the load generator's event loop woke
# 0.7-3.3 s late at p99 with the server in its own session (4 runs), 4-5 ms in the bench's
# (4 runs), at the same throughput (618-633 against 620-631 tok/s). Its lateness is in every
# token time it records (ITL p99 695 ms in one `bench compare`).
SERVER_GROUP = {"process_group": 0}


def _fail(process: subprocess.Popen, kind: str, log_path: Path, why: str) -> ServerStartError:
    if process.poll() is None:
        _signal_group(process, signal.SIGKILL)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:] if log_path.exists() else []
    return ServerStartError(f"{kind} did not start ({why}); see {log_path}" + "".join(f"\n    {line}" for line in tail))


def start_tokenline(settings: EngineSettings, log_path: Path, *, engine: str = "vllm", timeout_s: float = 600.0,
                    extra_args: tuple[str, ...] = ()) -> ServerProcess:
    """`tokenline serve` on a free port; returns once it prints that it is serving."""
    cmd = [sys.executable, "-m", "tokenline.server.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--engine", engine, "--model", str(settings.model_path()),
           *(("--kv-cache-mb", str(settings.kv_cache_mb)) if settings.kv_cache_mb else ()), "--max-seqs", str(settings.max_seqs),
           "--interactive-slots", str(settings.interactive_slots), "--max-model-len", str(settings.max_model_len), "--block-size", str(settings.block_size),
           "--prefill-budget", str(settings.prefill_budget), "--dtype", settings.dtype, "--log-level", "WARNING",
           "--compile", "on" if settings.compile else "off",
           # The bench measures the steady state: every worker compiled from the first request (serving while the
           # compiled workers are built would time eager workers, and workers compiling beside the load).
           "--serve-while-compiling", "off",
           *(("--workers", str(settings.workers)) if settings.workers else ()),
           *(("--threads", str(settings.threads)) if settings.threads else ()), *extra_args]
    process = _launch(cmd, log_path)
    deadline = time.monotonic() + timeout_s
    pattern = re.compile(r"tokenline: serving on (\S+:\d+)")
    while time.monotonic() < deadline:
        match = pattern.search(log_path.read_text(errors="replace"))
        if match:
            return ServerProcess("tokenline", process, match.group(1), log_path)
        if process.poll() is not None:
            raise _fail(process, "tokenline", log_path, f"exit status {process.returncode}")
        time.sleep(0.2)
    raise _fail(process, "tokenline", log_path, f"not serving after {timeout_s:g} s")


def start_vllm(settings: EngineSettings, log_path: Path, *, timeout_s: float = 600.0, own_defaults: bool = False,
               kv_cache_mb: int | None = None, attention_kernel: str = "vllm") -> ServerProcess:
    """vLLM's OpenAI-compatible server (through the AMX-safe launcher) on a free port.

    With `own_defaults`, only what it needs to start here is given (model, dtype, a KV size: its
    default asks for 90 % of RAM; priority scheduling, which the bench's requests use): the rest,
    batch sizes, block size, compilation and threads, are vLLM's own. `attention_kernel`: "vllm" (its
    own choice), or tokenline's policy ("auto") or a kernel name, in every process it starts.
    """
    port = free_port()
    path = settings.model_path()
    cmd = [sys.executable, "-m", "tokenline.bench.vllm_serve", "--model", str(path), "--served-model-name", path.name,
           *(["--tokenline-attention-kernel", attention_kernel] if attention_kernel != "vllm" else []),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", settings.resolved_dtype(),
           "--kv-cache-memory-bytes", str((kv_cache_mb or settings.worker_kv_mb()) * MiB),
           "--scheduling-policy", "priority", "--disable-log-stats", "--disable-uvicorn-access-log"]
    if not own_defaults:
        cmd += [*(() if settings.compile else ("--enforce-eager",)), "--block-size", str(settings.block_size), "--max-num-seqs", str(settings.engine_seqs),
                "--max-model-len", str(settings.context_len()), "--max-num-batched-tokens", str(settings.prefill_budget)]
    process = _launch(cmd, log_path)
    address = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise _fail(process, "vllm serve", log_path, f"exit status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{address}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return ServerProcess("vllm", process, address, log_path)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise _fail(process, "vllm serve", log_path, f"not ready after {timeout_s:g} s")


def run_ceiling(settings: EngineSettings, requests_path: Path, out_path: Path, log_path: Path, *,
                timeout_s: float = 1800.0, threads: int = 1, kv_cache_mb: int | None = None) -> dict:
    """The engine-ceiling run (bench/ceiling.py) in its own process; returns its results."""
    process = _launch(_ceiling_cmd(settings, requests_path, out_path, threads, kv_cache_mb or settings.worker_kv_mb()), log_path)
    _wait_ceiling(process, out_path, log_path, timeout_s)
    return json.loads(out_path.read_text())


def run_ceiling_engines(settings: EngineSettings, requests_path: Path, out_dir: Path, engines: int, *,
                        timeout_s: float = 1800.0, kv_cache_mb: int | None = None) -> dict:
    """The saturation workload split over `engines` 1-thread engines run side by side: their summed output tok/s."""
    ready = out_dir / "ready"
    if ready.exists():
        for f in ready.iterdir():
            f.unlink()
    runs = []
    for i in range(engines):
        out_path = out_dir / f"ceiling-{engines}x1-{i}.json"
        cmd = _ceiling_cmd(settings, requests_path, out_path, 1, kv_cache_mb or settings.worker_kv_mb())
        cmd += ["--shard", f"{i}/{engines}", "--ready-dir", str(ready)]
        runs.append((_launch(cmd, out_dir / "logs" / f"ceiling-{engines}x1-{i}.log"), out_path))
    for process, out_path in runs:
        _wait_ceiling(process, out_path, out_dir / "logs" / f"{out_path.stem}.log", timeout_s)
    results = [json.loads(out_path.read_text()) for _, out_path in runs]
    parts = [r["throughput"] for r in results]
    duration = max(p["ended_at"] for p in parts) - min(p["started_at"] for p in parts)
    out_tokens = sum(p["total_output_tokens"] for p in parts)
    return {"engines": engines, "threads": 1, "duration": duration, "total_output_tokens": out_tokens,
            "output_throughput": out_tokens / duration, "completed": sum(p["completed"] for p in parts),
            "attention_kernel": results[0].get("attention_kernel", "")}


def _ceiling_cmd(settings: EngineSettings, requests_path: Path, out_path: Path, threads: int, kv_cache_mb: int) -> list[str]:
    return [sys.executable, "-m", "tokenline.bench.ceiling", "--model", str(settings.model_path()),
            "--requests", str(requests_path), "--out", str(out_path), "--kv-cache-mb", str(kv_cache_mb),
            "--max-seqs", str(settings.engine_seqs), "--max-model-len", str(settings.context_len()),
            "--block-size", str(settings.block_size), "--prefill-budget", str(settings.prefill_budget),
            "--dtype", settings.resolved_dtype(), "--threads", str(threads),
            "--attention-kernel", settings.attention_kernel, *(["--compile"] if settings.compile else [])]


def _wait_ceiling(process: subprocess.Popen, out_path: Path, log_path: Path, timeout_s: float) -> None:
    try:
        code = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        raise _fail(process, "engine ceiling", log_path, f"still running after {timeout_s:g} s") from None
    if code != 0 or not out_path.exists():
        raise _fail(process, "engine ceiling", log_path, f"exit status {code}")

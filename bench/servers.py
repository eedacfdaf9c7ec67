"""Servers the bench starts itself, one at a time, on free loopback ports: tokenline and `vllm serve`.

Both get the same model and the same engine settings as tokenline's vLLM
worker (engine/config.py WorkerConfig and engine/vllm_backend.py: bf16, eager,
explicit KV cache size, block size, sequence and batch-token budgets, priority
scheduling), and the environment VLLM-CPU.md asks for. Each server runs in its
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

MiB = 1 << 20

# What every engine process on these CPU machines needs (see VLLM-CPU.md).
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
    kv_cache_mb: int = 512
    max_seqs: int = 64
    max_model_len: int = 4096
    block_size: int = 128
    prefill_budget: int = 512
    dtype: str = "bfloat16"

    def model_path(self) -> Path:
        from tokenline.engine.models import resolve_model

        return resolve_model(self.model)

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
        os.killpg(process.pid, sig)  # the server's own session: its engine processes too
    except ProcessLookupError:
        pass


def _launch(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=engine_env(), start_new_session=True)


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
           "--kv-cache-mb", str(settings.kv_cache_mb), "--max-seqs", str(settings.max_seqs),
           "--max-model-len", str(settings.max_model_len), "--block-size", str(settings.block_size),
           "--prefill-budget", str(settings.prefill_budget), "--log-level", "WARNING", *extra_args]
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


def start_vllm(settings: EngineSettings, log_path: Path, *, timeout_s: float = 600.0) -> ServerProcess:
    """vLLM's OpenAI-compatible server (through the AMX-safe launcher) on a free port."""
    port = free_port()
    path = settings.model_path()
    cmd = [sys.executable, "-m", "tokenline.bench.vllm_serve", "--model", str(path), "--served-model-name", path.name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", settings.dtype, "--enforce-eager",
           "--kv-cache-memory-bytes", str(settings.kv_cache_mb * MiB), "--block-size", str(settings.block_size),
           "--max-num-seqs", str(settings.max_seqs), "--max-model-len", str(settings.context_len()),
           "--max-num-batched-tokens", str(settings.prefill_budget), "--scheduling-policy", "priority",
           "--disable-log-stats", "--disable-uvicorn-access-log"]
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
                timeout_s: float = 1800.0) -> dict:
    """The engine-ceiling run (bench/ceiling.py) in its own process; returns its results."""
    cmd = [sys.executable, "-m", "tokenline.bench.ceiling", "--model", str(settings.model_path()),
           "--requests", str(requests_path), "--out", str(out_path), "--kv-cache-mb", str(settings.kv_cache_mb),
           "--max-seqs", str(settings.max_seqs), "--max-model-len", str(settings.context_len()),
           "--block-size", str(settings.block_size), "--prefill-budget", str(settings.prefill_budget),
           "--dtype", settings.dtype]
    process = _launch(cmd, log_path)
    try:
        code = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        raise _fail(process, "engine ceiling", log_path, f"still running after {timeout_s:g} s") from None
    if code != 0 or not out_path.exists():
        raise _fail(process, "engine ceiling", log_path, f"exit status {code}")
    return json.loads(out_path.read_text())

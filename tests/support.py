"""Test support: a real `tokenline serve` process on a free loopback port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READY = re.compile(r"tokenline: serving on (\S+):(\d+)")
LISTENING = re.compile(r"tokenline: listening on (\S+):(\d+)")
WEB = re.compile(r"tokenline: gRPC-Web and the page on (https?://\S+:\d+)/")


class ServerProcess:
    """`tokenline serve ARGS` in its own process group, its output kept for failure reports."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, machine_sized: bool = False):
        # One 1-thread worker unless a test asks for more, or for the machine-sized default (one per CPU).
        sizing = [] if machine_sized else [*(() if "--workers" in args else ("--workers", "1")),
                                           *(() if "--threads" in args else ("--threads", "1"))]
        # Eager unless a test asks for the compiled default: a compile costs a minute the first time.
        eager = () if "--compile" in args else ("--compile", "off")
        self.args = ["--port", "0", *sizing, *eager, *args]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lines: deque[str] = deque(maxlen=2000)
        self.address: str | None = None
        self.web_url: str | None = None  # with --web-port: http://host:port
        self._ready = threading.Event()
        self._listening = threading.Event()

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        """Start and wait until every model has a worker (health SERVING)."""
        return self._launch(self._ready, "become ready", timeout)

    def start_listening(self, timeout: float = 120.0) -> "ServerProcess":
        """Start without waiting for the workers (to observe start-up)."""
        return self._launch(self._listening, "listen", timeout)

    def _launch(self, reached: threading.Event, what: str, timeout: float) -> "ServerProcess":
        cmd = [sys.executable, "-m", "tokenline.server.cli", "serve", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()
        if not reached.wait(timeout):
            self.stop()
            raise RuntimeError(f"server did not {what} in {timeout}s:\n{self.output()}")
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            web = WEB.search(line)
            if web:
                self.web_url = web.group(1)
            m = LISTENING.search(line)
            if m:
                self.address = f"{m.group(1)}:{m.group(2)}"
                self._listening.set()
            if READY.search(line):
                self._ready.set()
        self._ready.set()
        self._listening.set()

    def output(self) -> str:
        return "\n".join(self.lines)

    def health(self, service: str = "") -> int:
        with grpc.insecure_channel(self.address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig) if sig == signal.SIGKILL else self.proc.send_signal(sig)

    def start_refused(self, timeout: float = 300.0) -> tuple[int, str]:
        """Start a server whose workers must fail to load; its exit status and output once it has given up."""
        self.start_listening()
        try:
            code = self.wait(timeout)
        finally:
            self.stop()
        out = self.output()
        assert "tokenline: workers failed to start" in out, out
        return code, out

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)

    def worker_pids(self) -> list[int]:
        """Worker processes: the server's children."""
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


# The prober HealthWatcher runs: a process of its own, as a load balancer's checks come from outside, so that
# neither the test's own client (its event loop holding the GIL on a loaded machine) nor its gRPC stack can
# starve or delay the checks. One line per check: "ok STATUS" or "error MESSAGE"; it stops when stdin closes.
_PROBER = """
import sys, threading, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
address, interval = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    try:
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        print("ok", status, flush=True)
    except Exception as err:
        print("error", type(err).__name__, (str(err).splitlines() or [""])[0], flush=True)
    stop.wait(interval)
"""


class HealthWatcher:
    """Polls a server's health from a prober process while a block runs; `seen` keeps every answer.

    A check that fails (no answer within its 5 s) is itself a finding: the health service must answer
    while workers crash and restart. The block starts once a first check is answered; leaving it raises
    if any check failed, or if too few were answered for "health never said X" to rest on anything."""

    def __init__(self, server: ServerProcess, interval: float = 0.05, min_answers: int = 3):
        self.server, self.interval, self.min_answers = server, interval, min_answers
        self.seen: list[int] = []
        self.errors: list[str] = []
        self._first = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            kind, _, rest = line.strip().partition(" ")
            if kind == "ok":
                self.seen.append(int(rest))
            elif kind:
                self.errors.append(rest)
            self._first.set()
        self._first.set()

    def __enter__(self) -> "HealthWatcher":
        assert self.server.address is not None
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBER, self.server.address, str(self.interval)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._first.wait(60) or not (self.seen or self.errors):
            self._proc.kill()
            raise RuntimeError("the health prober never answered")
        return self

    def __exit__(self, kind, *exc_info: object) -> None:
        assert self._proc is not None and self._proc.stdin is not None and self._reader is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._reader.join(5)
        if kind is None:
            assert not self.errors, f"health checks failed while watched: {self.errors[:3]}"
            assert len(self.seen) >= self.min_answers, f"only {len(self.seen)} health checks were answered"


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """Prometheus text exposition as {'name{labels}': value}."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric_values(metrics: dict[str, float], name: str) -> list[float]:
    return [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]

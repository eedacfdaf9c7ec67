"""Workers as Ray actors: the same handle contract as a local worker process, placed by Ray.

A local worker (engine/worker.py) is a spawned process on a duplex pipe. A Ray
worker is a Ray actor, placed by Ray on any node with the CPUs (or the GPU) it
asks for, that runs the very same `worker_main` over a socket instead of a
pipe: the actor dials back to a one-use listener the frontend opened for it and
both sides authenticate with a random key (multiprocessing's challenge). So the
step loop, the messages (Admit, Abort, StepPlan, Shutdown in; WorkerSpec,
WorkerFailed, StepReport out) and the frontend's reading of them are unchanged;
only transport and placement differ.

Loss is seen two ways, whichever comes first: the socket closes (the actor's
process died, or its node went away), or Ray reports the actor's `run` call
failed (actor death, node death). A partitioned node does neither: its actor
and raylet are there but silent, the socket stays open and Ray has not yet
declared the node dead. The watchdog sees the silence and calls `kill`, which
severs our end of the socket at once (the reader then ends) besides asking Ray
to kill the actor (which cannot reach it until the partition heals). Either way `on_exit` is called once, exactly
as for a local crash, and the supervisor's crash rules decide what follows.
Actors are created with `max_restarts=0`: a replacement is a new worker the
supervisor asks for (and Ray places, on a surviving node if one died), so
every crash passes through the same crash rules (isolation, quarantine) as a
local one rather than being hidden by a silent restart.

Ray is imported only when a `RayCluster` is made: `make run` needs no Ray.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

from tokenline.engine.config import WorkerConfig
from tokenline.engine.types import Shutdown
from tokenline.engine.worker import OnExit, OnMessage

log = logging.getLogger(__name__)

EXIT_KILLED = -9  # what on_exit reports for an actor we killed (as a SIGKILLed local process reads)
EXIT_LOST = 1  # an actor that died without a status we can read (process crash, node gone)
ACCEPT_POLL_S = 0.25  # how often the reader, waiting for the actor to dial in, checks that it still lives
HANDSHAKE_S = 10.0  # a peer that connects to the dial-back port must finish authenticating within this


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached."""


@dataclass(frozen=True)
class Placement:
    """Where Ray put one worker: its node, host and process id there."""

    node_id: str
    host: str
    pid: int


class RayCluster:
    """The frontend's connection to a Ray cluster, and the actor class its workers run in.

    `address` is what `ray.init` takes: "auto" (a cluster started on this
    machine with `ray start`), "ray://host:10001" (Ray Client), or a GCS
    address "host:6379". `host` is the address workers dial back to; by
    default the address Ray itself uses for this node.
    """

    def __init__(self, address: str, *, host: str | None = None, namespace: str = "tokenline"):
        try:
            import ray
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RayUnavailable(
                "--ray-address needs Ray: install it with `pip install 'tokenline[ray]'` (or `pip install ray`)"
            ) from e
        self.ray = ray  # the ray module, imported only once a cluster is asked for
        try:
            if not ray.is_initialized():
                ray.init(address=address, namespace=namespace, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False)
        except Exception as e:
            raise RayUnavailable(f"cannot connect to the Ray cluster at {address!r}: {e}") from e
        self.address = address
        self.host = host or ray.util.get_node_ip_address()
        self.actor_class = ray.remote(_WorkerActor)
        self.gpus_per_worker = 1 if self.resources().get("GPU", 0) >= 1 else 0

    def resources(self) -> dict[str, float]:
        """What the cluster has in all (CPU, GPU, memory...), as Ray counts it."""
        return dict(self.ray.cluster_resources())

    def alive_nodes(self) -> list[str]:
        return [n["NodeID"] for n in self.ray.nodes() if n.get("Alive")]

    def shutdown(self) -> None:
        self.ray.shutdown()


class _WorkerActor:
    """The actor a Ray worker lives in (made a Ray actor class by RayCluster)."""

    def where(self) -> Placement:
        import ray

        return Placement(ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid())

    def run(self, address: tuple[str, int], authkey: bytes, worker_id: int, config: WorkerConfig) -> None:
        from tokenline.engine.worker import worker_main

        import ray

        conn = multiprocessing.connection.Client(address, authkey=authkey)
        # Ends the actor's process: a crash or a failed start at once (os._exit), a clean stop through Ray.
        worker_main(conn, worker_id, config, leave=ray.actor.exit_actor)


class RayWorkerHandle:
    """The frontend's side of one worker running as a Ray actor (the `WorkerHandle` contract).

    `on_message(worker_id, msg)` for each message, `on_exit(worker_id, code)`
    once when the worker is gone; both on a reader thread. `send` never blocks.
    """

    def __init__(self, worker_id: int, config: WorkerConfig, on_message: OnMessage, on_exit: OnExit,
                 *, cluster: RayCluster):
        self.worker_id = worker_id
        self.config = config
        self.cluster = cluster
        self._on_message = on_message
        self._on_exit = on_exit
        self._outbox: SimpleQueue[object] = SimpleQueue()
        self._authkey = secrets.token_bytes(32)
        self._server: socket.socket | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._actor: Any = None
        self._run_ref: Any = None
        self._where_ref: Any = None
        self._exited = threading.Event()
        self._exitcode: int | None = None
        self._killed = False
        self._stopping = False  # a Shutdown was sent: the actor's end is a clean exit
        self.placement: Placement | None = None
        self._reader = threading.Thread(target=self._read, name=f"ray-worker-{worker_id}-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"ray-worker-{worker_id}-writer", daemon=True)

    def start(self) -> RayWorkerHandle:
        self._server = socket.create_server((self.cluster.host, 0))
        self._server.settimeout(ACCEPT_POLL_S)
        options: dict[str, Any] = {"num_cpus": self.config.threads, "max_restarts": 0, "max_task_retries": 0,
                                   "name": f"tokenline-worker-{self.worker_id}-{secrets.token_hex(3)}"}
        if self.config.backend == "vllm" and self.cluster.gpus_per_worker:
            options["num_gpus"] = self.cluster.gpus_per_worker  # one GPU per worker on a GPU cluster
        self._actor = self.cluster.actor_class.options(**options).remote()
        address = self._server.getsockname()[:2]
        self._where_ref = self._actor.where.remote()  # answered before `run` starts: an actor runs calls in order
        self._run_ref = self._actor.run.remote(address, self._authkey, self.worker_id, self.config)
        self._reader.start()
        return self

    @property
    def pid(self) -> int | None:
        return self.placement.pid if self.placement else None

    def is_alive(self) -> bool:
        return self._actor is not None and not self._exited.is_set()

    @property
    def exitcode(self) -> int | None:
        return self._exitcode if self._exited.is_set() else None

    def join(self, timeout: float | None = None) -> int | None:
        """Wait up to `timeout` seconds for the worker to end; its exit code, or None if it still runs."""
        self._exited.wait(timeout)
        return self.exitcode

    def send(self, msg: object) -> None:
        """Queue a message for the worker; dropped if it is gone (on_exit tells of that)."""
        self._outbox.put(msg)

    def kill(self) -> None:
        """Give the worker up at once: our end of its socket is closed (so the reader ends and on_exit
        follows now, even if the actor's node cannot be reached), and Ray is asked to kill the actor."""
        if self.is_alive():
            self._killed = True
            _sever(self._conn)
            # Off the caller's thread: on a partition the request may wait for an unreachable node.
            threading.Thread(target=self._ray_kill, name=f"ray-worker-{self.worker_id}-kill", daemon=True).start()

    def _ray_kill(self) -> None:
        try:
            self.cluster.ray.kill(self._actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - gone already, or the cluster is away: nothing left to do
            log.info("Ray worker %d: kill not delivered (%s)", self.worker_id, e)

    def terminate(self, timeout: float = 10.0) -> int | None:
        """Ask the worker to stop; kill the actor if it has not within `timeout`. Returns its exit code."""
        if self.is_alive():
            self._stopping = True
            self.send(Shutdown())
            self.join(timeout)
        if self.is_alive():
            self.kill()
            self.join(timeout)
        self._outbox.put(None)
        return self.exitcode

    # ------------------------------------------------------------ threads

    def _run_failed(self) -> bool:
        ready, _ = self.cluster.ray.wait([self._run_ref], timeout=0)
        return bool(ready)

    def _accept(self) -> multiprocessing.connection.Connection | None:
        """The actor's call back, authenticated; None if the actor died before it dialled."""
        assert self._server is not None
        try:
            while True:
                try:
                    sock, _ = self._server.accept()
                except socket.timeout:
                    if self._killed or self._run_failed():
                        return None
                    continue
                sock.settimeout(None)
                conn = multiprocessing.connection.Connection(sock.detach())
                # A peer that connects and then says nothing must not hold the port for ever.
                late = threading.Timer(HANDSHAKE_S, _sever, (conn,))
                late.start()
                try:
                    multiprocessing.connection.deliver_challenge(conn, self._authkey)
                    multiprocessing.connection.answer_challenge(conn, self._authkey)
                except (multiprocessing.AuthenticationError, OSError, EOFError):
                    log.warning("a connection to worker %d's port failed authentication (or stayed silent "
                                "for %.0f s): ignored", self.worker_id, HANDSHAKE_S)
                    conn.close()
                    continue
                finally:
                    late.cancel()
                if self._killed:
                    conn.close()
                    return None
                return conn
        finally:
            self._server.close()

    def _read(self) -> None:
        conn = self._accept()
        if conn is not None:
            self._conn = conn
            if self._killed:  # killed while it dialled in
                _sever(conn)
            try:
                self.placement = self.cluster.ray.get(self._where_ref, timeout=30)
            except Exception:  # noqa: BLE001 - the actor died at once; the read below ends
                pass
            self._writer.start()
            pump_messages(conn, self.worker_id, self._on_message)
        self._exitcode = self._exit_status()
        self._exited.set()
        self._outbox.put(None)  # let the writer go
        if conn is not None:
            conn.close()
        self._on_exit(self.worker_id, self._exitcode)

    def _exit_status(self) -> int:
        if self._killed:
            return EXIT_KILLED
        if self._stopping:
            return 0
        try:
            self.cluster.ray.get(self._run_ref, timeout=5)
        except Exception as e:  # noqa: BLE001 - RayActorError and friends: the actor is gone
            log.warning("Ray worker %d is gone: %s", self.worker_id, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return EXIT_LOST
        return 0

    def _write(self) -> None:
        assert self._conn is not None
        feed_connection(self._conn, self._outbox)


def _sever(conn: multiprocessing.connection.Connection | None) -> None:
    """Shut a connection's socket down in both directions: a thread blocked reading or writing it
    returns at once (EOF / EPIPE), whatever the peer does. The descriptor stays open for its owner to close."""
    if conn is None:
        return
    try:
        sock = socket.socket(fileno=conn.fileno())
    except (OSError, ValueError):
        return  # closed already
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


def pump_messages(conn: multiprocessing.connection.Connection, worker_id: int, on_message: OnMessage) -> None:
    """Hand each message from a worker's connection to `on_message` until the connection closes
    (the worker exited, was killed, or its node went away)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the worker's end closed
        except Exception:  # one message that would not unpickle; the stream is still framed
            log.exception("unreadable message from worker %d", worker_id)
            continue
        try:
            on_message(worker_id, msg)
        except Exception:
            log.exception("on_message failed for worker %d", worker_id)


def feed_connection(conn: multiprocessing.connection.Connection, outbox: SimpleQueue) -> None:
    """Send what is queued for a worker until a None is queued or the worker is gone."""
    while (msg := outbox.get()) is not None:
        try:
            conn.send(msg)
        except OSError:
            return  # the worker is gone; the reader reports it

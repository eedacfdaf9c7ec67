"""Workers as Ray actors on a real (local, multi-node) Ray cluster: spread, loss and correctness.

The cluster is Ray's own test cluster (`ray.cluster_utils.Cluster`): a head
with no CPUs, so no worker lands there, and worker nodes of one CPU each, each
a real raylet with its own processes. Removing a node kills them for real.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

from tokenline.client import AsyncClient, Client
from tokenline.client.errors import TokenlineError
from tests.support import ServerProcess, wait_until

ray_cluster_utils = pytest.importorskip("ray.cluster_utils", reason="Ray is installed by `make test` (the test extra)")

pytestmark = pytest.mark.engine

READY_ON_NODE = re.compile(r"worker (\d+) ready: .* on Ray node ([0-9a-f]+)")
TOKENS = 60


@pytest.fixture(scope="module")
def cluster():
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(3)]
    c.wait_for_nodes()
    c.worker_nodes_ = nodes
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def sim_server(cluster, tmp_path_factory):
    steps = tmp_path_factory.mktemp("ray") / "steps.jsonl"
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--workers", "2", "--ray-address", cluster.address,
                      "--sim-step-ms", "40", "--max-seqs", "16", "--step-log", str(steps), "--log-level", "INFO").start()
    s.step_log = steps
    assert wait_until(lambda: len(placements(s)) == 2, timeout=120), s.output()[-3000:]
    yield s
    s.stop()


def placements(server: ServerProcess) -> dict[int, str]:
    """Worker id -> the Ray node it runs on, as the server's start-up lines say (latest first wins)."""
    out: dict[int, str] = {}
    for line in server.output().splitlines():
        if m := READY_ON_NODE.search(line):
            out[int(m.group(1))] = m.group(2)
    return out


async def stream_all(address: str, n: int, *, on_token=None):
    async with AsyncClient(address) as client:
        async def one(i: int):
            deltas = []
            try:
                async for d in client.generate(token_ids=[5 + i, 7, 9, 11], max_tokens=TOKENS, ignore_eos=True,
                                               traffic_class="bulk"):
                    deltas.append(d)
                    if on_token is not None:
                        on_token(deltas)
            except TokenlineError as err:
                return deltas, err
            return deltas, None

        return await asyncio.gather(*(one(i) for i in range(n)))


def assert_whole(deltas) -> None:
    """Every index once, in order: nothing lost or repeated, across attempts."""
    position = 0
    for d in deltas:
        assert d.index == position, f"chunk at index {d.index}, expected {position}"
        position += len(d.token_ids)
    assert position == TOKENS
    assert deltas[-1].finish_reason == "length"


def test_workers_are_placed_on_different_nodes_and_both_take_requests(sim_server):
    where = placements(sim_server)
    assert len(where) == 2 and len(set(where.values())) == 2, where

    results = asyncio.run(stream_all(sim_server.address, 8))

    assert [err for _, err in results if err] == []
    for deltas, _ in results:
        assert_whole(deltas)
    steps = [json.loads(line) for line in sim_server.step_log.read_text().splitlines()]
    busy_workers = {s["worker"] for s in steps if s["batch"] > 0}
    assert busy_workers == set(where), f"steps came from {busy_workers}, workers are {set(where)}"


def test_removing_a_node_mid_stream_loses_and_repeats_no_token(cluster, sim_server):
    where = placements(sim_server)
    victim_node = next(iter(where.values()))
    node = next(n for n in cluster.worker_nodes_ if n.node_id == victim_node)
    removed = []

    def remove_once(deltas):
        if not removed and sum(len(d.token_ids) for d in deltas) >= 15:
            removed.append(True)
            cluster.remove_node(node)  # its raylet and every process on it end now

    results = asyncio.run(stream_all(sim_server.address, 8, on_token=remove_once))

    assert removed
    assert [err for _, err in results if err] == []
    for deltas, _ in results:
        assert_whole(deltas)
    assert any(deltas[-1].attempt > 1 for deltas, _ in results), "no stream was on the removed node"
    # The lost worker is replaced, by Ray, on a node that is still there.
    assert wait_until(lambda: len(placements(sim_server)) >= 3, timeout=120)
    alive = {n.node_id for n in cluster.worker_nodes_ if n is not node}
    newest = max(placements(sim_server))
    assert placements(sim_server)[newest] in alive
    with Client(sim_server.address) as c:
        assert wait_until(lambda: all(m.loaded for m in c.list_models(timeout=5)), timeout=120)


def test_a_partitioned_node_is_given_up_on_the_watchdogs_time_and_its_streams_continue_elsewhere(cluster, sim_server):
    """What a network partition looks like from here: the node's raylet and the worker's actor are there
    but silent (SIGSTOPped). Nothing closes the worker's socket and Ray does not yet call the node dead;
    the watchdog must, and then every stream on it continues on a worker that answers."""
    spare = cluster.add_node(num_cpus=1)  # room for the replacement while the partitioned node holds its CPU
    cluster.wait_for_nodes()
    partitioned = []
    stopped: list[int] = []
    nodes = {n.node_id: n for n in cluster.worker_nodes_ + [spare]}

    def partition_once(deltas):
        if partitioned or sum(len(d.token_ids) for d in deltas) < 15:
            return
        # The worker running most of the streams now, by the step log; its node and its actor go silent.
        recent = [json.loads(line) for line in sim_server.step_log.read_text().splitlines()[-40:]]
        wid = max(recent, key=lambda s: s["batch"])["worker"]
        node = nodes[placements(sim_server)[wid]]
        actor_pid = int(re.findall(rf"worker {wid} ready: .* pid (\d+)\)", sim_server.output())[-1])
        stopped.extend([proc.process.pid for proc in node.all_processes["raylet"]] + [actor_pid])
        partitioned.append(node)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)

    try:
        started = time.monotonic()
        results = asyncio.run(asyncio.wait_for(stream_all(sim_server.address, 8, on_token=partition_once), 90))
        ended = time.monotonic()
        assert partitioned
        assert [err for _, err in results if err] == []
        for deltas, _ in results:
            assert_whole(deltas)
        assert any(deltas[-1].attempt > 1 for deltas, _ in results), "no stream was on the partitioned node"
        assert "declared lost" in sim_server.output()
        # A new request is served (by the survivor or the replacement), not left to its deadline.
        with Client(sim_server.address) as c:
            assert len(c.complete(token_ids=[3, 5, 7], max_tokens=8, ignore_eos=True, timeout=60).token_ids) == 8
        print(f"8 streams done {ended - started:.1f} s after they began, a node partitioned mid-way")
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for node in partitioned:
            cluster.remove_node(node)


def test_on_ray_the_autoscaler_adds_an_actor_that_ray_places_and_removes_it_after_the_cool_down(cluster, tmp_path):
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]  # room for this server's worker and the one it adds
    cluster.wait_for_nodes()
    steps = tmp_path / "steps.jsonl"
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--workers", "1", "--ray-address", cluster.address,
                           "--sim-step-ms", "60", "--max-seqs", "4", "--autoscale-max-workers", "2",
                           "--autoscale-queue-age-s", "0.5", "--autoscale-cooldown-s", "3", "--autoscale-settle-s", "1",
                           "--step-log", str(steps), "--log-level", "INFO").start()
    try:
        async def burst():
            async with AsyncClient(server.address) as client:
                async def one(i: int):
                    return [d async for d in client.generate(token_ids=[3 + i, 5, 7], max_tokens=TOKENS,
                                                             ignore_eos=True, traffic_class="bulk")]

                return await asyncio.gather(*(one(i) for i in range(48)))

        for deltas in asyncio.run(burst()):
            assert_whole(deltas)
        added = re.findall(r"autoscale: adding worker (\d+)", server.output())
        assert added, server.output()[-3000:]
        new = int(added[0])
        assert new in placements(server), "the added worker did not start on a Ray node"
        log = [json.loads(line) for line in steps.read_text().splitlines()]
        assert any(s["worker"] == new and s["batch"] > 0 for s in log), "the added actor took no work"
        assert wait_until(lambda: "autoscale: removing worker" in server.output(), timeout=60)
        assert wait_until(lambda: "stopped after removal" in server.output(), timeout=60)  # the actor ended
    finally:
        server.stop()
        for node in nodes:
            cluster.remove_node(node)


def test_the_real_engine_in_a_ray_actor_answers_as_the_float32_reference_does(cluster):
    from tokenline.engine.models import resolve_model
    from tests.greedy import Float32Judge

    judge = Float32Judge(resolve_model("tiny-trained"))
    node = cluster.add_node(num_cpus=1)  # room for one more worker beside the simulated ones
    cluster.wait_for_nodes()
    server = ServerProcess("--model", "tiny-trained", "--workers", "1", "--ray-address", cluster.address, "--kv-cache-mb", "64",
                           "--max-seqs", "4", "--max-model-len", "512", "--log-level", "INFO").start()
    try:
        assert placements(server), "the worker did not run on a Ray node"
        prompt = judge.encode("a story about a lighthouse")
        with Client(server.address) as c:
            deltas = list(c.generate(token_ids=prompt, max_tokens=24, temperature=0, ignore_eos=True))
    finally:
        server.stop()
        cluster.remove_node(node)
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == 24
    assert judge.violations(prompt, tokens) == []


def test_a_peer_that_connects_to_the_dial_back_port_and_says_nothing_does_not_hold_it(monkeypatch):
    """The port a worker's actor dials back to: a silent connection is dropped after the handshake
    limit, and the actor that dials in next is accepted (it waited for ever before)."""
    import multiprocessing.connection
    import socket
    import threading
    import types

    from tokenline.engine import ray_workers

    monkeypatch.setattr(ray_workers, "HANDSHAKE_S", 1.0)
    never_done = types.SimpleNamespace(wait=lambda refs, timeout: ([], refs))  # the actor's run is still under way
    cluster = types.SimpleNamespace(host="127.0.0.1", ray=never_done)
    handle = ray_workers.RayWorkerHandle(0, None, lambda *a: None, lambda *a: None, cluster=cluster)
    handle._server = socket.create_server(("127.0.0.1", 0))
    handle._server.settimeout(ray_workers.ACCEPT_POLL_S)
    address = handle._server.getsockname()[:2]
    silent = socket.create_connection(address)
    accepted = []
    accepting = threading.Thread(target=lambda: accepted.append(handle._accept()), daemon=True)
    accepting.start()
    actor = []  # the real worker, next in line
    dialling = threading.Thread(target=lambda: actor.append(
        multiprocessing.connection.Client(address, authkey=handle._authkey)), daemon=True)
    dialling.start()
    accepting.join(timeout=15)
    dialling.join(timeout=5)
    try:
        assert not accepting.is_alive() and actor, "the silent peer still holds the port"
        assert accepted[0] is not None
        accepted[0].send("hello")
        assert actor[0].recv() == "hello"
    finally:
        silent.close()

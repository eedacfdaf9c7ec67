"""What "accepted" promises when real worker processes die under real streams."""

import asyncio
import os
import signal
import time

import pytest
from grpc_health.v1 import health_pb2

from tokenline.client import AsyncClient, Client
from tokenline.client.errors import TokenlineError
from tests.support import HealthWatcher, ServerProcess, wait_until

pytestmark = pytest.mark.engine

MARKER = "POISON-PILL"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024",
                      "--fault-marker", MARKER, "--log-level", "WARNING").start()
    yield s
    s.stop()


def worker_pids(server: ServerProcess) -> list[int]:
    """The server's worker processes (spawned Python children running the step loop)."""
    pids = []
    for pid in server.worker_pids():
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "multiprocessing.spawn" in cmd or "spawn_main" in cmd:
            if "resource_tracker" not in cmd:
                pids.append(pid)
    return pids


def models_loaded(server) -> bool:
    with Client(server.address) as c:
        return all(m.loaded for m in c.list_models(timeout=5))


PROMPTS = [f"stream number {i} tells a story" for i in range(16)]


async def run_streams(address, *, kill_after_tokens: int | None = None, server=None):
    """16 greedy streams; optionally SIGKILL the worker once the first has `kill_after_tokens` tokens."""
    killed_at = None
    first_after_kill = None
    async with AsyncClient(address) as client:
        async def one(prompt):
            nonlocal killed_at, first_after_kill
            deltas = []
            try:
                async for d in client.generate(prompt, max_tokens=96, temperature=0, ignore_eos=True):
                    deltas.append(d)
                    if killed_at is not None and first_after_kill is None and d.attempt > 1:
                        first_after_kill = time.monotonic()
                    produced = sum(len(x.token_ids) for x in deltas)
                    if kill_after_tokens is not None and killed_at is None and produced >= kill_after_tokens:
                        killed_at = time.monotonic()
                        for pid in worker_pids(server):
                            os.kill(pid, signal.SIGKILL)
            except TokenlineError as err:
                return deltas, err
            return deltas, None

        results = await asyncio.gather(*(one(p) for p in PROMPTS))
    return results, killed_at, first_after_kill


def test_worker_sigkill_mid_stream_every_stream_completes_once_with_the_uninterrupted_text(server):
    reference, _, _ = asyncio.run(run_streams(server.address))
    expected = [[t for d in deltas for t in d.token_ids] for deltas, _ in reference]
    assert all(len(e) == 96 for e in expected)

    with HealthWatcher(server) as health:
        results, killed_at, first_after_kill = asyncio.run(run_streams(server.address, kill_after_tokens=20, server=server))
    health_seen = health.seen
    assert killed_at is not None
    # While the only worker was down, health said so; it came back once the worker was restarted.
    assert health_pb2.HealthCheckResponse.NOT_SERVING in health_seen
    assert health_seen[-1] == health_pb2.HealthCheckResponse.SERVING
    retried = 0
    for (deltas, err), want in zip(results, expected):
        if err is not None:
            # A clear status, never a silent truncation.
            assert err.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION"), err
            continue
        tokens = [t for d in deltas for t in d.token_ids]
        indexes = [d.index for d in deltas]
        # Contiguous: no token repeated, none missing, across the attempt boundary.
        position = 0
        for d in deltas:
            assert d.index == position
            position += len(d.token_ids)
        assert indexes == sorted(indexes)
        assert tokens == want
        retried += deltas[-1].attempt > 1
    completed = sum(err is None for _, err in results)
    assert completed == 16
    assert retried >= 1
    recover_s = (first_after_kill - killed_at) if first_after_kill else None
    print(f"\nworker SIGKILL: {completed}/16 streams completed identical to the uninterrupted run, "
          f"{retried} continued as attempt 2; first token after the kill in {recover_s:.2f} s")
    assert wait_until(lambda: models_loaded(server), timeout=120)


def test_a_poison_request_is_quarantined_after_two_crashes_while_other_traffic_completes(server):
    assert wait_until(lambda: models_loaded(server), timeout=120)

    async def run():
        async with AsyncClient(server.address) as client:
            async def normal(i):
                for _ in range(20):  # a caller retries what was refused while the worker restarted
                    try:
                        r = await client.complete(f"normal {i}", max_tokens=16, ignore_eos=True)
                        return r
                    except TokenlineError as err:
                        if err.code.name != "UNAVAILABLE":
                            raise
                        await asyncio.sleep(0.5)
                raise AssertionError("normal request never completed")

            async def poison():
                try:
                    await client.complete(f"{MARKER} please crash", max_tokens=16, ignore_eos=True)
                except TokenlineError as err:
                    return err
                return None

            normal_tasks = [asyncio.create_task(normal(i)) for i in range(6)]
            poison_err = await poison()
            return poison_err, await asyncio.gather(*normal_tasks)

    poison_err, normals = asyncio.run(run())
    assert poison_err is not None and poison_err.code.name == "FAILED_PRECONDITION"
    assert "quarantined" in poison_err.details
    assert all(len(r.token_ids) == 16 for r in normals)
    # The same request is refused at once now, without touching a worker.
    assert wait_until(lambda: models_loaded(server), timeout=120)
    pids_before = worker_pids(server)
    with Client(server.address) as client:
        with pytest.raises(TokenlineError) as info:
            client.complete(f"{MARKER} please crash", max_tokens=16, ignore_eos=True)
    assert info.value.code.name == "FAILED_PRECONDITION"
    assert worker_pids(server) == pids_before


def test_with_a_standby_worker_a_killed_worker_is_replaced_at_once_and_health_never_drops():
    import re

    s = ServerProcess("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024",
                      "--standby-workers", "1").start()
    try:
        assert wait_until(lambda: "standby worker" in s.output() and "ready" in s.output(), timeout=120)
        active_pid = int(re.search(r"worker \d+ ready: model \S+, pid (\d+), \d+ KV", s.output()).group(1))
        reference, _, _ = asyncio.run(run_streams(s.address))
        expected = [[t for d in deltas for t in d.token_ids] for deltas, _ in reference]

        marks = {}

        async def kill_active_mid_stream():
            async with AsyncClient(s.address) as client:
                async def one(prompt, kill):
                    deltas = []
                    async for d in client.generate(prompt, max_tokens=96, temperature=0, ignore_eos=True):
                        deltas.append(d)
                        if d.attempt > 1 and "killed" in marks:
                            marks.setdefault("resumed", time.monotonic())
                        if kill and sum(len(x.token_ids) for x in deltas) >= 20:
                            kill = False
                            marks["killed"] = time.monotonic()
                            os.kill(active_pid, signal.SIGKILL)
                    return deltas
                return await asyncio.gather(*(one(p, i == 0) for i, p in enumerate(PROMPTS)))

        with HealthWatcher(s) as health:
            results = asyncio.run(kill_active_mid_stream())
        health_seen = health.seen
        for deltas, want in zip(results, expected):
            assert [t for d in deltas for t in d.token_ids] == want
        assert any(d.attempt > 1 for deltas in results for d in deltas)
        # The standby took over in the same instant: health never said NOT_SERVING.
        assert health_pb2.HealthCheckResponse.NOT_SERVING not in health_seen
        assert "takes over" in s.output()
        print(f"\nstandby takeover: first token after the kill in {marks['resumed'] - marks['killed']:.2f} s")
        # And a new standby is loaded to take the next failure.
        assert wait_until(lambda: s.output().count("standby worker") >= 3, timeout=120)
    finally:
        s.stop()

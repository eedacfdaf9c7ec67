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
    s = ServerProcess("--model", "tiny-trained", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024",
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
TOKENS = 96


@pytest.fixture(scope="module")
def judge():
    from tokenline.engine.models import resolve_model
    from tests.greedy import Float32Judge

    return Float32Judge(resolve_model("tiny-trained"))


async def run_streams(address, prompts, *, kill_after_tokens: int | None = None, kill=None):
    """Greedy streams of token-id prompts; once the first has `kill_after_tokens` tokens, call `kill()`.

    Returns ([(deltas, error)], seconds from the kill to the first token of a later attempt).
    """
    marks: dict[str, float] = {}
    async with AsyncClient(address) as client:
        async def one(prompt_ids):
            deltas = []
            try:
                async for d in client.generate(token_ids=prompt_ids, max_tokens=TOKENS, temperature=0, ignore_eos=True):
                    deltas.append(d)
                    if d.attempt > 1 and "killed" in marks:
                        marks.setdefault("resumed", time.monotonic())
                    produced = sum(len(x.token_ids) for x in deltas)
                    if kill_after_tokens is not None and "killed" not in marks and produced >= kill_after_tokens:
                        marks["killed"] = time.monotonic()
                        kill()
            except TokenlineError as err:
                return deltas, err
            return deltas, None

        results = await asyncio.gather(*(one(p) for p in prompts))
    assert "killed" in marks, "the kill never happened"
    recovered_s = marks["resumed"] - marks["killed"] if "resumed" in marks else None
    return results, recovered_s


def assert_whole_and_greedy(judge, prompt_ids, deltas):
    """What a greedy stream promises across attempts (see tests/greedy.py)."""
    # Contiguous: every index once, in order, no token repeated or missing at the attempt boundary.
    position = 0
    for d in deltas:
        assert d.index == position, f"chunk at index {d.index}, expected {position}"
        position += len(d.token_ids)
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == TOKENS
    # Every token, the first of each new attempt included, is a greedy choice given exactly the
    # tokens the caller received before it.
    assert judge.violations(prompt_ids, tokens) == []
    # The text is the text of the tokens, whatever attempt produced them.
    assert "".join(d.text for d in deltas) == judge.streamed_text(tokens)


def test_worker_sigkill_mid_stream_every_stream_completes_once_and_continues_from_what_was_delivered(server, judge):
    prompts = [judge.encode(p) for p in PROMPTS]

    def kill_workers():
        for pid in worker_pids(server):
            os.kill(pid, signal.SIGKILL)

    with HealthWatcher(server) as health:
        results, recovered_s = asyncio.run(run_streams(server.address, prompts, kill_after_tokens=20, kill=kill_workers))
    health_seen = health.seen
    # While the only worker was down, health said so; it comes back once the worker is restarted. (The
    # watcher's last answer may predate the restart: under a CPU hog the streams finished right after it,
    # between two of its polls, so the server is asked again.)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in health_seen
    assert health_seen[-1] == health_pb2.HealthCheckResponse.SERVING or \
        wait_until(lambda: server.health() == health_pb2.HealthCheckResponse.SERVING, timeout=60)
    errors = [err for _, err in results if err is not None]
    assert errors == [], f"streams ended with errors: {errors}"
    for prompt_ids, (deltas, _) in zip(prompts, results):
        assert_whole_and_greedy(judge, prompt_ids, deltas)
    retried = sum(deltas[-1].attempt > 1 for deltas, _ in results)
    assert retried >= 1
    # One crash blames no one: the interrupted streams ran on together, not one at a time as suspects.
    spans = [(min(d.received_at for d in deltas if d.attempt > 1), max(d.received_at for d in deltas if d.attempt > 1))
             for deltas, _ in results if deltas[-1].attempt > 1]
    together = max(sum(1 for a, b in spans if a <= start <= b) for start, _ in spans)
    assert together >= len(spans) // 2, f"retried streams ran {together} at a time"
    print(f"\nworker SIGKILL: 16/16 streams completed whole and greedy across the boundary, {retried} continued "
          f"as attempt 2, up to {together} at a time; first token after the kill in {recovered_s:.2f} s")
    assert wait_until(lambda: models_loaded(server), timeout=120)


def test_a_poison_request_is_named_by_a_crash_while_alone_and_quarantined_while_other_traffic_completes(server):
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


def test_with_a_standby_worker_a_killed_worker_is_replaced_at_once_and_health_never_drops(judge):
    import re

    s = ServerProcess("--model", "tiny-trained", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024",
                      "--standby-workers", "1").start()
    try:
        assert wait_until(lambda: "standby worker" in s.output() and "ready" in s.output(), timeout=120)
        active_pid = int(re.search(r"worker \d+ ready: model \S+, pid (\d+), \d+ KV", s.output()).group(1))
        prompts = [judge.encode(p) for p in PROMPTS]

        with HealthWatcher(s) as health:
            results, recovered_s = asyncio.run(run_streams(s.address, prompts, kill_after_tokens=20,
                                                           kill=lambda: os.kill(active_pid, signal.SIGKILL)))
        health_seen = health.seen
        assert [err for _, err in results if err is not None] == []
        for prompt_ids, (deltas, _) in zip(prompts, results):
            assert_whole_and_greedy(judge, prompt_ids, deltas)
        assert any(d.attempt > 1 for deltas, _ in results for d in deltas)
        # The standby took over in the same instant: health never said NOT_SERVING.
        assert health_pb2.HealthCheckResponse.NOT_SERVING not in health_seen
        assert "takes over" in s.output()
        print(f"\nstandby takeover: first token after the kill in {recovered_s:.2f} s")
        # And a new standby is loaded to take the next failure.
        assert wait_until(lambda: s.output().count("standby worker") >= 3, timeout=120)
    finally:
        s.stop()


def test_a_hung_worker_is_declared_lost_and_its_streams_continue_on_the_standby(judge):
    import re

    s = ServerProcess("--model", "tiny-trained", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024",
                      "--standby-workers", "1", "--step-watchdog-s", "3").start()
    stopped = None
    try:
        assert wait_until(lambda: "standby worker" in s.output() and "ready" in s.output(), timeout=120)
        active_pid = int(re.search(r"worker \d+ ready: model \S+, pid (\d+), \d+ KV", s.output()).group(1))
        prompts = [judge.encode(p) for p in PROMPTS]

        def hang():
            nonlocal stopped
            stopped = active_pid
            os.kill(active_pid, signal.SIGSTOP)  # alive, holding its pipe, silent: no crash to notice

        with HealthWatcher(s) as health:
            results, recovered_s = asyncio.run(run_streams(s.address, prompts, kill_after_tokens=20, kill=hang))
        assert [err for _, err in results if err is not None] == []
        for prompt_ids, (deltas, _) in zip(prompts, results):
            assert_whole_and_greedy(judge, prompt_ids, deltas)
        assert any(d.attempt > 1 for deltas, _ in results for d in deltas)
        assert "declared lost" in s.output()
        assert wait_until(lambda: not os.path.exists(f"/proc/{active_pid}") or _is_zombie(active_pid), timeout=30)
        # The standby took over: health never said NOT_SERVING.
        assert health_pb2.HealthCheckResponse.NOT_SERVING not in health.seen
        print(f"\nhung worker: declared lost; first token after the hang in {recovered_s:.2f} s")
    finally:
        if stopped is not None and os.path.exists(f"/proc/{stopped}"):
            os.kill(stopped, signal.SIGCONT)
        s.stop()


def _is_zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True

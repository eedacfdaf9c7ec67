"""SIGTERM drains: health goes NOT_SERVING, new calls are refused, running streams finish, exit 0."""

import asyncio
import signal
import threading

import pytest
from grpc_health.v1 import health_pb2

from tokenline.client import AsyncClient, Client
from tokenline.client.errors import Unavailable
from tests.support import ServerProcess, wait_until

pytestmark = pytest.mark.engine


def test_sigterm_under_load_drains_and_exits_zero():
    # Streams of 2,000 tokens: still draining when the late call comes, on a fast machine too (at 400 they had ended
    # and the port had closed: the call was refused by the kernel, not by the draining server).
    server = ServerProcess("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "2048",
                           "--grace-s", "120").start()
    started, running = threading.Event(), set()
    try:
        async def streams():
            async with AsyncClient(server.address) as client:
                async def one(i):
                    deltas = []
                    async for d in client.generate(f"drain {i}", max_tokens=2000, ignore_eos=True):
                        deltas.append(d)
                        running.add(i)
                        if len(running) == 8:
                            started.set()
                    return deltas
                return await asyncio.gather(*(one(i) for i in range(8)))

        result = {}
        runner = threading.Thread(target=lambda: result.setdefault("streams", asyncio.run(streams())))
        runner.start()
        assert started.wait(120)  # every stream has its first token: all are running, none merely on its way
        server.signal(signal.SIGTERM)
        assert wait_until(lambda: server.health() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10)
        with Client(server.address) as client, pytest.raises(Unavailable) as info:
            client.complete("too late", max_tokens=4)
        assert runner.is_alive(), "the streams had ended before the late call: nothing was draining"
        assert "draining" in info.value.details
        runner.join(180)
        assert server.wait(120) == 0
        for deltas in result["streams"]:
            assert sum(len(d.token_ids) for d in deltas) == 2000
            assert deltas[-1].finish_reason == "length"
    finally:
        server.stop()

"""A storm of client disconnects leaves nothing running and every KV block free."""

import asyncio
import random

import pytest

from tokenline.client import AsyncClient
from tests.support import ServerProcess, free_port, metric_values, scrape, wait_until

pytestmark = pytest.mark.engine


def test_200_streams_cancelled_at_random_points_leave_no_running_request_and_all_kv_free():
    port = free_port()
    server = ServerProcess("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "32", "--max-model-len", "1024",
                           "--workers", "2", "--metrics-port", str(port)).start()
    rng = random.Random(3)
    try:
        async def storm():
            async with AsyncClient(server.address) as client:
                async def one(i):
                    stop_after = rng.randint(0, 40)
                    stream = client.generate(f"storm {i}", max_tokens=200, ignore_eos=True,
                                             traffic_class=rng.choice(["interactive", "bulk"]))
                    seen = 0
                    async for d in stream:
                        seen += len(d.token_ids)
                        if seen >= stop_after:
                            stream.cancel()
                            break
                    return seen

                async def launch(i):
                    await asyncio.sleep(rng.random() * 2.0)
                    return await one(i)

                return await asyncio.gather(*(launch(i) for i in range(200)))

        seen = asyncio.run(storm())
        assert len(seen) == 200

        def drained():
            m = scrape(port)
            running = metric_values(m, "tokenline_worker_running_sequences")
            kv = metric_values(m, "tokenline_worker_kv_usage_ratio")
            inflight = metric_values(m, "tokenline_requests_in_flight")
            # Each gauge must be there to be read as zero: a missing metric is not a drained server.
            return len(running) == 2 and len(kv) == 2 and len(inflight) >= 1 and \
                all(v == 0 for v in running) and all(v == 0 for v in kv) and all(v == 0 for v in inflight)

        assert wait_until(drained, timeout=30), scrape(port)
    finally:
        server.stop()

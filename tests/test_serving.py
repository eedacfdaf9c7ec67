"""Serving on the real vLLM engine (tiny random model: assert on tokens, not text)."""

import asyncio

import pytest

from tokenline.client import AsyncClient, Client
from tests.support import metric_values, scrape, wait_until

pytestmark = pytest.mark.engine


def test_tokens_arrive_incrementally_before_the_last_one_is_generated(tiny_server):
    with Client(tiny_server.address) as client:
        deltas = list(client.generate("stream me", max_tokens=64, ignore_eos=True))
    token_chunks = [d for d in deltas if d.token_ids]
    assert len(token_chunks) > 1
    t = deltas[-1].timeline
    # The server produced the first token well before it finished, and the client
    # received the first chunk before the last token existed.
    assert t.first_token_ms < t.finished_ms
    assert t.decode_ms > 0
    assert token_chunks[0].received_at < deltas[-1].received_at


def test_greedy_generate_and_complete_give_the_same_tokens_and_text(tiny_server):
    with Client(tiny_server.address) as client:
        streamed = list(client.generate("same answer", max_tokens=32, temperature=0, ignore_eos=True))
        whole = client.complete("same answer", max_tokens=32, temperature=0, ignore_eos=True)
    assert [t for d in streamed for t in d.token_ids] == list(whole.token_ids)
    assert "".join(d.text for d in streamed) == whole.text
    assert len(whole.token_ids) == 32


def test_token_id_and_chat_prompts_are_served(tiny_server):
    with Client(tiny_server.address) as client:
        by_ids = client.complete(token_ids=[5, 6, 7, 8], max_tokens=8, ignore_eos=True)
        by_chat = client.complete(messages=[{"role": "user", "content": "hi"}], max_tokens=8, ignore_eos=True)
    assert by_ids.usage.prompt_tokens == 4 and len(by_ids.token_ids) == 8
    assert by_chat.usage.prompt_tokens > 2 and len(by_chat.token_ids) == 8


def test_concurrent_streams_are_batched_and_all_complete(tiny_server):
    async def run():
        async with AsyncClient(tiny_server.address) as client:
            async def one(i):
                return [d async for d in client.generate(f"request {i}", max_tokens=24, ignore_eos=True)]
            return await asyncio.gather(*(one(i) for i in range(12)))

    results = asyncio.run(run())
    for deltas in results:
        assert sum(len(d.token_ids) for d in deltas) == 24
        assert deltas[-1].finish_reason == "length"


def _worker_idle(server) -> bool:
    m = scrape(server.metrics_port)
    running = metric_values(m, "tokenline_worker_running_sequences")
    kv = metric_values(m, "tokenline_worker_kv_usage_ratio")
    return bool(running) and all(v == 0 for v in running) and all(v == 0 for v in kv)


@pytest.mark.parametrize("how", ["client cancel", "Cancel RPC"])
def test_cancelling_mid_stream_ends_the_request_and_frees_the_worker(tiny_server, how):
    with Client(tiny_server.address) as client:
        stream = client.generate("cancel me", max_tokens=1500, ignore_eos=True, request_id=f"cancel-{how}")
        it = iter(stream)
        received = len(next(it).token_ids)
        m = scrape(tiny_server.metrics_port)
        assert max(metric_values(m, "tokenline_worker_running_sequences")) >= 1 or received
        if how == "client cancel":
            stream.cancel()
            rest = list(it)
            assert rest == []
        else:
            assert client.cancel(f"cancel-{how}") is True
            rest = list(it)
            assert rest[-1].finish_reason == "cancelled"
        received += sum(len(d.token_ids) for d in rest)
    assert received < 1500
    assert wait_until(lambda: _worker_idle(tiny_server), timeout=10), scrape(tiny_server.metrics_port)

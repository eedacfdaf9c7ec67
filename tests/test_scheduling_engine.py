"""Scheduling on the real engine: interactive traffic cuts through a bulk flood."""

import asyncio
import statistics

import pytest

from tokenline.client import AsyncClient, Client
from tokenline.client.errors import Overloaded
from tests.support import ServerProcess
from tests.test_telemetry import METRICS_URL, Scrape

pytestmark = pytest.mark.engine


def _eight_slot_server(interactive_slots: int) -> ServerProcess:
    # 8 sequence slots for bulk, so a flood of 32 bulk requests keeps every one busy.
    return ServerProcess("--model", "tiny", "--kv-cache-mb", "32", "--max-seqs", "8", "--interactive-slots", str(interactive_slots),
                         "--max-model-len", "1024", "--queue-requests", "48", "--bulk-window-ms", "5").start()


@pytest.fixture(scope="module")
def small_server():
    # None held for interactive: an interactive arrival must take its slot from bulk.
    server = _eight_slot_server(0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def held_slots_server():
    # 2 slots beyond bulk's 8 held for interactive streams.
    server = _eight_slot_server(2)
    yield server
    server.stop()


async def _flood_then_people(address: str) -> tuple[list, list]:
    """32 bulk streams of 160 tokens; once the flood is running (its first token out), 5 interactive requests one
    after another. The people take ~5 × 8 steps, the flood 4 waves of 160: it is still queued when the last leaves,
    on a fast machine as on a slow one (a fixed second's wait plus 0.2 s pauses had outlasted it on a fast one)."""
    async with AsyncClient(address) as client:
        running = asyncio.Event()

        async def bulk_stream(i):
            deltas = []
            async for d in client.generate(f"bulk {i}", ignore_eos=True, max_tokens=160, traffic_class="bulk"):
                deltas.append(d)
                running.set()
            return deltas

        bulk = [asyncio.create_task(bulk_stream(i)) for i in range(32)]
        await asyncio.wait_for(running.wait(), timeout=120)
        interactive = []
        for i in range(5):
            interactive.append(await _stream(client, f"person {i}", max_tokens=8))
            await asyncio.sleep(0.02)
        return await asyncio.gather(*bulk), interactive


def _flood_outlasted_people(bulk, interactive) -> bool:
    """The premise: when the last person had their answer, some bulk had not yet got its first token (was queued)."""
    last_person = interactive[-1][-1].received_at
    return any(next(d.received_at for d in deltas if d.token_ids) > last_person for deltas in bulk)


async def _stream(client, prompt, **kw):
    return [d async for d in client.generate(prompt, ignore_eos=True, **kw)]


def test_interactive_gets_its_first_token_within_a_few_steps_during_a_bulk_flood(small_server):
    bulk, interactive = asyncio.run(_flood_then_people(small_server.address))
    # Bulk still completes, every token delivered once, in order.
    for deltas in bulk:
        assert [d.index for d in deltas if d.token_ids] == sorted(d.index for d in deltas if d.token_ids)
        assert sum(len(d.token_ids) for d in deltas) == 160
    bulk_waits = [d[-1].timeline.admitted_ms - d[-1].timeline.enqueued_ms for d in bulk]
    inter_waits = [d[-1].timeline.admitted_ms - d[-1].timeline.enqueued_ms for d in interactive]
    itl = statistics.median(d[-1].timeline.itl_mean_ms for d in bulk)
    # Interactive requests waited a few steps at most, while bulk queued behind the flood.
    assert max(inter_waits) < 5 * itl + 50, (inter_waits, itl)
    assert max(inter_waits) < max(bulk_waits) / 4
    assert _flood_outlasted_people(bulk, interactive), "the flood had drained before the people came"
    # Taking slots from bulk is visible as preemptions on bulk timelines, and the time they
    # lost is accounted on its own: every split still adds up to the completion time.
    preempted = [d[-1].timeline for d in bulk if d[-1].timeline.preemptions]
    assert preempted
    for t in preempted:
        assert t.lost_preemption_ms > 0
        parts = (t.enqueued_ms + t.admission_wait_ms + t.queueing_ms + t.prefill_ms + t.decode_ms
                 + t.lost_preemption_ms + t.lost_retry_ms + t.return_ms)
        assert parts == pytest.approx(t.completion_ms, abs=0.01), t


def test_with_slots_held_for_interactive_a_stream_cuts_through_the_flood_and_no_bulk_run_is_stopped(held_slots_server):
    bulk, interactive = asyncio.run(_flood_then_people(held_slots_server.address))
    for deltas in bulk:
        assert [d.index for d in deltas if d.token_ids] == sorted(d.index for d in deltas if d.token_ids)
        assert sum(len(d.token_ids) for d in deltas) == 160
    assert all(sum(len(d.token_ids) for d in deltas) == 8 for deltas in interactive)
    bulk_waits = [d[-1].timeline.admitted_ms - d[-1].timeline.enqueued_ms for d in bulk]
    inter_waits = [d[-1].timeline.admitted_ms - d[-1].timeline.enqueued_ms for d in interactive]
    itl = statistics.median(d[-1].timeline.itl_mean_ms for d in bulk)
    assert max(inter_waits) < 5 * itl + 50, (inter_waits, itl)
    assert max(inter_waits) < max(bulk_waits) / 4
    assert _flood_outlasted_people(bulk, interactive), "the flood had drained before the people came"
    # Each took a held slot: no bulk run was preempted (and redone) for it.
    assert not any(d[-1].timeline.preemptions for d in bulk)


def test_beyond_the_queue_limit_refusals_come_back_at_once_with_a_retry_hint(small_server):
    async def run():
        async with AsyncClient(small_server.address) as client:
            async def one(i):
                try:
                    return await _stream(client, f"load {i}", max_tokens=64, traffic_class="bulk")
                except Overloaded as err:
                    return err
            return await asyncio.gather(*(one(i) for i in range(120)))

    results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, Overloaded)]
    accepted = [r for r in results if not isinstance(r, Overloaded)]
    assert refused, "120 requests against 8 slots + 48 queued must overflow"
    assert all(r.retry_after_s and r.retry_after_s > 0 for r in refused)
    assert all("queue" in r.details for r in refused)
    # Everything accepted completes in full.
    assert all(sum(len(d.token_ids) for d in a) == 64 for a in accepted)
    assert len(accepted) >= 8 + 48 - 8  # at least the queue and the slots' worth


def test_with_late_requests_refused_a_burst_gets_first_tokens_or_a_refusal_with_a_retry_hint():
    """`--late-interactive refuse` on the real engine: a burst of long prompts that no worker can start within a
    150 ms TTFT target. Those it can are served whole; the rest are answered RESOURCE_EXHAUSTED with a retry hint
    (not served late); retried once the burst has passed, a refused one is served."""
    server = ServerProcess("--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16", "--max-model-len", "1024",
                           "--late-interactive", "refuse", "--interactive-ttft-target-ms", "150", "--metrics-port", "0").start()
    prompts = [[(7 * i + 13 * j) % 500 + 3 for j in range(900)] for i in range(40)]
    try:
        assert "late interactive requests refused" in server.output()

        async def burst():
            async with AsyncClient(server.address) as client:
                for p in prompts[:3]:  # the worker learns what a prompt token costs
                    await _stream(client, None, token_ids=p[::-1], max_tokens=4)

                async def one(p):
                    try:
                        return await _stream(client, None, token_ids=p, max_tokens=16, timeout=120)  # never left queued
                    except Overloaded as err:
                        return err
                return await asyncio.gather(*(one(p) for p in prompts))

        results = asyncio.run(burst())
        refused = [(p, r) for p, r in zip(prompts, results) if isinstance(r, Overloaded)]
        served = [r for r in results if not isinstance(r, Overloaded)]
        assert served and refused, (len(served), len(refused))
        print(f"\nlate requests refused: {len(served)} of {len(prompts)} served, {len(refused)} refused, hints "
              f"{min(e.retry_after_s for _, e in refused):.2f}-{max(e.retry_after_s for _, e in refused):.2f} s")
        for deltas in served:
            assert [d.index for d in deltas if d.token_ids] == sorted(d.index for d in deltas if d.token_ids)
            assert sum(len(d.token_ids) for d in deltas) == 16
        for _, err in refused:
            assert err.retry_after_s and err.retry_after_s > 0 and "TTFT target" in err.details, err
        metrics = Scrape(METRICS_URL.search(server.output()).group(1))
        assert metrics.value("tokenline_refusals_total", reason="no_room_in_time") == len(refused)
        with Client(server.address) as client:
            again = client.complete(token_ids=refused[0][0], max_tokens=16, ignore_eos=True)
        assert len(again.token_ids) == 16
    finally:
        server.stop()

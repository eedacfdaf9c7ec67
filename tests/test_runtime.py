"""The runtime between the servicer and the scheduler (server/runtime.py): what the workers are sent."""

from __future__ import annotations

import asyncio

from tokenline.engine import types as wire
from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.types import Sampling, TrafficClass, WorkerSpec
from tokenline.server.request import RequestKey, RequestState
from tokenline.server.runtime import Runtime
from tokenline.server.timeline import Timeline


def test_a_burst_of_submissions_in_one_turn_of_the_loop_reaches_the_worker_as_one_admission():
    """One dispatch (admit, plan) per turn for all its submissions: a GenerateMany message that starts many
    streams costs the scheduler one decision, and the worker one admission batch."""
    async def scenario():
        runtime = Runtime(SchedulerConfig(bulk=ClassConfig(admission_window_s=0.0)), {})  # admitted as they come
        sent: list = []
        runtime._send = lambda wid, msg: sent.append(msg)  # type: ignore[method-assign]
        runtime._handle(runtime.scheduler.add_worker(WorkerSpec(
            worker_id=0, model="m", model_version="", kv_blocks_total=4096, block_size=16, engine_seqs=64,
            max_model_len=4096, prefill_token_budget=8192, vocab_size=1000, eos_token_id=None)))
        sent.clear()
        states = [RequestState(RequestKey("t", f"r{i}"), "m", TrafficClass.BULK, [1, 2, 3], Sampling(max_tokens=8),
                               Timeline(received=0.0, validated=0.0), None) for i in range(20)]
        for st in states:
            st.subscribe()
            runtime.submit(st)
        before = list(sent)  # nothing is decided inside submit
        await asyncio.sleep(0)
        admits = [m for m in sent if isinstance(m, wire.Admit)]
        return before, admits, states

    before, admits, states = asyncio.run(scenario())
    assert before == []
    assert len(admits) == 1 and sorted(item.key for item in admits[0].items) == sorted(st.entry.run_key for st in states)
    assert all(st.timeline.admitted is not None and st.timeline.queueing_s == 0.0 for st in states)


def test_requests_submitted_in_one_turn_to_a_full_queue_are_decided_in_order_not_refused_for_each_other():
    """One slot, a queue of one: two requests in one turn are one running and one queued, as one after the other
    would be; only a third finds the queue full (tests/test_http_limits.py holds the same over HTTP)."""
    async def scenario():
        config = SchedulerConfig(interactive=ClassConfig(max_queued_requests=1))
        runtime = Runtime(config, {})
        runtime._send = lambda wid, msg: None  # type: ignore[method-assign]
        runtime._handle(runtime.scheduler.add_worker(WorkerSpec(
            worker_id=0, model="m", model_version="", kv_blocks_total=4096, block_size=16, engine_seqs=1,
            max_model_len=4096, prefill_token_budget=8192, vocab_size=1000, eos_token_id=None)))
        outcomes = []
        for i in range(3):
            st = RequestState(RequestKey("t", f"r{i}"), "m", TrafficClass.INTERACTIVE, [1, 2, 3], Sampling(max_tokens=8),
                              Timeline(received=0.0, validated=0.0), None)
            st.subscribe()
            try:
                runtime.submit(st)
                outcomes.append("in")
            except Exception as err:  # noqa: BLE001
                outcomes.append(type(err).__name__)
        await asyncio.sleep(0)
        return outcomes, runtime.scheduler.running(0), runtime.scheduler.queue_depth("m", TrafficClass.INTERACTIVE)[0]

    outcomes, running, queued = asyncio.run(scenario())
    assert outcomes == ["in", "in", "Overloaded"] and (running, queued) == (1, 1)

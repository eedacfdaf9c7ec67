"""Admission on the KV cache sequences really hold (virtual time, simulated workers).

A running sequence is charged for its prompt and the tokens it has produced, plus a small
margin, not for prompt + max_tokens; when sequences outgrow the worker's KV, bulk gives way
(newest first), never an interactive stream and never a run with a deadline promise.
"""

import math

from tokenline.engine.scheduler.budget import blocks_for
from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.simulation import SimRequest, Simulation, linear_cost, worker_spec
from tokenline.engine.types import TrafficClass

BLOCK = 16
BULK = TrafficClass.BULK


def simulation(kv_blocks: int, *, max_seqs: int = 32, margin: int = 16, workers: int = 1) -> Simulation:
    now = ClassConfig(admission_window_s=0.0)
    config = SchedulerConfig(interactive=now, bulk=now, bulk_floor=0.0, step_time_prior_s=0.01, kv_margin_tokens=margin)
    return Simulation(config, [(worker_spec(i, max_seqs=max_seqs, continuous=True, kv_blocks=kv_blocks, block_size=BLOCK),
                                linear_cost(0.01, 0.001)) for i in range(workers)])


def reservations_follow_what_each_sequence_holds(sim: Simulation) -> None:
    sched = sim.scheduler
    for w in sched.workers.values():
        for e in w.running.values():
            assert e.blocks == blocks_for(e, BLOCK, sched.config.kv_margin_tokens)
        assert w.reserved_blocks == sum(e.blocks for e in w.running.values())


def early_stoppers(n: int, cls: TrafficClass = BULK) -> list[SimRequest]:
    # Each may ask for 300 tokens (20 blocks with its prompt) but stops after 8, as chat replies do.
    return [SimRequest(f"r{i}", 0.0, prompt_tokens=16, max_tokens=300, cls=cls, stops_after=8) for i in range(n)]


def test_requests_that_stop_early_fill_the_worker_instead_of_reserving_max_tokens():
    used = simulation(kv_blocks=40)
    out = used.run(early_stoppers(30), after_event=reservations_follow_what_each_sequence_holds)
    # Charging prompt + max_tokens (a margin as large as max_tokens does exactly that) runs one at a time.
    full = simulation(kv_blocks=40, margin=300)
    full_out = full.run(early_stoppers(30))
    assert all(o.status == "finished" and o.tokens == 8 for o in [*out.values(), *full_out.values()])
    assert max(full.workers[0].batch_sizes) == 1
    assert max(used.workers[0].batch_sizes) >= 15
    assert max(o.completed for o in out.values()) < max(o.completed for o in full_out.values()) / 5


def test_an_interactive_request_is_admitted_only_where_its_whole_output_fits():
    sim = simulation(kv_blocks=40)
    out = sim.run(early_stoppers(15, TrafficClass.INTERACTIVE))
    assert all(o.status == "finished" for o in out.values())
    # 39 usable blocks; each is charged 2 but needs 20 free to be admitted: 39, 37, ..., 21 → 10 at once
    assert max(sim.workers[0].batch_sizes) == 10


def test_when_sequences_outgrow_the_kv_bulk_gives_way_and_interactive_streams_never_do():
    sim = simulation(kv_blocks=30)
    reqs = [SimRequest(f"b{i}", 0.0, prompt_tokens=16, max_tokens=128, cls=BULK) for i in range(6)]
    reqs += [SimRequest(f"i{i}", 0.001, prompt_tokens=16, max_tokens=64) for i in range(4)]
    out = sim.run(reqs, after_event=reservations_follow_what_each_sequence_holds)
    assert all(o.status == "finished" and o.tokens == o_max for o, o_max in ((out[r.key], r.max_tokens) for r in reqs))
    assert sim.scheduler.counters.kv_preemptions > 0
    assert all(out[f"i{i}"].admissions == 1 for i in range(4))
    assert any(out[f"b{i}"].admissions > 1 for i in range(6))
    # What the worker's sequences held never exceeded its KV cache: vLLM never had to preempt on its own.
    assert sim.workers[0].kv_blocks_peak <= 30


def test_the_newest_bulk_run_gives_way_first():
    sim = simulation(kv_blocks=20)
    reqs = [SimRequest(f"b{i}", i * 0.001, prompt_tokens=16, max_tokens=100, cls=BULK) for i in range(4)]
    out = sim.run(reqs)
    assert all(o.status == "finished" for o in out.values())
    assert out["b0"].admissions == 1
    assert out["b3"].admissions > 1


def test_a_bulk_run_that_must_complete_by_its_deadline_is_never_preempted_for_kv():
    sim = simulation(kv_blocks=20)
    reqs = [SimRequest("promised", 0.0, prompt_tokens=16, max_tokens=100, cls=BULK, deadline=1000.0, must_complete=True)]
    reqs += [SimRequest(f"b{i}", 0.001, prompt_tokens=16, max_tokens=100, cls=BULK) for i in range(3)]
    out = sim.run(reqs)
    assert out["promised"].status == "finished" and out["promised"].admissions == 1
    assert sim.scheduler.counters.kv_preemptions > 0


def test_reservation_is_what_the_sequence_holds_plus_the_margin_capped_at_its_last_token():
    from tokenline.engine.scheduler.records import Entry

    e = Entry("k", "m", "t", BULK, prompt_tokens=100, max_tokens=50, arrival=0.0)
    assert blocks_for(e, BLOCK, 16) == math.ceil(116 / BLOCK)
    e.generated = 40
    assert blocks_for(e, BLOCK, 16) == math.ceil(150 / BLOCK)  # never past prompt + max_tokens

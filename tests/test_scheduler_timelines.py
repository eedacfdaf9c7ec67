"""The reference timelines, exactly, in virtual time.

A fixed-cost batch model: every batch takes 100 ms whatever its size, at most
4 requests a batch, one worker, admission window 10 ms, worker idle at 0.
"""

import pytest

from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.simulation import SimRequest, Simulation, fixed_cost, worker_spec

MS = 0.001


def simulation() -> Simulation:
    window = ClassConfig(admission_window_s=10 * MS)
    config = SchedulerConfig(interactive=window, bulk=window, step_time_prior_s=100 * MS, bulk_floor=0.0)
    return Simulation(config, [(worker_spec(0, max_seqs=4, continuous=False), fixed_cost(100 * MS))])


def test_two_requests_within_the_window_depart_together_when_the_oldest_window_ends():
    out = simulation().run([SimRequest("A", 0 * MS), SimRequest("B", 7 * MS)])
    assert out["A"].departed == pytest.approx(10 * MS)
    assert out["B"].departed == pytest.approx(10 * MS)
    assert out["A"].completed == pytest.approx(110 * MS)
    assert out["B"].completed == pytest.approx(110 * MS)
    assert out["A"].end_to_end == pytest.approx(110 * MS)
    assert out["B"].end_to_end == pytest.approx(103 * MS)


def test_a_full_batch_departs_at_once():
    out = simulation().run([SimRequest(k, 0.0) for k in "ABCD"])
    for k in "ABCD":
        assert out[k].departed == pytest.approx(0.0)
        assert out[k].completed == pytest.approx(100 * MS)


def test_a_request_that_waited_past_its_window_departs_as_soon_as_capacity_returns():
    out = simulation().run([SimRequest("A", 0.0), SimRequest("B", 0.0), SimRequest("C", 0.0), SimRequest("D", 0.0), SimRequest("E", 1 * MS)])
    assert out["A"].departed == pytest.approx(0.0)
    assert out["E"].departed == pytest.approx(100 * MS)  # not 110: no timer restarts
    assert out["E"].completed == pytest.approx(200 * MS)
    # E waited for capacity, not for batching.
    assert out["E"].queueing_s == pytest.approx(99 * MS)
    assert out["E"].admission_wait_s == pytest.approx(0.0)


def test_a_request_whose_deadline_cannot_be_met_is_refused_at_arrival():
    out = simulation().run([*(SimRequest(k, 0.0) for k in "ABCD"), SimRequest("E", 1 * MS, deadline=150 * MS)])
    assert out["E"].status == "refused"
    assert out["E"].completed == pytest.approx(1 * MS)  # at arrival, not after waiting
    assert out["E"].departed is None
    assert "deadline" in out["E"].message


def test_bulk_work_that_must_complete_by_its_deadline_is_refused_when_only_its_first_token_would_fit():
    from tokenline.engine.simulation import linear_cost
    from tokenline.engine.types import TrafficClass

    config = SchedulerConfig(step_time_prior_s=10 * MS, bulk=ClassConfig(admission_window_s=0.0))
    sim = Simulation(config, [(worker_spec(0, max_seqs=8, continuous=True), linear_cost(10 * MS, 0.0))])
    # 100 tokens at 10 ms a step need about a second; the deadline is half a second away.
    first_token_only = SimRequest("A", 0.0, max_tokens=100, cls=TrafficClass.BULK, deadline=0.5)
    whole = SimRequest("B", 0.0, max_tokens=100, cls=TrafficClass.BULK, deadline=0.5, must_complete=True)
    out = sim.run([first_token_only, whole])
    assert out["B"].status == "refused" and "all 100 tokens" in out["B"].message
    assert out["A"].departed == pytest.approx(0.0)  # its first token fits: it runs (and expires at 0.5 s)
    assert out["A"].status == "expired"


def test_a_new_request_waits_rather_than_slow_a_running_one_past_its_deadline():
    from tokenline.engine.simulation import linear_cost

    # A step takes 10 ms + 10 ms per sequence: 20 ms alone, 30 ms for two.
    config = SchedulerConfig(step_time_prior_s=20 * MS)
    cost = linear_cost(10 * MS, 10 * MS)

    def run(deadline):
        sim = Simulation(config, [(worker_spec(0, max_seqs=8, continuous=True), cost)])
        for _ in range(20):  # it has been measured alone and with two sequences
            sim.scheduler.workers[0].pace.estimator.observe(1, 0, 20 * MS)
            sim.scheduler.workers[0].pace.estimator.observe(2, 0, 30 * MS)
        # R needs 20 steps: 400 ms alone, 600 ms sharing; its deadline is 500 ms.
        return sim.run([SimRequest("R", 0.0, max_tokens=20, deadline=deadline), SimRequest("N", 0.1, max_tokens=5)])

    protected = run(0.5)
    # N waits until sharing the worker no longer costs R its deadline, then joins; R makes it.
    assert protected["N"].departed > 0.1
    assert protected["R"].status == "finished"
    assert protected["R"].completed <= 0.5 + 1e-9
    unprotected = run(None)
    assert unprotected["N"].departed == pytest.approx(0.1)  # no deadline to keep: N joins at once

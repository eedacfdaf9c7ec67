"""Several workers share one model's queue: each request goes where its first token comes soonest (virtual time)."""

from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.simulation import SimRequest, Simulation, linear_cost, worker_spec


def simulation(*workers) -> Simulation:
    now = ClassConfig(admission_window_s=0.0)
    config = SchedulerConfig(interactive=now, bulk=now, bulk_floor=0.0, step_time_prior_s=0.01)
    return Simulation(config, workers)


def worker_of(sim: Simulation, key: str) -> int:
    return next(w for _, k, w in sim.dispatched if k == key)


def test_requests_go_to_the_worker_that_has_been_measured_faster():
    fast = (worker_spec(0, max_seqs=4, continuous=True), linear_cost(0.02, 0.002))
    slow = (worker_spec(1, max_seqs=4, continuous=True), linear_cost(0.10, 0.010))
    sim = simulation(slow, fast)
    burst = [SimRequest(f"burst{i}", 0.0, max_tokens=20) for i in range(8)]  # both workers run and get measured
    later = [SimRequest(f"later{i}", 10.0 + i, max_tokens=5) for i in range(5)]  # one at a time, both idle
    out = sim.run(burst + later)
    assert {worker_of(sim, f"burst{i}") for i in range(8)} == {0, 1}
    assert all(worker_of(sim, f"later{i}") == 0 for i in range(5))
    assert all(o.status == "finished" for o in out.values())


def test_before_any_step_is_measured_requests_spread_rather_than_pile_on_the_worker_with_most_slots():
    big = (worker_spec(0, max_seqs=64, continuous=True), linear_cost(0.02, 0.002))
    small = (worker_spec(1, max_seqs=8, continuous=True), linear_cost(0.02, 0.002))
    sim = simulation(big, small)
    running = [SimRequest(f"long{i}", 0.0, max_tokens=200) for i in range(4)]  # all fit worker 0's free slots
    out = sim.run(running)
    assert [worker_of(sim, f"long{i}") for i in range(4)].count(1) == 2
    assert all(o.status == "finished" for o in out.values())


def test_a_new_request_joins_the_worker_with_the_smaller_batch_when_both_are_busy():
    a = (worker_spec(0, max_seqs=16, continuous=True), linear_cost(0.02, 0.002))
    b = (worker_spec(1, max_seqs=16, continuous=True), linear_cost(0.02, 0.002))
    sim = simulation(a, b)
    reqs = [SimRequest(f"a{i}", 0.0, max_tokens=100) for i in range(6)]
    out = sim.run([*reqs, SimRequest("new", 0.3, max_tokens=5)])
    per_worker = [sum(1 for i in range(6) if worker_of(sim, f"a{i}") == w) for w in (0, 1)]
    assert per_worker == [3, 3]
    assert out["new"].status == "finished"

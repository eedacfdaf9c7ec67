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


def _prompts_admitted_on_a_report(runs_ahead: bool) -> tuple[int, int]:
    """A bulk backlog of 256-token prompts, a worker with a 512-token step budget: (prompts admitted
    at once, prompts admitted on its first report, which has not applied the first admissions yet)."""
    from dataclasses import replace

    from tokenline.engine.scheduler.core import Scheduler
    from tokenline.engine.scheduler.records import Admit, Entry
    from tokenline.engine.types import StepReport, TrafficClass

    now = ClassConfig(admission_window_s=0.0)
    s = Scheduler(SchedulerConfig(interactive=now, bulk=now, bulk_floor=0.0), lambda: 0.0)
    s.add_worker(replace(worker_spec(0, max_seqs=32, continuous=True, prefill_token_budget=512, model="sim"),
                         runs_ahead=runs_ahead))

    def admitted(actions: list) -> int:
        return sum(len(d.admissions) for d in actions if isinstance(d, Admit))

    first = sum(admitted(s.submit(Entry(key=f"b{i}", model="sim", tenant="t", cls=TrafficClass.BULK,
                                        prompt_tokens=256, max_tokens=64, arrival=0.0))) for i in range(12))
    report = StepReport(worker_id=0, applied_seq=0, step_s=0.1, batch_size=1, prefill_tokens=0,
                        kv_blocks_free=1000, running=0, waiting=0)
    return first, admitted(s.on_step(report).actions)


def test_a_worker_that_steps_on_before_its_report_is_read_gets_the_next_steps_prompts_on_that_report():
    # Its next step is already under way with the first two prompts (they reached it after it
    # reported): the two admitted now are for the step after, and its batch fills two prompts a step.
    assert _prompts_admitted_on_a_report(runs_ahead=True) == (2, 2)
    # A worker that waits for its answer would take them into the next step: no room left there.
    assert _prompts_admitted_on_a_report(runs_ahead=False) == (2, 0)


def test_prompts_waiting_for_their_format_to_compile_are_still_owed_so_a_compiling_worker_takes_no_more():
    """A worker whose admitted prompts wait for their structured-output format to compile runs empty
    steps meanwhile. Each empty report once read as 'its prompts are in, room for a step's more': it took
    two prompts a report, a hundred reports a second, until it held nearly all of a burst (55 of 64, the
    other worker 9, and every step twice as long). Its stalled prompts count against its step budget."""
    from tokenline.engine.scheduler.core import Scheduler
    from tokenline.engine.scheduler.records import Admit, Entry
    from tokenline.engine.types import StepReport, TrafficClass

    def admitted_on_empty_reports(stalled: int) -> int:
        now = ClassConfig(admission_window_s=0.0)
        s = Scheduler(SchedulerConfig(interactive=now, bulk=now, bulk_floor=0.0), lambda: 0.0)
        s.add_worker(worker_spec(0, max_seqs=64, continuous=True, prefill_token_budget=512, model="sim"))
        for i in range(40):
            s.submit(Entry(key=f"j{i}", model="sim", tenant="t", cls=TrafficClass.INTERACTIVE, prompt_tokens=256,
                           max_tokens=64, arrival=0.0))
        total = 0
        for seq in range(1, 6):  # five empty steps: the format is still compiling
            report = StepReport(worker_id=0, applied_seq=seq, step_s=0.0002, batch_size=0, prefill_tokens=0,
                                kv_blocks_free=1000, running=0, waiting=2, stalled_prompt_tokens=stalled)
            total += sum(len(d.admissions) for d in s.on_step(report).actions if isinstance(d, Admit))
        return total

    assert admitted_on_empty_reports(stalled=512) == 0  # the first two prompts fill its budget until they run
    assert admitted_on_empty_reports(stalled=0) >= 5  # unreported, it takes more on every empty report


def test_a_burst_after_an_idle_spell_is_not_refused_for_its_deadline_by_what_the_idle_model_happened_to_finish():
    # Found by `bench poison` on the real engine: one 4-token request, then 16 at once with a 600 s deadline,
    # and 12 were refused "estimated at 748 s": the drain rate was the little the idle model was asked for.
    # A drain rate counts only what finishes while the model is full; an idle model has given no evidence.
    from tokenline.engine.types import TrafficClass

    a = (worker_spec(0, max_seqs=4, continuous=True), linear_cost(0.02, 0.002))
    b = (worker_spec(1, max_seqs=4, continuous=True), linear_cost(0.02, 0.002))
    sim = simulation(a, b)
    warm = SimRequest("warm", 0.0, prompt_tokens=3, max_tokens=4)
    burst = [SimRequest(f"b{i}", 2.0, max_tokens=128, cls=TrafficClass.BULK, deadline=602.0) for i in range(16)]
    out = sim.run([warm, *burst])
    assert [k for k, o in out.items() if o.status != "finished"] == []
    # Full, the model does give evidence: its drain rate is what it finished per second full.
    rate = sim.scheduler.admission.drain_rate(sim.scheduler.models["sim"], 2.0 + 5.0)
    assert rate > 0


def test_a_new_config_reaches_admission_at_once():
    # The server swaps the scheduler's config when the keys file changes (its quotas); admission control,
    # the dispatch rule and the planner are parts of the scheduler and must read the new one, not a copy.
    from dataclasses import replace

    from tokenline.engine.scheduler.config import TenantConfig
    from tokenline.engine.scheduler.records import Refuse

    sim = simulation((worker_spec(0, max_seqs=8, continuous=True), linear_cost(0.02, 0.002)))
    s = sim.scheduler
    s.add_worker(worker_spec(0, max_seqs=8, continuous=True))
    s.config = replace(s.config, tenants={"t": TenantConfig(max_concurrent=1)})
    from tokenline.engine.scheduler.records import Entry
    from tokenline.engine.types import TrafficClass

    def entry(key):
        return Entry(key=key, model="sim", tenant="t", cls=TrafficClass.INTERACTIVE, prompt_tokens=8, max_tokens=16, arrival=0.0)

    assert not any(isinstance(a, Refuse) for a in s.submit(entry("a")))
    refused = [a for a in s.submit(entry("b")) if isinstance(a, Refuse)]
    assert refused and "its limit is 1" in refused[0].message
    assert s.admission.config is s.config and s.rules.config is s.config and s.planner.config is s.config


def test_a_tenants_limit_on_one_model_holds_there_and_leaves_its_other_models_free():
    # The keys file's "models": {"a": {"max_concurrent": 2}}: a share of model a's workers, every version of it counted
    # (runtime keys "a" and "a@v2" are one model), while model b and the tenant's overall limit are untouched.
    from dataclasses import replace

    from tokenline.engine.scheduler.config import TenantConfig
    from tokenline.engine.scheduler.records import Entry, Refuse
    from tokenline.engine.types import TrafficClass

    sim = simulation((worker_spec(0, max_seqs=8, continuous=True), linear_cost(0.02, 0.002)))
    s = sim.scheduler
    for wid, model in ((0, "a"), (1, "a@v2"), (2, "b")):
        s.add_worker(worker_spec(wid, max_seqs=8, continuous=True, model=model))
    s.config = replace(s.config, tenants={"t": TenantConfig(max_concurrent=10, model_concurrent=(("a", 2),))})

    def submit(key: str, model: str, tenant: str = "t") -> Refuse | None:
        e = Entry(key=key, model=model, tenant=tenant, cls=TrafficClass.INTERACTIVE, prompt_tokens=8, max_tokens=16,
                  arrival=0.0)
        return next((a for a in s.submit(e) if isinstance(a, Refuse)), None)

    assert submit("1", "a") is None and submit("2", "a@v2") is None
    refused = submit("3", "a")
    assert refused is not None and "on model 'a', its limit there is 2" in refused.message and refused.retry_after_s
    assert submit("4", "b") is None and submit("5", "b") is None  # another model: free
    assert submit("6", "a", tenant="other") is None  # another tenant: free
    s.cancel("1")
    assert submit("7", "a") is None  # a request of a ended: room again

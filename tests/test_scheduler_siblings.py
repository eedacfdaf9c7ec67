"""A call's n samples go to one worker while it has room, so that their prompt is computed once and shared through
the prefix cache (engine/scheduler/placement.py); never at the cost of a wait (the pure scheduler, virtual time)."""

from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.scheduler.core import Scheduler
from tokenline.engine.scheduler.records import Admit, Entry, Retry
from tokenline.engine.simulation import SimRequest, Simulation, linear_cost, worker_spec
from tokenline.engine.types import SeqOutput, StepReport, TrafficClass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(window_s: float = 0.0) -> Scheduler:
    now = ClassConfig(admission_window_s=window_s)
    return Scheduler(SchedulerConfig(interactive=now, bulk=now, bulk_floor=0.0), Clock())


def spec(worker_id: int, max_seqs: int = 32):
    return worker_spec(worker_id, max_seqs=max_seqs, continuous=True, model="sim")


def sample(key: str, group: str | None, prompt_tokens: int = 256) -> Entry:
    return Entry(key=key, model="sim", tenant="t", cls=TrafficClass.INTERACTIVE, prompt_tokens=prompt_tokens,
                 max_tokens=64, arrival=0.0, group=group)


def placed(actions: list) -> dict[str, int]:
    return {a.key: d.worker_id for d in actions if isinstance(d, Admit) for a in d.admissions}


def test_a_calls_samples_go_where_its_first_sample_went_while_calls_still_spread():
    s = scheduler()
    s.add_worker(spec(0))
    s.add_worker(spec(1))
    where: dict[str, int] = {}
    for call in ("a", "b"):  # two calls of four samples, as the frontend submits them: each submit a round
        for i in range(4):
            where |= placed(s.submit(sample(f"{call}{i}", call)))
    assert len(where) == 8  # all admitted at once: none waited for its group's worker
    assert len({where[f"a{i}"] for i in range(4)}) == 1
    assert len({where[f"b{i}"] for i in range(4)}) == 1
    assert where["a0"] != where["b0"]  # the calls themselves still go where the first token comes soonest
    # Requests without a group are spread as before.
    plain: dict[str, int] = {}
    t = scheduler()
    t.add_worker(spec(0))
    t.add_worker(spec(1))
    for i in range(4):
        plain |= placed(t.submit(sample(f"p{i}", None)))
    assert sorted(plain.values()) == [0, 0, 1, 1]


def test_samples_released_together_in_one_round_go_to_one_worker():
    s = scheduler(window_s=0.05)
    s.add_worker(spec(0))
    s.add_worker(spec(1))
    for i in range(4):
        assert not placed(s.submit(sample(f"a{i}", "a", prompt_tokens=16)))  # each waits its admission window
    s.clock.now = 0.05
    where = placed(s.on_timer())
    assert len(where) == 4 and len(set(where.values())) == 1


def test_a_sample_never_waits_for_its_groups_worker_when_another_has_room():
    s = scheduler()
    s.add_worker(spec(0, max_seqs=2))
    where = placed(s.submit(sample("a0", "a", prompt_tokens=16)))  # the group's worker: 0, with one slot left
    s.add_worker(spec(1, max_seqs=8))
    for i in range(1, 4):
        where |= placed(s.submit(sample(f"a{i}", "a", prompt_tokens=16)))
    # Two on the group's worker; the two it has no slot for went to the other at once, not after it.
    assert where == {"a0": 0, "a1": 0, "a2": 1, "a3": 1}


def test_after_a_crash_each_sample_continues_from_its_tokens_and_the_group_follows_its_new_worker():
    s = scheduler()
    s.add_worker(spec(0))
    s.add_worker(spec(1))
    first: dict[str, int] = {}
    for i in range(3):
        first |= placed(s.submit(sample(f"a{i}", "a")))
    (w,) = set(first.values())
    run_keys = {e.key: e.run_key for e in s.workers[w].running.values()}
    s.on_step(StepReport(worker_id=w, applied_seq=1, step_s=0.05, batch_size=3, prefill_tokens=768, kv_blocks_free=100,
                         running=3, waiting=0, outputs=[SeqOutput(run_keys[k], [1, 2, 3], "abc") for k in run_keys]))
    retried = [a.key for a in s.worker_lost(w) if isinstance(a, Retry)]
    assert sorted(retried) == ["a0", "a1", "a2"]
    again = [a for d in s.add_worker(spec(w)) for a in getattr(d, "admissions", ())]  # its replacement, same id
    assert sorted(a.key for a in again) == ["a0", "a1", "a2"]
    assert all(a.generated == 3 for a in again)  # each continues after the tokens it had delivered
    # A sample submitted now joins its group where the survivors went (a new worker under the same id is
    # another worker: the dead one's preference is gone with it).
    now_at = {e.key: e.worker_id for e in s.entries.values()}
    late = placed(s.submit(sample("a3", "a")))
    assert late["a3"] == s.siblings.preferred(s.entries["a3"]) and late["a3"] in set(now_at.values())


def test_the_groups_row_goes_with_its_last_sample():
    sim = Simulation(SchedulerConfig(interactive=ClassConfig(admission_window_s=0.0), bulk=ClassConfig(admission_window_s=0.0),
                                     bulk_floor=0.0, step_time_prior_s=0.01),
                     [(worker_spec(i, max_seqs=4, continuous=True), linear_cost(0.01, 0.001)) for i in range(2)])
    reqs = [SimRequest(f"c{c}s{i}", c * 0.01, prompt_tokens=64, max_tokens=5, group=f"c{c}") for c in range(6) for i in range(4)]
    out = sim.run(reqs)
    assert all(o.status == "finished" for o in out.values())
    assert not sim.scheduler.siblings.where and not sim.scheduler.siblings.members


def test_a_sample_beside_its_sibling_is_charged_only_the_prompt_the_prefix_cache_lacks():
    # 256-token prompts, 128-token blocks: a sibling on the worker holds the first block (vLLM computes at least
    # the last token, so not the second). A 512-token step takes two separate requests; a call's four samples
    # all go, the ones past the step's room riding with their siblings (their tails computed in the next step).
    def first_round(group: str | None) -> tuple[int, int]:
        s = scheduler()
        s.add_worker(worker_spec(0, max_seqs=32, continuous=True, model="sim", block_size=128, prefill_token_budget=512))
        took = sum(len(placed(s.submit(sample(f"a{i}", group)))) for i in range(4))
        return took, sum(n for n, _ in s.workers[0].pending_prefill.values())

    assert first_round("a") == (4, 256 + 3 * 128)
    assert first_round(None) == (2, 512)  # separate requests with the same prompt are charged in full, as before


def test_at_saturation_a_calls_samples_stay_on_one_worker_so_its_shared_prompt_is_computed_once():
    # bench features' n = 4 run: 64 calls of four 256-token samples at once, two workers of 80 slots and 512-token
    # steps. Charged as saved but held to the step's room, a call's fourth sample went to whichever worker reported
    # next: 53 of 64 calls ran on both workers (47,744 prompt tokens computed where one engine computes 40,960).
    specs = [(worker_spec(i, max_seqs=80, continuous=True, block_size=128, prefill_token_budget=512),
              linear_cost(0.1, 0.0106, 0.004)) for i in range(2)]
    sim = Simulation(SchedulerConfig(bulk_floor=0.0), specs)
    where: dict[str, tuple[int, int]] = {}
    placed_first = sim.scheduler.siblings.placed

    def spy(e: Entry, wid: int) -> None:
        placed_first(e, wid)
        where.setdefault(e.key, (wid, e.cached_prompt))

    sim.scheduler.siblings.placed = spy
    out = sim.run([SimRequest(f"c{c}s{i}", 0.0, prompt_tokens=256, max_tokens=32, group=f"c{c}")
                   for c in range(64) for i in range(4)])
    assert all(o.status == "finished" for o in out.values())
    split = [c for c in range(64) if len({where[f"c{c}s{i}"][0] for i in range(4)}) > 1]
    assert len(split) <= 4, split
    assert sum(256 - cached for _, cached in where.values()) <= 64 * (256 + 3 * 128) + 4 * 128
    assert {wid for wid, _ in where.values()} == {0, 1}  # the calls themselves still use both workers

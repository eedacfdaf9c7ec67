"""A retiring worker (serve while compiling: a compiled worker took its place) takes no new work, is counted out of
the model's forecasts, finishes what it runs, and once it runs nothing leaves without a retry, a crash or a
replacement (virtual time, simulated worker specs)."""

from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.scheduler.core import Scheduler
from tokenline.engine.scheduler.records import Admit, Entry, Fail, Retry
from tokenline.engine.simulation import worker_spec
from tokenline.engine.types import SeqOutput, StepReport, TrafficClass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler() -> tuple[Scheduler, Clock]:
    clock = Clock()
    at_once = ClassConfig(admission_window_s=0.0)
    s = Scheduler(SchedulerConfig(interactive=at_once, bulk=at_once, bulk_floor=0.0, step_time_prior_s=0.01), clock)
    for wid in (0, 1):
        s.add_worker(worker_spec(wid, max_seqs=4, continuous=True))
    return s, clock


def submit(s: Scheduler, key: str, cls: TrafficClass = TrafficClass.INTERACTIVE) -> list:
    return s.submit(Entry(key=key, model="sim", tenant="t", cls=cls, prompt_tokens=8, max_tokens=4, arrival=0.0))


def placed(actions: list) -> dict[str, int]:
    return {a.key: d.worker_id for d in actions if isinstance(d, Admit) for a in d.admissions}


def report(s: Scheduler, wid: int, *, finished: bool = False) -> list:
    """One step of worker `wid`: a token for every run it holds, each finished if `finished`."""
    w = s.workers[wid]
    outputs = [SeqOutput(key, [7], "x", finished=finished) for key in w.running]
    return s.on_step(StepReport(worker_id=wid, applied_seq=w.seq, step_s=0.01, batch_size=len(outputs),
                                prefill_tokens=0, kv_blocks_free=1000, running=len(outputs), waiting=0,
                                outputs=outputs)).actions


def test_a_retiring_worker_takes_no_new_work_while_it_finishes_its_runs_then_leaves_without_a_retry():
    s, clock = scheduler()
    first = {}
    for i in range(4):
        first |= placed(submit(s, f"a{i}"))
    assert set(first.values()) == {0, 1}  # both workers run some
    held = [k for k, w in first.items() if w == 0]

    assert s.models["sim"].retire(0)

    clock.now = 1.0
    later = {}
    for i in range(6):
        later |= placed(submit(s, f"b{i}"))
        later |= placed(report(s, 0))  # worker 0's reports: the moments it would be given work
    assert later and set(later.values()) == {1}  # every newcomer goes to the worker that stays
    assert s.running(0) == len(held)  # what worker 0 runs, it keeps running
    report(s, 1)  # worker 1 is full: a queued request starts when one of its runs ends, not on worker 0's free slots
    assert s.admission.estimate_start(s.entries["b5"], s.models["sim"], clock.now) > clock.now

    clock.now = 2.0
    report(s, 0, finished=True)
    assert s.running(0) == 0  # idle: what the runtime tells its supervisor (Runtime._busy_workers)
    actions = s.worker_lost(0)  # the supervisor stops it
    assert not [a for a in actions if isinstance(a, (Retry, Fail))]
    assert s.models["sim"].replacements_due == [] and s.models["sim"].retiring == []
    assert all(s.entries.get(k) is None for k in held)  # finished, each once


def test_a_retiring_worker_that_dies_before_its_runs_finish_hands_them_on_like_any_crash_but_is_not_replaced():
    s, clock = scheduler()
    placed_on = {}
    for i in range(4):
        placed_on |= placed(submit(s, f"a{i}"))
    held = sorted(k for k, w in placed_on.items() if w == 0)
    s.models["sim"].retire(0)

    clock.now = 1.0
    actions = s.worker_lost(0)  # it crashed while retiring

    assert sorted(a.key for a in actions if isinstance(a, Retry)) == held  # its runs go on elsewhere
    assert {a.worker_id for a in actions if isinstance(a, Admit)} <= {1}
    assert s.models["sim"].replacements_due == []  # no restart is coming: the compiled worker took its place


def test_only_a_serving_worker_can_retire():
    s, _ = scheduler()
    assert s.models["sim"].retire(0)
    assert not s.models["sim"].retire(0)  # already retiring
    assert not s.models["sim"].retire(7)  # no such worker
    assert s.models["sim"].workers == [1]

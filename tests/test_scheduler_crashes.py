"""Who is blamed when a worker dies (virtual time, the pure scheduler).

One crash names no one: everything it interrupted runs again together, and new work joins it.
Requests that were running at a second crash are suspects and run alone, one per worker, so the
next crash names its culprit exactly; that one is quarantined, and nobody else is.
"""

from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.scheduler.core import Scheduler
from tokenline.engine.scheduler.records import Dispatch, Entry, Fail, Retry
from tokenline.engine.simulation import worker_spec
from tokenline.engine.types import TrafficClass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler() -> Scheduler:
    now = ClassConfig(admission_window_s=0.0)
    return Scheduler(SchedulerConfig(interactive=now, bulk=now, bulk_floor=0.0), Clock())


def entry(key: str) -> Entry:
    return Entry(key=key, model="sim", tenant="t", cls=TrafficClass.INTERACTIVE, prompt_tokens=8, max_tokens=16, arrival=0.0)


def admitted(actions: list) -> list[str]:
    return [a.key for d in actions if isinstance(d, Dispatch) for a in d.admissions]


def spec(worker_id: int):
    return worker_spec(worker_id, max_seqs=32, continuous=True, model="sim")


def test_after_one_crash_the_survivors_run_again_together_and_new_work_joins_them():
    s = scheduler()
    s.add_worker(spec(0))
    first = admitted(sum((s.submit(entry(f"r{i}")) for i in range(16)), []))
    assert len(first) == 16

    retries = s.worker_lost(0)
    assert sorted(a.key for a in retries if isinstance(a, Retry)) == sorted(first)

    again = admitted(s.add_worker(spec(1)))
    assert sorted(again) == sorted(first)  # one batch: nobody serialised
    assert admitted(s.submit(entry("new"))) == ["new"]  # and new work is not kept waiting


def test_after_a_second_crash_its_suspects_run_alone_and_the_one_that_crashes_alone_is_quarantined():
    s = scheduler()
    s.add_worker(spec(0))
    for i in range(4):
        s.submit(entry(f"r{i}"))
    s.worker_lost(0)
    s.add_worker(spec(1))
    s.worker_lost(1)  # the same four were running at both crashes

    alone = admitted(s.add_worker(spec(2)))
    assert len(alone) == 1
    others = admitted(s.add_worker(spec(3)))
    assert len(others) == 1 and others[0] not in alone
    assert admitted(s.submit(entry("new"))) == []  # no worker runs a suspect and anything else
    assert len(admitted(s.add_worker(spec(4)))) == 1  # a worker takes one suspect, alone

    verdict = s.worker_lost(2)  # it crashed a worker while running alone: named exactly
    assert [(a.key, a.quarantined) for a in verdict if isinstance(a, Fail)] == [(alone[0], True)]
    assert "while it ran alone" in next(a for a in verdict if isinstance(a, Fail)).message


def test_a_crash_of_a_shared_worker_quarantines_no_one_before_the_limit():
    s = scheduler()
    s.add_worker(spec(0))
    s.submit(entry("a"))
    s.submit(entry("b"))
    s.worker_lost(0)
    s.add_worker(spec(1))
    second = s.worker_lost(1)

    assert [a for a in second if isinstance(a, Fail)] == []

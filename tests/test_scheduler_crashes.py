"""Who is blamed when a worker dies (virtual time, the pure scheduler).

One crash names no one: everything it interrupted runs again together, and new work joins it.
Requests that were running at a second crash are suspects and run alone, one per worker, so the
next crash names its culprit exactly; that one is quarantined, and nobody else is.
"""

from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.scheduler.core import Scheduler
from tokenline.engine.scheduler.records import Admit, Entry, Fail, Retry
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
    return [a.key for d in actions if isinstance(d, Admit) for a in d.admissions]


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


def test_with_two_workers_a_crashs_survivors_wait_for_a_worker_that_leaves_the_other_clean():
    # bench poison on the real engine: the survivors of worker 0's crash went to worker 1, the poison among
    # them killed it too, and for a restart's time no worker served (98 newcomers refused UNAVAILABLE).
    s = scheduler()
    s.add_worker(spec(0))
    s.add_worker(spec(1))
    first = admitted(sum((s.submit(entry(f"r{i}")) for i in range(16)), []))
    on_0 = [k for k in first if s.entries[k].worker_id == 0]
    assert on_0 and len(on_0) < 16

    s.worker_lost(0)
    assert all(s.entries[k].worker_id is None for k in on_0)  # not onto worker 1, the last clean one
    assert admitted(s.submit(entry("new"))) == ["new"]  # which newcomers still get at once
    assert sorted(admitted(s.add_worker(spec(2)))) == sorted(on_0)  # the replacement takes them, together
    assert {s.entries[k].worker_id for k in on_0} == {2}  # the fresh worker, not the one full of innocents
    assert admitted(s.submit(entry("new2"))) == ["new2"]
    assert s.entries["new2"].worker_id == 1  # new work goes to the clean worker

    # They crash again: suspects now. Worker 1 is the only one up (idle: its work is done), and worker 2 is
    # being restarted: the suspects wait for it, and worker 1 goes on serving.
    for k in [k for k, e in s.entries.items() if e.worker_id == 1]:
        s.cancel(k)
    s.worker_lost(2)
    assert all(s.entries[k].worker_id is None for k in on_0)
    assert admitted(s.submit(entry("new3"))) == ["new3"]
    assert len(admitted(s.add_worker(spec(3)))) == (len(on_0) + 1) // 2  # a group, on the replacement
    assert s.entries["new3"].worker_id == 1


def test_survivors_waiting_for_a_replacement_that_never_comes_take_the_last_worker_after_the_wait():
    s = scheduler()
    s.add_worker(spec(0))
    s.add_worker(spec(1))
    first = admitted(sum((s.submit(entry(f"r{i}")) for i in range(16)), []))
    on_0 = [k for k in first if s.entries[k].worker_id == 0]
    s.worker_lost(0)
    wake = s.next_wakeup()
    assert wake is not None and wake == s.config.survivors_wait_s  # queued at 0.0 (virtual time)
    s.clock.now = wake
    assert sorted(admitted(s.on_timer())) == sorted(on_0)
    assert {s.entries[k].worker_id for k in on_0} == {1}


def crashed_twice(s: Scheduler, n: int) -> list[str]:
    """n requests that were running at two crashes: suspects now."""
    s.add_worker(spec(0))
    for i in range(n):
        s.submit(entry(f"r{i}"))
    s.worker_lost(0)
    s.add_worker(spec(1))
    s.worker_lost(1)
    return [f"r{i}" for i in range(n)]


def test_after_a_second_crash_the_suspects_rerun_in_two_groups_apart_from_all_other_work():
    s = scheduler()
    suspects = crashed_twice(s, 4)

    first = admitted(s.add_worker(spec(2)))
    assert len(first) == 2  # half of them, together: a group
    assert admitted(s.submit(entry("new"))) == []  # nothing joins a group's worker
    assert admitted(s.add_worker(spec(3))) == ["new"]  # the worker left to the rest of the work
    second = admitted(s.add_worker(spec(4)))
    assert sorted(first + second) == sorted(suspects)  # the other half, on a worker of its own


def test_a_group_that_crashes_is_split_until_its_culprit_crashes_alone_and_only_it_is_quarantined():
    s = scheduler()
    suspects = crashed_twice(s, 8)
    culprit = "r5"
    failed, deaths, next_worker = [], 0, 2
    while not failed:
        while s.entries[culprit].worker_id is None:  # workers join until the culprit's group has one
            s.add_worker(spec(next_worker))
            next_worker += 1
            assert next_worker < 20
        wid = s.entries[culprit].worker_id
        failed = [a for a in s.worker_lost(wid) if isinstance(a, Fail)]
        deaths += 1
    assert [(a.key, a.quarantined) for a in failed] == [(culprit, True)]
    assert "while it ran alone" in failed[0].message
    assert deaths == 3  # 8 suspects: groups of 4, 2, then the culprit alone (one by one took up to 8)
    innocent = [k for k in suspects if k != culprit]
    s.add_worker(spec(next_worker))
    s.add_worker(spec(next_worker + 1))
    assert {s.entries[k].status.name for k in innocent} == {"RUNNING"}  # none failed: all running again


def test_on_a_single_worker_a_group_still_runs_and_newcomers_follow_it():
    s = scheduler()
    crashed_twice(s, 4)
    assert len(admitted(s.add_worker(spec(2)))) == 2  # the only worker: the diagnosis goes first
    assert admitted(s.submit(entry("new"))) == []


def test_a_crash_of_a_shared_worker_quarantines_no_one_before_the_limit():
    s = scheduler()
    s.add_worker(spec(0))
    s.submit(entry("a"))
    s.submit(entry("b"))
    s.worker_lost(0)
    s.add_worker(spec(1))
    second = s.worker_lost(1)

    assert [a for a in second if isinstance(a, Fail)] == []

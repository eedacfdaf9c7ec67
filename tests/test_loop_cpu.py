"""`python -m tokenline.bench.loop_cpu`: the loop thread's CPU counted per wrapped function (docs/performance.md)."""

from __future__ import annotations

import threading
import time

from tokenline.bench.loop_cpu import FUNCTIONS, LoopCpu


class Work:
    def busy(self, ms: float) -> str:
        end = time.thread_time() + ms / 1000
        while time.thread_time() < end:
            pass
        return "done"

    def asleep(self, ms: float) -> None:
        time.sleep(ms / 1000)  # wall time, not CPU: counts next to nothing


def test_each_wrapped_function_gets_its_own_cpu_and_calls_on_the_counted_thread_only():
    counter = LoopCpu()
    counter.wrap(Work, "busy")
    counter.wrap(Work, "asleep")
    w = Work()
    assert w.busy(30) == "done"  # still returns what it returns
    w.busy(30)
    w.asleep(100)
    other = threading.Thread(target=w.busy, args=(50,))
    other.start()
    other.join()  # another thread's call: not counted
    busy_ns, busy_calls = counter.counts["Work.busy"]
    sleep_ns, sleep_calls = counter.counts["Work.asleep"]
    assert busy_calls == 2 and 55e6 <= busy_ns < 200e6, counter.counts
    assert sleep_calls == 1 and sleep_ns < 20e6, counter.counts
    table = counter.table()
    assert table.splitlines()[1].startswith("Work.busy") and "2 calls" in table
    counter.reset()
    assert counter.counts == {}


def test_every_function_it_names_exists_where_it_says():
    import importlib

    for module, cls, name in FUNCTIONS:
        owner = importlib.import_module(module)
        assert callable(getattr(getattr(owner, cls) if cls else owner, name)), (module, cls, name)

"""Scaled to zero and back: with --autoscale-min-workers 0 the last idle worker goes, and the next
request queues, starts a worker and is served (it was refused UNAVAILABLE for ever).

The pure scheduler in virtual time, then a real server (simulated engine, real worker processes).
"""

import re

import pytest

from tokenline.client import Client
from tokenline.engine.scheduler.config import ClassConfig, SchedulerConfig
from tokenline.engine.scheduler.core import Scheduler
from tokenline.engine.scheduler.records import Admit, Entry, Refuse
from tokenline.engine.simulation import worker_spec
from tokenline.engine.types import TrafficClass
from tests.support import ServerProcess, wait_until


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(key: str, **kw) -> Entry:
    return Entry(**{"key": key, "model": "sim", "tenant": "t", "cls": TrafficClass.INTERACTIVE, "prompt_tokens": 8,
                    "max_tokens": 16, "arrival": 0.0, **kw})


def scheduler_scaled_to_zero(on_demand: bool) -> Scheduler:
    now = ClassConfig(admission_window_s=0.0)
    s = Scheduler(SchedulerConfig(interactive=now, bulk=now, bulk_floor=0.0), Clock())
    s.add_worker(worker_spec(0, max_seqs=4, continuous=True, model="sim", kv_blocks=64))
    if on_demand:
        s.on_demand["sim"] = 3.0  # a start takes 3 s
    s.worker_lost(0)  # the autoscaler removed the last (idle) worker
    return s


def test_a_model_that_starts_on_demand_queues_work_while_it_has_no_worker_and_runs_it_on_the_next():
    s = scheduler_scaled_to_zero(on_demand=True)
    assert s.submit(entry("a")) == []  # queued, not refused
    deadline_too_soon = s.submit(entry("b", deadline=1.0))  # a start takes 3 s
    assert isinstance(deadline_too_soon[0], Refuse) and deadline_too_soon[0].reason.name == "DEADLINE"
    assert s.submit(entry("c", deadline=10.0)) == []
    too_large = s.submit(entry("d", prompt_tokens=2000))  # checked against the worker it last had
    assert isinstance(too_large[0], Refuse) and too_large[0].reason.name == "TOO_LARGE"
    actions = s.add_worker(worker_spec(1, max_seqs=4, continuous=True, model="sim"))
    assert sorted(a.key for d in actions if isinstance(d, Admit) for a in d.admissions) == ["a", "c"]


def test_a_model_without_workers_that_cannot_start_one_refuses_at_once():
    s = scheduler_scaled_to_zero(on_demand=False)
    (refusal,) = s.submit(entry("a"))
    assert isinstance(refusal, Refuse) and refusal.reason.name == "NO_WORKER"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--workers", "1", "--autoscale-max-workers", "1",
                      "--autoscale-min-workers", "0", "--autoscale-cooldown-s", "1", "--autoscale-settle-s", "0.5",
                      "--log-level", "INFO").start()
    yield s
    s.stop()


def test_the_last_idle_worker_goes_and_the_next_request_brings_one_back(server):
    with Client(server.address) as client:
        assert len(client.complete("warm", max_tokens=4, ignore_eos=True).token_ids) == 4
        assert wait_until(lambda: "removing worker" in server.output(), timeout=60)
        assert wait_until(lambda: "stopped after removal" in server.output(), timeout=30)
        health = client.health(timeout=5)  # scaled to zero is still serving: requests start a worker
        answer = client.complete("cold", max_tokens=4, ignore_eos=True, timeout=120)
    assert len(answer.token_ids) == 4 and health == "SERVING"
    added = re.findall(r"autoscale: adding worker \d+ .*", server.output())
    assert added and "no worker" in added[-1]

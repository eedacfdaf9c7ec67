"""The autoscaler follows backlog and deadline pressure: its decisions, in virtual time."""

from __future__ import annotations

import pytest

from tokenline.engine.autoscale import (
    AddWorker,
    AutoscaleConfig,
    Autoscaler,
    Pressure,
    RemoveWorker,
    WorkerLoad,
)


def busy(wid: int, running: int = 4) -> WorkerLoad:
    return WorkerLoad(wid, running, None)


def idle(wid: int, since: float) -> WorkerLoad:
    return WorkerLoad(wid, 0, since)


def pressure(workers=(), *, queued=0, age=0.0, misses=0, starting=0) -> Pressure:
    return Pressure(queued=queued, oldest_queued_age_s=age, predicted_misses=misses,
                    workers=tuple(workers), starting=starting)


class QueueModel:
    """A fluid queue in virtual time: requests arrive at `rate`, each ready worker serves `per_worker` a second,
    and a worker asked for is ready `startup_s` later. The autoscaler is asked every `tick_s`."""

    def __init__(self, scaler: Autoscaler, *, per_worker: float, startup_s: float, workers: int = 1, tick_s: float = 0.5):
        self.scaler, self.per_worker, self.startup_s, self.tick_s = scaler, per_worker, startup_s, tick_s
        self.now = 0.0
        self.backlog = 0.0  # requests waiting
        self.oldest_age = 0.0
        self.ready: dict[int, float | None] = {i: 0.0 for i in range(workers)}  # id -> idle since (None: busy)
        self.starting: list[float] = []  # ready-at instants
        self.next_id = workers
        self.history: list[tuple[float, int, float]] = []  # (time, ready workers, oldest age)

    def run(self, seconds: float, rate: float) -> None:
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now += self.tick_s
            for at in [s for s in self.starting if s <= self.now]:
                self.starting.remove(at)
                self.ready[self.next_id] = self.now
                self.next_id += 1
            served = self.per_worker * len(self.ready) * self.tick_s
            self.backlog = max(0.0, self.backlog + rate * self.tick_s - served)
            # FIFO: the oldest queued request arrived about backlog / rate seconds ago.
            self.oldest_age = self.backlog / rate if self.backlog > 0.5 and rate > 0 else 0.0
            need = rate / self.per_worker  # workers the offered load keeps busy
            for i, wid in enumerate(sorted(self.ready)):
                working = i < need or self.backlog > 0.5
                if working:
                    self.ready[wid] = None
                elif self.ready[wid] is None:
                    self.ready[wid] = self.now
            loads = [WorkerLoad(w, 4 if s is None else 0, s) for w, s in self.ready.items()]
            p = pressure(loads, queued=int(self.backlog), age=self.oldest_age, starting=len(self.starting))
            for d in self.scaler.decide(self.now, p):
                if isinstance(d, AddWorker):
                    self.starting.append(self.now + self.startup_s)
                else:
                    assert d.worker_id in self.ready and self.ready[d.worker_id] is not None, "removed a busy worker"
                    del self.ready[d.worker_id]
            self.history.append((self.now, len(self.ready), self.oldest_age))


def test_a_step_of_load_adds_workers_until_the_queue_drains_then_idle_ones_go_after_the_cool_down():
    cfg = AutoscaleConfig(min_workers=1, max_workers=5, max_queue_age_s=2.0, cooldown_s=20.0, settle_s=3.0)
    model = QueueModel(Autoscaler(cfg), per_worker=10.0, startup_s=4.0)

    model.run(30, rate=5.0)  # within one worker's capacity
    assert len(model.ready) == 1 and not model.scaler.decisions

    model.run(90, rate=32.0)  # 3.2 workers' worth
    assert len(model.ready) == 4  # enough to keep up, not the maximum
    assert model.history[-1][2] == 0.0  # the queue has drained
    # Each of the three adds waited only for the age limit, a start-up and the settling time.
    fourth_ready = min(t for t, n, _ in model.history if n == 4)
    assert fourth_ready - 30 <= 3 * (2.0 + 4.0 + 3.0 + 0.5)

    model.run(120, rate=5.0)
    assert len(model.ready) == 1  # back to what the load needs, and to the minimum
    removals = [t for t, d in model.scaler.decisions if isinstance(d, RemoveWorker)]
    assert removals and min(removals) >= 120 + 20.0  # none before a worker had been idle for the cool-down


def test_never_more_than_the_maximum_however_long_the_queue():
    cfg = AutoscaleConfig(min_workers=1, max_workers=3, max_queue_age_s=1.0, settle_s=1.0)
    model = QueueModel(Autoscaler(cfg), per_worker=10.0, startup_s=2.0)

    model.run(120, rate=100.0)

    assert max(n for _, n, _ in model.history) == 3
    assert len(model.ready) == 3


def test_no_flapping_a_load_at_the_edge_does_not_add_and_remove_in_turn():
    cfg = AutoscaleConfig(min_workers=1, max_workers=4, max_queue_age_s=2.0, cooldown_s=15.0, settle_s=3.0)
    model = QueueModel(Autoscaler(cfg), per_worker=10.0, startup_s=3.0)

    for _ in range(6):  # bursts shorter than the cool-down
        model.run(8, rate=25.0)
        model.run(6, rate=8.0)

    kinds = [type(d) for _, d in model.scaler.decisions]
    turns = sum(1 for a, b in zip(kinds, kinds[1:]) if a is not b)
    assert turns <= 1  # it grew, and at most shed what the bursts never used; it never went back and forth
    assert kinds.count(AddWorker) <= 3


def test_a_predicted_deadline_miss_adds_a_worker_before_the_queue_is_old():
    scaler = Autoscaler(AutoscaleConfig(max_queue_age_s=10.0))

    decisions = scaler.decide(100.0, pressure([busy(0)], queued=3, age=0.2, misses=2))

    assert [type(d) for d in decisions] == [AddWorker]
    assert "predicted to miss" in decisions[0].reason


def test_a_worker_already_starting_counts_as_capacity_asked_for():
    scaler = Autoscaler(AutoscaleConfig(max_queue_age_s=1.0, settle_s=0.0))

    assert scaler.decide(10.0, pressure([busy(0)], queued=50, age=5.0, starting=1)) == []
    assert len(scaler.decide(11.0, pressure([busy(0), busy(1)], queued=50, age=6.0))) == 1


def test_warm_standby_is_kept_ready_ahead_of_the_load_and_not_removed_as_idle():
    scaler = Autoscaler(AutoscaleConfig(min_workers=1, max_workers=4, warm_standby=1, cooldown_s=10.0, settle_s=0.0))

    first = scaler.decide(0.0, pressure([busy(0)]))
    assert [type(d) for d in first] == [AddWorker] and "warm" in first[0].reason

    # Ready and idle for far longer than the cool-down: it is the reserve, not waste.
    assert scaler.decide(500.0, pressure([busy(0), idle(1, since=1.0)])) == []
    # When the load ends, one idle worker beyond the reserve goes.
    out = scaler.decide(600.0, pressure([idle(0, since=550.0), idle(1, since=1.0)]))
    assert out == [RemoveWorker(1, out[0].reason)]


def test_below_the_minimum_workers_are_asked_for_at_once():
    scaler = Autoscaler(AutoscaleConfig(min_workers=3, max_workers=4))

    assert [type(d) for d in scaler.decide(0.0, pressure())] == [AddWorker] * 3


def test_scaled_to_zero_the_first_queued_request_starts_a_worker_at_once():
    scaler = Autoscaler(AutoscaleConfig(min_workers=0, max_workers=2, cooldown_s=10, settle_s=5))
    assert scaler.decide(0.0, pressure([busy(0)], queued=3, age=5.0)) != []  # an add: the settle clock starts
    out = scaler.decide(60.0, pressure([idle(0, since=40.0)]))
    assert out == [RemoveWorker(0, out[0].reason)]  # min 0: the last idle worker goes
    assert scaler.decide(60.5, pressure()) == []  # nothing queued, nothing started
    out = scaler.decide(61.0, pressure(queued=1))  # well inside the settle time, and the request is young
    assert [type(d) for d in out] == [AddWorker] and "no worker" in out[0].reason
    assert scaler.decide(61.5, pressure(queued=4, starting=1)) == []  # the start under way is the answer


@pytest.mark.parametrize("kwargs, word", [
    ({"min_workers": -1}, "min_workers"),
    ({"min_workers": 3, "max_workers": 2}, "max_workers"),
    ({"cooldown_s": float("nan")}, "cooldown_s"),
    ({"warm_standby": -2}, "warm_standby"),
])
def test_a_bad_setting_is_refused_with_a_message_naming_it(kwargs, word):
    with pytest.raises(ValueError, match=word):
        AutoscaleConfig(**kwargs)


# ---------------------------------------------------------------- several models, one budget (issue 34)

def test_within_the_budget_every_models_additions_pass():
    from tokenline.engine.autoscale import Share, share_workers

    share = Share(budget=4, own={"a": 2, "b": 2})
    pressures = {"a": pressure([busy(0)]), "b": pressure([busy(1)], queued=3, age=5.0)}
    out = share_workers({"a": [], "b": [AddWorker("queue")]}, pressures, {"a": 1, "b": 1}, share, 10.0, in_use=2)
    assert out == [("b", AddWorker("queue"))]


def test_at_the_budget_a_model_that_needs_a_worker_borrows_one_idle_long_enough_above_its_models_minimum():
    from tokenline.engine.autoscale import Share, share_workers

    share = Share(budget=2, own={"a": 1, "b": 1}, lend_after_s=5.0)
    flood = pressure([busy(1)], queued=8, age=5.0)
    # a's worker idle 3 s: not yet lent.
    out = share_workers({"a": [], "b": [AddWorker("queue")]}, {"a": pressure([idle(0, 7.0)]), "b": flood},
                        {"a": 0, "b": 1}, share, 10.0, in_use=2)
    assert out == []
    # Idle 6 s: lent (removed from a, added to b).
    out = share_workers({"a": [], "b": [AddWorker("queue")]}, {"a": pressure([idle(0, 4.0)]), "b": flood},
                        {"a": 0, "b": 1}, share, 10.0, in_use=2)
    assert [(m, type(d).__name__) for m, d in out] == [("a", "RemoveWorker"), ("b", "AddWorker")]
    assert out[0][1].worker_id == 0 and "lent to b" in out[0][1].reason
    # Never below the lender's minimum, and never from a model with a queue of its own.
    assert share_workers({"a": [], "b": [AddWorker("queue")]}, {"a": pressure([idle(0, 4.0)]), "b": flood},
                         {"a": 1, "b": 1}, share, 10.0, in_use=2) == []
    assert share_workers({"a": [], "b": [AddWorker("queue")]}, {"a": pressure([idle(0, 4.0)], queued=1), "b": flood},
                         {"a": 0, "b": 1}, share, 10.0, in_use=2) == []


def test_a_model_below_its_own_count_takes_a_borrowed_worker_back_one_at_a_time():
    from tokenline.engine.autoscale import GiveBack, Share, share_workers

    share = Share(budget=2, own={"a": 1, "b": 1})
    # b borrowed a's worker and runs on both; a's load came back: a has no worker, b has 2 (its own is 1).
    pressures = {"a": pressure([], queued=2, age=1.0), "b": pressure([busy(1, 4), busy(2, 1)], queued=5)}
    out = share_workers({"a": [AddWorker("no worker")], "b": [AddWorker("queue")]}, pressures, {"a": 0, "b": 1},
                        share, 10.0, in_use=2)
    # b's add waits (no room, it holds more than its own); a takes back b's least busy worker, which finishes its streams.
    assert out == [("b", GiveBack(2, "given back to a (0 of its own 1 workers; no worker)"))]
    # A model at or below its own count gives nothing back.
    pressures = {"a": pressure([busy(0)], queued=2, age=3.0), "b": pressure([busy(1)], queued=5, age=3.0)}
    assert share_workers({"a": [AddWorker("q")], "b": [AddWorker("q")]}, pressures, {"a": 1, "b": 1}, share, 10.0,
                         in_use=2) == []


def test_removals_free_room_for_another_models_addition_in_the_same_round():
    from tokenline.engine.autoscale import Share, share_workers

    share = Share(budget=2, own={"a": 1, "b": 1})
    pressures = {"a": pressure([idle(0, 0.0)]), "b": pressure([busy(1)], queued=3, age=5.0)}
    out = share_workers({"a": [RemoveWorker(0, "idle")], "b": [AddWorker("queue")]}, pressures, {"a": 0, "b": 1},
                        share, 40.0, in_use=2)
    assert out == [("a", RemoveWorker(0, "idle")), ("b", AddWorker("queue"))]

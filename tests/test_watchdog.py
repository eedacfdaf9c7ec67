"""The step watchdog: silence from a worker with work in flight, past what its steps explain, is a failure."""

import pytest

from tokenline.engine.watchdog import StepWatchdog


def test_a_busy_worker_silent_past_the_floor_is_reported_with_how_long():
    dog = StepWatchdog(floor_s=5.0)
    dog.saw_step(0, step_s=0.05, now=100.0)

    assert dog.silent({0}, now=104.9) == []
    [silence] = dog.silent({0}, now=105.5)
    assert silence.worker_id == 0 and silence.silent_s == pytest.approx(5.5) and silence.limit_s == 5.0


def test_an_idle_worker_is_never_reported_however_long_it_is_quiet():
    dog = StepWatchdog(floor_s=5.0)
    dog.saw_step(0, step_s=0.05, now=100.0)

    assert dog.silent(set(), now=10_000.0) == []


def test_work_sent_to_an_idle_worker_starts_its_silence_anew():
    dog = StepWatchdog(floor_s=5.0)
    dog.saw_step(0, step_s=0.05, now=100.0)  # then idle for an hour

    dog.expect(0, now=3700.0)

    assert dog.silent({0}, now=3703.0) == []
    assert [s.worker_id for s in dog.silent({0}, now=3706.0)] == [0]


def test_a_worker_with_long_steps_gets_a_proportionally_longer_limit():
    dog = StepWatchdog(floor_s=5.0, factor=10.0)
    dog.saw_step(0, step_s=1.2, now=100.0)  # a long prefill step

    assert dog.limit_s(0) == pytest.approx(12.0)
    assert dog.silent({0}, now=111.0) == []
    assert dog.silent({0}, now=113.0) != []


def test_a_forgotten_worker_is_not_reported():
    dog = StepWatchdog()
    dog.saw_step(3, step_s=0.01, now=0.0)

    dog.forget(3)

    assert dog.silent({3}, now=100.0) == []


def test_nonsense_limits_are_refused_with_a_message():
    with pytest.raises(ValueError, match="floor_s > 0"):
        StepWatchdog(floor_s=0)


def test_the_step_time_models_heaviest_step_widens_the_limit_before_any_long_step_is_seen():
    dog = StepWatchdog(floor_s=5.0, factor=10.0)
    dog.saw_step(0, step_s=0.01, now=100.0, heaviest_step_s=0.8)  # a full prefill budget would take 0.8 s

    assert dog.limit_s(0) == pytest.approx(8.0)


def test_a_worker_whose_first_step_is_a_full_prefill_is_given_the_time_it_measured_for_one_while_loading():
    # On a slow CPU a whole prefill budget takes seconds; the first work a worker gets may be just that.
    dog = StepWatchdog(floor_s=5.0, factor=10.0)
    dog.expect(0, now=100.0, heaviest_step_s=1.5)  # the full step it timed at load

    assert dog.limit_s(0) == pytest.approx(15.0)
    assert dog.silent({0}, now=112.0) == []
    assert dog.silent({0}, now=116.0) != []

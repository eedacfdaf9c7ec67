"""Arrival schedules and workload plans: rates, burstiness, seeds, stream specs."""

from __future__ import annotations

import statistics

import pytest
from tokenline.bench.arrivals import ArrivalProcess
from tokenline.bench.prompts import SyntheticPrompts
from tokenline.bench.workload import LengthDist, RequestFactory, open_loop_plan, parse_stream


def gaps(times):
    return [b - a for a, b in zip([0.0, *times], times)]


def test_poisson_arrivals_come_at_the_rate_with_exponential_gaps():
    times = ArrivalProcess(rate=50.0).schedule(seed=1, count=40_000)
    g = gaps(times)
    assert statistics.fmean(g) == pytest.approx(1 / 50, rel=0.02)
    cv = statistics.pstdev(g) / statistics.fmean(g)
    assert cv == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_burstiness_sets_the_variability(burstiness):
    times = ArrivalProcess(rate=20.0, kind="gamma", burstiness=burstiness).schedule(seed=3, count=80_000)
    g = gaps(times)
    assert statistics.fmean(g) == pytest.approx(1 / 20, rel=0.03)
    cv2 = statistics.pvariance(g) / statistics.fmean(g) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)  # burstiness 1 is Poisson; lower is burstier


def test_constant_arrivals_are_evenly_spaced():
    times = ArrivalProcess(rate=4.0, kind="constant").schedule(seed=0, duration_s=2.0)
    assert times == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])


def test_a_schedule_is_reproducible_from_its_seed():
    process = ArrivalProcess(rate=10.0, kind="gamma", burstiness=0.5)
    assert process.schedule(seed=42, count=100) == process.schedule(seed=42, count=100)
    assert process.schedule(seed=42, count=100) != process.schedule(seed=43, count=100)


def test_a_schedule_stops_at_its_duration_or_count():
    process = ArrivalProcess(rate=100.0)
    assert all(t < 3.0 for t in process.schedule(seed=0, duration_s=3.0))
    assert len(process.schedule(seed=0, count=17)) == 17
    with pytest.raises(ValueError):
        process.schedule(seed=0)


@pytest.mark.parametrize("kwargs", [dict(rate=0), dict(rate=1, kind="weibull"), dict(rate=1, burstiness=0)])
def test_bad_arrival_settings_are_refused_with_a_message(kwargs):
    with pytest.raises(ValueError):
        ArrivalProcess(**kwargs)


def test_lengths_parse_fixed_ranges_and_distributions():
    assert LengthDist.parse("256") == LengthDist("fixed", 256)
    uniform = LengthDist.parse("128-512")
    import random

    rng = random.Random(0)
    samples = [uniform.sample(rng) for _ in range(2000)]
    assert min(samples) >= 128 and max(samples) <= 512
    assert LengthDist.parse("lognormal:200:0.5").sample(rng) >= 1
    with pytest.raises(ValueError):
        LengthDist.parse("512-128")


def test_a_stream_spec_reads_its_class_arrivals_lengths_deadline_and_slo():
    s = parse_stream("name=chat,class=interactive,rate=4,arrival=gamma,burstiness=0.5,input=64-128,output=32,"
                     "deadline_ms=5000,slo_ttft_ms=200,slo_itl_ms=50,cancel=0.1")
    assert s.name == "chat" and s.traffic_class == "interactive"
    assert s.arrival == ArrivalProcess(4.0, "gamma", 0.5)
    assert s.deadline_ms == 5000 and s.slo.ttft_ms == 200 and s.slo.itl_ms == 50
    assert s.cancel_fraction == 0.1
    closed = parse_stream("name=batch,class=bulk,concurrency=8")
    assert not closed.open_loop and closed.concurrency == 8
    for bad in ("name=x", "name=x,rate=1,concurrency=2", "name=x,rate=1,class=urgent", "rate=1,colour=red"):
        with pytest.raises(ValueError):
            parse_stream(bad)


class FakeTokenizer:
    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 100

    def decode(self, ids):
        return " ".join(map(str, ids))


def factories(seed=0):
    tok = FakeTokenizer()
    source = SyntheticPrompts(tok)
    streams = [parse_stream("name=chat,class=interactive,rate=30,input=16-32,output=8"),
               parse_stream("name=batch,class=bulk,rate=10,input=64,output=4-16")]
    return [RequestFactory(s, i, seed, source, tokenizer=tok) for i, s in enumerate(streams)]


def test_a_plan_merges_streams_in_arrival_order_at_their_rates():
    plan = open_loop_plan(factories(), seed=5, duration_s=60.0, num_requests=None)
    times = [r.at for r in plan]
    assert times == sorted(times)
    chat = sum(r.stream == "chat" for r in plan)
    batch = sum(r.stream == "batch" for r in plan)
    assert chat / 60 == pytest.approx(30, rel=0.1) and batch / 60 == pytest.approx(10, rel=0.15)
    assert all(16 <= len(r.prompt_ids) <= 32 for r in plan if r.stream == "chat")
    assert all(t not in (0, 1, 2) for r in plan for t in r.prompt_ids)  # no special tokens


def test_a_plan_is_the_same_for_the_same_seed():
    a = open_loop_plan(factories(seed=1), seed=1, duration_s=None, num_requests=50)
    b = open_loop_plan(factories(seed=1), seed=1, duration_s=None, num_requests=50)
    c = open_loop_plan(factories(seed=2), seed=2, duration_s=None, num_requests=50)
    assert len(a) == 50 and a == b
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]

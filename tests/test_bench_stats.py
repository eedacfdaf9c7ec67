"""The bench's statistics: percentiles, inter-token gaps, goodput, and the server-side split."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from tokenline.bench.records import CANCELLED, ERROR, OK, REFUSED, TIMEOUT, UNFINISHED, RequestRecord, itl_gaps
from tokenline.bench.report import build_results, format_results, meets_slo, summarize_records
from tokenline.bench.stats import ecdf, percentile, percentiles, slope, summarize
from tokenline.bench.workload import Slo, StreamSpec


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentiles_match_numpy_linear_interpolation(n):
    rng = random.Random(n)
    values = [rng.lognormvariate(0, 1) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_summary_has_count_mean_std_and_the_reported_percentiles_like_numpy():
    rng = random.Random(7)
    values = [rng.expovariate(1.0) for _ in range(5000)]
    s = summarize(values)
    assert s["count"] == 5000
    assert s["mean"] == pytest.approx(float(np.mean(values)))
    assert s["std"] == pytest.approx(float(np.std(values)))
    for key, q in (("p50", 50), ("p90", 90), ("p99", 99), ("p99.9", 99.9)):
        assert s[key] == pytest.approx(float(np.percentile(values, q)))


def test_summary_of_no_samples_counts_zero_and_reports_nan():
    s = summarize([])
    assert s["count"] == 0
    assert math.isnan(s["mean"]) and math.isnan(s["p99"])


def test_percentiles_keep_their_existing_names():
    assert percentiles([1, 2, 3, 4], (50, 99.9)) == {"p50": 2.5, "p99.9": pytest.approx(3.997)}


def test_ecdf_and_slope():
    xs, ys = ecdf([3.0, 1.0, 2.0])
    assert xs == [1.0, 2.0, 3.0] and ys == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)


def test_a_chunk_of_several_tokens_counts_as_that_many_gaps_sharing_its_wait():
    # First chunk 1 token at 0.100; next chunk 3 tokens 30 ms later; then one token 10 ms later.
    gaps = itl_gaps([0.100, 0.130, 0.140], [1, 3, 1])
    assert gaps == pytest.approx([0.010, 0.010, 0.010, 0.010])
    assert len(gaps) == 5 - 1  # one gap per token after the first


def test_tokens_arriving_together_in_the_first_chunk_add_zero_gaps():
    assert itl_gaps([0.05, 0.07], [2, 1]) == pytest.approx([0.0, 0.02])


def record(status=OK, *, stream="chat", cls="interactive", scheduled=0.0, sent=0.001, chunks=((0.05, 1), (0.07, 1)),
           end=None, server=None, deadline_s=None, input_tokens=10):
    times = [t for t, _ in chunks]
    counts = [n for _, n in chunks]
    r = RequestRecord(f"r{random.random()}", stream, cls, scheduled, input_tokens, 16, deadline_s)
    r.sent, r.chunk_times, r.chunk_tokens, r.status, r.server = sent, times, counts, status, server
    r.end = end if end is not None else (times[-1] if times else scheduled + 0.01)
    return r


def test_latencies_count_from_the_scheduled_arrival_not_the_send():
    r = record(scheduled=1.0, sent=1.5, chunks=((1.6, 1), (1.7, 1)), end=1.7)
    assert r.ttft == pytest.approx(0.6)
    assert r.send_lag == pytest.approx(0.5)
    assert r.e2e == pytest.approx(0.7)
    assert r.tpot == pytest.approx(0.1)


def test_goodput_divides_by_every_offered_request_including_refused_and_timed_out():
    slo = Slo(ttft_ms=100)
    records = [
        record(),  # good
        record(),  # good
        record(chunks=((0.5, 1), (0.6, 1))),  # finished but missed the TTFT bound
        record(REFUSED, chunks=(), end=0.004),
        record(TIMEOUT, chunks=((0.05, 1),)),
        record(ERROR, chunks=()),
        record(UNFINISHED, chunks=((0.05, 1),)),
        record(CANCELLED, chunks=((0.05, 1),)),  # abandoned by the bench on purpose: not offered
    ]
    results = summarize_records(records, 1.0, {"chat": slo})
    assert results["offered"] == 7
    assert results["good"] == 2
    assert results["goodput"] == pytest.approx(2 / 7)
    assert results["refused"] == 1 and results["refusal_rate"] == pytest.approx(1 / 7)
    assert results["time_to_refuse_ms"]["p50"] == pytest.approx(4.0)
    assert results["request_goodput"] == pytest.approx(2.0)


def test_tokens_spent_on_cancelled_and_deadline_missing_requests_are_counted():
    records = [
        record(TIMEOUT, chunks=((0.05, 3), (0.06, 2))),
        record(CANCELLED, chunks=((0.05, 4),)),
        record(OK, chunks=((0.05, 1), (3.0, 1)), deadline_s=2.0),  # finished after its deadline
        record(OK),
        record(TIMEOUT, chunks=()),  # never started: its prompt was not computed
    ]
    results = summarize_records(records, 1.0, {})
    assert results["wasted_output_tokens"] == 5 + 4 + 2
    assert results["wasted_prompt_tokens"] == 3 * 10
    assert not meets_slo(records[2], Slo())


def test_itl_statistics_weigh_every_gap_and_tpot_every_request():
    records = [record(chunks=((0.01, 1), (0.04, 3))), record(chunks=((0.01, 1), (0.02, 1)))]
    results = summarize_records(records, 1.0, {})
    assert results["itl_count"] == 3 + 1
    assert results["median_itl_ms"] == pytest.approx(10.0)
    assert results["tpot_count"] == 2


def test_results_use_vllm_benchmark_key_names_per_class_and_in_total():
    streams = [StreamSpec("chat", "interactive", concurrency=1), StreamSpec("batch", "bulk", concurrency=1)]
    results = build_results([record(), record(stream="batch", cls="bulk")], 2.0, streams)
    for key in ("completed", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert key in results and key in results["classes"]["bulk"]
    assert set(results["classes"]) == {"interactive", "bulk"}
    assert results["completed"] == 2 and results["output_throughput"] == pytest.approx(2.0)
    assert "interactive" in format_results(results)


def test_transport_is_client_side_time_minus_server_side_time():
    server = {"admission_wait_ms": 1.0, "queueing_ms": 2.0, "prefill_ms": 3.0, "decode_ms": 20.0, "return_ms": 0.5,
              "ttft_ms": 40.0, "completion_ms": 60.0}
    r = record(sent=0.0, chunks=((0.045, 1), (0.07, 1)), end=0.07, server=server)
    split = summarize_records([r], 1.0, {})["server_split_ms"]
    assert split["transport"]["p50"] == pytest.approx(10.0)
    assert split["transport_ttft"]["p50"] == pytest.approx(5.0)
    assert split["queueing"]["p50"] == 2.0 and split["decode"]["p50"] == 20.0

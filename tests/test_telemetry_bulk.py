"""Token gaps recorded in bulk (server/otel_bulk.py) export exactly what one `record` per gap exports.

The real OpenTelemetry SDK on both sides: one meter provider fed value by value through the public
API, one fed through `record_many`, each read by the SDK's own in-memory reader.
"""

from __future__ import annotations

import random

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View

from tokenline.server.otel_bulk import Series, record_many
from tokenline.server.telemetry_config import GAP_BUCKETS


def histogram(views=(), temporality=None):  # noqa: ANN001, ANN201
    reader = InMemoryMetricReader(**({"preferred_temporality": temporality} if temporality else {}))
    provider = MeterProvider(metric_readers=[reader], views=list(views))
    h = provider.get_meter("t").create_histogram("gaps", unit="s", explicit_bucket_boundaries_advisory=GAP_BUCKETS)
    return h, reader


def points(reader) -> dict:  # noqa: ANN001
    """Each series' data point, by its attributes: count, sum, min, max, bucket counts."""
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    buckets = getattr(p, "bucket_counts", None) or (p.positive.bucket_counts if hasattr(p, "positive") else ())
                    out[tuple(sorted(p.attributes.items()))] = (p.count, round(p.sum, 9), p.min, p.max, tuple(buckets))
    return out


def requests(seed: int = 3) -> list[tuple[list[float], dict]]:
    """Requests' gap lists, some sharing labels: gaps on both sides of every bucket boundary, one exactly on one."""
    rng = random.Random(seed)
    labels = [{"model": "m", "class": "interactive", "outcome": "finished"},
              {"model": "m", "class": "bulk", "outcome": "finished"},
              {"model": "m", "class": "bulk", "outcome": "cancelled"}]
    out = []
    for i in range(30):
        gaps = [rng.choice([rng.uniform(0, 0.004), rng.uniform(0.004, 0.2), rng.uniform(0.2, 40)]) for _ in range(rng.randint(0, 60))]
        if i == 4:
            gaps.append(GAP_BUCKETS[3])  # a bucket's upper bound belongs to that bucket
        out.append((gaps, labels[i % 3]))
    return out


def test_bulk_recording_exports_what_one_record_per_gap_exports():
    one_by_one, reader_a = histogram()
    bulk, reader_b = histogram()
    for gaps, labels in requests():
        for gap in gaps:
            one_by_one.record(gap, labels)
        record_many(bulk, gaps, labels)
    expected = points(reader_a)
    assert len(expected) == 3 and sum(p[0] for p in expected.values()) > 500
    assert points(reader_b) == expected
    # and it goes on adding after a collection, as a cumulative reader expects
    for gaps, labels in requests(seed=4):
        for gap in gaps:
            one_by_one.record(gap, labels)
        record_many(bulk, gaps, labels)
    assert points(reader_b) == points(reader_a)


def test_where_the_bulk_path_does_not_apply_every_gap_still_counts():
    """A View choosing another aggregation, and a delta reader: record_many falls back to one record per gap."""
    for views, temporality in (([View(instrument_name="gaps", aggregation=ExponentialBucketHistogramAggregation())], None),
                               ((), {_histogram_type(): AggregationTemporality.DELTA})):
        one_by_one, reader_a = histogram(views, temporality)
        bulk, reader_b = histogram(views, temporality)
        for gaps, labels in requests():
            for gap in gaps:
                one_by_one.record(gap, labels)
            record_many(bulk, gaps, labels)
        expected = points(reader_a)
        assert sum(p[0] for p in expected.values()) > 500
        assert points(reader_b) == expected


def test_a_series_recorded_a_value_at_a_time_exports_what_record_exports_before_and_after_collections():
    """otel_bulk.Series (the worker step histogram, once per step report): its values go straight into the
    aggregation after the first; read in the middle, and with a View or a delta reader where it must fall back."""
    cases = [((), None), ([View(instrument_name="gaps", aggregation=ExponentialBucketHistogramAggregation())], None),
             ((), {_histogram_type(): AggregationTemporality.DELTA})]
    for views, temporality in cases:
        one_by_one, reader_a = histogram(views, temporality)
        fast, reader_b = histogram(views, temporality)
        series: dict[str, Series] = {}
        for round_ in range(2):
            for gaps, labels in requests(seed=5 + round_):
                key = labels["class"] + labels["outcome"]
                s = series.setdefault(key, Series(fast, labels))
                for gap in gaps:
                    one_by_one.record(gap, labels)
                    s.record(gap)
            expected = points(reader_a)
            assert sum(p[0] for p in expected.values()) > 200
            assert points(reader_b) == expected, (views, temporality, round_)


def _histogram_type():  # noqa: ANN202
    from opentelemetry.sdk.metrics import Histogram

    return Histogram

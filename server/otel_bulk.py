"""Many values into one OpenTelemetry histogram at once: what one `record` call per value does, cheaper.

The inter-token latency histogram takes one sample per token gap, recorded when a request ends: a
128-token request is 127 `Histogram.record` calls. The SDK's `record` builds a Measurement, reads
the current context, asks the exemplar filter, copies and hashes the attributes and takes a lock,
for every value: ~3 µs of the frontend's CPU per streamed token at saturation (py-spy, 256 streams
on the simulated engine, 2026-12-05), for an addition to a bucket count.

`record_many` records the first value through the public API (so the SDK creates the series and
samples an exemplar as usual), then adds the rest to each reader's aggregation of those attributes
directly: the bucket counts, the sum, the count, min and max, under the aggregation's own lock.
It relies on the SDK's internals (opentelemetry-sdk 1.4x's explicit-bucket aggregation); where
they are not what it expects (another aggregation chosen by a View, another SDK version, a
series past the cardinality limit) it falls back to one `record` per value, so a change there
costs speed, never a sample. tests/test_telemetry_bulk.py holds the two paths to the same export.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from typing import Any

try:
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes
    from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation
except ImportError:  # another SDK layout: every value goes through record()
    _hash_attributes = None
    _ExplicitBucketHistogramAggregation = None


def record_many(histogram: Any, values: Sequence[float], attributes: dict[str, Any]) -> None:
    """`histogram.record(v, attributes)` for every v in `values` (each finite and >= 0, as token gaps are)."""
    if not values:
        return
    histogram.record(values[0], attributes)
    rest = values[1:]
    if not rest:
        return
    aggregations = _aggregations(histogram, attributes)
    if aggregations is None:
        for value in rest:
            histogram.record(value, attributes)
        return
    for aggregation in aggregations:
        _add(aggregation, rest)


class Series:
    """One series of a histogram (its attributes fixed), recorded a value at a time: the first value goes through
    `record` (the SDK makes the series then), the rest straight into each reader's aggregation of it, as
    `record_many` adds its rest: ~1 µs a value against `record`'s ~20 (issue 38: the worker step histogram takes
    one per step report, hundreds a second). Where the SDK is not laid out as expected, every value goes through
    `record`. Values are offered to no exemplar reservoir: a step report is handled outside any span."""

    def __init__(self, histogram: Any, attributes: dict[str, Any]):
        self._histogram, self._attributes = histogram, attributes
        self._aggregations: list[Any] | None = None  # found after the first value
        self._fallback = False

    def record(self, value: float) -> None:
        aggregations = self._aggregations
        if aggregations is None:
            self._histogram.record(value, self._attributes)
            if not self._fallback:
                self._aggregations = _aggregations(self._histogram, self._attributes)
                self._fallback = self._aggregations is None
            return
        for aggregation in aggregations:
            _add_one(aggregation, value)


def _aggregations(histogram: Any, attributes: dict[str, Any]) -> list[Any] | None:
    """Every reader's aggregation of `attributes` on `histogram` (each an explicit-bucket histogram), or None."""
    if _hash_attributes is None:
        return None
    try:
        if not histogram._is_enabled():
            return []  # record() is a no-op on a disabled instrument
        found = []
        for storage in histogram._measurement_consumer._reader_storages.values():
            for match in storage._get_or_init_view_instrument_match(histogram):
                keys = match._view._attribute_keys
                attrs = dict(attributes) if keys is None else {k: v for k, v in attributes.items() if k in keys}
                aggregation = match._attributes_aggregation.get(_hash_attributes(attrs))
                if type(aggregation) is not _ExplicitBucketHistogramAggregation or match._reset_on_collect:
                    return None  # not made by the first record (overflow), another kind, or a delta reader
                found.append(aggregation)
        return found
    except AttributeError:  # the SDK's internals moved
        return None


def _add(aggregation: Any, values: Sequence[float]) -> None:
    boundaries = aggregation._boundaries
    counts = Counter(bisect_left(boundaries, v) for v in values)
    total = sum(values)
    low, high = min(values), max(values)
    with aggregation._lock:
        if aggregation._value is None:
            aggregation._value = aggregation._get_empty_bucket_counts()
        buckets = aggregation._value
        for index, n in counts.items():
            buckets[index] += n
        aggregation._sum += total
        if aggregation._record_min_max:
            aggregation._min = min(aggregation._min, low)
            aggregation._max = max(aggregation._max, high)


def _add_one(aggregation: Any, value: float) -> None:
    index = bisect_left(aggregation._boundaries, value)
    with aggregation._lock:
        if aggregation._value is None:
            aggregation._value = aggregation._get_empty_bucket_counts()
        aggregation._value[index] += 1
        aggregation._sum += value
        if aggregation._record_min_max:
            if value < aggregation._min:
                aggregation._min = value
            if value > aggregation._max:
                aggregation._max = value

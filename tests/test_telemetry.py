"""The latency bill, as an operator sees it: the Prometheus endpoint and the final timeline.

A real `tokenline serve --metrics-port 0` runs as a subprocess, on the simulated engine and on
the real vLLM engine (tiny random model). Counts are compared as differences between two scrapes,
so the assertions hold whatever the same server served before.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ServerProcess, wait_until
from tokenline.client import AsyncClient, Client
from tokenline.client.errors import AlreadyExists, InvalidRequest, NotFound

METRICS_URL = re.compile(r"tokenline: metrics on (http://\S+)")
STAMPS = ("received_ms", "validated_ms", "enqueued_ms", "admitted_ms", "first_scheduled_ms", "first_token_ms",
          "finished_ms", "last_byte_ms")
SPLITS = ("admission_wait_ms", "queueing_ms", "prefill_ms", "decode_ms", "lost_preemption_ms", "lost_retry_ms", "return_ms")
ROUNDING_MS = 0.001  # float rounding of millisecond values, nothing more


class Scrape:
    """One read of the endpoint: sample values by name and labels."""

    def __init__(self, url: str):
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        self.samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of `name` over every series whose labels include `labels`."""
        return sum(v for n, lab, v in self.samples if n == name and labels.items() <= lab.items())


@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=pytest.mark.engine)])
def server(request):
    """A server with its metrics endpoint on a free port; `.metrics_url` is where to scrape."""
    proc = ServerProcess("--engine", request.param, "--model", "tiny", "--kv-cache-mb", "64", "--max-seqs", "16",
                         "--max-model-len", "2048", "--metrics-port", "0").start()
    found = METRICS_URL.search(proc.output())
    assert found, proc.output()
    proc.metrics_url = found.group(1)
    yield proc
    proc.stop()


def scrape(server) -> Scrape:
    return Scrape(server.metrics_url)


def test_counters_and_histogram_counts_match_the_requests_served(server):
    before = scrape(server)
    with Client(server.address) as client:
        finished = [list(client.generate("the same prompt", max_tokens=8, ignore_eos=True)) for _ in range(3)]
        completed = [client.complete("the same prompt", max_tokens=5, ignore_eos=True) for _ in range(2)]

        # Cancelled by the Cancel RPC: the stream still ends with its final chunk.
        stream = client.generate("the same prompt", max_tokens=1900, ignore_eos=True, request_id="telemetry-cancel")
        deltas = iter(stream)
        next(deltas)
        with pytest.raises(AlreadyExists):  # refused at once: the id is in flight
            client.complete("the same prompt", max_tokens=4, request_id="telemetry-cancel")
        assert client.cancel("telemetry-cancel")
        cancelled = list(deltas)

        # The caller goes away: no final chunk is written.
        gone = client.generate("the same prompt", max_tokens=1900, ignore_eos=True)
        next(iter(gone))
        gone.cancel()

        with pytest.raises(InvalidRequest):
            client.complete("the same prompt", max_tokens=100_000)
        with pytest.raises(NotFound):
            client.complete("the same prompt", model="no-such-model")

    assert wait_until(lambda: scrape(server).value("tokenline_requests_total", outcome="disconnected")
                      - before.value("tokenline_requests_total", outcome="disconnected") == 1)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert cancelled[-1].finish_reason == "cancelled"
    assert [d[-1].finish_reason for d in finished] + [c.finish_reason for c in completed] == ["length"] * 5
    assert delta("tokenline_requests_total", outcome="length") == 5
    assert delta("tokenline_requests_total", outcome="cancelled") == 1
    assert delta("tokenline_requests_total", outcome="disconnected") == 1
    assert delta("tokenline_requests_total", outcome="duplicate_request") == 1
    assert delta("tokenline_requests_total", outcome="invalid_request") == 1
    assert delta("tokenline_requests_total", outcome="model_not_found", model="unknown") == 1
    assert delta("tokenline_requests_total") == 10
    assert delta("tokenline_refusals_total", reason="duplicate_request") == 1
    assert delta("tokenline_refusals_total", reason="invalid_request") == 1
    assert delta("tokenline_refusals_total", reason="model_not_found") == 1
    assert delta("tokenline_refusals_total") == 3

    # Seven requests reached the engine; all were admitted and produced a first token.
    accepted, admitted, first_token = 7, 7, 7
    # Six got their final message (the disconnected one did not).
    delivered = 6
    prompt = completed[0].usage.prompt_tokens
    assert delta("tokenline_prompt_tokens_total") == accepted * prompt
    generated = delta("tokenline_generated_tokens_total")
    assert generated >= 3 * 8 + 2 * 5 + cancelled[-1].usage.completion_tokens + 1
    assert delta("tokenline_request_intake_seconds_count") == accepted
    assert delta("tokenline_request_admission_wait_seconds_count") == admitted
    assert delta("tokenline_request_queueing_seconds_count") == admitted
    assert delta("tokenline_request_prefill_seconds_count") == first_token
    assert delta("tokenline_request_ttft_seconds_count") == first_token
    assert delta("tokenline_request_decode_seconds_count") == first_token
    assert delta("tokenline_request_return_seconds_count") == delivered
    assert delta("tokenline_request_completion_seconds_count") == delivered
    # One gap between each pair of consecutive tokens of a request.
    assert delta("tokenline_inter_token_latency_seconds_count") == generated - first_token
    assert delta("tokenline_request_completion_seconds_count", outcome="length", **{"class": "interactive"}) == 5


def test_timelines_are_ordered_and_their_splits_add_up(server):
    async def run():
        async with AsyncClient(server.address) as client:
            async def one(i: int, cls: str):
                return [d async for d in client.generate(f"request {i}", max_tokens=16, ignore_eos=True, traffic_class=cls)]
            alone = [await one(i, "interactive") for i in range(3)]
            together = await asyncio.gather(*(one(i, ("interactive", "bulk")[i % 2]) for i in range(24)))
            return alone + list(together)

    timelines = [deltas[-1].timeline for deltas in asyncio.run(run())]
    for t in timelines:
        stamps = [getattr(t, name) for name in STAMPS]
        assert stamps == sorted(stamps), t
        assert all(getattr(t, name) >= 0 for name in SPLITS + ("ttft_ms", "itl_mean_ms", "completion_ms")), t
        assert t.ttft_ms >= t.prefill_ms, t
    for t in timelines:
        # received → enqueued is intake; every later moment is in exactly one split,
        # including time lost to a preemption (re-queueing and re-prefill).
        total = t.enqueued_ms + sum(getattr(t, name) for name in SPLITS)
        assert total == pytest.approx(t.completion_ms, abs=ROUNDING_MS), t
        assert t.admitted_ms - t.enqueued_ms == pytest.approx(t.admission_wait_ms + t.queueing_ms, abs=ROUNDING_MS), t


def test_a_request_admitted_while_capacity_is_free_shows_no_queueing(server):
    with Client(server.address) as client:
        assert wait_until(lambda: scrape(server).value("tokenline_requests_in_flight") == 0)
        timeline = list(client.generate("alone", max_tokens=4, ignore_eos=True))[-1].timeline
    assert timeline.queueing_ms == 0.0


def test_gauges_describe_queues_and_workers(server):
    with Client(server.address) as client:
        list(client.generate("warm", max_tokens=4, ignore_eos=True))
    s = scrape(server)
    for cls in ("interactive", "bulk"):
        assert ("tokenline_queue_requests", cls) in {(n, lab.get("class")) for n, lab, _ in s.samples}
    workers = [lab for n, lab, _ in s.samples if n == "tokenline_worker_kv_usage_ratio"]
    assert workers and all(lab["worker"].isdigit() for lab in workers)
    assert 0.0 <= s.value("tokenline_worker_kv_usage_ratio") <= 1.0
    assert s.value("tokenline_worker_step_seconds_count") > 0
    assert s.value("tokenline_stale_outputs_total") >= 0


def test_each_finished_request_is_logged_as_one_key_value_line(server):
    with Client(server.address) as client:
        client.complete("log me", max_tokens=3, ignore_eos=True, request_id="telemetry-log-line")
    assert wait_until(lambda: "id=telemetry-log-line" in server.output())
    line = next(x for x in server.output().splitlines() if "id=telemetry-log-line" in x)
    fields = dict(kv.split("=", 1) for kv in line.split("request ", 1)[1].split())
    assert fields["outcome"] == "length" and fields["class"] == "interactive" and fields["tokens"] == "3"
    for name in ("intake_ms", "admission_wait_ms", "queueing_ms", "prefill_ms", "decode_ms", "return_ms",
                 "ttft_ms", "itl_mean_ms", "completion_ms"):
        assert float(fields[name]) >= 0.0


def test_a_caller_that_goes_away_is_counted_as_disconnected_and_its_run_stops(server):
    before = scrape(server)
    with Client(server.address) as client:
        for _ in range(5):
            stream = client.generate("going away", max_tokens=1900, ignore_eos=True)
            next(iter(stream))
            stream.cancel()

    def settled() -> bool:
        now = scrape(server)
        return (now.value("tokenline_requests_total", outcome="disconnected")
                - before.value("tokenline_requests_total", outcome="disconnected") == 5
                and now.value("tokenline_requests_in_flight") == 0)

    assert wait_until(settled)
    after = scrape(server)
    assert after.value("tokenline_requests_total", outcome="error") == before.value("tokenline_requests_total", outcome="error")

"""`tokenline bench features`: each feature driven on every request, by both kinds of target, and its cost
reported as a ratio to the same server's plain requests."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tokenline.bench.features import SCHEMA, format_features, summarize, variant_stream
from tokenline.bench.targets import OpenAITarget
from tokenline.bench.workload import PlannedRequest, parse_stream


def test_a_stream_names_the_features_its_requests_ask_for(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    stream = parse_stream(f"name=x,concurrency=4,logprobs=5,n=4,json_schema={schema}")
    assert (stream.logprobs, stream.n, stream.json_schema) == (5, 4, str(schema))
    with pytest.raises(ValueError, match="n must be in"):
        parse_stream("name=x,concurrency=4,n=40")
    plain = parse_stream("name=x,concurrency=4")
    assert variant_stream(plain, "json", schema).ignore_eos is False  # a format ends itself
    assert variant_stream(plain, "n4", schema).n == 4 and variant_stream(plain, "n4", schema).temperature == 1.0
    assert variant_stream(plain, "logprobs", schema).logprobs == 5


def test_an_openai_target_asks_vllm_serve_for_the_same_features():
    request = PlannedRequest(request_id="r", stream="s", traffic_class="bulk", at=None, prompt_ids=(1, 2), prompt_text=None,
                             max_tokens=8, ignore_eos=False, deadline_s=None, cancel_after=None, logprobs=5, n=4,
                             json_schema=json.dumps(SCHEMA))
    body = OpenAITarget("http://x", model="m")._body(request)
    assert body["logprobs"] == 5 and body["n"] == 4 and body["structured_outputs"] == {"json": SCHEMA}
    plain = OpenAITarget("http://x", model="m")._body(PlannedRequest(
        request_id="r", stream="s", traffic_class="bulk", at=None, prompt_ids=(1,), prompt_text=None, max_tokens=8,
        ignore_eos=True, deadline_s=None, cancel_after=None))
    assert not {"logprobs", "n", "structured_outputs"} & set(plain)


def test_the_report_puts_each_servers_ratios_side_by_side():
    report = {"requests": 64, "input_len": 256, "output_len": 128,
              "throughput": {"tokenline": {"plain": 700.0, "logprobs": 630.0, "n4": 910.0, "json": 350.0},
                             "vllm": {"plain": 450.0, "logprobs": 360.0, "n4": 600.0, "json": None}},
              "ratio_to_plain": {"tokenline": {"logprobs": 0.9, "n4": 1.3, "json": 0.5},
                                 "vllm": {"logprobs": 0.8, "n4": 600 / 450, "json": None}}}
    text = re.sub(r" +", " ", format_features(report))
    assert "| logprobs | 630 tok/s (0.90×) | 360 tok/s (0.80×) |" in text
    assert "| json | 350 tok/s (0.50×) | - |" in text


@pytest.mark.engine
def test_bench_features_measures_every_variant_on_a_real_server(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tokenline.server.cli", "bench", "features", "--model", "tiny",
                          "--compile", "off", "--workers", "1", "--skip", "vllm", "--requests", "6", "--output-len", "12",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    report = json.loads((tmp_path / "features.json").read_text())
    tok_s = report["throughput"]["tokenline"]
    assert all(tok_s[v] and tok_s[v] > 0 for v in ("plain", "logprobs", "n4", "json")), tok_s
    assert set(report["ratio_to_plain"]["tokenline"]) == {"logprobs", "n4", "json"}
    assert "feature cost at saturation" in out.stdout


def test_over_several_rounds_a_features_cost_is_the_median_of_each_rounds_own_ratio():
    spec = SimpleNamespace(settings=SimpleNamespace(), requests=64, input_len=256, output_len=128)
    rounds = [{"tokenline": {"plain": 100.0, "logprobs": 90.0, "n4": 120.0, "json": 95.0}},
              {"tokenline": {"plain": 50.0, "logprobs": 50.0, "n4": 70.0, "json": None}},  # a slow round
              {"tokenline": {"plain": 110.0, "logprobs": 88.0, "n4": 132.0, "json": 99.0}}]
    report = summarize(spec, rounds)
    got = report["ratio_to_plain"]["tokenline"]
    # Each round's ratio, then their median: the slow round's 1.0 and 1.4 count as ratios, not as tok/s.
    assert got["logprobs"] == pytest.approx(0.9) and got["n4"] == pytest.approx(1.2)
    assert got["json"] == pytest.approx((0.95 + 0.9) / 2)  # a round that did not measure it is left out
    assert report["throughput"]["tokenline"]["plain"] == 100.0
    text = re.sub(r" +", " ", format_features(report))
    assert "| n4 | 120 tok/s (1.20×, 1.20–1.40) |" in text and "medians of 3 rounds" in text

"""`tokenline bench doors`: vLLM's own benchmark against tokenline's HTTP door, and tokenline's bench through
both of tokenline's doors, each side by side; a run whose requests failed is no figure."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tokenline.bench.doors import format_doors, ratios


def test_the_report_gives_each_comparison_its_ratio():
    report = {"requests": 64, "input_len": 256, "output_len": 128,
              "vllm_bench_serve": {"tokenline": {"output_throughput": 150.0, "p50_ttft_ms": 9000.0, "p99_ttft_ms": 20000.0},
                                   "vllm": {"output_throughput": 75.0, "p50_ttft_ms": 15000.0, "p99_ttft_ms": 40000.0}},
              "tokenline_bench": {"grpc": {"output_throughput": 140.0, "p99_ttft_ms": 30000.0, "c1_p50_ttft_ms": 850.0},
                                  "http": {"output_throughput": 137.2, "p99_ttft_ms": 30500.0, "c1_p50_ttft_ms": 852.5}}}
    report["ratios"] = ratios(report)
    assert report["ratios"]["http_over_vllm_serve_throughput"] == 2.0
    assert report["ratios"]["http_over_vllm_serve_p99_ttft"] == 0.5
    assert report["ratios"]["http_minus_grpc_c1_p50_ttft_ms"] == pytest.approx(2.5)
    text = re.sub(r" +", " ", format_doors(report))
    assert "tokenline HTTP ÷ vllm serve: throughput 2.00×, TTFT p99 0.50×" in text
    assert "HTTP door ÷ gRPC door: throughput 0.980×, TTFT p50 at concurrency 1 +2.5 ms" in text


@pytest.mark.engine
def test_bench_doors_drives_both_doors_of_a_real_server_with_both_load_generators(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tokenline.server.cli", "bench", "doors", "--model", "tiny",
                          "--compile", "off", "--workers", "1", "--skip", "vllm", "--requests", "6", "--output-len", "12",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    report = json.loads((tmp_path / "doors.json").read_text())
    assert report["vllm_bench_serve"]["tokenline"]["output_throughput"] > 0
    assert set(report["tokenline_bench"]) == {"grpc", "http"}
    assert all(d["output_throughput"] > 0 and d["c1_p50_ttft_ms"] > 0 for d in report["tokenline_bench"].values())
    assert report["ratios"]["http_over_grpc_throughput"] > 0 and "HTTP door ÷ gRPC door" in out.stdout

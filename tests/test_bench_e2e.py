"""`tokenline bench` end to end against real servers: a short mixed run writes every output file."""

from __future__ import annotations

import json

import pytest
from tokenline.server.cli import main

OUTPUT_FILES = ("results.json", "requests.jsonl", "summary.txt", "latency_cdf.png", "timeline.png")


def bench_run(address: str, out, *extra: str) -> int:
    return main(["bench", "run", "--target", address, "--tokenizer", "tiny", "--quiet", "--out", str(out),
                 "--duration-s", "2", "--seed", "3",
                 "--stream", "name=chat,class=interactive,rate=8,input=16-64,output=8,slo_ttft_ms=5000,slo_itl_ms=1000",
                 "--stream", "name=batch,class=bulk,concurrency=2,input=128,output=32,deadline_ms=30000",
                 *extra])


def check_outputs(out) -> dict:
    for name in OUTPUT_FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert set(results["classes"]) == {"interactive", "bulk"}
    assert results["completed"] > 0 and results["offered"] == len(lines)
    assert results["classes"]["bulk"]["completed"] >= 2
    done = [line for line in lines if line["status"] == "ok"]
    assert all(line["output_tokens"] == line["max_tokens"] == sum(line["token_counts"]) for line in done)
    assert all(len(line["token_times_s"]) == len(line["token_counts"]) for line in done)
    assert all(line["server_ms"]["completion_ms"] > 0 for line in done)  # the server's timeline came back
    for key in ("mean_ttft_ms", "p99_itl_ms", "output_throughput", "request_throughput", "completed"):
        assert results[key] is not None
    return results


def test_a_short_run_against_the_simulated_engine_writes_every_output_file(sim_server, tmp_path):
    assert bench_run(sim_server.address, tmp_path) == 0
    results = check_outputs(tmp_path)
    assert results["server_split_ms"]["decode"]["count"] == results["completed"]


def test_the_capacity_search_writes_its_points_and_plot(sim_server, tmp_path):
    code = main(["bench", "capacity", "--target", sim_server.address, "--tokenizer", "tiny", "--quiet",
                 "--out", str(tmp_path), "--rate", "4", "--input-len", "32", "--output-len", "8", "--duration-s", "1",
                 "--slo-ttft-ms", "5000", "--attainment", "0.9", "--max-runs", "2", "--pause-s", "0"])
    assert code == 0
    doc = json.loads((tmp_path / "capacity.json").read_text())
    assert [p["rate"] for p in doc["points"]] == [4.0, 8.0] and doc["capacity_rate"] == 8.0
    assert (tmp_path / "capacity.png").is_file() and (tmp_path / "at-capacity" / "results.json").is_file()


@pytest.mark.engine
def test_a_short_run_against_the_real_engine_writes_every_output_file(tiny_server, tmp_path):
    assert bench_run(tiny_server.address, tmp_path) == 0
    check_outputs(tmp_path)


def test_a_run_against_several_models_sends_each_stream_to_its_model_and_reports_each(tmp_path):
    from tests.support import ServerProcess

    server = ServerProcess("--engine", "sim", "--model", "a=tiny", "--model", "b=tiny-trained", "--max-seqs", "8").start()
    try:
        code = main(["bench", "run", "--target", server.address, "--tokenizer", "tiny", "--quiet", "--out", str(tmp_path),
                     "--num-requests", "24", "--seed", "3",
                     "--stream", "name=chat,class=interactive,concurrency=2,input=16,output=8,model=a",
                     "--stream", "name=batch,class=bulk,concurrency=2,input=32,output=8,model=b",
                     "--stream", "name=typo,class=bulk,concurrency=1,input=32,output=8,model=nope"])
    finally:
        server.stop()
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    models = results["models"]
    assert set(models) == {"a", "b", "nope"}
    assert models["a"]["completed"] == models["a"]["offered"] > 0
    assert models["b"]["completed"] == models["b"]["offered"] > 0
    # Each stream named its own model: the one the server does not serve was refused, not served by another.
    assert models["nope"]["completed"] == 0 and models["nope"]["offered"] > 0
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert all("unknown model 'nope'" in line["error"] for line in lines if line["stream"] == "typo")
    assert "model a" in (tmp_path / "summary.txt").read_text()


def test_an_openai_target_names_the_streams_model_over_the_runs():
    from tokenline.bench.targets import OpenAITarget
    from tokenline.bench.workload import PlannedRequest

    def body(model: str | None) -> dict:
        return OpenAITarget("http://x", model="run-model")._body(PlannedRequest(
            request_id="r", stream="s", traffic_class="bulk", at=None, prompt_ids=(1,), prompt_text=None, max_tokens=8,
            ignore_eos=True, deadline_s=None, cancel_after=None, model=model))

    assert body("b@v2")["model"] == "b@v2" and body(None)["model"] == "run-model"

"""bench compare's arithmetic: throughput over the box's best engine and over one worker's engine."""

from types import SimpleNamespace

import pytest

from tokenline.bench.compare import format_comparison, ratios


def outcome(tok_s: float, ttft: float = 100.0, itl: float = 10.0):
    return SimpleNamespace(results={"output_throughput": tok_s, "median_ttft_ms": ttft, "p99_ttft_ms": ttft,
                                    "median_itl_ms": itl, "p99_itl_ms": itl, "classes": {},
                                    "send_lag_ms": {"p99": 1.0}})


def test_both_ratios_are_reported():
    runs = {"tokenline/saturation": outcome(570.0), "vllm/saturation": outcome(380.0),
            "tokenline/c1": outcome(90.0, 110.0, 12.0), "vllm/c1": outcome(80.0, 120.0, 13.0)}
    ceiling = {"throughput": {"output_throughput": 300.0}, "sequential": {"median_ttft_ms": 100.0, "median_itl_ms": 10.0}}
    best = {"config": "2 engines × 1 thread", "output_throughput": 600.0, "configs": {"2 engines × 1 thread": 600.0}}
    r = ratios(ceiling, runs, best)
    assert r["tokenline_throughput_over_box_best"] == pytest.approx(0.95)
    assert r["tokenline_throughput_over_ceiling"] == pytest.approx(1.9)
    assert r["tokenline_over_vllm"]["saturation"]["output_throughput"] == pytest.approx(1.5)
    text = format_comparison({"runs": {k: v.results for k, v in runs.items()}, "ceiling": ceiling, "ratios": r,
                              "box_best": best, "plan": "2 workers × 1 thread"})
    assert "the box's best engine: 2 engines × 1 thread, 600 output tok/s" in text
    assert "tokenline: served throughput ÷ the box's best engine 0.95" in text


def test_without_the_best_engine_run_there_is_no_such_ratio():
    assert "tokenline_throughput_over_box_best" not in ratios(None, {"tokenline/saturation": outcome(1.0)})


def test_a_server_that_was_not_measured_gets_no_ratio_lines():
    runs = {"tokenline/saturation": outcome(570.0), "tokenline/c1": outcome(90.0, 110.0, 12.0)}
    best = {"config": "2 engines × 1 thread", "output_throughput": 600.0, "configs": {"2 engines × 1 thread": 600.0}}
    r = ratios(None, runs, best)
    assert "vllm_throughput_over_box_best" not in r
    text = format_comparison({"runs": {k: v.results for k, v in runs.items()}, "ceiling": None, "ratios": r,
                              "box_best": best, "not_measured": {"vllm serve": "skipped"}})
    assert "tokenline: served throughput ÷ the box's best engine 0.95" in text
    assert "vllm serve: served throughput" not in text


def test_the_concurrency_1_prompts_are_not_the_saturation_runs_so_ttft_is_never_a_prefix_cache_hit():
    from tokenline.bench.compare import CompareSpec, ceiling_requests
    from tokenline.bench.servers import EngineSettings

    reqs = ceiling_requests(CompareSpec(settings=EngineSettings(model="tiny"), requests=8, c1_requests=8))

    seen = {tuple(r["prompt_ids"][:32]) for r in reqs["throughput"]}
    assert not any(tuple(r["prompt_ids"][:32]) in seen for r in reqs["sequential"])


def test_the_engine_ceiling_runs_the_real_engine_under_tokenlines_kernel_policy(tmp_path):
    # "The box's best" must be an engine that answers right: on an AMX CPU, vLLM 0.32.0's own choice
    # (its AMX attention kernel) does not when run eagerly (engine/kernels.py), so the ceiling runs
    # tokenline's policy: this eager one never takes it.
    import json

    from tokenline.bench.compare import CompareSpec, ceiling_requests
    from tokenline.bench.servers import EngineSettings, run_ceiling

    settings = EngineSettings(model="tiny", kv_cache_mb=64, max_seqs=8, compile=False)  # eager: starts in seconds
    reqs = ceiling_requests(CompareSpec(settings=settings, requests=4, output_len=8, c1_requests=1, c1_output_len=4))
    path = tmp_path / "requests.json"
    path.write_text(json.dumps(reqs))

    result = run_ceiling(settings, path, tmp_path / "ceiling.json", tmp_path / "ceiling.log", timeout_s=600)

    assert result["throughput"]["completed"] == 4 and result["throughput"]["total_output_tokens"] == 4 * 8
    assert result["attention_kernel"] and not result["attention_kernel"].startswith("amx")


def test_a_shape_given_to_the_bench_is_the_shape_tokenline_is_planned_and_started_with():
    from tokenline.bench.servers import EngineSettings

    plan = EngineSettings(model="tiny", workers=1, threads=2).plan()
    assert (plan.workers, plan.threads) == (1, 2)
    assert EngineSettings(model="tiny").plan().threads == 1  # none given: tokenline serve's own plan


def test_with_several_rounds_the_ratios_are_the_medians_of_each_rounds_own_ratio():
    # One round's box's best and servers are measured side by side; across rounds the machine drifts
    # (here 700 → 600), so each round is divided by its own best before the median is taken.
    runs = {"tokenline/saturation": outcome(650.0, ttft=3000.0), "vllm/saturation": outcome(420.0, ttft=6000.0)}
    best = {"config": "2 engines × 1 thread", "output_throughput": 700.0, "configs": {"2 engines × 1 thread": 700.0}}
    rounds = [
        {"box_best": 700.0, "best_config": "2 engines × 1 thread",
         "tokenline": {"output_throughput": 650.0, "p99_ttft_ms": 3000.0}, "vllm": {"output_throughput": 420.0, "p99_ttft_ms": 6000.0}},
        {"box_best": 600.0, "best_config": "2 engines × 1 thread",
         "tokenline": {"output_throughput": 580.0, "p99_ttft_ms": 3500.0}, "vllm": {"output_throughput": 400.0, "p99_ttft_ms": 5000.0}},
        {"box_best": 650.0, "best_config": "1 engine × 2 threads",
         "tokenline": None, "vllm": {"output_throughput": 410.0, "p99_ttft_ms": 5500.0}},  # tokenline not measured this round
    ]

    r = ratios(None, runs, best, rounds)

    assert r["rounds"]["tokenline_throughput_over_box_best"]["rounds"] == pytest.approx([650 / 700, 580 / 600])
    assert r["tokenline_throughput_over_box_best"] == pytest.approx((650 / 700 + 580 / 600) / 2)
    assert r["vllm_throughput_over_box_best"] == pytest.approx(410 / 650)
    assert r["tokenline_over_vllm"]["saturation"]["output_throughput"] == pytest.approx((650 / 420 + 580 / 400) / 2)
    assert r["tokenline_over_vllm"]["saturation"]["p99_ttft_ms"] == pytest.approx((0.5 + 0.7) / 2)
    text = format_comparison({"runs": {k: v.results for k, v in runs.items()}, "ceiling": None, "ratios": r,
                              "box_best": best, "rounds": rounds})
    assert "tokenline: served throughput ÷ the box's best engine 0.95 (median of 2 rounds, 0.93–0.97)" in text
    assert "round 2: box's best 600 (2 engines × 1 thread); tokenline 580 (0.97 of the best)" in text
    assert "round 3: box's best 650 (1 engine × 2 threads); tokenline -" in text
    row = next(line for line in text.splitlines() if "saturation: output tok/s" in line)
    assert [cell.strip() for cell in row.split("|")][2:4] == ["615", "410"]  # the rounds' medians, not round 1's


def test_a_single_round_reports_that_run_alone():
    runs = {"tokenline/saturation": outcome(650.0), "vllm/saturation": outcome(420.0)}
    best = {"config": "2 engines × 1 thread", "output_throughput": 700.0, "configs": {"2 engines × 1 thread": 700.0}}
    rounds = [{"box_best": 700.0, "tokenline": {"output_throughput": 650.0, "p99_ttft_ms": 1.0},
               "vllm": {"output_throughput": 420.0, "p99_ttft_ms": 1.0}}]
    r = ratios(None, runs, best, rounds)
    assert "rounds" not in r and r["tokenline_throughput_over_box_best"] == pytest.approx(650 / 700)


def test_every_round_has_prompts_of_its_own_so_no_round_is_a_prefix_cache_hit():
    from tokenline.bench.compare import CompareSpec, ceiling_requests
    from tokenline.bench.servers import EngineSettings

    spec = CompareSpec(settings=EngineSettings(model="tiny"), requests=8, c1_requests=8, rounds=3)
    first, *later = (ceiling_requests(spec, r) for r in range(3))

    assert all(set(reqs) == {"throughput"} for reqs in later)  # the concurrency-1 run is measured once
    heads = [{tuple(r["prompt_ids"][:32]) for r in reqs["throughput"]} for reqs in (first, *later)]
    heads.append({tuple(r["prompt_ids"][:32]) for r in first["sequential"]})
    for i, a in enumerate(heads):
        for b in heads[i + 1:]:
            assert not a & b
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        CompareSpec(rounds=0)

"""bench mixed's arithmetic: the step-period curve from a step log, and the bound on bulk under an ITL target."""

import pytest

from tokenline.bench.mixed import MixedSpec, bulk_bound, fit_prompt_cost, fit_step_curve
from tokenline.server.flags import ITL_TARGET_STEPS


def _log(batches, a=0.010, b=0.002, interactive=0, start=100.0, prefills=None, c=0.0):
    steps, t = [], start
    for i, n in enumerate(batches):
        prefill = prefills[i] if prefills else 0
        t += a + b * n + c * prefill
        steps.append({"unix": t, "batch": n, "paused": 0, "prefill": prefill,
                      "step_ms": (a + b * n + c * prefill) * 1000 * 0.8, "interactive": interactive})
    return steps


def test_the_step_curve_is_fitted_on_the_periods_between_reports():
    a, b = fit_step_curve(_log([1, 4, 8, 16, 32, 48] * 5))
    assert a == pytest.approx(0.010, abs=1e-6) and b == pytest.approx(0.002, abs=1e-7)


def test_the_bound_is_bulk_alone_without_interactive_and_what_fits_the_target_with_it():
    curve = (0.010, 0.002)
    alone = bulk_bound(curve, _log([48] * 10), 48, 0.030, 0.0, bulk_alone_tok_s=400.0)
    assert alone["bound_tok_s"] == pytest.approx(400.0)
    # 2 interactive streams and a 30 ms target: at most (30 − 10)/2 − 2 = 8 bulk sequences per 30 ms step
    mixed = bulk_bound(curve, _log([10] * 10, interactive=2), 48, 0.030, 0.0, bulk_alone_tok_s=400.0)
    assert mixed["bound_tok_s"] == pytest.approx(8 / 0.030)


def test_the_prompt_cost_is_what_prompt_steps_took_beyond_the_decode_line():
    log = _log([8, 8, 8, 8, 8, 8] * 4, prefills=[0, 128, 0, 256, 0, 16] * 4, c=0.001)
    assert fit_prompt_cost(log, (0.010, 0.002)) == pytest.approx(0.001, rel=1e-6)  # the 16-token steps say too little
    assert fit_prompt_cost(_log([8] * 10), (0.010, 0.002)) == 0.0  # no prompt step: no cost known


def test_the_bound_leaves_room_in_each_step_for_the_prompts_that_replace_ending_bulk():
    # 2 prompt tokens a bulk token at 1 ms each: a bulk sequence costs 2 + 2 = 4 ms a step, not 2, so with
    # 2 interactive streams and a 30 ms target at most (30 − 10 − 4)/4 = 4 bulk sequences, in a 30 ms step
    curve = (0.010, 0.002)
    mixed = bulk_bound(curve, _log([10] * 10, interactive=2), 48, 0.030, 0.0, bulk_alone_tok_s=400.0,
                       prompt_cost_s=0.001, prompt_per_output=2.0)
    assert mixed["bound_tok_s"] == pytest.approx(4 / 0.030)


def test_targets_are_multiples_of_the_reference_unless_given_in_ms():
    assert MixedSpec(itl_target_steps=(2.0, 3.0)).targets(50.0) == [(2.0, 100.0), (3.0, 150.0)]
    # in ms: the same T whatever the reference came out as, its multiple only reported
    given = MixedSpec(itl_target_steps=(2.0, 3.0), itl_targets_ms=(150.0,))
    assert given.targets(50.0) == [(3.0, 150.0)] and given.targets(75.0) == [(2.0, 150.0)]


def test_a_short_mixed_run_reports_every_target_beside_the_references(tmp_path):
    """The bench end to end, short: tokenline on the simulated engine (tiny model), targets off, then one ITL
    target, then tokenline's own default targets (no target flag)."""
    import json

    from tokenline.server.cli import main

    code = main(["bench", "mixed", "--model", "tiny", "--tokenline-engine", "sim", "--skip", "vllm", "--out", str(tmp_path),
                 "--duration-s", "3", "--bulk-concurrency", "6", "--max-seqs", "8", "--bulk-input-len", "64",
                 "--bulk-output-len", "32", "--interactive-rate", "2", "--interactive-input-len", "16",
                 "--interactive-output-len", "8", "--itl-target-steps", "3"])

    assert code == 0
    report = json.loads((tmp_path / "mixed.json").read_text())
    reference = report["servers"]["tokenline"]
    assert reference["bulk_alone_tok_s"] > 0 and reference["solo_itl_ms"] > 0
    run, defaults = report["runs"]
    assert defaults["server"] == "tokenline (defaults)" and defaults["interactive_requests"] > 0
    assert defaults["slo"]["itl_ms"] == pytest.approx(ITL_TARGET_STEPS * reference["solo_itl_ms"])
    logs = tmp_path / "logs"
    assert "interactive targets off" in (logs / "tokenline-no-target.log").read_text()  # the references: off
    assert "interactive targets: ITL 3 × the single-sequence step" in (logs / "tokenline-defaults.log").read_text()
    assert run["itl_target_steps"] == 3 and run["slo"]["itl_ms"] == pytest.approx(3 * reference["solo_itl_ms"])
    assert run["interactive_requests"] > 0
    for key in ("attain_ttft", "attain_itl", "attain_both"):
        assert 0.0 <= run[key] <= 1.0
    assert run["bulk_mixed_tok_s"] > 0 and run["bulk_alone_targeted_tok_s"] > 0
    assert run["unused_target_cost"] == pytest.approx(run["bulk_alone_targeted_tok_s"] / reference["bulk_alone_tok_s"])
    assert (tmp_path / "tokenline" / "itl-3x" / "steps.png").stat().st_size > 0
    text = (tmp_path / "mixed.txt").read_text()
    assert "bulk alone with targets ÷ without" in text and "3× = " in text


def test_the_defaults_run_is_also_scored_at_the_itl_target_the_server_named():
    from tokenline.bench.mixed import format_mixed, named_itl_target_ms

    log = ("tokenline: listening on 127.0.0.1:5 (default model m); loading workers…\n"
           "tokenline: serving on 127.0.0.1:5; interactive ITL target 32.7 ms (3 × the 10.9 ms single-sequence step "
           "it measured)\n")
    assert named_itl_target_ms(log) == 32.7
    assert named_itl_target_ms("tokenline: serving on 127.0.0.1:5\n") is None  # a target given in ms, or none
    # workers that timed different steps each keep their own: the promise is the loosest of them
    assert named_itl_target_ms("tokenline: serving on 127.0.0.1:5; interactive ITL target 32.7-33.9 ms (3 × each "
                               "worker's single-sequence step, 10.9-11.3 ms as each measured it)\n") == 33.9
    run = {"server": "tokenline (defaults)", "itl_target_steps": 3.0, "slo": {"itl_ms": 32.8, "ttft_ms": 500.0},
           "attain_ttft": 1.0, "attain_itl": 0.5, "attain_both": 0.5, "own_itl_target_ms": 32.7,
           "attain_ttft_own": 1.0, "attain_itl_own": 0.25, "attain_both_own": 0.25}
    text = format_mixed({"servers": {}, "runs": [run], "spec": {"ttft_target_ms": 500.0}})
    own = next(line for line in text.splitlines() if "at its own T" in line)
    assert "named 32.7 ms" in own and "0.250" in own and "0.500" not in own

"""The model self-check's verdict: right answers pass whatever the numerics, wrong ones fail loudly.

`compare` is pure, so these tests build references and engine observations by hand. The real
engine runs the self-check at every worker start (tests/test_selfcheck_engine.py and every engine
test that starts a server in the default strict mode).
"""

from pathlib import Path

from tokenline.engine import selfcheck
from tokenline.engine.selfcheck import Observed, Position, Probe, Reference


def pos(token: int, logprob: float, *others: tuple[int, float]) -> Position:
    return Position(token, logprob, tuple(sorted([(token, logprob), *others], key=lambda x: -x[1])))


# A sure reference: token 7 then 8 then 9, each far ahead of the runner-up, except a near-tie at 2.
REFERENCE = Reference("fp", (Probe("p", (1, 2, 3), (
    pos(7, -0.1, (70, -3.0)),
    pos(8, -0.2, (80, -4.0)),
    pos(9, -0.60, (90, -0.65)),  # a near-tie: 9 and 90 within 0.05 nats
    pos(10, -0.1, (100, -5.0)),
)),))
FORCED_OK = (-0.11, -0.19, -0.62, -0.12)


def test_an_engine_that_agrees_within_bf16_noise_passes():
    seen = {"p": Observed((pos(7, -0.12), pos(8, -0.21), pos(9, -0.59), pos(10, -0.11)), FORCED_OK)}

    verdict = selfcheck.compare(REFERENCE, seen)

    assert verdict.ok, verdict.summary()
    assert verdict.positions_compared == 8
    assert verdict.max_logprob_error < 0.05


def test_parting_ways_at_a_near_tie_is_not_an_error_and_comparing_stops_there():
    # The engine takes the runner-up at the near-tie, then continues its own (different) way.
    seen = {"p": Observed((pos(7, -0.12), pos(8, -0.21), pos(90, -0.61), pos(55, -0.01)), FORCED_OK)}

    verdict = selfcheck.compare(REFERENCE, seen)

    assert verdict.ok, verdict.summary()
    assert verdict.positions_compared == 4 + 3


def test_parting_ways_at_a_near_tie_is_reported_with_the_references_margin():
    # A tipped near-tie can change a whole answer (eager AMX on the France question): the start-up line says where.
    parted = {"p": Observed((pos(7, -0.12), pos(8, -0.21), pos(90, -0.61), pos(55, -0.01)), FORCED_OK)}
    agreed = {"p": Observed((pos(7, -0.12), pos(8, -0.21), pos(9, -0.59), pos(10, -0.11)), FORCED_OK)}

    summary = selfcheck.compare(REFERENCE, parted).summary()

    assert summary.startswith("passed")
    assert "parted from the reference at a near-tie: p token 2 (the reference's own token ahead by 0.05 nats)" in summary
    assert "near-tie" not in selfcheck.compare(REFERENCE, agreed).summary()


def test_a_confident_wrong_token_fails_with_the_numbers():
    seen = {"p": Observed((pos(70, -0.05),), FORCED_OK)}

    verdict = selfcheck.compare(REFERENCE, seen)

    assert not verdict.ok
    assert "p token 0: engine chose 70, which the reference scores -3.00 against -0.10 for its choice 7" in verdict.summary()


def test_a_token_outside_the_references_top_k_fails():
    seen = {"p": Observed((pos(12345, -0.05),), FORCED_OK)}

    verdict = selfcheck.compare(REFERENCE, seen)

    assert not verdict.ok
    assert "engine chose 12345, which the reference scores < -3.00" in verdict.summary()


def test_wrong_probabilities_on_the_references_own_tokens_fail_even_when_greedy_tokens_agree():
    seen = {"p": Observed((pos(7, -0.12), pos(8, -0.21), pos(9, -0.59), pos(10, -0.11)), (-0.11, -1.9, -0.62, -0.12))}

    verdict = selfcheck.compare(REFERENCE, seen)

    assert not verdict.ok
    assert "p reading token 1 (8): engine log-probability -1.90, reference -0.20" in verdict.summary()


def test_many_small_errors_fail_on_the_mean_though_each_is_within_bounds():
    off = 0.5  # each within the 0.75-nat bound for one position; systematically so, far above bf16 noise
    seen = {"p": Observed(tuple(pos(p.token, p.logprob - off) for p in REFERENCE.probes[0].positions),
                          tuple(p.logprob - off for p in REFERENCE.probes[0].positions))}

    verdict = selfcheck.compare(REFERENCE, seen)

    assert not verdict.ok
    assert "mean |logprob error| 0.500 > 0.15" in verdict.summary()


def test_a_probe_the_engine_did_not_answer_fails():
    verdict = selfcheck.compare(REFERENCE, {})

    assert not verdict.ok
    assert "p: the engine produced no output" in verdict.summary()


def test_a_reference_survives_a_round_trip_through_its_file(tmp_path):
    path = tmp_path / "ref.json"

    selfcheck.save_reference(REFERENCE, path)

    assert selfcheck.load_reference(path) == REFERENCE


def test_a_cached_reference_is_not_used_once_the_folder_changes(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    cache = tmp_path / "cache"
    stored = Reference(selfcheck.folder_fingerprint(folder), REFERENCE.probes)
    selfcheck.save_reference(stored, selfcheck.reference_location(folder, cache))
    calls = []

    def compute(f: Path) -> Reference:
        calls.append(f)
        return Reference(selfcheck.folder_fingerprint(f), ())

    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selfcheck, "compute_reference", compute)
        assert selfcheck.reference_for(folder, cache) == stored  # unchanged folder: the cached one
        assert calls == []
        (folder / "model.safetensors").write_bytes(b"other weights")
        fresh = selfcheck.reference_for(folder, cache)

    assert calls == [folder]
    assert fresh.probes == ()


def test_auto_avoids_the_amx_attention_kernel_in_an_eager_engine_where_that_vllm_release_answers_wrongly():
    # Eager, vLLM 0.32.0's AMX kernel tips the France question's near-tie to "L'Étoile, ..." (engine/kernels.py).
    from tokenline.engine.kernels import choose_attention_kernel

    kernel, why = choose_attention_kernel("auto", "amx", "0.32.0", compiled=False)

    assert kernel == "vec"
    assert "would take 'amx'" in why and "eagerly" in why


def test_auto_keeps_the_amx_kernel_in_a_compiled_engine_where_it_answers_right_and_runs_faster():
    from tokenline.engine.kernels import choose_attention_kernel

    assert choose_attention_kernel("auto", "amx", "0.32.0", compiled=True) == ("amx", "")


def test_every_process_that_wraps_vllms_chooser_gets_the_policys_kernel_and_hears_why():
    # The worker, the bench's engine ceiling and its vllm serve launcher all wrap vLLM's chooser so.
    from types import SimpleNamespace

    from tokenline.engine.kernels import wrap_vllm_chooser

    heard = []
    for compiled in (False, True):
        cpu_attn = SimpleNamespace(_get_attn_isa=lambda dtype, block_size, head_size=None, kv_cache_dtype=None: "amx")
        wrap_vllm_chooser(cpu_attn, "auto", "0.32.0", compiled=compiled,
                          on_choice=lambda kernel, why: heard.append((kernel, why)))
        cpu_attn._get_attn_isa("bf16", 128, 64, "auto")

    assert heard == [("vec", "vLLM 0.32.0 would take 'amx', which answers wrongly when run eagerly"), ("amx", "")]


def test_auto_keeps_vllms_choice_everywhere_else_and_the_choice_can_be_forced_or_left_to_vllm():
    from tokenline.engine.kernels import choose_attention_kernel

    for compiled in (False, True):
        assert choose_attention_kernel("auto", "vec", "0.32.0", compiled=compiled) == ("vec", "")
        assert choose_attention_kernel("auto", "amx", "0.99.0", compiled=compiled) == ("amx", "")  # not known wrong
        assert choose_attention_kernel("vllm", "amx", "0.32.0", compiled=compiled) == ("amx", "")
        assert choose_attention_kernel("vec16", "vec", "0.32.0", compiled=compiled)[0] == "vec16"

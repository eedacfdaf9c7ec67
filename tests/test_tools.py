"""Tool calls on both doors, against the real engine: a named function and a required call (constrained, so
valid on any model, here the tiny random one), a conversation that goes on after a call, and AUTO through
vLLM's own parser for the model's format (the tiny model is steered into Hermes' format by a regex, since it
cannot choose to call anything itself)."""

from __future__ import annotations

import json

import openai
import pytest

from tokenline.client import Client, InvalidRequest
from tests.conftest import TINY_ARGS
from tests.support import ServerProcess

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": CITY}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_call(name: str, arguments: str) -> bool:
    args = json.loads(arguments, strict=False)  # vLLM's JSON grammar lets strings hold raw control characters
    if name == "get_weather":
        return set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 10
    return name == "add" and set(args) == {"a", "b"} and all(isinstance(v, int) and 0 <= v <= 99 for v in args.values())


@pytest.fixture(scope="module")
def sdk(tiny_server):
    with openai.OpenAI(base_url=tiny_server.web_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_a_named_function_is_called_alike_on_both_doors_streamed_and_whole(tiny_server, sdk):
    # Seeded sampling, one request at a time: the same tokens each time (greedy, the random model can write
    # JSON whitespace until max_tokens, which vLLM's grammar allows).
    same = dict(temperature=1.0, seed=3)
    choice = {"type": "function", "function": {"name": "add"}}
    whole = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, **same,
                                        max_completion_tokens=300)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert valid_call("add", call.function.arguments)

    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, **same,
                                              max_completion_tokens=300, stream=True))
    pieces = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "add" and all(p.index == 0 for p in pieces)
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert all(not p.id for p in pieces[1:]) and chunks[-1].choices[0].finish_reason == "tool_calls"

    # The gRPC door: the same call (one conversion layer, greedy on one server).
    with Client(tiny_server.address) as client:
        done = client.complete(messages=ASK, tools=TOOLS, tool_choice={"name": "add"}, **same, max_tokens=300)
        deltas = list(client.generate(messages=ASK, tools=TOOLS, tool_choice={"name": "add"}, **same, max_tokens=300))
    assert done.finish_reason == "tool_calls" and done.content == ""
    assert [(c.name, c.arguments) for c in done.tool_calls] == [("add", call.function.arguments)]
    assert "".join(p.arguments for d in deltas for p in d.tool_calls) == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls"


def test_a_required_call_then_its_result_and_the_conversation_goes_on(sdk):
    first = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=1.0, seed=5, max_completion_tokens=200)
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and valid_call(call.function.name, call.function.arguments)
    # The assistant's message goes back as the SDK gives it, then the tool's result, multi-part text included.
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}]
    then = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_completion_tokens=8, extra_body={"ignore_eos": True})
    assert then.choices[0].finish_reason == "length" and then.choices[0].message.tool_calls is None
    assert then.choices[0].message.content and then.usage.prompt_tokens > first.usage.prompt_tokens
    # The template saw the call and the result: without them the prompt is shorter by at least their text.
    without = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_completion_tokens=1)
    assert then.usage.prompt_tokens >= without.usage.prompt_tokens + len(call.function.arguments) // 8


def test_several_required_calls_stream_one_after_another(sdk):
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=11, max_completion_tokens=400, stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or ()) if c.choices else ():
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and sorted(calls) == list(range(len(calls)))
    assert len({c["id"] for c in calls.values()}) == len(calls)
    assert all(valid_call(c["name"], c["arguments"]) for c in calls.values())


def test_tool_choice_auto_needs_a_parser_and_bad_tools_are_refused(tiny_server, sdk):
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match="not one of the tools"):
        sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "fly"}})
    with pytest.raises(openai.BadRequestError, match="no tool_call_id"):
        sdk.chat.completions.create(model=MODEL, messages=ASK + [{"role": "tool", "content": "x"}])
    with Client(tiny_server.address) as client:
        with pytest.raises(InvalidRequest, match="drop structured_output"):
            client.complete(messages=ASK, tools=TOOLS, tool_choice="required", regex="a+")
        with pytest.raises(InvalidRequest, match="not tool calls"):
            client.submit_job(messages=ASK, tools=TOOLS, tool_choice="required")


HERMES = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    steps = tmp_path_factory.mktemp("hermes") / "steps.jsonl"
    server = ServerProcess(*TINY_ARGS, "--web-port", "0", "--compile", "off", "--tool-call-parser", "hermes",
                           "--step-log", str(steps)).start()
    server.steps = steps
    yield server
    server.stop()


def test_auto_reads_the_models_own_format_with_vllms_parser(hermes_server):
    with openai.OpenAI(base_url=hermes_server.web_url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        fields = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_completion_tokens=400,
                      extra_body={"structured_outputs": {"regex": HERMES}})
        whole = sdk.chat.completions.create(**fields)
        chunks = list(sdk.chat.completions.create(**fields, stream=True))
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and not whole.choices[0].message.content
    pieces = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name == "get_weather" and pieces[0].id.startswith("call_")
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_a_worker_compiling_a_format_reports_the_prompt_it_cannot_start_yet(hermes_server):
    """The scheduler counts such prompts as owed (test_scheduler_dispatch.py): here the worker's side, that it
    says so while vLLM compiles the format, and stops saying so once the request runs."""
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}x+"}
                                               for i in range(1, 40)}, "required": ["field_1"]}
    with Client(hermes_server.address) as client:
        prompt = client.tokenize(messages=ASK)
        done = client.complete(messages=ASK, json_schema=schema, max_tokens=4)
    assert done.usage.completion_tokens == 4
    lines = [json.loads(line) for line in hermes_server.steps.read_text().splitlines()]
    stalled = [line["stalled"] for line in lines]
    assert len(prompt) in stalled, stalled[-20:]  # while it compiled
    assert stalled[-1] == 0

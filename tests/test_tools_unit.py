"""Tool calls' pure parts: what is refused before any work, the constraint a required or named call becomes,
the prompt a template without tools is given, and calls read back from output text however it is split."""

from __future__ import annotations

import json
import random

import pytest

from tokenline.server import tools
from tokenline.server.errors import InvalidRequest
from tokenline.server.openai_requests import ChatRequest, to_generate_request
from tokenline.v1 import tokenline_pb2 as pb

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def chat(*tool_list: pb.Tool, mode=pb.ToolChoice.MODE_UNSPECIFIED, function="", **fields) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")], tools=tool_list,
                           tool_choice=pb.ToolChoice(mode=mode, function_name=function), **fields)


def weather() -> pb.Tool:
    return pb.Tool(name="get_weather", description="Weather of a city", parameters_json=json.dumps(WEATHER))


@pytest.mark.parametrize("messages, words", [
    (chat(pb.Tool(name="bad name")), "tools[0].name must be"),
    (chat(weather(), weather()), "given twice"),
    (chat(pb.Tool(name="f", parameters_json="{oops")), "parameters_json is not JSON"),
    (chat(pb.Tool(name="f", parameters_json="[1]")), "must be a JSON schema object"),
    (chat(mode=pb.ToolChoice.REQUIRED), "REQUIRED needs tools"),
    (chat(weather(), mode=pb.ToolChoice.FUNCTION, function="nope"), "not one of the tools"),
    (chat(weather(), mode=pb.ToolChoice.REQUIRED, function="get_weather"), "mode is not FUNCTION"),
    (chat(weather()), "--tool-call-parser"),  # AUTO by default, and this server has no parser
    (chat(weather(), mode=pb.ToolChoice.AUTO), "--tool-call-parser"),
])
def test_bad_tools_are_refused_with_what_to_change(messages, words):
    with pytest.raises(InvalidRequest) as e:
        tools.spec_of(messages, None)
    assert words in e.value.message


def test_chat_template_kwargs_must_be_an_object_that_leaves_the_servers_own_keys_alone():
    assert tools.template_kwargs(pb.ChatMessages(chat_template_kwargs_json='{"enable_thinking": false}')) == \
        {"enable_thinking": False}
    for bad, words in (("[1]", "JSON object"), ('{"tools": []}', "cannot set tools"), ("{", "not JSON")):
        with pytest.raises(InvalidRequest) as e:
            tools.template_kwargs(pb.ChatMessages(chat_template_kwargs_json=bad))
        assert words in e.value.message


def test_no_tools_no_spec_and_none_parses_nothing():
    assert tools.spec_of(chat(), None) is None
    spec = tools.spec_of(chat(weather(), mode=pb.ToolChoice.NONE), None)
    assert spec is not None and not spec.parses and tools.constraint(spec) is None


def test_a_named_function_is_constrained_to_its_arguments_and_required_to_a_list_of_calls():
    named = tools.spec_of(chat(weather(), mode=pb.ToolChoice.FUNCTION, function="get_weather"), None)
    assert json.loads(tools.constraint(named)) == WEATHER
    add = pb.Tool(name="add", parameters_json=json.dumps({"type": "object", "properties": {"x": {"type": "number"}}}))
    required = tools.spec_of(chat(weather(), add, mode=pb.ToolChoice.REQUIRED), None)
    schema = json.loads(tools.constraint(required))
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]] and schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
    single = tools.spec_of(pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")], tools=[weather()],
                                           tool_choice=pb.ToolChoice(mode=pb.ToolChoice.REQUIRED, single_call=True)), None)
    assert json.loads(tools.constraint(single))["maxItems"] == 1


def test_a_template_without_tools_gets_them_as_a_system_message_and_earlier_calls_as_text():
    spec = tools.spec_of(chat(weather(), mode=pb.ToolChoice.REQUIRED), None)
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    rendered, listed = tools.template_input(messages, spec, plain)
    assert listed is None and rendered[0]["role"] == "system" and '"get_weather"' in rendered[0]["content"]
    assert json.loads(rendered[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert rendered[3] == {"role": "tool", "content": "sunny"}
    # A template that knows tools gets them as they are, the arguments as an object (Hugging Face's convention).
    rendered, listed = tools.template_input(messages, spec, "{{ tools }}{% for m in messages %}{{ m.tool_calls }}{% endfor %}")
    assert listed[0]["function"]["name"] == "get_weather" and len(rendered) == 3
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        out.append(text[i:j])
        i = j
    return out


def streamed(spec: tools.ToolSpec, parts: list[str], prime: int = 0) -> tuple[str, list[pb.ToolCallDelta]]:
    stream = tools.CallStream(spec, "req-1", 0)
    content, deltas = "", []
    for part in parts:
        c, d = stream.feed(part)
        content, deltas = content + c, deltas + d
    c, d = stream.finish()
    return content + c, deltas + d


REQUIRED_OUTPUTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    ' [ {"name":"get_weather","parameters":{"city":"Pa\\"r}]is","n":[1,{"a":"]"}]}} ,\n{"parameters": {"x": 1.5},"name":"add"} ]',
    '[{"parameters": {}, "name": "add"}]',
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_required_calls_read_back_the_same_however_the_text_is_split(text):
    """Each call's name once, then its arguments: exactly the text of its "parameters" value."""
    spec = tools.ToolSpec((tools.Tool("get_weather", "", WEATHER), tools.Tool("add", "", {})), "required")
    expected = [(c["name"], c["parameters"]) for c in json.loads(text)]
    rng = random.Random(4)
    for _ in range(100):
        content, deltas = streamed(spec, pieces(text, rng))
        calls = tools.merge(deltas)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == expected
        assert [c.id for c in calls] == [tools.call_id("req-1", 0, i) for i in range(len(calls))]
        assert all(d.name and d.id for d in deltas if d.id) and sum(1 for d in deltas if d.name) == len(calls)


def test_a_named_call_streams_its_arguments_as_they_come_and_whole_results_agree():
    spec = tools.ToolSpec((tools.Tool("get_weather", "", WEATHER),), "function", "get_weather")
    content, deltas = streamed(spec, ['{"ci', 'ty": "Os', 'lo"}'])
    assert deltas[0].name == "get_weather" and [d.arguments for d in deltas] == ['{"ci', 'ty": "Os', 'lo"}']
    result = pb.CompleteResponse(request_id="req-1", text='{"city": "Oslo"}', finish_reason=pb.STOP)
    tools.annotate(spec, result, "req-1", 0)
    assert result.finish_reason == pb.TOOL_CALLS and result.content == ""
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [(deltas[0].id, "get_weather", '{"city": "Oslo"}')]


def test_a_resumed_stream_sends_only_what_follows_its_index():
    """ChunkAnnotator primes a stream that starts part-way with the text before it: no call is begun twice."""
    spec = tools.ToolSpec((tools.Tool("get_weather", "", WEATHER),), "required")
    text = REQUIRED_OUTPUTS[0]
    whole = tools.ChunkAnnotator(spec, None, None)
    first = whole(pb.GenerateChunk(request_id="r", index=0, text=text[:30]))
    rest = whole(pb.GenerateChunk(request_id="r", index=5, text=text[30:], finish_reason=pb.STOP))
    resumed = tools.ChunkAnnotator(spec, None, lambda sample, index: text[:30])(
        pb.GenerateChunk(request_id="r", index=5, text=text[30:], finish_reason=pb.STOP))
    assert list(resumed.tool_calls) == list(rest.tool_calls) and resumed.finish_reason == pb.TOOL_CALLS
    assert tools.merge(list(first.tool_calls) + list(rest.tool_calls))[0].arguments == '{"city": "Paris"}'


def test_the_openai_shapes_become_the_grpc_fields_one_for_one():
    req = ChatRequest.model_validate({
        "model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "rain"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": False}})
    out = to_generate_request(req, {}).chat
    assert [m.role for m in out.messages] == ["user", "assistant", "tool"]
    assert out.messages[1].tool_calls[0] == pb.ToolCall(id="call_9", name="get_weather", arguments='{"city":"Rome"}')
    assert out.messages[2].tool_call_id == "call_9" and out.messages[0].content == "weather?"
    assert out.tools[0].name == "get_weather" and json.loads(out.tools[0].parameters_json) == WEATHER
    assert out.tool_choice == pb.ToolChoice(mode=pb.ToolChoice.FUNCTION, function_name="get_weather", single_call=True)
    assert json.loads(out.chat_template_kwargs_json) == {"enable_thinking": False}

"""OpenAI's Responses API (POST /v1/responses, coordinator/http_api/responses_api.py) with the official `openai` client: the
answer equals the chat route's, streamed events come in order and add up to it, conversations with earlier tool
calls, forced function calls as function_call items, and refusals that say what to send."""
from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio

from coordinator.http_api.responses_api import ResponseEvents, ResponsesRequest, input_messages
from tests.test_grammar_wire import HERMES_CHARS, Stack
from tests.test_openai_http import MODEL, api  # noqa: F401 (the module-scoped stack fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.mark.parametrize("mode", ["ar", "pacer_pearl"])
async def test_a_response_equals_the_chat_answer(api, mode):
    chat = await api.client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=20, extra_body={"mode": mode},
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    out = await api.client.responses.create(model=MODEL, instructions="be brief", input="hello there",
                                            temperature=0, max_output_tokens=20, extra_body={"mode": mode})
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.output_text == chat.choices[0].message.content
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert out.usage.input_tokens == chat.usage.prompt_tokens and out.usage.output_tokens == 20
    assert out.usage.total_tokens == chat.usage.total_tokens and out.model_extra["stats"]["mode"] == mode


async def test_streamed_events_add_up_to_the_response(api):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
              temperature=0, max_output_tokens=16, extra_body={"mode": "sd"})
    whole = await api.client.responses.create(**kw)
    events = [e async for e in await api.client.responses.create(**kw, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 16 and events[0].response.status == "in_progress"


async def test_what_sdks_send_at_its_neutral_values_is_accepted(api):
    neutral = {"store": None, "reasoning": None, "include": [], "top_logprobs": 0, "service_tier": "auto",
               "prompt_cache_key": "k", "safety_identifier": "u", "truncation": "disabled", "metadata": {"a": "b"},
               "stream_options": {"include_obfuscation": False}}
    r = await api.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2, **neutral})
    assert r.status_code == 200 and r.json()["metadata"] == {"a": "b"}, r.text


async def test_logprobs_whole_and_streamed_equal_the_chat_routes(api):
    kw = dict(model=MODEL, input="hello there", temperature=0, max_output_tokens=12,
              include=["message.output_text.logprobs"], top_logprobs=2, extra_body={"mode": "pacer_pearl"})
    chat = await api.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                                    temperature=0, max_tokens=12, logprobs=True, top_logprobs=2,
                                                    extra_body={"mode": "pacer_pearl"})
    want = [(c.token, round(c.logprob, 5), [(t.token, round(t.logprob, 5)) for t in c.top_logprobs])
            for c in chat.choices[0].logprobs.content]

    def seen(entries):
        return [(e.token, round(e.logprob, 5), [(t.token, round(t.logprob, 5)) for t in e.top_logprobs])
                for e in entries]

    whole = await api.client.responses.create(**kw)
    assert seen(whole.output[0].content[0].logprobs) == want and len(want) == 12
    events = [e async for e in await api.client.responses.create(**kw, stream=True)]
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert seen(streamed) == seen(done.logprobs) == want
    r = await api.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "top_logprobs": 2})
    assert r.status_code == 400 and "needs include" in r.json()["error"]["message"]


async def test_a_conversation_with_earlier_tool_calls(api):
    conversation = [{"role": "user", "content": "weather in paris"},
                    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    out = await api.client.responses.create(model=MODEL, input=conversation, max_output_tokens=8,
                                            tool_choice="none", tools=[{"type": "function", "name": "weather",
                                                                        "parameters": {"type": "object"}}])
    assert out.status == "incomplete" and out.output[0].type == "message"


@pytest.mark.parametrize("extra, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id: no stored response 'resp_1'"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "type 'web_search_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text parts"),
    ({"tools": [{"type": "function", "name": "f"}]}, "COORDINATOR_TOOL_CALL_PARSER"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"model": "gpt-5"}, "does not exist"),
    ({"reasoning": {"effort": "high"}}, "effort and summaries cannot be set"),
    ({"include": ["reasoning.encrypted_content"]}, "only 'message.output_text.logprobs'"),
])
async def test_refusals_say_what_to_send(api, extra, words):
    r = await api.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra})
    assert r.status_code in (400, 404) and words in r.json()["error"]["message"], r.text


async def test_events_of_text_then_calls():
    body = ResponsesRequest(input="x", tools=[{"type": "function", "name": "d"}], tool_choice="required")
    ev = ResponseEvents(body, "resp_1", 0, "m")
    call = {"id": "call_1", "type": "function", "function": {"name": "d", "arguments": '{"a": 1}'}}
    lines = ev.start() + ev.delta({"content": "so"}) + ev.delta({"content": "!"}) + ev.delta({"tool_calls": [call]})
    lines += ev.finish("tool_calls", None)
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert all(line.startswith(f"event: {e['type']}\n") for line, e in zip(lines, events))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "so!" and final["output"][1]["call_id"] == "call_1"
    assert final["status"] == "completed"


async def test_events_of_a_call_whose_arguments_stream():
    ev = ResponseEvents(ResponsesRequest(input="x"), "resp_1", 0, "m")
    start = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "d", "arguments": '{"a"'}}
    lines = ev.delta({"tool_calls": [start]}) + ev.delta({"tool_calls": [{"index": 0, "function": {
        "arguments": ': 1}'}}]})
    lines += ev.finish("length", None)
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert [e["type"] for e in events] == ["response.output_item.added", "response.function_call_arguments.delta",
                                           "response.function_call_arguments.delta",
                                           "response.function_call_arguments.done", "response.output_item.done",
                                           "response.incomplete"]
    assert events[3]["arguments"] == '{"a": 1}' and events[4]["item"]["status"] == "incomplete"
    assert events[0]["item"]["arguments"] == "" and events[-1]["response"]["output"][0]["arguments"] == '{"a": 1}'


async def test_input_items_become_chat_messages():
    msgs = input_messages("sys", [{"role": "user", "content": "q"},
                                  {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                                  {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
                                  {"type": "function_call_output", "call_id": "a", "output": "1"}])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["a", "b"] and msgs[3]["tool_call_id"] == "a"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hermes(tmp_path_factory):
    s = await Stack().start(tmp_path_factory.mktemp("resp-tools"), HERMES_CHARS, tool_call_parser="hermes")
    yield s
    await s.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_function_calls_are_function_call_items(hermes, stream):
    client = openai.AsyncOpenAI(base_url=str(hermes.http.base_url) + "/v1", api_key="x", max_retries=0)
    bounded = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 6}},
               "required": ["a"], "additionalProperties": False}
    tools = [{"type": "function", "name": "d", "parameters": bounded}]
    kw = dict(model="tiny", input="add", temperature=0, max_output_tokens=40, tools=tools,
              tool_choice={"type": "function", "name": "d"})
    if stream:
        events = [e async for e in await client.responses.create(**kw, stream=True)]
        out = events[-1].response
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert [e.arguments for e in done] == [out.output[0].arguments] == ["".join(deltas)] and len(deltas) > 1
    else:
        out = await client.responses.create(**kw)
    await client.close()
    (call,) = out.output
    assert call.type == "function_call" and call.name == "d" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"a"} and out.status == "completed"


async def test_logprobs_with_tools_stream_as_the_whole_response_has_them(hermes):
    """tool_choice "auto" (a tool reader reads the answer): a text answer's logprobs, whole and streamed alike."""
    client = openai.AsyncOpenAI(base_url=str(hermes.http.base_url) + "/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "d", "parameters": {"type": "object", "properties": {}}}]
    kw = dict(model="tiny", input="add", temperature=0, max_output_tokens=12, tools=tools,
              include=["message.output_text.logprobs"], extra_body={"mode": "sd"})
    whole = await client.responses.create(**kw)
    (item,) = [i for i in whole.output if i.type == "message"]
    want = [e.token for e in item.content[0].logprobs]
    assert len(want) == 12, whole.output  # a text answer: every token's logprob on its message
    events = [e async for e in await client.responses.create(**kw, stream=True)]
    await client.close()
    done = next(e for e in events if e.type == "response.output_text.done")
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [e.token for e in done.logprobs] == want and streamed == want[:len(streamed)]

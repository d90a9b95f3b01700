"""Bad or odd input to the OpenAI-compatible HTTP door, found by an audit: each case once answered
500 with a traceback (or a wrong answer); now a 400 naming the field, or what OpenAI's API does."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.test_grammar_wire import TOOLS, json_stack  # noqa: F401 (a module-scoped stack whose vocabulary has JSON)
from tests.test_openai_http import KEY, MODEL, api  # noqa: F401 (the module-scoped stack fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
HI = [{"role": "user", "content": "hello"}]
FN = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("route, body, param, words", [
    # integers past the proto's int32
    (COMPLETIONS, {"prompt": "abc", "max_tokens": 2**31}, "max_tokens", "less than or equal to 2147483647"),
    (CHAT, {"messages": HI, "gamma": 2**40}, "gamma", "2147483647"),
    (CHAT, {"messages": HI, "stop_token_ids": [2**40]}, "stop_token_ids", "2147483647"),
    (CHAT, {"messages": HI, "allowed_token_ids": [2**40]}, "allowed_token_ids", "2147483647"),
    (CHAT, {"messages": HI, "min_tokens": 2**40}, "min_tokens", "2147483647"),
    (COMPLETIONS, {"prompt": [2**40]}, "prompt", "2147483647"),
    (RESPONSES, {"input": "hi", "max_output_tokens": 2**40}, "max_output_tokens", "2147483647"),
    (CHAT, {"messages": HI, "logit_bias": {str(2**40): 1}}, "logit_bias", "strings of digits"),
    (CHAT, {"messages": HI, "logit_bias": {"\u00b2": 1}}, "logit_bias", "strings of digits"),  # isdigit() but no int
    (CHAT, {"messages": HI, "logit_bias": {"\u0661\u0662": 1}}, "logit_bias", "strings of digits"),
    # tool_choice and the Responses API's items of the wrong shape
    (CHAT, {"messages": HI, "tools": FN, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice",
     "names no tool"),
    (CHAT, {"messages": HI, "tools": FN, "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
     "tool_choice", "names no tool"),
    (RESPONSES, {"input": [{"type": "reasoning", "content": "abc"}, {"role": "user", "content": "hi"}]}, "input",
     "lists of text parts"),
    (RESPONSES, {"input": [{"type": "reasoning", "summary": {"a": 1}}]}, "input", "lists of text parts"),
    (RESPONSES, {"input": "hi", "text": {"format": 5}}, "text.format", "an object"),
    (RESPONSES, {"input": "hi", "text": {"format": "json"}}, "text.format", "an object"),
    (CHAT, {"messages": HI, "store": True}, "store", "not stored here"),
    (CHAT, {"messages": HI, "structured_outputs": {"json_object": "false"}}, "structured_outputs.json_object",
     "a JSON boolean"),
])
async def test_bad_values_are_400s_naming_the_field(api, route, body, param, words):
    r = await api.http.post(route, json={"model": MODEL, "max_tokens": 2, **body} if route != RESPONSES else
                            {"model": MODEL, "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("route, raw, param", [
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages.0.content"),
    (RESPONSES, '{"input": [{"role": "user", "content": "a\\udfffb"}]}', "input.0.content"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
async def test_a_lone_surrogate_is_not_text(api, route, raw, param):
    r = await api.http.post(route, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "lone surrogate" in r.json()["error"]["message"]


async def test_nulls_mean_unset_and_what_openai_sends_back_is_accepted(api):
    kw = dict(model=MODEL, messages=HI, max_tokens=6, seed=3)
    base = await api.client.chat.completions.create(**kw)
    nulls = await api.http.post(CHAT, json={**kw, "temperature": None, "top_p": None, "n": None, "stream": None,
                                            "presence_penalty": None, "frequency_penalty": None, "stop": None})
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["message"]["content"] == base.choices[0].message.content
    back = base.choices[0].message.model_dump()  # refusal, annotations, audio, function_call: null
    assert {"refusal", "audio", "function_call"} <= set(back)
    r = await api.http.post(CHAT, json={**kw, "messages": HI + [back, {"role": "user", "content": "more"}],
                                        "store": False, "service_tier": "auto", "modalities": ["text"],
                                        "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text


async def test_echo_logprobs_of_a_one_token_prompt(api):
    r = await api.http.post(COMPLETIONS, json={"model": MODEL, "prompt": "a", "echo": True, "logprobs": 1,
                                               "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][0] == "a" and lp["token_logprobs"][0] is None and len(lp["tokens"]) == 3


async def test_streamed_text_offsets_count_from_the_start(api):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = (await api.http.post(COMPLETIONS, json=body)).json()["choices"][0]["logprobs"]["text_offset"]
    offsets = []
    async with api.http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                offsets += lp["text_offset"] if lp else []
    assert offsets == whole and len(whole) == 8 and whole[-1] > 0


async def test_streamed_tool_calls_carry_their_logprobs(json_stack):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "add"}], "max_tokens": 60, "temperature": 0,
            "tools": TOOLS, "tool_choice": "required", "logprobs": True}
    whole = (await json_stack.http.post(CHAT, json=body)).json()["choices"][0]
    want = [e["token"] for e in whole["logprobs"]["content"]]
    assert whole["message"]["tool_calls"] and len(want) == whole["stats"]["completion_tokens"] > 5
    got = []
    async with json_stack.http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    got += [e["token"] for e in (choice.get("logprobs") or {}).get("content") or []]
    assert got == want


async def test_the_api_key_comes_before_the_body_and_covers_models(api):
    url = api.urls["keyed"]
    async with httpx.AsyncClient(base_url=url) as c:
        for method, path, body in (("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                                   ("POST", CHAT, {"messages": "not a list"}), ("POST", "/tokenize", {})):
            r = await c.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        for path in ("/health", "/version", "/metrics"):  # probes and scrapers need no key
            assert (await c.get(path)).status_code in (200, 404), path
        bad = await c.post(CHAT, json={"messages": "not a list"}, headers={"Authorization": f"Bearer {KEY}"})
        assert bad.status_code == 400
    card = await api.client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await api.client.models.retrieve("gpt-4o")
    r = await api.http.post(COMPLETIONS, content=b"{not json", headers={"content-type": "application/json"})
    assert r.json()["error"]["message"] == "the body is not valid JSON: send a JSON object"


async def test_a_context_overflow_names_the_field_as_the_client_knows_it(api):
    r = await api.http.post(COMPLETIONS, json={"model": MODEL, "prompt": "ab " * 100, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert "max_tokens" in err["message"] and "max_new_tokens" not in err["message"]


async def test_servicer_errors_name_the_field_as_the_route_knows_it(api):
    r = await api.http.post(RESPONSES, json={"model": MODEL, "input": "hi", "max_output_tokens": 5000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_output_tokens", err
    assert err["message"].startswith("max_output_tokens:") and "max_tokens" not in err["message"].replace(
        "max_output_tokens", "")
    r = await api.http.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 2,
                                        "structured_outputs": {"regex": "(unclosed"}})
    err = r.json()["error"]
    # (this tiny stack's model names no EOS: refused for that; the field is the HTTP one either way)
    assert r.status_code == 400 and err["param"] == "structured_outputs", err
    assert err["message"].startswith("structured_outputs:"), err

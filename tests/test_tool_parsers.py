"""Tool calls a model chose (tool_choice "auto"): the hermes, llama3_json, pythonic and mistral parsers
(coordinator/grpc_api/tool_parsers.py), whole and fed in pieces of every size, and the streamed reader's deltas."""
from __future__ import annotations

import json

import pytest

from coordinator.http_api.structured import tool_choice
from coordinator.grpc_api.tool_parsers import PARSERS, AutoToolReader, HermesParser, MistralParser, parse_whole

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HERMES = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>')
PARIS, ROME = ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')


def calls_of(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    (HERMES, "Let me check both.", [PARIS, ROME]),
    ("no tools needed", "no tools needed", []),
    ('<tool_call>{"name": "f", "arguments": {}}', None, [("f", "{}")]),  # ended before its closing tag
    ('a <tool_call>{"name": "f", "arguments": [1]}</tool_call> b',  # arguments not an object: stays content
     'a <tool_call>{"name": "f", "arguments": [1]}</tool_call> b', []),
    ('x<tool_call>{oops</tool_call><tool_call>{"name": "g", "arguments": {"a": 1}}</tool_call>',
     "x<tool_call>{oops</tool_call>", [("g", '{"a": 1}')]),
    ("a < b <tool_call", "a < b <tool_call", []),  # a cut-off tag is text
])
def test_hermes_whole(text, content, calls):
    got_content, got_calls = parse_whole("hermes", text)
    assert got_content == content and calls_of(got_calls) == calls


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [PARIS, ROME]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "f", "parameters": {}} trailing words', '{"name": "f", "parameters": {}} trailing words', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON without a name is the answer, not a call
])
def test_llama3_json_whole(text, content, calls):
    got_content, got_calls = parse_whole("llama3_json", text)
    assert got_content == content and calls_of(got_calls) == calls


@pytest.mark.parametrize("text, content, calls", [
    ('[get_weather(city="Paris"), get_weather(city=\'Rome\')]', None, [PARIS, ROME]),
    ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [PARIS]),
    ("[f(a=[1, 2], b={'x': None}, c=True)]", None, [("f", '{"a": [1, 2], "b": {"x": null}, "c": true}')]),
    ("[tools.search(q='x')]", None, [("tools.search", '{"q": "x"}')]),
    ("[f(a=x)]", "[f(a=x)]", []),  # a name, not a literal: the model's text stays content
    ("[f(1)]", "[f(1)]", []),  # positional arguments have no names
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[1, 2]", "[1, 2]", []),
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set has no JSON form
    ("It is sunny.", "It is sunny.", []),
    ("[f(a=1)] and more", "[f(a=1)] and more", []),
])
def test_pythonic_whole(text, content, calls):
    got_content, got_calls = parse_whole("pythonic", text)
    assert got_content == content and calls_of(got_calls) == calls


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_weather", "arguments": {"city": "Rome"}}]', None, [PARIS, ROME]),
    ('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Checking.", [PARIS]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', None,
     [PARIS, ROME]),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}', None, [PARIS]),
    ("[TOOL_CALLS]get_weather[ARGS]{oops", "[TOOL_CALLS]get_weather[ARGS]{oops", []),
    ('[TOOL_CALLS][{"city": "Paris"}]', '[TOOL_CALLS][{"city": "Paris"}]', []),  # no name
    ("Plain [TOOL words", "Plain [TOOL words", []),
])
def test_mistral_whole(text, content, calls):
    got_content, got_calls = parse_whole("mistral", text)
    assert got_content == content and calls_of(got_calls) == calls


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", [HERMES, "plain answer <tool", 'a <tool_call>{"name": "f"}</tool_call>z',
                                  '{"name": "get_weather", "parameters": {"city": "Paris"}}', "  <|python_t",
                                  '[get_weather(city="Paris")]', "  <|python_sta",
                                  'Sure [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "text [TOOL_CA"])
def test_fed_in_pieces_equals_whole(name, text):
    """Content and calls do not depend on how the text was cut into verified pieces, and no piece of an opening
    tag is shown as content before it is known not to be one."""
    parser = PARSERS[name]
    whole_content, whole_calls = parse_whole(name, text)
    for size in (1, 2, 3, 7, len(text)):
        p, content, calls = parser(), [], []
        for piece in pieces(text, size):
            c, k = p.feed(piece)
            content.append(c)
            calls += k
            shown = "".join(content)
            if parser is HermesParser and "<tool_call>" in text:
                assert not shown.endswith(("<", "<t", "<tool")), shown
            if parser is MistralParser and "[TOOL_CALLS]" in text:
                assert "[" not in shown, shown
        c, k = p.end()
        content.append(c)
        calls += k
        assert calls_of(calls) == calls_of(whole_calls)
        assert ("".join(content).rstrip() or None if calls else "".join(content)) == whole_content


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_streamed_reader_deltas(size):
    reader, deltas = AutoToolReader("hermes"), []
    for piece in pieces(HERMES, size):
        deltas += reader.feed(piece)
    more, finish = reader.end("stop")
    deltas += more
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Let me check both." == parse_whole("hermes", HERMES)[0] and finish == "tool_calls"
    assert [c["index"] for c in calls] == [0, 1] and len({c["id"] for c in calls}) == 2
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [PARIS, ROME]
    plain = AutoToolReader("hermes")
    got = plain.feed("just text\n") + plain.end("length")[0]
    assert "".join(d["content"] for d in got) == "just text\n" and plain.end("length")[1] == "length"


def test_auto_choice_message():
    tool = tool_choice(TOOLS, None)
    assert tool.auto and tool_choice(TOOLS, "auto").auto
    tool.parser = "hermes"
    message, finish = tool.message(HERMES, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me check both."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"},
                                                                                      {"city": "Rome"}]
    assert all(c["id"].startswith("call_") and "index" not in c for c in message["tool_calls"])
    assert tool.message("hello", "stop") == ({"role": "assistant", "content": "hello"}, "stop")
    with pytest.raises(ValueError, match="none of 'auto'"):
        tool_choice(TOOLS, "sometimes")


CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "paris"}'}}
RENDERS_CALLS = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} "
                 "in {{ c.function.arguments.city }}{% endfor %}{% else %}{{ m.role }} {{ m.content }}{% endif %}. "
                 "{% endfor %}")


@pytest.mark.parametrize("renders", [True, False])
def test_earlier_tool_calls_reach_the_chat_template(tmp_path, renders):
    """An agent's history: the assistant's tool calls reach a template that renders them with their arguments as
    objects (what Hugging Face templates read), and any other template as their JSON content; the tool's answer
    keeps its tool_call_id. The HTTP body goes through GenerateRequest.messages to the coordinator's encoding."""
    from coordinator.http_api.schema import ChatCompletionRequest
    from coordinator.grpc_api.chat_prompt import chat_message
    from specdec.text.tokenizer import decode, encode_prompt, load_tokenizer
    from tests.helpers_models import save_tiny_tokenizer

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "weather"},
                                           {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = [chat_message(m) for m in body.to_proto().messages]
    assert messages[1]["tool_calls"] == [CALL] and messages[2]["tool_call_id"] == "call_1"
    tok = load_tokenizer(save_tiny_tokenizer(tmp_path))
    tok.chat_template = RENDERS_CALLS if renders else "{% for m in messages %}{{ m.role }} {{ m.content }}. {% endfor %}"
    text = decode(tok, encode_prompt(tok, messages=messages))
    if renders:
        assert text == "user weather. call weather in paris. tool sunny. "
    else:  # the calls' JSON: its braces and quotes are outside the tiny vocabulary, its words are not
        assert text.startswith("user weather. assistant ") and "name" in text and "paris" in text


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_only_the_mistral_parser_keeps_special_tokens(parser):
    """Mistral's [TOOL_CALLS] is a special token, which detokenization skips: its requests keep special tokens in
    their text (as vLLM's mistral parser sets skip_special_tokens=False); the others' requests leave the default."""
    from coordinator.http_api.schema import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=TOOLS)
    body.tool.parser = parser
    r = body.to_proto()
    assert r.HasField("skip_special_tokens") == (parser == "mistral") and not r.skip_special_tokens
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                 tool_choice="required")
    assert not body.to_proto().HasField("skip_special_tokens")  # a forced choice needs no parser

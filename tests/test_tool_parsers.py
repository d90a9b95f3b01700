"""Tool calls a model chose (tool_choice "auto"): the hermes and llama3_json parsers (coordinator/tool_parsers.py),
whole and fed in pieces of every size, and the streamed reader's deltas."""
from __future__ import annotations

import json

import pytest

from coordinator.openai_structured import tool_choice
from coordinator.tool_parsers import AutoToolReader, HermesParser, Llama3JsonParser, parse_whole

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


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser])
@pytest.mark.parametrize("text", [HERMES, "plain answer <tool", 'a <tool_call>{"name": "f"}</tool_call>z',
                                  '{"name": "get_weather", "parameters": {"city": "Paris"}}', "  <|python_t"])
def test_fed_in_pieces_equals_whole(parser, text):
    """Content and calls do not depend on how the text was cut into verified pieces, and no piece of an opening
    tag is shown as content before it is known not to be one."""
    name = "hermes" if parser is HermesParser else "llama3_json"
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
    from coordinator.openai_schema import ChatCompletionRequest
    from coordinator.chat_prompt import chat_message
    from specdec.tokenizer import decode, encode_prompt, load_tokenizer
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

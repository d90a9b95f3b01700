"""Reasoning parsers (coordinator/grpc_api/reasoning.py): a reasoning model's <think>...</think> apart from its answer,
whole and streamed, over gRPC (`separate_reasoning`), the chat route (`reasoning`) and the Responses API (a reasoning
item); structured output applies after the reasoning, exactly, in every mode."""
from __future__ import annotations

import json
import re

import grpc
import pytest
import pytest_asyncio
from llguidance import LLMatcher

from coordinator.http_api.schema import ChatCompletionRequest
from coordinator.grpc_api.reasoning import (CONTENT, REASONING, ReasoningSplitter, ReasoningStart, ThinkTags, answer_start,
                                   gate_grammar, reasoning_tokens)
from specdec.common.errors import InvalidRequestError
from specdec_rpc.pb import generation_pb2 as g
from tests.helpers_models import TOKENIZER_CHARS
from tests.test_grammar import EOS, grammar_of
from tests.test_grammar_wire import Stack

THINK, UNTHINK = 30, 31  # the think tokenizer's <think> and </think>
R1 = ReasoningStart(True, REASONING)
QWEN3 = ReasoningStart(True, CONTENT)
TAGS = ThinkTags(THINK, UNTHINK)


def think_tokenizer():
    """The tiny character tokenizer with `!` and `?` replaced by <think> and </think>, each one token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    toks = list(TOKENIZER_CHARS)
    toks[THINK], toks[UNTHINK] = "<think>", "</think>"
    vocab = {t: i for i, t in enumerate(toks) if i}
    vocab["<unk>"] = 0
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    return tk


def split(start: ReasoningStart, text: str, size: int = 0) -> tuple[str, str]:
    s = ReasoningSplitter(start)
    pieces = [text[i:i + size] for i in range(0, len(text), size)] if size else [text]
    parts = [s.feed(p) for p in pieces] + [s.end()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("start,text,want", [
    (R1, "<think>\nI add.</think>\n\n42", ("\nI add.", "\n\n42")),
    (R1, "I add.</think>42", ("I add.", "42")),  # the template opened <think>
    (R1, "  <think>x</think>", ("x", "")),
    (R1, "still thinking", ("still thinking", "")),  # never closed: all reasoning
    (R1, "a </thin", ("a </thin", "")),
    (QWEN3, "<think>r</think>c", ("r", "c")),
    (QWEN3, "plain answer", ("", "plain answer")),
    (QWEN3, "<thi", ("", "<thi")),
    (QWEN3, "a</think>b", ("", "a</think>b")),  # it did not open: all content
    (ReasoningStart(False, CONTENT), "<think>x</think>y", ("", "<think>x</think>y")),  # the prompt closed it
])
@pytest.mark.parametrize("size", [0, 1, 2, 3, 7])
def test_split_whole_and_in_pieces(start, text, want, size):
    assert split(start, text, size) == want


@pytest.mark.parametrize("parser,prompt_tail,want", [
    ("deepseek_r1", "<|Assistant|><think>\n", R1),
    ("deepseek_r1", "assistant\n", R1),
    ("deepseek_r1", "<think>\n\n</think>\n\n", ReasoningStart(False, CONTENT)),
    ("qwen3", "assistant\n", QWEN3),
    ("qwen3", "assistant\n<think>\n", R1),  # Qwen3 Thinking-2507's template opens it
    ("qwen3", "<think>\n\n</think>\n\n", ReasoningStart(False, CONTENT)),  # enable_thinking: false
    ("qwen3", "</think> earlier turn. user hi. assistant\n", QWEN3),  # a tag earlier in the prompt is not its end
])
def test_the_answer_starts_where_the_prompt_leaves_it(parser, prompt_tail, want):
    assert answer_start(parser, [1, 2, 3], lambda ids: prompt_tail) == want


def test_reasoning_tokens_count_through_the_closing_tag():
    assert reasoning_tokens(R1, [5, 6, UNTHINK, 7, EOS], TAGS) == 3
    assert reasoning_tokens(R1, [5, 6, 7], TAGS) == 3  # never closed
    assert reasoning_tokens(QWEN3, [THINK, 5, UNTHINK, 7], TAGS) == 3
    assert reasoning_tokens(QWEN3, [5, UNTHINK, 7], TAGS) == 0  # it did not open
    assert reasoning_tokens(ReasoningStart(False, CONTENT), [5, UNTHINK], TAGS) == 0
    assert reasoning_tokens(R1, [5, 6], ThinkTags(None, None)) == 0


@pytest.fixture(scope="module")
def think_vocab():
    from specdec.text.grammar import GrammarVocab

    tk = think_tokenizer()
    return GrammarVocab(tk.to_str(), 32, [EOS], parsed=tk)


@pytest.mark.parametrize("kind,value,answer", [("regex", r"(hello|hi) [a-z]{2,5}\.", "hi there."),
                                               ("choice", json.dumps(["yes", "no"]), "no"),
                                               ("grammar", 'start: "ab" rest\nrest: "c"+', "abcc")])
@pytest.mark.parametrize("start", [R1, QWEN3])
def test_the_gated_grammar_frees_the_reasoning_only(think_vocab, kind, value, answer, start):
    tk = think_tokenizer()
    matcher = LLMatcher(think_vocab.tokenizer, gate_grammar(grammar_of(kind, value), start, TAGS, [EOS]))
    assert not matcher.is_error(), matcher.get_error()
    body = tk.encode(answer, add_special_tokens=False).ids
    thought = tk.encode("any text, even <think>", add_special_tokens=False).ids
    opened = [THINK] if start is QWEN3 else []
    assert matcher.validate_tokens(opened + thought) == len(opened + thought)
    matcher.consume_tokens(opened + thought)
    assert matcher.validate_tokens([EOS]) == 0 and not matcher.is_accepting()  # EOS waits for the answer
    assert matcher.validate_tokens([UNTHINK] + body) == 1 + len(body)
    matcher.consume_tokens([UNTHINK] + body)
    assert matcher.is_accepting()
    bad = tk.encode("zz", add_special_tokens=False).ids
    fresh = LLMatcher(think_vocab.tokenizer, gate_grammar(grammar_of(kind, value), start, TAGS, [EOS]))
    assert fresh.validate_tokens(opened + [UNTHINK] + bad) == len(opened) + 1  # after </think>: the grammar
    if start is QWEN3:  # no <think> first: the answer from the first token
        direct = LLMatcher(think_vocab.tokenizer, gate_grammar(grammar_of(kind, value), start, TAGS, [EOS]))
        assert direct.validate_tokens(body) == len(body) and direct.validate_tokens(bad[:1]) == 0


def test_structured_output_needs_single_token_tags():
    with pytest.raises(InvalidRequestError, match="no single </think> token"):
        gate_grammar(grammar_of("json_object"), R1, ThinkTags(None, None), [EOS])
    plain = grammar_of("json_object")
    assert gate_grammar(plain, ReasoningStart(False, CONTENT), ThinkTags(None, None), [EOS]) == plain


def test_earlier_turns_reasoning_reaches_the_template():
    from coordinator.grpc_api.chat_prompt import chat_message

    for key in ("reasoning", "reasoning_content"):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "42", key: "I add."},
                                               {"role": "user", "content": "why"}])
        m = body.to_proto().messages[1]
        assert m.reasoning == "I add." and chat_message(m)["reasoning_content"] == "I add."


# ---- over the wire ---------------------------------------------------------------------------------------------
REGEX = r"(hello|hi)( [a-z]{2,5}){1,3}\."
PUSH = {UNTHINK: 2.0}  # makes the tiny random model close its reasoning after a few tokens


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def think_stack(tmp_path_factory):
    s = await Stack().start(tmp_path_factory.mktemp("think"), tokenizer=think_tokenizer(),
                            reasoning_parser="deepseek_r1")
    yield s
    await s.stop()


wire = pytest.mark.asyncio(loop_scope="module")


def decoded(ids) -> str:
    toks = list(TOKENIZER_CHARS)
    toks[THINK], toks[UNTHINK] = "<think>", "</think>"
    return "".join(toks[t] for t in ids if t != EOS)


@wire
@pytest.mark.parametrize("mode", ["ar", "sd", "pacer", "pearl", "pacer_pearl"])
async def test_every_mode_separates_the_reasoning_and_equals_ar(think_stack, mode):
    """The answer after </think> follows the grammar; every mode returns the target-only tokens; the reasoning and
    the answer are the text before and after the tag, unary and streamed."""
    def request(m):
        return g.GenerateRequest(prompt="hi", max_new_tokens=48, mode=m, separate_reasoning=True, logit_bias=PUSH,
                                 structured_output=g.StructuredOutput(regex=REGEX))

    want = await think_stack.stub.Generate(request("ar"))
    got = await think_stack.stub.Generate(request(mode))
    ids = list(got.token_ids)
    assert ids == list(want.token_ids) and UNTHINK in ids, (ids, got.text)
    k = ids.index(UNTHINK)
    assert k >= 2, "pick a PUSH that leaves some reasoning"
    assert got.reasoning == decoded(ids[:k]) and got.text == decoded(ids[k + 1:])
    assert re.fullmatch(REGEX, got.text) and got.finish_reason == g.FINISH_REASON_STOP
    assert got.stats.reasoning_tokens == k + 1
    parts = [p async for p in think_stack.stub.GenerateStream(request(mode))]
    assert "".join(p.reasoning_delta for p in parts) == got.reasoning
    assert "".join(p.text_delta for p in parts) == got.text
    assert sum(1 for p in parts if p.reasoning_delta) > 1 or mode != "ar"  # reasoning streams as it is verified


@wire
async def test_sampled_answers_split_at_the_tag(think_stack):
    for seed in range(4):
        r = g.GenerateRequest(prompt="hi", max_new_tokens=32, temperature=1.0, seed=seed, mode="pacer_pearl",
                              separate_reasoning=True, logit_bias=PUSH)
        got = await think_stack.stub.Generate(r)
        whole = decoded(got.token_ids)
        if UNTHINK in got.token_ids:
            assert whole == got.reasoning + "</think>" + got.text
        else:
            assert (got.reasoning, got.text) == (whole, "")


@wire
async def test_separate_reasoning_needs_a_parser(tmp_path):
    from coordinator.grpc_api.service import GenerationServicer
    from specdec.text.tokenizer import load_tokenizer
    from tests.helpers_models import save_tiny_tokenizer

    servicer = GenerationServicer(router=None, tokenizer=load_tokenizer(save_tiny_tokenizer(tmp_path)),
                                  eos_token_ids={EOS})
    with pytest.raises(InvalidRequestError, match="COORDINATOR_REASONING_PARSER"):
        servicer.prepare(g.GenerateRequest(prompt="hi", separate_reasoning=True))
    servicer.reasoning_parser = "deepseek_r1"  # a vocabulary without the tags: no structured output after them
    with pytest.raises(InvalidRequestError, match="no single </think> token"):
        servicer.prepare(g.GenerateRequest(prompt="hi", separate_reasoning=True,
                                           structured_output=g.StructuredOutput(json_object=True)))
    assert servicer.prepare(g.GenerateRequest(prompt="hi", separate_reasoning=True)).reasoning == R1


@wire
async def test_grpc_refuses_separate_reasoning_without_a_parser(tmp_path):
    s = await Stack().start(tmp_path)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.stub.Generate(g.GenerateRequest(prompt="hi", separate_reasoning=True))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "separate_reasoning" in e.value.details()
        r = await s.http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and "reasoning" not in r.json()["choices"][0]["message"]
    finally:
        await s.stop()


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 48, "temperature": 0,
        "logit_bias": {str(k): v for k, v in PUSH.items()}, "response_format": None,
        "structured_outputs": {"regex": REGEX}}


async def sse(stack, path: str, body: dict) -> list[dict]:
    async with stack.http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]


@wire
async def test_chat_returns_the_reasoning_whole_and_streamed(think_stack):
    want = await think_stack.stub.Generate(g.GenerateRequest(
        prompt="hi", max_new_tokens=48, mode="sd", separate_reasoning=True, logit_bias=PUSH,
        structured_output=g.StructuredOutput(regex=REGEX)))
    r = await think_stack.http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (want.reasoning, want.text)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": want.stats.reasoning_tokens}
    chunks = await sse(think_stack, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == want.reasoning
    assert "".join(d.get("content") or "" for d in deltas) == want.text
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == want.stats.reasoning_tokens
    hidden = (await think_stack.http.post("/v1/chat/completions", json={**CHAT, "include_reasoning": False})).json()
    assert hidden["choices"][0]["message"]["reasoning"] is None
    assert hidden["choices"][0]["message"]["content"] == want.text
    chunks = await sse(think_stack, "/v1/chat/completions", {**CHAT, "include_reasoning": False})
    assert not any(c["choices"][0]["delta"].get("reasoning") for c in chunks)
    plain = (await think_stack.http.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 0})).json()
    assert "reasoning" not in plain["choices"][0]  # completions return the text whole, as vLLM's


@wire
async def test_responses_api_returns_a_reasoning_item(think_stack):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 48, "temperature": 0, "mode": "sd"}
    want = await think_stack.stub.Generate(g.GenerateRequest(  # deepseek_r1: unclosed, it is all reasoning
        prompt="hi", max_new_tokens=48, mode="sd", separate_reasoning=True))
    assert want.reasoning, "the answer should start with some reasoning"
    r = await think_stack.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    kinds = [item["type"] for item in out["output"]]
    assert kinds[0] == "reasoning" and out["output"][0]["content"][0]["text"] == want.reasoning, out["output"]
    if want.text:
        assert kinds[1] == "message" and out["output"][1]["content"][0]["text"] == want.text
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == want.stats.reasoning_tokens
    async with think_stack.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == want.reasoning
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == kinds
    assert final["output"][0]["content"][0]["text"] == want.reasoning


def test_responses_input_takes_reasoning_items_back():
    """A client that sends an earlier response's output back as input (reasoning item included) is understood."""
    from coordinator.http_api.responses_api import ResponsesRequest

    body = ResponsesRequest(input=[
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "I add."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "42"}]},
        {"role": "user", "content": "why"}])
    messages = body.chat.to_proto().messages
    assert [m.role for m in messages] == ["user", "assistant", "user"] and messages[1].reasoning == "I add."

"""Structured output over the wire: GenerateRequest.structured_output and the HTTP API's response_format /
structured_outputs reach both replicas, the answer equals target-only decoding under the grammar, and bad forms get
INVALID_ARGUMENT / 400 naming the field."""
from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest
import pytest_asyncio

from coordinator.config import CoordinatorSettings
from coordinator.http_api.structured import response_format_pb, structured_output_pb
from coordinator.server import build_coordinator
from coordinator.stack import free_port
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import save_tiny_pair, save_tiny_tokenizer, start_replica, stream_killing_the_pinned_target
from tests.test_grammar import EOS, PROMPT, SENTENCE, grammar_of, masked_greedy

pytestmark = pytest.mark.asyncio(loop_scope="module")
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


class Stack:
    async def start(self, tmp, chars: str = "", tokenizer=None, **settings):
        """`chars`: the character vocabulary (TOKENIZER_CHARS by default), or `tokenizer` (a tokenizers.Tokenizer);
        `settings`: more CoordinatorSettings."""
        from specdec.modeling.model import load_model_dir
        from specdec.text.tokenizer import load_tokenizer
        from tests.helpers_models import tiny_tokenizer

        tdir, ddir = save_tiny_pair(tmp)
        save_tiny_tokenizer(ddir)
        for d in (tdir, ddir):  # the tiny tokenizer's <unk> serves as EOS
            (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
            if chars or tokenizer is not None:
                (tokenizer or tiny_tokenizer(chars)).save(str(d / "tokenizer.json"))
        self.target = load_model_dir(tdir)
        self.t = await start_replica("target", self.target)
        self.d = await start_replica("draft", load_model_dir(ddir), preverifier="random")
        tok = load_tokenizer(tdir)
        tok.chat_template = TEMPLATE
        s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                                draft_endpoints=self.d.endpoint, target_endpoints=self.t.endpoint,
                                max_new_tokens_cap=64, log_level="WARNING", http_port=free_port(),
                                served_model_name="tiny", **settings)
        self.app, _ = await build_coordinator(s, tokenizer=tok, eos_token_ids={EOS})
        await self.app.start()
        self.ch = grpc.aio.insecure_channel(f"127.0.0.1:{self.app.port}")
        self.stub = gg.GenerationServiceStub(self.ch)
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.app.http_port}", timeout=60)
        return self

    async def stop(self):
        await self.http.aclose()
        await self.ch.close()
        for a in (self.app, self.t, self.d):
            await a.shutdown(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    s = await Stack().start(tmp_path_factory.mktemp("grammar"))
    yield s
    await s.stop()


@pytest.mark.parametrize("mode", ["ar", "sd", "pacer", "pearl", "pacer_pearl"])
async def test_every_mode_over_the_wire_equals_masked_greedy(stack, mode):
    vocab = stack.t.host.worker.grammar_vocab
    assert vocab is not None and stack.d.host.worker.grammar_vocab is not None
    want = masked_greedy(stack.target, vocab, grammar_of("regex", SENTENCE), PROMPT, 40)
    r = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=40, mode=mode,
                          structured_output=g.StructuredOutput(regex=SENTENCE))
    got = await stack.stub.Generate(r)
    assert list(got.token_ids) == want and re.fullmatch(SENTENCE, got.text), got.text
    assert got.finish_reason == g.FINISH_REASON_STOP
    streamed = [t async for part in stack.stub.GenerateStream(r) for t in part.token_ids]
    assert streamed == want


async def test_sampled_choices_stay_in_the_grammar(stack):
    choices = ["yes.", "no!", "maybe so."]
    for seed in range(6):
        r = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=20, mode="sd", temperature=1.0, seed=seed,
                              structured_output=g.StructuredOutput(choice=g.Choices(choices=choices)))
        assert (await stack.stub.Generate(r)).text in choices


@pytest.mark.parametrize("form, field, words", [
    (g.StructuredOutput(regex="(unclosed"), "structured_output", "does not compile"),
    (g.StructuredOutput(json_schema="{oops"), "structured_output.json_schema", "not valid JSON"),
    (g.StructuredOutput(), "structured_output", "set one of"),
])
async def test_bad_forms_are_invalid_argument(stack, form, field, words):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stack.stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, structured_output=form))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details() and words in e.value.details(), e.value.details()


async def test_ignore_eos_is_refused_with_a_grammar(stack):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stack.stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, ignore_eos=True,
                                                    structured_output=g.StructuredOutput(json_object=True)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ignore_eos" in e.value.details()


async def test_http_structured_outputs_and_response_format(stack):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
    r = await stack.http.post("/v1/chat/completions",
                              json={**body, "structured_outputs": {"choice": ["yes.", "no!"]}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes.", "no!")
    r = await stack.http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 40,
                                                       "temperature": 0, "structured_outputs": {"regex": SENTENCE}})
    assert r.status_code == 200 and re.fullmatch(SENTENCE, r.json()["choices"][0]["text"]), r.text
    for bad, param in (({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
                       ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
                       ({"response_format": {"type": "xml"}}, "not supported"),
                       ({"structured_outputs": {"regex": "(bad"}}, "does not compile")):
        r = await stack.http.post("/v1/chat/completions", json={**body, **bad})
        assert r.status_code == 400 and param in r.json()["error"]["message"], r.text


async def test_http_forms_translate_to_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = response_format_pb({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(fmt.json_schema) == schema
    assert response_format_pb({"type": "json_object"}).json_object and response_format_pb({"type": "text"}) is None
    assert structured_output_pb({"json": schema}).json_schema == json.dumps(schema)
    assert list(structured_output_pb({"choice": ["a", "b"]}).choice.choices) == ["a", "b"]
    assert structured_output_pb({"grammar": 'start: "x"'}).grammar == 'start: "x"'
    assert structured_output_pb({"json_object": True}).json_object and structured_output_pb(None) is None
    with pytest.raises(ValueError, match="unknown key"):
        structured_output_pb({"xml": "<a/>"})


async def test_the_grammar_survives_a_target_failover(tmp_path):
    """The pinned target replica dies mid-request; the session is rebuilt on the other from its history, its
    matcher resumes from StartSession.output_start, and the answer still equals masked greedy decoding."""
    from specdec.modeling.model import load_model_dir

    tdir, ddir = save_tiny_pair(tmp_path)
    save_tiny_tokenizer(ddir)
    for d in (tdir, ddir):
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    target = load_model_dir(tdir)
    r1, r2 = await start_replica("target", target), await start_replica("target", target)
    d = await start_replica("draft", load_model_dir(ddir))
    app, _ = await build_coordinator(CoordinatorSettings(
        host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0, log_level="WARNING",
        draft_endpoints=d.endpoint, target_endpoints=f"{r1.endpoint},{r2.endpoint}"), eos_token_ids={EOS})
    await app.start()
    stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
    try:
        want = masked_greedy(target, r1.host.worker.grammar_vocab, grammar_of("regex", SENTENCE), PROMPT, 40)
        request = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=40, mode="sd", gamma=2,
                                    structured_output=g.StructuredOutput(regex=SENTENCE))
        ids, last = await stream_killing_the_pinned_target(stub, request, r1, r2, after=6)
        assert ids == want and "," in last.stats.target_replica, "the session moved and kept its grammar"
    finally:
        await ch.close()
        for a in (app, r1, r2, d):
            await a.shutdown(0)


JSON_CHARS = "<abdefikmnprst{}[]\":, 0123456789"  # 32 symbols: enough for tool calls' JSON
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "find", "parameters": {
             "type": "object", "properties": {"kind": {"enum": ["fast", "best"]}}, "required": ["kind"],
             "additionalProperties": False}}}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def json_stack(tmp_path_factory):
    assert len(JSON_CHARS) == 32
    s = await Stack().start(tmp_path_factory.mktemp("tools"), JSON_CHARS)
    yield s
    await s.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_calls_come_back_as_tool_calls(json_stack, stream):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "add"}], "max_tokens": 60, "temperature": 0,
            "tools": TOOLS, "stream": stream}

    async def answer(**kw) -> tuple[dict, str]:
        if not stream:
            r = await json_stack.http.post("/v1/chat/completions", json={**body, **kw})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"], choice["finish_reason"]
        calls, content, finish, pieces = {}, "", None, 0
        async with json_stack.http.stream("POST", "/v1/chat/completions", json={**body, **kw}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    for d in ch["delta"].get("tool_calls") or []:  # merged by index, as OpenAI clients do
                        pieces += 1
                        call = calls.setdefault(d["index"], {**d, "function": {**d["function"], "arguments": ""}})
                        call["function"]["arguments"] += d["function"].get("arguments", "")
                    content += ch["delta"].get("content") or ""
                    finish = ch["finish_reason"] or finish
        if kw.get("tool_choice") != "required":  # a named function's arguments stream as they are verified
            assert pieces > 1, pieces
        return {"tool_calls": [calls[k] for k in sorted(calls)] or None, "content": content or None}, finish

    message, finish = await answer(tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = message["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "add" and set(args) == {"a", "b"} and finish == "stop", message
    assert call["id"].startswith("call_") and call["type"] == "function" and message["content"] is None
    message, finish = await answer(tool_choice="required")
    assert finish == "tool_calls" and message["tool_calls"], message
    for call in message["tool_calls"]:
        args = json.loads(call["function"]["arguments"])
        assert (call["function"]["name"], set(args)) in (("add", {"a", "b"}), ("find", {"kind"}))


async def test_completions_take_response_format_too(json_stack):
    """vLLM reads response_format on /v1/completions as well: the continuation is a JSON object."""
    r = await json_stack.http.post("/v1/completions", json={"model": "tiny", "prompt": "add", "max_tokens": 60,
                                                            "temperature": 0, "response_format": {
                                                                "type": "json_schema", "json_schema": {
                                                                    "name": "a", "schema": TOOLS[1]["function"][
                                                                        "parameters"]}}})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["text"])) == {"kind"}
    r = await json_stack.http.post("/v1/completions", json={"model": "tiny", "prompt": "add", "response_format": {
        "type": "json_object"}, "structured_outputs": {"json_object": True}})
    assert r.status_code == 400 and "not both" in r.text


async def test_tool_choice_refusals(json_stack):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "add"}], "max_tokens": 8}
    for extra, words in (({"tools": TOOLS}, "COORDINATOR_TOOL_CALL_PARSER"),
                         ({"tools": TOOLS, "tool_choice": "auto"}, "COORDINATOR_TOOL_CALL_PARSER"),
                         ({"tools": TOOLS, "tool_choice": "maybe"}, "none of 'auto'"),
                         ({"tool_choice": "required"}, "needs tools"),
                         ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
                          "names no tool"),
                         ({"tools": [{"type": "function", "function": {"name": "bad name"}}],
                           "tool_choice": "required"}, "letters, digits"),
                         ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                          "fixes the answer"),
                         ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "two tools are named 'add'"),
                         ({"tools": TOOLS * 65, "tool_choice": "required"}, "at most 128")):
        r = await json_stack.http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (extra, r.text)
    r = await json_stack.http.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    history = [{"role": "user", "content": "add"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                      "function": {"name": "add",
                                                                                   "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = await json_stack.http.post("/v1/chat/completions", json={**body, "messages": history})
    assert r.status_code == 200, r.text
    r = await json_stack.http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user"}]})
    assert r.status_code == 400 and "content" in r.text


HERMES_CHARS = "<<>/_{}\":, acdeglmnoprstu0123456"  # 32 symbols (the first is <unk>): hermes tool calls
ADD = [{"type": "function", "function": {"name": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hermes_stack(tmp_path_factory):
    assert len(HERMES_CHARS) == 32
    s = await Stack().start(tmp_path_factory.mktemp("hermes"), HERMES_CHARS, tool_call_parser="hermes")
    yield s
    await s.stop()


async def auto_calls(stack, body: dict) -> tuple[str, list, str]:
    """A chat answer under tool_choice "auto", whole or streamed (`body["stream"]`): (content, tool_calls,
    finish_reason); streamed, the deltas joined."""
    if not body.get("stream"):
        r = await stack.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["message"].get("tool_calls") or [], choice["finish_reason"]
    calls, content, finish = [], "", None
    async with stack.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                calls += ch["delta"].get("tool_calls") or []
                content += ch["delta"].get("content") or ""
                finish = ch["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_tool_calls_are_read_from_the_answer(hermes_stack, stream):
    """tool_choice "auto" (the default with tools): the model answers freely (here a regex makes the tiny random
    model write a hermes call) and the parser turns its <tool_call> blocks into tool_calls, whole and streamed."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "add"}], "max_tokens": 64, "temperature": 0,
            "tools": ADD, "stream": stream, "mode": "pacer_pearl"}

    async def answer(regex: str) -> tuple[str, list, str]:
        return await auto_calls(hermes_stack, {**body, "structured_outputs": {"regex": regex}})

    # 62 characters, one token each, then EOS: within the stack's cap of 64 tokens
    content, calls, finish = await answer(r'so <tool_call>\{"name": "d", "arguments": \{"a": [0-6]\}\}</tool_call>')
    assert len(calls) == 1, (content, finish)
    call = calls[0]
    assert content == "so" and finish == "tool_calls", (content, calls)
    assert call["function"]["name"] == "d" and set(json.loads(call["function"]["arguments"])) == {"a"}
    assert call["id"].startswith("call_") and call["type"] == "function"
    content, calls, finish = await answer("so [a-e]+")
    assert not calls and finish == "stop" and content.startswith("so "), (content, calls)
    r = await hermes_stack.http.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
    assert r.status_code == 200, r.text  # json_stack has no parser: there "auto" is refused (test above)


MISTRAL_TOOLS = 31  # the mistral tokenizer's [TOOL_CALLS], a special token
MISTRAL_SYMBOLS = ["<unk>", *"[]{}\":, namedrgutso0123456lcpi", "[TOOL_CALLS]"]


def mistral_tokenizer():
    """A character tokenizer over the symbols of a Mistral tool call, with [TOOL_CALLS] as one special token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    assert len(MISTRAL_SYMBOLS) == 32 and MISTRAL_SYMBOLS[MISTRAL_TOOLS] == "[TOOL_CALLS]"
    tk = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(MISTRAL_SYMBOLS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    return tk


@pytest.mark.parametrize("stream", [False, True])
async def test_mistral_calls_after_the_special_token_over_the_wire(tmp_path, stream):
    """The mistral parser reads calls after [TOOL_CALLS], a special token that plain detokenization skips: its
    requests keep special tokens in their text. A Lark grammar makes the tiny random model write one."""
    s = await Stack().start(tmp_path, tokenizer=mistral_tokenizer(), tool_call_parser="mistral")
    grammar = f'start: "so " <[{MISTRAL_TOOLS}]> /\\[\\{{"name": "d", "arguments": \\{{"a": [0-6]\\}}\\}}\\]/'
    body = {"model": "tiny", "messages": [{"role": "user", "content": "add"}], "max_tokens": 60, "temperature": 0,
            "tools": ADD, "stream": stream, "mode": "sd", "structured_outputs": {"grammar": grammar}}
    try:
        content, calls, finish = await auto_calls(s, body)
        assert content == "so" and finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
        assert calls[0]["function"]["name"] == "d" and set(json.loads(calls[0]["function"]["arguments"])) == {"a"}
        plain = await s.http.post("/v1/chat/completions", json={**body, "tools": None, "stream": False})
        assert plain.json()["choices"][0]["message"]["content"].startswith("so [{"), plain.text  # skipped
    finally:
        await s.stop()

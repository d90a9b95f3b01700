"""vLLM's output controls: include_stop_str_in_output, skip_special_tokens, stop_reason, truncate_prompt_tokens and
return_tokens_as_token_ids. The text rules on their own (coordinator/grpc_api/text_output.py), then over both doors of a
real coordinator (the HTTP API and gRPC) with the character-level tiny tokenizer, where each token is one
character, so every expected text can be read off the token ids."""
from __future__ import annotations

import json

import grpc
import pytest
import pytest_asyncio

from coordinator.grpc_api.text_output import TextAssembler
from specdec_rpc.pb import generation_pb2 as g
from tests.helpers_models import TOKENIZER_CHARS, save_tiny_tokenizer
from tests.test_openai_http import MODEL, Http, until

wire = pytest.mark.asyncio(loop_scope="module")  # the tests over the wire share one stack


def ids_of(text: str) -> list[int]:
    return [TOKENIZER_CHARS.index(c) for c in text]


def text_of(ids) -> str:
    return "".join(TOKENIZER_CHARS[i] for i in ids)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from specdec.text.tokenizer import load_tokenizer

    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def assemble(asm: TextAssembler, ids: list[int], size: int = 1) -> str:
    return "".join(asm.push(ids[i:i + size])[0] for i in range(0, len(ids), size)) + asm.finish()


@pytest.mark.parametrize("size", [1, 3, 100])
def test_a_stop_string_is_cut_or_kept_and_named(tok, size):
    ids = ids_of("abc stop here")
    for include, want in ((False, "abc "), (True, "abc stop")):
        asm = TextAssembler(tok, [], ["zz", "stop"], include_stop=include)
        assert assemble(asm, ids, size) == want and asm.stop_reason == "stop" and asm.stopped
        assert asm.token_ids == ids[:len("abc stop")], "the ids end with the one completing the stop string"
    asm = TextAssembler(tok, [], ["zz"])
    assert assemble(asm, ids, size) == "abc stop here" and asm.stop_reason is None


@pytest.mark.parametrize("size", [1, 100])
def test_a_stop_token_ends_the_text_without_its_own(tok, size):
    """A stop token's id is returned, its text is not (vLLM's); include_stop_str_in_output keeps it. Only the
    request's own stop_token_ids become a stop_reason, the model's EOS does not."""
    ids = ids_of("hello.")
    dot = ids[-1]
    for include, want in ((False, "hello"), (True, "hello.")):
        asm = TextAssembler(tok, [], [], stop_token_ids={dot}, user_stop_token_ids={dot}, include_stop=include)
        assert assemble(asm, ids, size) == want and asm.stop_reason == dot and asm.token_ids == ids
    asm = TextAssembler(tok, [], [], stop_token_ids={dot})  # the model's EOS
    assert assemble(asm, ids, size) == "hello" and asm.stop_reason is None
    asm = TextAssembler(tok, [], ["lo"], stop_token_ids={dot}, user_stop_token_ids={dot})
    assert assemble(asm, ids, size) == "hel" and asm.stop_reason == "lo", "the stop string came first"


def test_special_tokens_are_skipped_unless_asked(tok):
    ids = [0] + ids_of("ab") + [0] + ids_of("c")  # id 0 is the tokenizer's <unk>, a special token
    assert assemble(TextAssembler(tok, [], []), ids) == "abc"
    assert assemble(TextAssembler(tok, [], [], skip_special_tokens=False), ids) == "<unk>ab<unk>c"


# ---- over the wire ---------------------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(tmp_path_factory):
    s = await Http().start(tmp_path_factory.mktemp("controls"))
    yield s
    await s.stop()


PROMPT = ids_of("the quick brown fox")


async def completion(api, **kw) -> dict:
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                     "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def streamed(api, route: str, body: dict) -> tuple[str, dict]:
    """(the streamed text, the chunk that carried finish_reason)."""
    text, last = [], None
    async with api.http.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
                if ch["finish_reason"]:
                    last = ch
    return "".join(text), last


@wire
@pytest.mark.parametrize("mode", ["ar", "pacer_pearl"])
async def test_stop_strings_and_stop_tokens_over_the_wire(api, mode):
    ref = await completion(api, mode=mode)
    assert ref["finish_reason"] == "length" and ref["stop_reason"] is None and len(ref["text"]) == 24
    text = ref["text"]
    stop = text[6:8]
    cut = text.index(stop)
    body = {"mode": mode, "stop": [stop]}
    for include in (False, True):
        got = await completion(api, include_stop_str_in_output=include, **body)
        want = text[:cut + (len(stop) if include else 0)]
        assert (got["text"], got["finish_reason"], got["stop_reason"]) == (want, "stop", stop), include
        s_text, last = await streamed(api, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                                "temperature": 0, "include_stop_str_in_output":
                                                                include, **body})
        assert (s_text, last["stop_reason"]) == (want, stop)
    token = ids_of(text[10])[0]
    end = text.index(text[10])
    for include in (False, True):
        got = await completion(api, mode=mode, stop_token_ids=[token], include_stop_str_in_output=include)
        assert got["text"] == text[:end + include] and got["stop_reason"] == token, include
    r = await api.stubs["open"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, mode=mode,
                                                           stop_token_ids=[token]))
    assert list(r.token_ids) == ids_of(text[:end + 1]) and r.text == text[:end]
    assert r.WhichOneof("stop_reason") == "stop_token_id" and r.stop_token_id == token
    r = await api.stubs["open"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, mode=mode,
                                                           stop=[stop]))
    assert r.text == text[:cut] and r.stop_string == stop
    last = [p async for p in api.stubs["open"].GenerateStream(
        g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, mode=mode, stop=[stop]))][-1]
    assert last.stop_string == stop
    chat = await api.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=24, temperature=0, extra_body={"mode": mode})
    say = chat.choices[0].message.content
    chat = await api.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=24, temperature=0, stop=[say[4:6]],
                                                    extra_body={"mode": mode, "include_stop_str_in_output": True})
    assert chat.choices[0].message.content == say[:say.index(say[4:6]) + 2]
    assert chat.choices[0].model_extra["stop_reason"] == say[4:6]


@wire
async def test_special_tokens_show_when_asked(api):
    """logit_bias makes the model write <unk> (id 0, a special token): skipped by default, shown with
    skip_special_tokens false, whole and streamed."""
    body = {"max_tokens": 5, "logit_bias": {"0": 100}, "mode": "sd"}
    assert (await completion(api, **body))["text"] == ""
    assert (await completion(api, skip_special_tokens=False, **body))["text"] == "<unk>" * 5
    s_text, last = await streamed(api, "/v1/chat/completions", {"model": MODEL, "temperature": 0,
                                                                 "messages": [{"role": "user", "content": "x"}],
                                                                 "skip_special_tokens": False, **body})
    assert s_text == "<unk>" * 5 and last["finish_reason"] == "length" and last["stop_reason"] is None


@wire
async def test_truncate_prompt_tokens_keeps_the_prompts_end(api):
    full = await completion(api, prompt=ids_of("and then the quick brown fox"), truncate_prompt_tokens=len(PROMPT),
                            logprobs=0)
    ref = await completion(api, logprobs=0)
    assert full["text"] == ref["text"] and full["logprobs"] == ref["logprobs"]
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": "and then the quick brown fox",
                                                     "max_tokens": 4, "temperature": 0, "echo": True,
                                                     "truncate_prompt_tokens": 9})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("brown fox") and r.json()["usage"]["prompt_tokens"] == 9
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await api.stubs["open"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, truncate_prompt_tokens=0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncate_prompt_tokens" in e.value.details()


@wire
async def test_tokens_as_token_ids_in_logprobs(api):
    plain = await api.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2)
    as_ids = await api.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    for a, b in zip(plain.choices[0].logprobs.content, as_ids.choices[0].logprobs.content, strict=True):
        assert b.token == f"token_id:{ids_of(a.token)[0]}" and b.logprob == a.logprob
        assert [t.token for t in b.top_logprobs] == [f"token_id:{ids_of(t.token)[0]}" for t in a.top_logprobs]
    c = await completion(api, max_tokens=6, logprobs=1, return_tokens_as_token_ids=True)
    assert c["logprobs"]["tokens"] == [f"token_id:{i}" for i in ids_of(c["text"])]


@wire
async def test_a_prompt_past_the_context_gets_openais_context_length_error(api):
    """The replicas refuse prompt + max_tokens past their context before any work; the HTTP door answers it as
    OpenAI does (code context_length_exceeded, "maximum context length" in the message), which clients such as
    LangChain and LiteLLM turn into their context-window errors."""
    room = api.t.host.worker.max_context
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * (room - 5), "max_tokens": 6,
                                                     "temperature": 0})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert f"maximum context length is {room} tokens" in err["message"] and "by 1" in err["message"]
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * (room - 5), "max_tokens": 5,
                                                     "temperature": 0, "mode": "pacer_pearl"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    await until(lambda: api.sessions() == 0)


@wire
@pytest.mark.parametrize("mode", ["sd", "pearl", "pacer_pearl"])
async def test_chat_without_max_tokens_runs_to_the_context(api, mode):
    """A chat request that leaves max_tokens out gets what the target's context leaves after its prompt, up to the
    coordinator's cap (vLLM's and OpenAI's default), not a fixed 128: a long answer, a reasoning model's
    thinking, is not cut short."""
    room, cap = api.t.host.worker.max_context, 64
    words = "ab " * ((room - 40) // 3)
    messages = [{"role": "user", "content": words}]
    n = (await api.http.post("/tokenize", json={"model": MODEL, "messages": messages})).json()["count"]
    assert 0 < room - n < cap, (room, n)
    body = {"model": MODEL, "messages": messages, "temperature": 0, "ignore_eos": True, "mode": mode}
    r = await api.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == room - n  # the rest of the context, exactly
    short = await api.http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})
    assert short.json()["usage"]["completion_tokens"] == cap  # the cap bounds it
    r = await api.http.post("/v1/responses", json={"model": MODEL, "input": words, "temperature": 0,
                                                   "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] > 0, r.text
    fixed = await api.http.post("/v1/chat/completions", json={**body, "max_tokens": 5})
    assert fixed.json()["usage"]["completion_tokens"] == 5
    await until(lambda: api.sessions() == 0)

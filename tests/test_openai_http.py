"""The OpenAI-compatible HTTP API (coordinator/http_api/app.py) over a real coordinator and loopback replicas:
the official `openai` client and raw HTTP, whole and streamed answers equal to the gRPC API's, the error shapes and
statuses, the API key, and that a client that goes away frees its replica sessions.
"""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from coordinator.config import CoordinatorSettings
from coordinator.server import build_coordinator
from coordinator.stack import free_port
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import start_replica, tiny_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny-target"
KEY = "sk-test-key"
CHAT_TEMPLATE = ("{% if style %}{{ style }} {% endif %}{% for m in messages %}{{ m['role'] }} {{ m['content'] }}."
                 "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


class Http:
    async def start(self, tmp):
        from specdec.text.tokenizer import load_tokenizer
        from tests.helpers_models import save_tiny_tokenizer

        self.tok = load_tokenizer(save_tiny_tokenizer(tmp / "tok"))
        self.tok.chat_template = CHAT_TEMPLATE
        target, draft = tiny_pair()
        self.t = await start_replica("target", target)
        self.d = await start_replica("draft", draft, preverifier="random")
        self.apps = []
        self.urls, self.stubs, self.channels = {}, {}, []
        for name, key in (("open", ""), ("keyed", KEY)):
            s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                                    draft_endpoints=self.d.endpoint, target_endpoints=self.t.endpoint,
                                    max_new_tokens_cap=64, log_level="WARNING", http_port=free_port(),
                                    served_model_name=MODEL, http_api_key=key, max_message_bytes=64 * 1024,
                                    responses_store=0 if key else 1000)  # the keyed door stores no response
            app, _ = await build_coordinator(s, tokenizer=self.tok, eos_token_ids=set())
            await app.start()
            self.apps.append(app)
            self.urls[name] = f"http://127.0.0.1:{app.http_port}"
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
            self.channels.append(ch)
            self.stubs[name] = gg.GenerationServiceStub(ch)
        self.client = openai.AsyncOpenAI(base_url=self.urls["open"] + "/v1", api_key="unused", max_retries=0)
        self.http = httpx.AsyncClient(base_url=self.urls["open"], timeout=60)
        return self

    def sessions(self) -> int:
        return len(self.t.host.table) + len(self.d.host.table)

    async def stop(self):
        await self.client.close()
        await self.http.aclose()
        for ch in self.channels:
            await ch.close()
        for a in self.apps + [self.t, self.d]:
            await a.shutdown(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(tmp_path_factory):
    s = await Http().start(tmp_path_factory.mktemp("http"))
    yield s
    await s.stop()


async def until(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.02)


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


# ---- answers equal the gRPC API's ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ar", "sd", "pacer_pearl"])
async def test_chat_completion_equals_grpc_generate(api, mode):
    grpc_req = g.GenerateRequest(max_new_tokens=20, mode=mode, temperature=0.0)
    for m in MESSAGES:
        grpc_req.messages.add(**m)
    ref = await api.stubs["open"].Generate(grpc_req)
    out = await api.client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                                   extra_body={"mode": mode})
    assert out.object == "chat.completion" and out.model == MODEL and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 20 and out.usage.prompt_tokens == ref.stats.prompt_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + 20
    stats = out.model_extra["stats"]
    assert stats["mode"] == mode and stats["target_forwards"] > 0


async def test_completion_continues_the_raw_text(api):
    prompt = "once upon a"
    raw = await api.stubs["open"].Generate(g.GenerateRequest(prompt=prompt, raw_prompt=True, max_new_tokens=16))
    templated = await api.stubs["open"].Generate(g.GenerateRequest(prompt=prompt, max_new_tokens=16))
    assert raw.stats.prompt_tokens == len(prompt) < templated.stats.prompt_tokens  # one token per character
    out = await api.client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    assert out.object == "text_completion" and out.choices[0].text == raw.text
    ids = api.tok(prompt)["input_ids"]
    by_ids = await api.client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=16)
    assert by_ids.choices[0].text == raw.text


async def test_streamed_chat_equals_the_whole_answer(api):
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, extra_body={"mode": "pearl"})
    whole = await api.client.chat.completions.create(**kw)
    stream = await api.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


async def test_stream_ends_with_done_and_stop_strings_cut(api):
    whole = await api.client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=30)
    text = whole.choices[0].text
    stop = text[8:10]
    cut = await api.client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=30, stop=stop)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    body = {"model": MODEL, "prompt": "abc", "temperature": 0, "max_tokens": 30, "stop": [stop], "stream": True}
    async with api.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == cut.choices[0].text
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_seeds_repeat_and_no_seed_draws_fresh(api):
    kw = dict(model=MODEL, prompt="hello", temperature=1.0, max_tokens=24, extra_body={"mode": "sd"})
    a = await api.client.completions.create(**kw, seed=7)
    b = await api.client.completions.create(**kw, seed=7)
    assert a.choices[0].text == b.choices[0].text
    unseeded = {(await api.client.completions.create(**kw)).choices[0].text for _ in range(3)}
    assert len(unseeded) > 1, "a request without a seed draws a fresh one (OpenAI's behaviour)"


async def test_n_choices_are_separate_seeded_generations(api):
    kw = dict(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=16, extra_body={"mode": "sd"})
    out = await api.client.chat.completions.create(**kw, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, choice in enumerate(out.choices):  # choice i samples as a lone request with seed 7 + i
        alone = await api.client.chat.completions.create(**kw, seed=7 + i)
        assert choice.message.content == alone.choices[0].message.content
        assert choice.model_extra["stats"]["completion_tokens"] == 16
    assert len({c.message.content for c in out.choices}) > 1
    assert out.usage.completion_tokens == 48 and out.usage.prompt_tokens == alone.usage.prompt_tokens
    stream = await api.client.chat.completions.create(**kw, n=3, seed=7, stream=True,
                                                      stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    texts, roles, finishes = ["", "", ""], [], []
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.delta.content or ""
        roles += [ch.index] if ch.delta.role else []
        finishes += [ch.index] if ch.finish_reason else []
    assert texts == [c.message.content for c in out.choices]
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 48
    greedy = await api.client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=8, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


async def test_continuous_usage_stats_count_each_choice_so_far(api):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far."""
    kw = dict(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=12, seed=3, n=2,
              extra_body={"mode": "pacer_pearl"})
    stream = await api.client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [c async for c in stream]
    last, prompt = chunks[-1].usage, chunks[-1].usage.prompt_tokens
    assert not chunks[-1].choices and last.completion_tokens == 24
    seen = {0: [], 1: []}
    for c in chunks[:-1]:
        (ch,) = c.choices
        assert c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + c.usage.completion_tokens
        seen[ch.index].append(c.usage.completion_tokens)
    for counts in seen.values():  # from 0 at the role chunk up to the choice's 12 tokens, never down
        assert counts[0] == 0 and counts[-1] == 12 and counts == sorted(counts) and len(set(counts)) > 2
    plain = await api.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    assert all(c.usage is None for c in [c async for c in plain][:-1])


async def test_logprobs_chat_and_completions_whole_and_streamed(api):
    grpc_req = g.GenerateRequest(max_new_tokens=12, mode="pearl", temperature=0.0, logprobs=2)
    for m in MESSAGES:
        grpc_req.messages.add(**m)
    ref = await api.stubs["open"].Generate(grpc_req)
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2,
              extra_body={"mode": "pearl"})
    out = await api.client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert "".join(e.token for e in content) == out.choices[0].message.content == ref.text
    assert [e.logprob for e in content] == pytest.approx(list(ref.logprobs.logprobs), abs=1e-6)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
    assert all(bytes(e.bytes).decode() == e.token for e in content)
    stream = await api.client.chat.completions.create(**kw, stream=True)
    streamed = [e async for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]

    text = await api.client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=10, logprobs=1)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    assert all(len(top) == 1 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    plain = await api.client.completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert plain.choices[0].logprobs is None


async def test_models_and_health(api):
    models = await api.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    # vLLM's max_model_len: what a target session holds (the replica's context, read with GetInfo)
    assert models.data[0].model_extra["max_model_len"] == api.t.host.worker.max_context > 0
    r = await api.http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "serving"
    from specdec import __version__

    r = await api.http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": __version__} and __version__[0].isdigit()
    metrics = await api.http.get("/metrics")
    assert metrics.status_code == 200
    assert 'specdec_http_requests_total{route="/health",status="200"}' in metrics.text
    assert "specdec_request_success_total" in metrics.text  # the generation metrics both doors share


async def test_tokenize_and_detokenize_match_what_the_routes_generate_from(api):
    """vLLM's /tokenize counts a prompt as the routes encode it: `prompt` raw (completions), `messages` through the
    chat template (chat), equal to the usage's prompt_tokens; /detokenize inverts it."""
    raw = await api.http.post("/tokenize", json={"model": MODEL, "prompt": "hello there"})
    assert raw.status_code == 200 and raw.json() == {"count": 11, "tokens": api.tok("hello there")["input_ids"]}
    chat = (await api.http.post("/tokenize", json={"messages": MESSAGES})).json()
    out = await api.client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=2)
    assert chat["count"] == out.usage.prompt_tokens == len(chat["tokens"])
    back = await api.http.post("/detokenize", json={"tokens": raw.json()["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "hello there"}
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
                              ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
                              ("/detokenize", {"tokens": [1, 10_000]}, "tokens"), ("/detokenize", {"tokens": []}, "tokens"),
                              ("/tokenize", {"model": "other", "prompt": "a"}, "model")]:
        r = await api.http.post(path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.text)
    async with httpx.AsyncClient(base_url=api.urls["keyed"]) as keyed:  # the API key guards them too
        assert (await keyed.post("/tokenize", json={"prompt": "a"})).status_code == 401
        ok = await keyed.post("/detokenize", json={"tokens": [1]}, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200


async def test_chat_template_controls(api):
    """vLLM's add_generation_prompt, continue_final_message (a prefilled answer) and chat_template_kwargs: /tokenize
    and the chat route render the same prompt, and the answer continues exactly that prompt."""
    async def ids(**body) -> list[int]:
        r = await api.http.post("/tokenize", json={"messages": MESSAGES[1:], **body})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert await ids() == api.tok("user hello there.assistant ")["input_ids"]
    assert await ids(add_generation_prompt=False) == api.tok("user hello there.")["input_ids"]
    assert await ids(chat_template_kwargs={"style": "brief"}) == api.tok("brief user hello there.assistant ")[
        "input_ids"]
    prefilled = MESSAGES[1:] + [{"role": "assistant", "content": "once upon"}]
    controls = {"add_generation_prompt": False, "continue_final_message": True}
    r = await api.http.post("/tokenize", json={"messages": prefilled, **controls})
    want = api.tok("user hello there.assistant once upon")["input_ids"]
    assert r.json()["tokens"] == want, r.text
    ref = await api.stubs["open"].Generate(g.GenerateRequest(prompt_token_ids=want, max_new_tokens=12))
    out = await api.client.chat.completions.create(model=MODEL, messages=prefilled, temperature=0, max_tokens=12,
                                                   extra_body=controls)
    assert out.choices[0].message.content == ref.text and out.usage.prompt_tokens == len(want)
    styled = await api.client.chat.completions.create(model=MODEL, messages=MESSAGES[1:], temperature=0,
                                                      max_tokens=2, extra_body={"chat_template_kwargs":
                                                                                {"style": "brief"}})
    assert styled.usage.prompt_tokens == len(await ids(chat_template_kwargs={"style": "brief"}))
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"messages": MESSAGES, **controls}, "continue_final_message"),
                        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs")):
        for path in ("/v1/chat/completions", "/tokenize"):
            r = await api.http.post(path, json={"messages": prefilled, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    for wrong in (dict(prompt="hi", continue_final_message=True), dict(prompt_token_ids=[1, 2], tools="[{}]"),
                  dict(prompt_token_ids=[1, 2], chat_template_kwargs='{"a": 1}'),
                  dict(prompt_token_ids=[1, 2], continue_final_message=True), dict(prompt="hi", tools="[{}]")):
        with pytest.raises(grpc.aio.AioRpcError) as e:  # token ids and text go in as they are: no template
            await api.stubs["open"].Generate(g.GenerateRequest(**wrong))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "send messages" in e.value.details(), wrong


# ---- errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,status,param,words", [
    ({"n": 17}, 400, "n", "less than or equal to 16"),
    ({"temperature": 3}, 400, "temperature", "temperature: must be in [0, 2] (0 is greedy), got 3"),
    ({"max_tokens": 1000}, 400, "max_tokens", "cap"),
    ({"mode": "fast"}, 400, "mode", "unknown mode"),
    ({"frequency_penalty": 2.5}, 400, "frequency_penalty", "frequency_penalty: must be in [-2, 2]"),
    ({"logit_bias": {"a": 1}}, 400, None, "token ids"),
    ({"logit_bias": {"9999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ({"tools": [{"type": "function"}]}, 400, None, "tool 0 must be"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "top_logprobs: must be in [0, 20]"),
    ({"bogus_knob": 1}, 400, "bogus_knob", "Extra inputs"),
    ({"model": "gpt-4o"}, 404, "model", MODEL),
    ({"messages": []}, 400, "messages", "at least 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages",
     "only text parts"),
])
async def test_bad_bodies_get_openai_errors(api, body, status, param, words):
    r = await api.http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param, err


async def test_the_openai_client_raises_typed_errors(api):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await api.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=65)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await api.client.completions.create(model="other", prompt="x")


async def test_transport_level_errors(api):
    r = await api.http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 70_000})
    assert r.status_code == 413 and "limit is 65536" in r.json()["error"]["message"]
    r = await api.http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 33, "n": 2})
    assert r.status_code == 400 and "at most 64 per request" in r.json()["error"]["message"]
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2], []]})
    assert r.status_code == 400 and "empty list of token ids" in r.json()["error"]["message"]


async def test_several_prompts_answer_their_choices_in_order(api):
    """/v1/completions with a list of prompts (text or token ids): choice k·n + i is choice i of prompt k, equal to
    that prompt sent alone; usage counts each prompt once; streamed and echoed the same."""
    prompts = ["once upon a", "hello", "abc d"]
    # spec_off_batch 0: six concurrent sessions still speculate, so each samples as it does alone
    kw = dict(model=MODEL, temperature=1.0, max_tokens=10, seed=11, extra_body={"mode": "sd", "spec_off_batch": 0})
    out = await api.client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    prompt_tokens = 0
    for k, p in enumerate(prompts):
        alone = await api.client.completions.create(prompt=p, n=2, **kw)
        assert [c.text for c in out.choices[2 * k:2 * k + 2]] == [c.text for c in alone.choices]
        prompt_tokens += alone.usage.prompt_tokens
    assert out.usage.prompt_tokens == prompt_tokens and out.usage.completion_tokens == 60
    stream = await api.client.completions.create(prompt=prompts, n=2, stream=True,
                                                 stream_options={"include_usage": True}, **kw)
    chunks = [c async for c in stream]
    texts = [""] * 6
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.text
    assert texts == [c.text for c in out.choices]
    assert chunks[-1].usage.prompt_tokens == prompt_tokens and chunks[-1].usage.completion_tokens == 60
    by_ids = await api.client.completions.create(prompt=[api.tok(p)["input_ids"] for p in prompts], n=2, **kw)
    assert [c.text for c in by_ids.choices] == [c.text for c in out.choices]
    echoed = await api.client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=0,
                                                 echo=True, logprobs=0)
    assert [c.text for c in echoed.choices] == ["once upon a", "hello", "abc d"]
    for c in echoed.choices:
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(c.text)


async def test_api_key(api):
    url = api.urls["keyed"]
    async with httpx.AsyncClient(base_url=url) as c:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
        assert (await c.post("/v1/completions", json=body)).status_code == 401
        wrong = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "Authorization: Bearer" in wrong.json()["error"]["message"]
        assert (await c.get("/health")).status_code == 200  # probes need no key
    keyed = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    out = await keyed.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    assert out.usage.completion_tokens == 4
    await keyed.close()


# ---- a client that goes away frees its sessions ----------------------------------------------------------------
async def test_dropped_stream_and_dropped_request_cancel_the_generation(api):
    """A client that hangs up (a stream after its first chunk, a whole answer before it comes) cancels its
    generations. The premise, that each would still be running when the client goes, needs generations far longer
    than noticing a hang-up takes on a loaded host: 192 tokens of `sd` γ = 1 (about 190 rounds), on a door of its own
    whose cap allows them."""
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=api.d.endpoint, target_endpoints=api.t.endpoint, max_new_tokens_cap=192,
                            log_level="WARNING", http_port=free_port(), served_model_name=MODEL)
    app, _ = await build_coordinator(s, tokenizer=api.tok, eos_token_ids=set())
    await app.start()
    url = f"http://127.0.0.1:{app.http_port}"
    reg = app.metrics.registry

    def finished() -> float:
        return sum(reg.get_sample_value("specdec_request_success_total", {"finish_reason": f}) or 0.0
                   for f in ("length", "stop"))

    try:
        await until(lambda: api.sessions() == 0)
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 192, "temperature": 0, "mode": "sd", "gamma": 1}
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            t0 = time.perf_counter()
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            whole_s = time.perf_counter() - t0
        done = finished()
        async with httpx.AsyncClient(base_url=url) as c:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True, "n": 2}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # one chunk, then hang up
        await until(lambda: api.sessions() == 0)
        hang_up = min(0.05, whole_s / 4)
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=hang_up)) as c:
                await c.post("/v1/completions", json={**body, "n": 2})
        await until(lambda: api.sessions() == 0)
        await asyncio.sleep(whole_s)  # past the time either would have taken to finish
        assert finished() == done, "all four generations were cancelled, not run to the end"
    finally:
        await app.shutdown(0)


async def test_draining_finishes_the_streams_in_flight(tmp_path):
    """SIGTERM's path (ServerApp.shutdown): the HTTP listener stops accepting, a stream in flight runs to its end,
    then the coordinator stops."""
    from specdec.text.tokenizer import load_tokenizer
    from tests.helpers_models import save_tiny_tokenizer

    tok = load_tokenizer(save_tiny_tokenizer(tmp_path / "tok"))
    target, draft = tiny_pair()
    t, d = await start_replica("target", target), await start_replica("draft", draft)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=5,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING",
                            http_port=free_port(), served_model_name=MODEL)
    app, _ = await build_coordinator(s, tokenizer=tok, eos_token_ids=set())
    await app.start()
    url = f"http://127.0.0.1:{app.http_port}"
    body = {"prompt": "abc", "max_tokens": 64, "temperature": 0, "mode": "sd", "gamma": 1, "stream": True}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            whole = (await c.post("/v1/completions", json={**body, "stream": False})).json()["choices"][0]["text"]
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                first = await anext(lines)
                stopping = asyncio.ensure_future(app.shutdown())
                await until(lambda: app.draining)
                rest = [ln async for ln in lines]
            events = [json.loads(ln[6:]) for ln in [first, *rest] if ln.startswith("data: {")]
            assert "".join(e["choices"][0]["text"] for e in events) == whole
            assert events[-1]["choices"][0]["finish_reason"] == "length" and rest[-2:] == ["data: [DONE]", ""]
            await asyncio.wait_for(stopping, 10)
            with pytest.raises(httpx.ConnectError):
                await c.post("/v1/completions", json=body)
    finally:
        for a in (app, t, d):
            await a.shutdown(0)


async def test_echo_returns_the_prompt_and_its_logprobs(api):
    prompt = "hello world"
    ref = await api.stubs["open"].Generate(g.GenerateRequest(prompt=prompt, raw_prompt=True, max_new_tokens=5,
                                                             logprobs=1, prompt_logprobs=1))
    out = await api.client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5, echo=True,
                                              logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt + ref.text
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = list(ref.prompt_logprobs.logprobs) + list(ref.logprobs.logprobs)
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # max_tokens 0: the prompt's logprobs alone (lm-eval's loglikelihood requests)
    alone = await api.client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=0, echo=True,
                                                logprobs=0)
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs[1:] == pytest.approx(list(ref.prompt_logprobs.logprobs),
                                                                          abs=1e-6)
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 0})
    assert r.status_code == 400 and "only with echo" in r.json()["error"]["message"]
    r = await api.http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "echo": True, "stream": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


async def test_request_ids_tie_logs_answers_and_sessions(api, caplog):
    """X-Request-Id (HTTP) / GenerateRequest.request_id (gRPC): the answer's id and header, GenerationStats and the
    coordinator's log line carry it; without one the server makes one; a malformed one is refused."""
    import logging

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="coordinator.requests"):
        r = await api.http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "trace.7:a-b_c"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace.7:a-b_c"
    out = r.json()
    assert out["id"] == "chatcmpl-trace.7:a-b_c" and out["stats"]["request_id"].startswith("trace.7:a-b_c-")
    (line,) = [rec.getMessage() for rec in caplog.records if rec.name == "coordinator.requests"]
    assert line.startswith(f"request {out['stats']['request_id']}: sd,") and "+ 4 completion tokens" in line
    r = await api.http.post("/v1/chat/completions", json=body)
    made = r.headers["x-request-id"]
    assert r.json()["id"] == f"chatcmpl-{made}" and r.json()["stats"]["request_id"].startswith(made)
    r = await api.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
                            headers={"X-Request-Id": "resp-trace"})
    assert r.json()["id"] == "resp_resp-trace" and r.headers["x-request-id"] == "resp-trace"
    r = await api.http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "no spaces"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    longest = "g" * 64  # with its suffix, a replica session id of 77 characters (they allow 128)
    ok = await api.stubs["open"].Generate(g.GenerateRequest(prompt="hi", max_new_tokens=2, request_id=longest,
                                                            mode="pacer_pearl"))
    assert ok.stats.request_id.startswith(longest + "-") and ok.stats.completion_tokens == 2
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await api.stubs["open"].Generate(g.GenerateRequest(prompt="hi", request_id="x" * 65))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()

"""Fuzzing a running stack of tiny models (a coordinator with its HTTP door, a target and a draft replica): every
answer is OK or a client status with a message (gRPC: never UNKNOWN, INTERNAL, UNAVAILABLE; HTTP: never 5xx), the
servers stay up, and every replica session ends.

- GenerateRequest messages from hypothesis, and raw wire bytes: random, corrupted, or a valid request whose string
  field is not UTF-8 (INVALID_ARGUMENT naming the field, on the coordinator and on both replicas);
- the HTTP door's routes, with bodies and parameters drawn by schemathesis from its own /openapi.json, which
  also validates as OpenAPI 3 and lists every route.

The bounded runs are part of the suite; the long ones (`fuzz_long`: thousands of cases, numbers printed) run with
`SPECDEC_FUZZ_LONG=1 pytest -m fuzz_long -s tests/test_fuzz.py` (FUZZ_GRPC_CASES, FUZZ_HTTP_CASES: how many).
"""
from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from specdec.scheduling.request import MODES
from specdec_rpc.pb import draft_pb2, generation_pb2 as g, target_pb2
from tests.helpers_models import VOCAB

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}.{% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")
BAD_STATUSES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DEADLINE_EXCEEDED}
LONG = pytest.mark.skipif(not os.environ.get("SPECDEC_FUZZ_LONG"), reason="the long fuzz runs: SPECDEC_FUZZ_LONG=1")
QUICK = settings(deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.filter_too_much, HealthCheck.data_too_large])


class Stack:
    """The servers on an event loop of their own (a thread): the tests call them as any client would."""

    def __init__(self, tmp):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start(tmp))

    def call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, tmp):
        from coordinator.config import CoordinatorSettings
        from coordinator.server import build_coordinator
        from coordinator.stack import free_port
        from specdec.text.tokenizer import load_tokenizer
        from tests.helpers_models import save_tiny_tokenizer, start_replica, tiny_pair

        tok = load_tokenizer(save_tiny_tokenizer(tmp / "tok"))
        tok.chat_template = CHAT_TEMPLATE
        target, draft = tiny_pair()
        self.t = await start_replica("target", target)
        self.d = await start_replica("draft", draft, preverifier="random")
        s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                                draft_endpoints=self.d.endpoint, target_endpoints=self.t.endpoint,
                                max_new_tokens_cap=64, log_level="WARNING", http_port=free_port(),
                                served_model_name="tiny", responses_store=100)
        self.app, _ = await build_coordinator(s, tokenizer=tok, eos_token_ids={1})
        await self.app.start()
        self.grpc_target = f"127.0.0.1:{self.app.port}"
        self.url = f"http://127.0.0.1:{self.app.http_port}"

    def sessions(self) -> int:
        return len(self.t.host.table) + len(self.d.host.table)

    def sessions_end(self, timeout: float = 10.0) -> None:
        t0 = time.monotonic()
        while self.sessions():
            assert time.monotonic() - t0 < timeout, f"{self.sessions()} replica sessions left open"
            time.sleep(0.05)

    def close(self):
        async def stop():
            for a in (self.app, self.t, self.d):
                await a.shutdown(0)
        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("fuzz"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def channel(stack):
    ch = grpc.insecure_channel(stack.grpc_target)
    yield ch
    ch.close()


def raw_method(channel, path: str, response_type):
    """A unary method that sends bytes as they are."""
    return channel.unary_unary(path, request_serializer=None, response_deserializer=response_type.FromString)


# ---- strategies ---------------------------------------------------------------------------------------------
TEXT = st.text(alphabet=st.sampled_from("abcdefghij .,!?<") | st.characters(codec="utf-8"), max_size=40)
small_ints = st.integers(-3, 70) | st.sampled_from([0, 2**31 - 1, -(2**31), VOCAB, VOCAB - 1])
floats = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from([0.0, 0.5, 1.0, -1.0])


@st.composite
def generate_requests(draw) -> g.GenerateRequest:
    r = g.GenerateRequest()
    which = draw(st.sampled_from(["prompt", "messages", "ids", "ids", "none", "two"]))
    if which in ("prompt", "two"):
        r.prompt = draw(TEXT)
    if which in ("messages", "two"):
        for _ in range(draw(st.integers(1, 3))):
            r.messages.add(role=draw(st.sampled_from(["user", "system", "assistant", "tool", ""]) | TEXT),
                           content=draw(TEXT))
    if which == "ids":
        r.prompt_token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1) | small_ints, min_size=0, max_size=12)))
    if draw(st.booleans()):
        r.max_new_tokens = draw(st.integers(1, 8) | small_ints)
    else:
        r.max_new_tokens = draw(st.integers(1, 8))
    r.mode = draw(st.sampled_from(MODES + ("", "bogus")))
    r.temperature = draw(st.sampled_from([0.0, 0.7, 1.0]) | floats)
    r.seed = draw(st.integers(0, 2**63 - 1))
    for name, strategy in (("top_p", floats), ("top_k", small_ints), ("gamma", small_ints),
                           ("logprobs", small_ints), ("prompt_logprobs", small_ints), ("min_p", floats),
                           ("min_tokens", small_ints), ("repetition_penalty", floats),
                           ("presence_penalty", floats), ("frequency_penalty", floats),
                           ("pacer_threshold", floats), ("pearl_first_block", small_ints),
                           ("truncate_prompt_tokens", small_ints), ("block_size", small_ints),
                           ("verify_method", st.sampled_from(["", "token", "block", "greedy", "x"])),
                           ("pearl_overlap", st.sampled_from(["", "x"]) | TEXT), ("cache_salt", TEXT),
                           ("request_id", TEXT), ("priority", small_ints), ("raw_prompt", st.booleans()),
                           ("ignore_eos", st.booleans()), ("chat_template_kwargs", TEXT), ("tools", TEXT),
                           ("separate_reasoning", st.booleans()), ("max_new_tokens_to_context", st.booleans()),
                           ("include_stop_str_in_output", st.booleans()), ("skip_special_tokens", st.booleans())):
        if draw(st.integers(0, 5)) == 0:
            setattr(r, name, draw(strategy))
    if draw(st.integers(0, 3)) == 0:
        r.stop.extend(draw(st.lists(TEXT, max_size=3)))
    if draw(st.integers(0, 3)) == 0:
        r.stop_token_ids.extend(draw(st.lists(small_ints, max_size=3)))
    if draw(st.integers(0, 5)) == 0:
        r.allowed_token_ids.extend(draw(st.lists(small_ints, max_size=4)))
    if draw(st.integers(0, 5)) == 0:
        r.bad_words.extend(draw(st.lists(TEXT, max_size=3)))
    if draw(st.integers(0, 5)) == 0:
        for k, v in draw(st.dictionaries(small_ints, floats, max_size=3)).items():
            r.logit_bias[k] = v
    if draw(st.integers(0, 6)) == 0:
        kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "choice", "grammar"]))
        so = r.structured_output
        if kind == "choice":
            so.choice.choices.extend(draw(st.lists(TEXT, max_size=3)))
        elif kind == "json_object":
            so.json_object = draw(st.booleans())
        else:
            setattr(so, kind, draw(TEXT | st.sampled_from(['{"type": "object"}', "[a-c]+", "start: 'a'"])))
    return r


CHARS = st.text(alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyz .,!?"), min_size=1, max_size=30)


@st.composite
def sane_requests(draw) -> g.GenerateRequest:
    """Requests a client would send: mostly answered OK."""
    r = g.GenerateRequest(max_new_tokens=draw(st.integers(1, 8)), mode=draw(st.sampled_from(MODES)),
                          temperature=draw(st.sampled_from([0.0, 0.5, 1.0])), seed=draw(st.integers(0, 99)))
    which = draw(st.sampled_from(["prompt", "messages", "ids"]))
    if which == "prompt":
        r.prompt, r.raw_prompt = draw(CHARS), draw(st.booleans())
    elif which == "messages":
        r.messages.add(role="user", content=draw(CHARS))
    else:
        r.prompt_token_ids.extend(draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=12)))
    if draw(st.booleans()):
        r.top_p = draw(st.floats(0.05, 1.0))
    if draw(st.booleans()):
        r.stop.extend(draw(st.lists(CHARS, max_size=2)))
        r.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)))
    if draw(st.booleans()):
        r.logprobs = draw(st.integers(0, 3))
    return r


STRING_FIELDS = ["prompt", "stop", "mode", "verify_method", "pearl_overlap", "cache_salt", "request_id", "tools",
                 "chat_template_kwargs", "bad_words", "messages.content", "messages.role"]
MARK = "QQQQ"
BAD_UTF8 = [b"\xff\xfe\xfd\xfc", b"\xc3\x28ab", b"a\xed\xa0\x80", b"\xf8\x88\x80\x80"]


def with_bad_utf8(field: str, bad: bytes) -> bytes:
    """A valid GenerateRequest whose `field` holds `bad` (4 bytes that are not UTF-8)."""
    r = g.GenerateRequest(prompt_token_ids=[2, 3], max_new_tokens=2)
    if field.startswith("messages."):
        r.ClearField("prompt_token_ids")
        r.messages.add(role="user", content="hi")
        setattr(r.messages[0], field.split(".")[1], MARK)
    elif field in ("stop", "bad_words"):
        getattr(r, field).append(MARK)
    else:
        setattr(r, field, MARK)
    data = r.SerializeToString()
    assert data.count(MARK.encode()) == 1
    return data.replace(MARK.encode(), bad)


@st.composite
def wire_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["random", "corrupt", "utf8", "truncated"]))
    if kind == "random":
        return draw(st.binary(max_size=120))
    if kind == "utf8":
        return with_bad_utf8(draw(st.sampled_from(STRING_FIELDS)), draw(st.sampled_from(BAD_UTF8)))
    data = bytearray(draw(generate_requests()).SerializeToString())
    if kind == "truncated" and data:
        return bytes(data[:draw(st.integers(0, len(data) - 1))])
    for _ in range(draw(st.integers(1, 4))):
        if data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    return bytes(data)


def check_status(code: grpc.StatusCode, details: str, tally: collections.Counter) -> None:
    tally[code.name] += 1
    assert code not in BAD_STATUSES, f"{code.name}: {details}"
    if code != grpc.StatusCode.OK:
        assert details, code.name


def call_generate(channel, request: bytes, tally: collections.Counter) -> None:
    method = raw_method(channel, "/specdec.v1.GenerationService/Generate", g.GenerateResponse)
    try:
        method(request, timeout=60)
        check_status(grpc.StatusCode.OK, "", tally)
    except grpc.RpcError as e:
        check_status(e.code(), e.details(), tally)


def grpc_fuzz(stack, channel, n: int, tally: collections.Counter):
    @settings(QUICK, max_examples=n)
    @given(st.one_of(sane_requests(), generate_requests()).map(lambda r: r.SerializeToString()) | wire_bytes())
    def run(data):
        call_generate(channel, data, tally)
    run()
    stack.sessions_end()
    ok = g.GenerateRequest(prompt_token_ids=[2, 3, 4], max_new_tokens=4, mode="sd")
    assert len(raw_method(channel, "/specdec.v1.GenerationService/Generate", g.GenerateResponse)(
        ok.SerializeToString(), timeout=60).token_ids) == 4  # still serving


# ---- gRPC -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", STRING_FIELDS)
def test_string_field_not_utf8_is_invalid_argument_naming_it(channel, field):
    with pytest.raises(grpc.RpcError) as e:
        raw_method(channel, "/specdec.v1.GenerationService/Generate", g.GenerateResponse)(
            with_bad_utf8(field, BAD_UTF8[0]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"field `{field}` is not valid UTF-8" in e.value.details()


def test_corrupt_body_is_invalid_argument(channel):
    with pytest.raises(grpc.RpcError) as e:
        raw_method(channel, "/specdec.v1.GenerationService/GenerateStream", g.GenerateStreamResponse)(
            b"\x0a\x40ab", timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid specdec.v1.GenerateRequest" in e.value.details()


def test_replicas_refuse_undecodable_requests(stack):
    """The replicas' services share the interceptor: a session id that is not UTF-8 is INVALID_ARGUMENT, on a
    unary call and on a per-round stream."""
    bad = target_pb2.TargetServiceEndSessionRequest(session_id=MARK).SerializeToString().replace(
        MARK.encode(), BAD_UTF8[0])
    for endpoint, path, response in (
            (stack.t.endpoint, "/specdec.v1.TargetService/EndSession", target_pb2.TargetServiceEndSessionResponse),
            (stack.d.endpoint, "/specdec.v1.DraftService/EndSession", draft_pb2.DraftServiceEndSessionResponse)):
        with grpc.insecure_channel(endpoint) as ch:
            with pytest.raises(grpc.RpcError) as e:
                raw_method(ch, path, response)(bad, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "field `session_id` is not valid UTF-8" in e.value.details()
    with grpc.insecure_channel(stack.t.endpoint) as ch:
        rounds = ch.stream_stream("/specdec.v1.TargetService/VerifyRounds", request_serializer=None,
                                  response_deserializer=target_pb2.VerifyRoundsResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(rounds(iter([b"\x0a\x40ab"]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_undecodable_requests_log_no_error(channel, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        for field in STRING_FIELDS:
            with pytest.raises(grpc.RpcError):
                raw_method(channel, "/specdec.v1.GenerationService/Generate", g.GenerateResponse)(
                    with_bad_utf8(field, BAD_UTF8[1]), timeout=30)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([r for r in caplog.records if "do not decode" in r.getMessage()]) <= 1  # rate-limited


def test_grpc_fuzz(stack, channel):
    tally = collections.Counter()
    grpc_fuzz(stack, channel, 300, tally)
    print(f"\ngRPC fuzz: statuses {dict(tally)}")
    assert sum(tally.values()) >= 300 and tally["OK"] >= 10


@LONG
@pytest.mark.fuzz_long
def test_grpc_fuzz_long(stack, channel):
    tally, t0 = collections.Counter(), time.monotonic()
    n = int(os.environ.get("FUZZ_GRPC_CASES", "5000"))
    grpc_fuzz(stack, channel, n, tally)
    print(f"\ngRPC fuzz: {sum(tally.values())} cases in {time.monotonic() - t0:.0f} s, statuses {dict(tally)}")


# ---- HTTP -----------------------------------------------------------------------------------------------------
def test_openapi_validates_and_lists_every_route(stack):
    from openapi_spec_validator import validate

    doc = httpx.get(stack.url + "/openapi.json", timeout=30).json()
    validate(doc)
    routes = stack.app.http_door.app().routes  # the door's routes (its app is built from the door alone)
    served = {(r.path.replace(":path", ""), m.lower()) for r in routes
              for m in r.methods if m != "HEAD" and getattr(r, "include_in_schema", True)}
    listed = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert served == listed
    post = doc["paths"]["/v1/chat/completions"]["post"]
    assert post["responses"]["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert "422" not in post["responses"] and "text/event-stream" in post["responses"]["200"]["content"]
    assert doc["paths"]["/health"]["get"]["security"] == []


def test_openapi_names_the_api_key():
    from prometheus_client import CollectorRegistry

    from coordinator.http_api.app import OpenAIFrontDoor

    class NoBackend:
        tok = None

    doc = OpenAIFrontDoor(NoBackend(), "m", api_key="k", registry=CollectorRegistry()).app().openapi()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/metrics"]["get"]["security"] == []
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]


def http_fuzz(stack, n: int, tally: collections.Counter):
    import schemathesis

    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    strategy = st.one_of([op.as_strategy() for op in operations])
    @settings(QUICK, max_examples=n)
    @given(strategy)
    def run(case):
        response = case.call(base_url=stack.url, timeout=60)
        tally[response.status_code] += 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400:
            assert response.json()["error"]["message"]
    run()
    stack.sessions_end()
    assert httpx.get(stack.url + "/health", timeout=30).status_code == 200


def test_http_fuzz(stack):
    tally = collections.Counter()
    http_fuzz(stack, 200, tally)
    print(f"\nHTTP fuzz: statuses {dict(sorted(tally.items()))}")
    assert sum(tally.values()) >= 200 and tally[200] >= 5


@LONG
@pytest.mark.fuzz_long
def test_http_fuzz_long(stack):
    tally, t0 = collections.Counter(), time.monotonic()
    http_fuzz(stack, int(os.environ.get("FUZZ_HTTP_CASES", "10000")), tally)
    print(f"\nHTTP fuzz (schemathesis, /openapi.json): {sum(tally.values())} cases in {time.monotonic() - t0:.0f} s, "
          f"statuses {dict(sorted(tally.items()))}")



# ---- the edges the fuzzing found ----------------------------------------------------------------------------
def test_prompt_past_the_context_is_refused_before_tokenizing(stack, channel):
    ctx = httpx.get(stack.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    servicer = stack.app.servicer
    prepared = []
    prepare = servicer.prepare
    servicer.prepare = lambda r: prepared.append(r) or prepare(r)
    try:
        t0 = time.monotonic()
        for big in (g.GenerateRequest(prompt="abc " * (64 * ctx), max_new_tokens=4),
                    g.GenerateRequest(messages=[g.ChatMessage(role="user", content="ab " * (64 * ctx))]),
                    g.GenerateRequest(prompt_token_ids=[3] * max(ctx, 1100))):
            with pytest.raises(grpc.RpcError) as e:
                raw_method(channel, "/specdec.v1.GenerationService/Generate", g.GenerateResponse)(
                    big.SerializeToString(), timeout=30)
            assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE, e.value.details()
            assert f"maximum context length is {ctx} tokens" in e.value.details()
        assert time.monotonic() - t0 < 5.0 and not prepared  # refused before the prompt work
        r = httpx.post(stack.url + "/v1/completions", json={"prompt": "abc " * (64 * ctx), "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # truncated, the same text is tokenized (off the event loop) and answered
        ok = g.GenerateRequest(prompt="abc " * (64 * ctx), truncate_prompt_tokens=8, max_new_tokens=2)
        assert len(raw_method(channel, "/specdec.v1.GenerationService/Generate", g.GenerateResponse)(
            ok.SerializeToString(), timeout=60).token_ids) == 2
    finally:
        servicer.prepare = prepare


@pytest.mark.parametrize("bad", [VOCAB, 2**31 - 1])
def test_stop_token_ids_outside_the_vocabulary(stack, channel, bad):
    req = g.GenerateRequest(prompt_token_ids=[2, 3], max_new_tokens=2, stop_token_ids=[bad])
    with pytest.raises(grpc.RpcError) as e:
        raw_method(channel, "/specdec.v1.GenerationService/Generate", g.GenerateResponse)(
            req.SerializeToString(), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"stop_token_ids: id {bad} is outside the vocabulary [0, {VOCAB})" in e.value.details()


def test_abort_log_names_what_the_request_held(stack, channel, caplog):
    import logging

    stub = channel.unary_stream("/specdec.v1.GenerationService/GenerateStream",
                                request_serializer=g.GenerateRequest.SerializeToString,
                                response_deserializer=g.GenerateStreamResponse.FromString)
    req = g.GenerateRequest(prompt_token_ids=[2, 3, 4, 5], max_new_tokens=64, mode="sd", ignore_eos=True, gamma=1)
    aborts = []
    with caplog.at_level(logging.INFO, logger="coordinator.requests"):
        for _ in range(5):
            call = stub(req, timeout=30)
            next(call)
            call.cancel()
            stack.sessions_end()
            aborts = [r.getMessage() for r in caplog.records if "finish abort" in r.getMessage()]
            if aborts:
                break
    assert aborts, "no request was cancelled before its end"
    assert all(" 4 prompt " in line and "target 127.0.0.1:" in line and "draft 127.0.0.1:" in line
               for line in aborts), aborts

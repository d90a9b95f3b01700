"""specdec/scheduling/field_rules.py, the one table of request fields' rules: every row driven through both front doors
of one coordinator over tiny replicas. A value the row refuses gets the same message from a gRPC Generate call
(INVALID_ARGUMENT) as from an HTTP /v1/completions call (400), and a value at the row's edge is answered by both.
The HTTP door names a field as OpenAI's clients know it (`max_tokens`, `prompt`, the X-Request-Id header), which
is the only difference it may make to the message. Also: the core applies the same rows, and docs/api/grpc.md
shows the table as it is."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from coordinator.config import CoordinatorSettings
from coordinator.server import build_coordinator
from coordinator.stack import free_port
from specdec.common.errors import InvalidRequestError
from specdec.decoding.sampling import SamplingParams
from specdec.scheduling import field_rules
from specdec.scheduling.field_rules import validate_request
from specdec.scheduling.request import GenerationRequest
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import start_replica, tiny_pair

on_the_stack = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny-target"
CAP = 16  # the coordinator's max_new_tokens cap
PROMPT = [5, 6, 7]
VOCAB = 32  # the tiny tokenizer's


@dataclass
class Case:
    """A row's values: `bad` (each refused), `good` (at the row's edge, answered), and what else the request
    needs (`extra`: a mode, a gamma). `http`: the HTTP name, where it differs (a header: `header=True`)."""
    bad: list
    good: object
    extra: dict = field(default_factory=dict)
    http: str = ""
    header: bool = False


CASES = {
    "mode": Case(["fast"], "pacer_pearl"),
    "temperature": Case([2.5, -0.5, float("nan")], 2.0),
    "max_new_tokens": Case([CAP + 1, -1], CAP, http="max_tokens"),
    "verify_method": Case(["magic"], "token", {"temperature": 1.0}),
    "pacer_threshold": Case([1.5, -0.25], 1.0, {"mode": "pacer"}),
    "pacer_skip_below": Case([1.5], 1.0, {"mode": "pacer"}),
    "pacer_post_threshold": Case([1.25], 0.0, {"mode": "pacer_pearl"}),
    "gamma": Case([65, 0], 64, {"mode": "sd"}),
    "pearl_first_block": Case([5, -1], 4, {"mode": "pearl", "gamma": 4}),
    "spec_off_batch": Case([1025, -1], 1024),
    "pearl_overlap": Case(["sometimes"], "always", {"mode": "pearl"}),
    "block_size": Case([0], 1, {"mode": "pacer"}),
    "top_p": Case([0.0, 1.5], 1.0, {"temperature": 1.0}),
    "top_k": Case([-2], 0, {"temperature": 1.0}),
    "min_p": Case([1.5, -0.5], 1.0, {"temperature": 1.0}),
    "presence_penalty": Case([2.5, -2.5], -2.0),
    "frequency_penalty": Case([2.5], 2.0),
    "repetition_penalty": Case([0.0, 10.5], 10.0),
    "logit_bias": Case([{3: 101.0}, {t: 1.0 for t in range(301)}], {3: -100.0}),
    "logprobs": Case([21, -1], 20),
    "prompt_logprobs": Case([21], 20),  # HTTP: echo with logprobs, which sets both
    "min_tokens": Case([3, -1], 2),  # max_new_tokens 2
    "stop": Case([["z"] * 17], ["z"] * 16),
    "stop_token_ids": Case([[1] * 65, [-1], [VOCAB]], [VOCAB - 1] * 64),
    "allowed_token_ids": Case([[3] * 4097, [-1]], [3] * 4096),
    "bad_words": Case([["a"] * 129, [" "]], ["a"] * 128),
    "cache_salt": Case(["x" * 257], "x" * 256),
    "prompt_token_ids": Case([[1, -1]], [0], http="prompt"),
    "truncate_prompt_tokens": Case([0, -3], 1),
    "request_id": Case(["x" * 65, "no spaces"], "g" * 64, http="X-Request-Id", header=True),
}


def grpc_request(name: str, value, extra: dict) -> g.GenerateRequest:
    kw = {"prompt_token_ids": PROMPT, "max_new_tokens": 2, **extra, name: value}
    return g.GenerateRequest(**kw)


def http_body(name: str, value, case: Case) -> dict:
    """The same request's body on /v1/completions."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **case.extra}
    if case.header:
        return body
    if name == "logit_bias":
        value = {str(k): v for k, v in value.items()}
    if name == "prompt_logprobs":
        return {**body, "echo": True, "logprobs": value}
    return {**body, (case.http or name): value}


async def http_post(doors, name: str, value, case: Case, path: str = "/v1/completions") -> httpx.Response:
    headers = {"content-type": "application/json", **({"X-Request-Id": value} if case.header else {})}
    # json.dumps writes NaN as Python's json reads it (and the door's parser does)
    return await doors.http.post(path, content=json.dumps(http_body(name, value, case)), headers=headers)


class Doors:
    async def start(self, tmp: Path):
        from specdec.text.tokenizer import load_tokenizer
        from tests.helpers_models import save_tiny_tokenizer

        tok = load_tokenizer(save_tiny_tokenizer(tmp / "tok"))
        target, draft = tiny_pair()
        self.t = await start_replica("target", target)
        self.d = await start_replica("draft", draft, preverifier="random")
        s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                                draft_endpoints=self.d.endpoint, target_endpoints=self.t.endpoint,
                                max_new_tokens_cap=CAP, log_level="WARNING", http_port=free_port(),
                                served_model_name=MODEL)
        self.app, _ = await build_coordinator(s, tokenizer=tok, eos_token_ids=set())
        await self.app.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.app.port}")
        self.stub = gg.GenerationServiceStub(self.channel)
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.app.http_port}", timeout=60)
        return self

    async def stop(self):
        await self.http.aclose()
        await self.channel.close()
        for a in (self.app, self.t, self.d):
            await a.shutdown(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def doors(tmp_path_factory):
    d = await Doors().start(tmp_path_factory.mktemp("rules"))
    yield d
    await d.stop()


def test_every_row_has_a_case():
    assert [r.field for r in field_rules.REQUEST_RULES] == list(CASES)


@on_the_stack
async def test_every_rule_answers_the_same_through_both_doors(doors):
    for rule in field_rules.REQUEST_RULES:
        name, case = rule.field, CASES[rule.field]
        for bad in case.bad:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await doors.stub.Generate(grpc_request(name, bad, case.extra))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, bad, e.value.details())
            details = e.value.details()
            assert details.startswith(f"{name}: "), (name, bad, details)
            r = await http_post(doors, name, bad, case)
            assert r.status_code == 400, (name, bad, r.text)
            http_name = "logprobs" if name == "prompt_logprobs" else case.http or name
            # the HTTP door's names: the field's, and max_new_tokens as max_tokens wherever the message says it
            want = (http_name + details[len(name):]).replace("max_new_tokens", "max_tokens")
            assert r.json()["error"]["message"] == want, (name, bad)
            assert r.json()["error"]["param"] == http_name, (name, bad, r.json())
        out = await doors.stub.Generate(grpc_request(name, case.good, case.extra))
        assert out.finish_reason, (name, case.good)
        r = await http_post(doors, name, case.good, case)
        assert r.status_code == 200, (name, case.good, r.text)


@on_the_stack
async def test_chat_top_logprobs_is_the_logprobs_row_under_its_own_name(doors):
    r = await doors.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                                          "content": "hi"}],
                                                              "max_tokens": 2, "logprobs": True, "top_logprobs": 21})
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await doors.stub.Generate(grpc_request("logprobs", 21, {}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert r.json()["error"]["message"] == "top_logprobs" + e.value.details().removeprefix("logprobs")


@pytest.mark.parametrize("build, name, value", [
    (lambda v: SamplingParams(temperature=v), "temperature", 2.5),
    (lambda v: SamplingParams(top_p=v), "top_p", 1.5),
    (lambda v: SamplingParams(logprobs=v), "logprobs", 21),
    (lambda v: SamplingParams(cache_salt=v), "cache_salt", "x" * 257),
    (lambda v: GenerationRequest([1, 2], 4, gamma=v), "gamma", 65),
    (lambda v: GenerationRequest([1, 2], 4, mode="pearl", gamma=4, pearl_first_block=v), "pearl_first_block", 5),
    (lambda v: GenerationRequest([1, 2], 4, pacer_threshold=v), "pacer_threshold", 1.5),
])
def test_the_core_applies_the_same_rows(build, name, value):
    """Requests built in process (the engine, `specdec bench`) or received by a replica: the same rule, the same
    words."""
    with pytest.raises(InvalidRequestError) as core:
        v = build(value)
        validate_request(v) if isinstance(v, GenerationRequest) else field_rules.check_sampling(v)
    with pytest.raises(InvalidRequestError) as table:
        field_rules.check(field_rules.REQUEST_RULES, {name: value}, gamma=4)
    assert str(core.value) == str(table.value)


def test_the_docs_show_the_table():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "api" / "grpc.md").read_text()
    assert field_rules.markdown_table() in doc


def test_modes_are_defined_once():
    from coordinator import metrics
    from specdec.scheduling import request

    assert metrics.MODES is request.MODES

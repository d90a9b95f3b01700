"""The OpenAI-compatible front door alone (coordinator/http_api/app.py) over a scripted servicer: the HTTP status of
each gRPC code, an error after the first chunk, the limits, draining and the request metric; and the schema's
translation of specdec's extra fields."""
from __future__ import annotations

import json

import grpc
import httpx

from specdec_rpc.pb import common_pb2, generation_pb2 as g

MODEL = "tiny-target"
MESSAGES = [{"role": "user", "content": "hello there"}]


class ScriptedServicer:
    """Answers every request with `script`: stream responses, then optionally a gRPC abort or an exception."""

    def __init__(self, script):
        self.script = script

    async def generate(self, request, incremental=True, metadata=()):
        from coordinator.grpc_api.service import GenerationFailed

        for item in self.script:
            if isinstance(item, tuple):
                raise GenerationFailed(*item)
            if isinstance(item, Exception):
                raise item
            yield item


def door_client(script, draining=False):
    from prometheus_client import CollectorRegistry

    from coordinator.http_api.app import OpenAIFrontDoor
    from coordinator.http_api.backend import ServicerBackend

    reg = CollectorRegistry()
    door = OpenAIFrontDoor(ServicerBackend(ScriptedServicer(script)), MODEL, is_draining=lambda: draining,
                           registry=reg, max_body_bytes=1000)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=door.app()), base_url="http://door"), reg


DONE = g.GenerateStreamResponse(text_delta="!", finish_reason=g.FINISH_REASON_STOP,
                                stats=g.GenerationStats(prompt_tokens=3, completion_tokens=2))
BODY = {"model": MODEL, "prompt": "abc"}


async def test_grpc_codes_become_http_statuses():
    from specdec.common.errors import CapacityError

    cases = [((grpc.StatusCode.RESOURCE_EXHAUSTED, "pools full: 256 requests wait"), 429, "rate_limit_error"),
             ((grpc.StatusCode.UNAVAILABLE, "no target replica at 10.0.0.1:50071"), 503, "server_error"),
             ((grpc.StatusCode.OUT_OF_RANGE, "prompt: 3000 tokens exceed max_context 2048"), 400,
              "invalid_request_error"),
             (CapacityError("queue full"), 429, "rate_limit_error"),
             (RuntimeError("boom"), 500, "server_error")]
    for failure, status, kind in cases:
        client, _ = door_client([failure])
        async with client:
            for stream in (False, True):
                r = await client.post("/v1/completions", json={**BODY, "stream": stream})
                assert r.status_code == status and r.json()["error"]["type"] == kind, (failure, r.text)
    assert r.json()["error"]["message"] == "RuntimeError: boom"


async def test_an_error_after_the_first_chunk_is_an_event_then_done():
    client, reg = door_client([g.GenerateStreamResponse(text_delta="ab"),
                               (grpc.StatusCode.UNAVAILABLE, "the target replica went away")])
    async with client:
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
    lines = [ln for ln in r.text.split("\n") if ln]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"] == {"content": "ab"}
    assert events[2]["error"]["message"] == "the target replica went away"
    assert reg.get_sample_value("specdec_http_requests_total",
                                {"route": "/v1/chat/completions", "status": "200"}) == 1
    async with door_client([g.GenerateStreamResponse(text_delta="ab"),
                            (grpc.StatusCode.UNAVAILABLE, "the target replica went away")])[0] as client:
        r = await client.post("/v1/completions", json={**BODY, "stream": True, "n": 3})
    lines = [ln for ln in r.text.split("\n") if ln]
    assert lines[-1] == "data: [DONE]" and sum("error" in ln for ln in lines) == 1, "the first error ends all choices"


async def test_limits_draining_and_metrics():
    client, reg = door_client([DONE])
    async with client:
        ok = await client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"
        assert ok.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                      "prompt_tokens_details": {"cached_tokens": 0}}
        big = await client.post("/v1/completions", json={**BODY, "prompt": "x" * 2000})
        assert big.status_code == 413 and "limit is 1000" in big.json()["error"]["message"]
        async def body():
            yield json.dumps(BODY).encode()

        chunked = await client.post("/v1/completions", content=body())
        assert chunked.status_code == 411
        await client.get("/v1/../../etc/passwd")
    assert reg.get_sample_value("specdec_http_requests_total", {"route": "other", "status": "404"}) == 1
    client, _ = door_client([DONE], draining=True)
    async with client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 503
        assert (await client.get("/health")).status_code == 503


def test_ignore_eos_reaches_the_request():
    from coordinator.http_api.schema import CompletionRequest
    from coordinator.grpc_api.service import GenerationServicer

    servicer = GenerationServicer(router=None, eos_token_ids={7})
    for ignore in (False, True):
        proto = CompletionRequest(prompt=[1, 2], max_tokens=4, ignore_eos=ignore).to_proto()
        assert list(servicer.prepare(proto).request.generation.eos_token_ids) == ([] if ignore else [7])


async def test_requests_in_flight_are_bounded():
    import asyncio

    from prometheus_client import CollectorRegistry

    from coordinator.http_api.app import OpenAIFrontDoor
    from coordinator.http_api.backend import ServicerBackend

    release = asyncio.Event()

    class Held:
        async def generate(self, request, incremental=True, metadata=()):
            await release.wait()
            yield DONE

    door = OpenAIFrontDoor(ServicerBackend(Held()), MODEL, registry=CollectorRegistry(), max_in_flight=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=door.app()), base_url="http://door") as client:
        held = [asyncio.ensure_future(client.post("/v1/completions", json=BODY)) for _ in range(2)]
        while door.in_flight < 2:
            await asyncio.sleep(0.01)
        over = await client.post("/v1/completions", json=BODY)
        assert over.status_code == 429 and "COORDINATOR_HTTP_MAX_IN_FLIGHT" in over.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200  # probes are not counted
        release.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        assert door.in_flight == 0
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200


def test_the_coordinators_default_mode_applies_to_requests_without_one():
    from coordinator.http_api.schema import ChatCompletionRequest
    from coordinator.grpc_api.service import GenerationServicer

    body = ChatCompletionRequest(messages=MESSAGES)
    servicer = GenerationServicer(router=None, tokenizer=None, default_mode="pacer_pearl")
    proto = body.to_proto()
    proto.ClearField("messages")
    proto.prompt_token_ids.extend([1, 2])
    assert servicer.prepare(proto).request.generation.mode == "pacer_pearl"
    proto.speculation.draft_stop = common_pb2.DRAFT_STOP_NONE
    assert servicer.prepare(proto).request.generation.mode == "ar"
    proto.speculation.draft_stop = common_pb2.DRAFT_STOP_FIXED  # the default's overlap, this stop rule
    assert servicer.prepare(proto).request.generation.mode == "pearl"


async def test_usage_reports_the_prefix_cache_hits():
    """usage.prompt_tokens_details.cached_tokens (OpenAI's and vLLM's field) is the target's reused prompt
    positions: the fewest any choice reused, since every choice processes the prompt."""
    hit = g.GenerateStreamResponse(text_delta="!", finish_reason=g.FINISH_REASON_STOP,
                                   stats=g.GenerationStats(prompt_tokens=300, completion_tokens=2,
                                                           cached_prompt_tokens=256))
    async with door_client([hit])[0] as client:
        one = await client.post("/v1/completions", json=BODY)
        three = await client.post("/v1/completions", json={**BODY, "n": 3})
        streamed = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True,
                                                                   "stream_options": {"include_usage": True}})
    assert one.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    assert three.json()["usage"] == {"prompt_tokens": 300, "completion_tokens": 6, "total_tokens": 306,
                                     "prompt_tokens_details": {"cached_tokens": 256}}
    last = json.loads([ln for ln in streamed.text.split("\n") if ln][-2].removeprefix("data: "))
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}


def test_the_schema_passes_cache_salt_and_the_servicer_bounds_it():
    import pytest

    from coordinator.grpc_api.service import GenerationServicer
    from coordinator.http_api.schema import ChatCompletionRequest
    from specdec.common.errors import InvalidRequestError

    body = ChatCompletionRequest(messages=MESSAGES, cache_salt="tenant-a")
    assert body.to_proto().sampling.cache_salt == "tenant-a"
    assert ChatCompletionRequest(messages=MESSAGES).to_proto().sampling.cache_salt == ""
    long = ChatCompletionRequest(messages=MESSAGES, cache_salt="x" * 300).to_proto()  # the table's rule, not the body's
    with pytest.raises(InvalidRequestError, match="^sampling.cache_salt: is 300 characters; use at most 256"):
        GenerationServicer(router=None).prepare(long)


def test_the_schema_passes_penalties_and_logit_bias():
    import pytest
    from pydantic import ValidationError

    from coordinator.http_api.schema import CompletionRequest

    r = CompletionRequest(prompt="abc", presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.5,
                          logit_bias={"3": 2.0, "17": -100}).to_proto()
    sp = r.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.25, 1.5)
    assert dict(sp.logit_bias) == {3: 2.0, 17: -100.0}
    assert not CompletionRequest(prompt="abc").to_proto().sampling.HasField("repetition_penalty")
    assert list(CompletionRequest(prompt="abc", stop_token_ids=[5, 9]).to_proto().stop_token_ids) == [5, 9]
    with pytest.raises(ValidationError, match="strings of digits"):  # the keys' form is this door's own
        CompletionRequest(prompt="abc", logit_bias={"x": 1})
    from coordinator.grpc_api.service import GenerationServicer
    from specdec.common.errors import InvalidRequestError

    for bad, words in (({"logit_bias": {"3": 101}}, "sampling.logit_bias: token 3: a bias must be in [-100, 100]"),
                       ({"presence_penalty": 3}, "sampling.presence_penalty: must be in [-2, 2]")):  # the table's
        with pytest.raises(InvalidRequestError) as e:
            GenerationServicer(router=None).prepare(CompletionRequest(prompt=[1, 2], **bad).to_proto())
        assert str(e.value).startswith(words), e.value

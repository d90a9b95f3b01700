"""GenerateRequest's typed settings (`sampling`, `speculation`: the mode as a pair of enums) and the deprecated flat
fields they replace: both forms give the same pipeline request, the same tokens and statistics over the wire; a
request that sends a setting both ways differently is refused naming both fields; the HTTP door sends the typed
form and calls the same service method as the gRPC door."""
from __future__ import annotations

import dataclasses
import pickle

import grpc
import httpx
import pytest
import pytest_asyncio

from coordinator.grpc_api.service import GenerationServicer
from specdec.common.errors import InvalidRequestError
from specdec.scheduling.request import (MODE_PAIRS, MODES, DraftStop, Overlap, PipelineRequest, Speculation, mode_name,
                                        mode_pair)
from specdec_rpc.decode import request_from_speculate
from specdec_rpc.encode import speculate_request
from specdec_rpc.pb import common_pb2 as c, draft_pb2, generation_pb2 as g, generation_pb2_grpc as gg

STOP_PB = {DraftStop.NONE: c.DRAFT_STOP_NONE, DraftStop.FIXED: c.DRAFT_STOP_FIXED,
           DraftStop.PREVERIFIER: c.DRAFT_STOP_PREVERIFIER}
OVERLAP_PB = {Overlap.OFF: c.OVERLAP_OFF, Overlap.AUTO: c.OVERLAP_AUTO, Overlap.ALWAYS: c.OVERLAP_ALWAYS}
SAMPLING = dict(temperature=0.75, top_k=5, top_p=0.875, seed=11, logprobs=2, presence_penalty=0.5,
                frequency_penalty=0.25, repetition_penalty=1.25, min_p=0.125, min_tokens=1, cache_salt="t",
                allowed_token_ids=[3, 4, 5])


def old_style(mode: str, pearl_overlap: str = "", **kw) -> g.GenerateRequest:
    """A client of the last release: every setting in the flat fields, the mode and methods as strings."""
    return g.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=6, mode=mode, pearl_overlap=pearl_overlap,
                             verify_method="token", gamma=3, spec_off_batch=4, logit_bias={3: 1.5}, **SAMPLING, **kw)


def new_style(mode: str, pearl_overlap: str = "auto") -> g.GenerateRequest:
    stop, overlap = mode_pair(mode, pearl_overlap)
    return g.GenerateRequest(
        prompt_token_ids=[1, 2, 3], max_new_tokens=6,
        sampling=c.SamplingParams(logit_bias={3: 1.5}, **SAMPLING),
        speculation=c.Speculation(draft_stop=STOP_PB[stop], overlap=OVERLAP_PB[overlap], gamma=3, spec_off_batch=4,
                                  verify_method=c.VERIFY_METHOD_TOKEN))


def same_request(a: PipelineRequest, b: PipelineRequest) -> bool:
    return dataclasses.replace(a.generation, session_id="") == dataclasses.replace(b.generation, session_id="")


# -- the types -------------------------------------------------------------------------------------------------
def test_the_modes_are_the_four_combinations_and_ar():
    assert tuple(MODE_PAIRS) == MODES
    assert {mode_name(s, o) for s in (DraftStop.FIXED, DraftStop.PREVERIFIER) for o in Overlap} == \
        {"sd", "pacer", "pearl", "pacer_pearl"}
    assert mode_name(DraftStop.NONE, Overlap.OFF) == "ar"
    with pytest.raises(ValueError):
        mode_name(DraftStop.NONE, Overlap.AUTO)
    for mode in MODES:
        for setting in ("auto", "always"):
            sp = Speculation(*mode_pair(mode, setting))
            assert sp.mode == mode and sp.request_fields()["mode"] == mode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setting", ["", "always"])
def test_old_style_and_typed_requests_are_the_same_request(mode, setting):
    svc = GenerationServicer(router=None, eos_token_ids={9})
    old = svc.prepare(old_style(mode, setting)).request
    new = svc.prepare(new_style(mode, setting or "auto")).request
    assert same_request(old, new), (old.generation, new.generation)
    assert old.generation.params.temperature == pytest.approx(0.75) and old.generation.gamma == 3
    # the pipeline takes it as it is; a Ray pipeline actor gets it pickled, the same request
    assert pickle.loads(pickle.dumps(new)) == new
    assert new.generation.speculation.mode == mode


def test_a_setting_sent_both_ways_must_agree():
    svc = GenerationServicer(router=None)
    both, typed = old_style("sd"), new_style("sd")
    both.sampling.CopyFrom(typed.sampling)
    both.speculation.CopyFrom(typed.speculation)
    assert same_request(svc.prepare(both).request, svc.prepare(new_style("sd")).request)  # the same values: fine
    cases = [(dict(temperature=0.5), lambda r: setattr(r.sampling, "temperature", 0.25), "sampling.temperature"),
             (dict(gamma=3), lambda r: setattr(r.speculation, "gamma", 5), "speculation.gamma"),
             (dict(mode="sd"), lambda r: setattr(r.speculation, "draft_stop", c.DRAFT_STOP_PREVERIFIER),
              "speculation.draft_stop"),
             (dict(mode="sd"), lambda r: setattr(r.speculation, "overlap", c.OVERLAP_AUTO), "speculation.overlap"),
             (dict(mode="pearl", pearl_overlap="auto"), lambda r: setattr(r.speculation, "overlap", c.OVERLAP_ALWAYS),
              "speculation.overlap"),
             (dict(verify_method="token"),
              lambda r: setattr(r.speculation, "verify_method", c.VERIFY_METHOD_BLOCK), "speculation.verify_method"),
             (dict(logit_bias={3: 1.0}), lambda r: r.sampling.logit_bias.update({3: 2.0}), "sampling.logit_bias")]
    for flat, typed, name in cases:
        r = g.GenerateRequest(prompt_token_ids=[1, 2], **flat)
        typed(r)
        with pytest.raises(InvalidRequestError) as e:
            svc.prepare(r)
        flat_name = next(iter(flat)) if name != "speculation.overlap" or "pearl_overlap" not in flat else \
            "pearl_overlap"
        assert str(e.value).startswith(f"{name}: ") and f" {flat_name} = " in str(e.value), str(e.value)
        assert "deprecated" in str(e.value) and e.value.field == name


def test_the_halves_of_a_mode_default_one_by_one():
    """A half left unset is the deprecated mode's, else the coordinator's default mode's."""
    svc = GenerationServicer(router=None, default_mode="pearl")

    def mode(**spec) -> str:
        r = g.GenerateRequest(prompt_token_ids=[1, 2], speculation=c.Speculation(**spec))
        return svc.prepare(r).request.generation.mode

    assert mode() == "pearl"
    assert mode(draft_stop=c.DRAFT_STOP_PREVERIFIER) == "pacer_pearl"
    assert mode(overlap=c.OVERLAP_OFF) == "sd"
    assert mode(draft_stop=c.DRAFT_STOP_NONE) == "ar"
    flat = g.GenerateRequest(prompt_token_ids=[1, 2], mode="sd", speculation=c.Speculation(
        draft_stop=c.DRAFT_STOP_FIXED))
    assert svc.prepare(flat).request.generation.mode == "sd"


@pytest.mark.parametrize("spec, name", [(dict(draft_stop=7), "speculation.draft_stop"),
                                        (dict(overlap=9), "speculation.overlap"),
                                        (dict(verify_method=8), "speculation.verify_method"),
                                        (dict(draft_stop=c.DRAFT_STOP_NONE, overlap=c.OVERLAP_AUTO),
                                         "speculation.overlap"),
                                        (dict(gamma=65), "speculation.gamma")])
def test_bad_typed_values_name_the_typed_field(spec, name):
    with pytest.raises(InvalidRequestError) as e:
        GenerationServicer(router=None).prepare(g.GenerateRequest(prompt_token_ids=[1, 2],
                                                                  speculation=c.Speculation(**spec)))
    assert e.value.field == name, str(e.value)


def test_the_replicas_sampling_fields_are_the_coordinators_to_fill():
    for field, value in (("grammar", "start: 'a'"), ("stop_ids", [1])):
        r = g.GenerateRequest(prompt_token_ids=[1, 2])
        getattr(r.sampling, field).extend(value) if isinstance(value, list) else setattr(r.sampling, field, value)
        with pytest.raises(InvalidRequestError, match=f"^sampling.{field}: the coordinator fills it"):
            GenerationServicer(router=None).prepare(r)


def test_the_replicas_receive_the_message_the_coordinator_completed():
    """The pipeline's SamplingParams keep the message they were read from, with what the coordinator derived, and
    a transport sends that message rather than a new one; a copy with a changed field, or one that crossed a
    process, has none and is written anew, the same settings either way."""
    from specdec_rpc.decode import sampling_from_proto
    from specdec_rpc.encode import sampling_to_proto

    r = old_style("sd", stop_token_ids=[7])  # min_tokens=1: the stop ids go to the replicas
    params = GenerationServicer(router=None, eos_token_ids={9}).prepare(r).request.generation.params
    msg = params.source
    assert isinstance(msg, c.SamplingParams) and sampling_to_proto(params) is msg
    assert msg.temperature == pytest.approx(0.75) and list(msg.stop_ids) == [7, 9]  # flat fields in, derived added
    assert sampling_from_proto(msg) == params
    for copy in (dataclasses.replace(params, prompt_logprobs=3), pickle.loads(pickle.dumps(params))):
        assert copy.source is None and sampling_to_proto(copy) is not msg
    assert sampling_from_proto(sampling_to_proto(pickle.loads(pickle.dumps(params)))) == params
    assert sampling_from_proto(sampling_to_proto(dataclasses.replace(params, prompt_logprobs=3))).prompt_logprobs == 3


def test_the_draft_replicas_speculate_request_shares_the_message():
    field = draft_pb2.SpeculateRequest.DESCRIPTOR.fields_by_name["speculation"]
    assert field.message_type is c.Speculation.DESCRIPTOR
    assert g.GenerateRequest.DESCRIPTOR.fields_by_name["speculation"].message_type is c.Speculation.DESCRIPTOR
    assert g.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].message_type is c.SamplingParams.DESCRIPTOR
    deprecated = [f.name for f in g.GenerateRequest.DESCRIPTOR.fields if f.GetOptions().deprecated]
    assert {"mode", "verify_method", "pearl_overlap", "temperature", "gamma"} <= set(deprecated)


def old_speculate(msg: draft_pb2.SpeculateRequest) -> draft_pb2.SpeculateRequest:
    """What a coordinator of the last release sends: the speculation in the flat fields only."""
    old = draft_pb2.SpeculateRequest()
    old.CopyFrom(msg)
    old.ClearField("speculation")
    return old


@pytest.mark.parametrize("mode", ["sd", "pacer", "pearl", "pacer_pearl"])
@pytest.mark.parametrize("setting", ["auto", "always"])
def test_the_speculate_request_carries_the_speculation_both_ways(mode, setting):
    """The coordinator sends `speculation` and, for a draft replica of the last release, the same settings in the
    flat fields; the replica reads the typed form where it is set, else the flat fields: the same request."""
    svc = GenerationServicer(router=None, eos_token_ids={9})
    req = svc.prepare(new_style(mode, setting)).request.generation
    req = dataclasses.replace(req, pacer_threshold=0.3, pearl_first_block=2)
    msg = speculate_request(req, target_endpoint="t:1")
    assert msg.HasField("speculation") and msg.mode == mode and msg.gamma == 3
    assert (msg.speculation.draft_stop, msg.speculation.overlap) == (STOP_PB[mode_pair(mode, setting)[0]],
                                                                    OVERLAP_PB[mode_pair(mode, setting)[1]])
    assert msg.speculation.verify_method == c.VERIFY_METHOD_TOKEN and msg.speculation.spec_off_batch == 4
    typed, old = request_from_speculate(msg), request_from_speculate(old_speculate(msg))
    assert typed == old
    want = dataclasses.replace(req, pacer_threshold=typed.pacer_threshold)  # float32 on the wire
    assert typed == want and typed.pacer_threshold == pytest.approx(0.3)
    only_typed = draft_pb2.SpeculateRequest()
    only_typed.CopyFrom(msg)
    for name in ("mode", "verify_method", "pearl_overlap", "gamma", "spec_off_batch", "pacer_threshold",
                 "pearl_first_block"):
        only_typed.ClearField(name)
    assert request_from_speculate(only_typed) == typed  # a later coordinator may drop the flat fields


def test_a_speculate_request_refuses_typed_and_flat_settings_that_differ():
    msg = speculate_request(GenerationServicer(router=None).prepare(new_style("sd")).request.generation)
    for change, field in ((lambda m: setattr(m, "gamma", 5), "speculation.gamma"),
                          (lambda m: setattr(m, "mode", "pacer"), "speculation.mode"),
                          (lambda m: setattr(m, "verify_method", "block"), "speculation.verify_method"),
                          (lambda m: setattr(m.speculation, "draft_stop", 9), "speculation.draft_stop")):
        bad = draft_pb2.SpeculateRequest()
        bad.CopyFrom(msg)
        change(bad)
        with pytest.raises(InvalidRequestError) as e:
            request_from_speculate(bad)
        assert e.value.field == field, str(e.value)
    unset = draft_pb2.SpeculateRequest(speculation=c.Speculation(gamma=2))
    with pytest.raises(InvalidRequestError, match="^speculation.draft_stop: set it"):
        request_from_speculate(unset)


def test_the_http_door_sends_the_typed_form():
    from coordinator.http_api.schema import CompletionRequest

    r = CompletionRequest(prompt=[1, 2], mode="pacer_pearl", pearl_overlap="always", verify_method="token",
                          gamma=5, temperature=0.5, seed=3, logprobs=2).to_proto()
    flat = {f.name for f, _ in r.ListFields()}
    assert not flat & {"mode", "pearl_overlap", "verify_method", "gamma", "temperature", "seed", "logprobs"}
    assert (r.speculation.draft_stop, r.speculation.overlap, r.speculation.verify_method, r.speculation.gamma) == \
        (c.DRAFT_STOP_PREVERIFIER, c.OVERLAP_ALWAYS, c.VERIFY_METHOD_TOKEN, 5)
    assert (r.sampling.temperature, r.sampling.seed, r.sampling.logprobs) == (0.5, 3, 2)


# -- over the wire ---------------------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def doors(tmp_path_factory):
    from tests.test_field_rules import Doors

    d = await Doors().start(tmp_path_factory.mktemp("typed"))
    yield d
    await d.stop()


on_the_stack = pytest.mark.asyncio(loop_scope="module")
STAT_FIELDS = ("mode", "rounds", "target_forwards", "draft_tokens", "accepted_tokens", "prompt_tokens",
               "completion_tokens")


@on_the_stack
@pytest.mark.parametrize("mode", ["sd", "pacer", "pearl", "pacer_pearl", "ar"])
async def test_an_old_style_client_gets_the_same_answer(doors, mode):
    def wire(r: g.GenerateRequest) -> g.GenerateRequest:
        r.sampling.temperature, r.temperature = 0.0, 0.0  # greedy: the same tokens whatever the timing
        r.max_new_tokens = 8
        r.ClearField("logit_bias")
        r.sampling.ClearField("logit_bias")
        r.sampling.ClearField("allowed_token_ids")
        r.ClearField("allowed_token_ids")
        return r

    old = await doors.stub.Generate(wire(old_style(mode)))
    new = await doors.stub.Generate(wire(new_style(mode)))
    assert list(old.token_ids) == list(new.token_ids) and old.text == new.text
    assert old.finish_reason == new.finish_reason
    # PEARL's drafting runs while verifies do, so what it drafts depends on timing: its counts are not compared
    same = STAT_FIELDS if mode in ("ar", "sd", "pacer") else ("mode", "prompt_tokens", "completion_tokens")
    assert [getattr(old.stats, f) for f in same] == [getattr(new.stats, f) for f in same]
    assert old.stats.mode == mode


@on_the_stack
async def test_both_doors_give_the_same_error_for_a_typed_field(doors):
    bad = g.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=2, speculation=c.Speculation(gamma=65))
    with pytest.raises(grpc.aio.AioRpcError) as typed:
        await doors.stub.Generate(bad)
    with pytest.raises(grpc.aio.AioRpcError) as flat:
        await doors.stub.Generate(g.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=2, gamma=65))
    assert typed.value.code() == flat.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert typed.value.details() == "speculation." + flat.value.details()
    r = await doors.http.post("/v1/completions", json={"model": "tiny-target", "prompt": [5, 6, 7], "max_tokens": 2,
                                                       "gamma": 65})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == flat.value.details() and r.json()["error"]["param"] == "gamma"
    r = await doors.http.post("/v1/completions", json={"model": "tiny-target", "prompt": [5, 6, 7], "max_tokens": 2,
                                                       "mode": "fast"})
    with pytest.raises(grpc.aio.AioRpcError) as mode:
        await doors.stub.Generate(g.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=2, mode="fast"))
    assert r.status_code == 400 and r.json()["error"]["message"] == mode.value.details()


@on_the_stack
async def test_both_doors_call_the_same_service_method(doors, monkeypatch):
    servicer = doors.app.servicer
    calls = []
    generate = servicer.generate

    def counted(r, incremental=True, metadata=()):
        calls.append(type(r).__name__)
        return generate(r, incremental, metadata)

    monkeypatch.setattr(servicer, "generate", counted)
    await doors.stub.Generate(g.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=2))
    r = await doors.http.post("/v1/completions", json={"model": "tiny-target", "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200 and calls == ["GenerateRequest", "GenerateRequest"]
    assert isinstance(doors.http, httpx.AsyncClient)

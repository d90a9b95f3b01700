"""A request's temperature, walked from the HTTP body to the target's verify (experiments/request_walk.py): it is
held in four types only, each made once on the way (the JSON body, its model, the request's SamplingParams message,
the core's SamplingParams), every process reads the message once and forwards it as it came, and no call a process
serves returns to a file it left."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

BODY, MODEL = "builtins.dict", "coordinator.http_api.schema.CompletionRequest"
MESSAGE, CORE = "specdec.v1.common_pb2.SamplingParams", "specdec.decoding.sampling.SamplingParams"


@pytest.mark.parametrize("mode", ["sd", "pearl"])  # the direct data plane, the coordinator's own rounds
def test_the_temperature_changes_form_three_times_from_body_to_verify(mode):
    import request_walk as walk

    stops = walk.record(mode)
    path = walk.path_to_verify(stops)
    assert path[-1].function == "logits_to_probs" and path[-1].thread.startswith("target-")
    assert walk.forms_in_order(path) == [MODEL, MESSAGE, CORE]
    before = stops[:stops.index(path[0])]  # the framework parsing the body, before the door's handler
    assert set(walk.forms_in_order(before)) <= {BODY, MODEL}
    assert {walk.role(s) for s in path} == {"coordinator", "draft", "target"}
    # no process writes the message anew from the core's SamplingParams: each forwards the one it read
    encodes = [s for s in stops if s.function == "sampling_to_proto" and MESSAGE in s.returned]
    assert encodes == [], encodes
    # the coordinator reads the request once: its field table and its settings reader are each entered once
    coordinator = [s.file for s in walk.handoffs(path) if walk.role(s) == "coordinator"]
    for module in ("coordinator/grpc_api/typed_request.py", "specdec/scheduling/field_rules.py",
                   "coordinator/grpc_api/output_constraints.py"):
        assert coordinator.count(module) == 1, (module, coordinator)
    # each replica's StartSession and Verify are calls of their own, each one seen from its handler on
    assert {s.function for s in path if s.door and walk.role(s) == "target"} >= {"TargetServicer.StartSession",
                                                                                  "TargetServicer.Verify"}
    assert walk.revisits(path) == {}


def _stop(file, function, caller, process="target", door=False):
    import request_walk as walk

    return walk.Stop(file, function, "MainThread", [] if door else ["T"], process, door=door,
                     stack=[] if door else [caller, "target_service/servicer.py"])


def test_the_walk_counts_a_return_to_a_file_once_per_call_served():
    import request_walk as walk

    host, worker = "specdec_rpc/host.py", "specdec/workers/base.py"
    door = _stop("target_service/servicer.py", "TargetServicer.StartSession", "", door=True)
    bounce = [_stop(worker, "open_session", host), _stop(worker, "prefill_chunk", host)]
    assert walk.revisits([door] + bounce) == {"target": [f"{host} -> {worker}:prefill_chunk"]}
    # the same hand-off again (the next chunk's call) is one a reader has followed already
    assert walk.revisits([door, bounce[0], bounce[0]]) == {}
    # a call served anew (the Verify after the StartSession) is walked on its own
    verify = _stop("target_service/servicer.py", "TargetServicer.Verify", "", door=True)
    assert walk.revisits([door, bounce[0], verify, bounce[1]]) == {}

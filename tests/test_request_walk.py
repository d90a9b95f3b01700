"""A request's temperature, walked from the HTTP body to the target's verify (experiments/request_walk.py): it is
held in four types only, each made once on the way (the body, its model, the request's SamplingParams message, the
core's SamplingParams), and every process reads the message once and forwards it as it came."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

FORMS = ["builtins.dict", "coordinator.http_api.schema.CompletionRequest", "specdec.v1.common_pb2.SamplingParams",
         "specdec.decoding.sampling.SamplingParams"]


@pytest.mark.parametrize("mode", ["sd", "pearl"])  # the direct data plane, the coordinator's own rounds
def test_the_temperature_changes_form_three_times_from_body_to_verify(mode):
    import request_walk as walk

    stops = walk.path_to_verify(walk.record(mode))
    assert stops[-1].function == "logits_to_probs" and stops[-1].thread.startswith("target-")
    assert walk.forms_in_order(stops) == FORMS
    roles = {walk.role(s) for s in stops}
    assert roles == {"coordinator", "draft", "target"}, roles
    # no process writes the message anew from the core's SamplingParams: each forwards the one it read
    encodes = [s for s in stops if s.function == "sampling_to_proto" and FORMS[2] in s.returned]
    assert encodes == [], encodes

"""A pipeline's events (coordinator/events.py): they cross from a Ray pipeline actor to the driver pickled, and a
finished request's stats reach the gRPC answer's GenerationStats under their own names."""
from __future__ import annotations

import pickle

from coordinator.events import DoneEvent, ErrorEvent, RequestStats, Served, ServedEvent, TokensEvent
from coordinator.grpc_api.service import stats_pb
from specdec.scheduling.request import GenerationStats


def _stats() -> RequestStats:
    schedule = GenerationStats(mode="pearl", rounds=7, network_s=9.0, cached_prompt_tokens=64,
                               accepted_per_position=[5, 3])
    return RequestStats.of(schedule, network_s=0.25, cached_prompt_tokens=32, draft_replica="d:1",
                           target_replica="t:1,t:2", draft_unavailable=True, draft_fallback="context")


def test_every_event_survives_pickling():
    served = Served(prompt_tokens=12, cached_prompt_tokens=8, target_replica="t:1", draft_replica="d:1")
    for ev in (TokensEvent([1, 2, 3], [(-0.5, [1], [-0.5])] * 3, served), TokensEvent([4]), ServedEvent(served),
               DoneEvent([1, 2, 3, 4], "length", _stats(), None, [(-1.0, [2], [-1.0])]),
               ErrorEvent("UNAVAILABLE", "no target replica")):
        back = pickle.loads(pickle.dumps(ev))
        assert back == ev and type(back) is type(ev)


def test_the_coordinators_measures_replace_the_schedules_and_reach_the_answer():
    stats = _stats()
    assert (stats.network_s, stats.cached_prompt_tokens, stats.rounds) == (0.25, 32, 7)
    assert RequestStats().prompt_tokens == 0 and RequestStats().mode == ""  # an abort's: what the request held
    pb = stats_pb(stats)
    assert (pb.mode, pb.rounds, pb.network_s, pb.cached_prompt_tokens) == ("pearl", 7, 0.25, 32)
    assert (pb.draft_replica, pb.target_replica, pb.draft_unavailable, pb.draft_fallback) == (
        "d:1", "t:1,t:2", True, "context")
    assert list(pb.accepted_per_position) == [5, 3]

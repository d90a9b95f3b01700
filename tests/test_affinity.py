"""Prefix-aware routing (coordinator/routing/affinity.py): requests sharing a prompt prefix go to the replica that holds it,
unless that replica is busier than the least-loaded one by more than the slack; over the wire, a conversation's
next turn lands where its first turn ran and reuses its chunks."""
from __future__ import annotations

import asyncio

import grpc

from coordinator.routing.affinity import PrefixAffinity, prefix_keys
from coordinator.routing.discovery import StaticSource
from coordinator.routing.pool import PoolManager

A, B = "10.0.0.1:7", "10.0.0.2:7"


def test_prefix_keys_name_whole_chunks_of_the_prefilled_part():
    p = list(range(10))
    keys = prefix_keys(p, 4)  # prefilled: p[:9] -> two whole chunks
    assert len(keys) == 2 and keys == prefix_keys(p[:9] + [99], 4)
    assert prefix_keys(p[:4] + [7] * 6, 4)[0] == keys[0] and prefix_keys(p[:4] + [7] * 6, 4)[1] != keys[1]
    assert prefix_keys(p, 0) == [] and prefix_keys(p[:4], 4) == []  # a prompt of one chunk prefills 3 positions


def test_prefer_the_longest_prefix_within_the_slack():
    aff = PrefixAffinity(slack=1, max_keys=4)
    short, longer = prefix_keys(list(range(9)), 4), prefix_keys(list(range(13)), 4)
    aff.record(short, A)
    aff.record(longer[1:], B)  # the 8-position prefix went to B later
    assert aff.prefer(longer, {A: 0, B: 0}) == B
    assert aff.prefer(longer, {A: 0, B: 2}) == A, "B is too busy: the shorter prefix's replica, within the slack"
    assert aff.prefer(longer, {A: 3, B: 2, "c": 0}) is None, "both beyond the slack of the least loaded (c)"
    assert aff.prefer(short, {B: 0}) == B and aff.prefer([], {A: 0}) is None
    aff.forget(B)
    assert aff.prefer(longer, {A: 0, B: 0}) == A
    aff.record(prefix_keys(list(range(100, 125)), 4), A)  # 6 keys: the oldest are forgotten past max_keys
    assert len(aff) == 4 and aff.prefer(short, {A: 0, B: 0}) is None


def manager(slack):
    async def health(endpoint, service):
        return True, ""

    async def capacity(kind, endpoint):
        return 8

    return PoolManager({"target": StaticSource([A, B])}, refresh_s=60, health_check=health, capacity_check=capacity,
                       affinity_slack=slack)


async def test_the_pool_routes_a_shared_prefix_to_one_replica():
    system = list(range(40))
    keys = [prefix_keys(system + [100 + i, 5], 8) for i in range(6)]
    pm = manager(slack=2)
    await pm.start()
    first = await pm.acquire("target", keys=keys[0])
    others = [await pm.acquire("target", keys=k) for k in keys[1:3]]
    assert others == [first, first], "within the slack the shared prefix's replica gets them"
    other = B if first == A else A
    assert await pm.acquire("target", keys=keys[3]) == other, "3 sessions beyond the least loaded: the other one"
    assert await pm.acquire("target", keys=keys[4]) == other, "the prefix went there last: it holds it too"
    pm.release("target", other)
    pm.release("target", other)
    assert await pm.acquire("target") == other, "no keys: least loaded"
    await pm.stop()
    plain = manager(slack=None)  # no affinity: least loaded, alternating
    await plain.start()
    assert [await plain.acquire("target", keys=keys[0]) for _ in range(4)] in ([A, B, A, B], [B, A, B, A])
    await plain.stop()


async def test_a_conversation_turn_lands_on_the_replica_that_holds_it():
    """Two target replicas with 4-position chunks: each conversation's second turn goes to the target replica of
    its first turn and reuses its whole prefill chunks; without affinity, least-loaded routing alternates."""
    from coordinator.config import CoordinatorSettings
    from coordinator.server import build_coordinator
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from tests.helpers_models import start_replica, target_greedy, tiny_pair

    target, draft = tiny_pair()
    kw = dict(prefill_chunk=4)
    ts = [await start_replica("target", target, **kw) for _ in range(2)]
    d = await start_replica("draft", draft, **kw)
    results = {}
    try:
        for chunk in (4, 0):
            app, _ = await build_coordinator(CoordinatorSettings(
                host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", draft_endpoints=d.endpoint,
                target_endpoints=",".join(t.endpoint for t in ts), pipelines=1, log_level="WARNING", grace_s=0,
                prefix_affinity_chunk=chunk))
            await app.start()
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
            stub = gg.GenerationServiceStub(ch)
            turns = []
            for conv in range(3):
                first = [conv + 1] * 9 + [5, 6, 7]
                one = await stub.Generate(g.GenerateRequest(prompt_token_ids=first, max_new_tokens=6, mode="sd"))
                second = first + list(one.token_ids) + [8, 9]
                two = await stub.Generate(g.GenerateRequest(prompt_token_ids=second, max_new_tokens=6, mode="sd"))
                assert list(two.token_ids) == target_greedy(target, second, 6)
                turns.append((one.stats.target_replica, two.stats.target_replica, two.stats.cached_prompt_tokens))
            results[chunk] = turns
            await ch.close()
            await app.shutdown(0)
    finally:
        for app in ts + [d]:
            await app.shutdown(0)
    assert all(a == b and cached == 8 for a, b, cached in results[4]), results[4]
    assert all(a != b for a, b, _ in results[0]), results[0]  # least loaded alternates between the two
    await asyncio.sleep(0)

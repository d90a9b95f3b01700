"""Interleaved prefill (SessionHost): a prefill runs chunk by chunk on the model thread, so other sessions' steps run
between its chunks; a start that fails or is cancelled midway leaves no session and no KV slot behind."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import torch
import pytest

from specdec_rpc.pb import common_pb2, target_pb2, target_pb2_grpc
from tests.helpers_models import build_tiny_model, start_replica

CHUNK = 4


async def replica(**kw):
    model = build_tiny_model(vocab_size=40, seed=1, max_position_embeddings=256)
    app = await start_replica("target", model, prefill_chunk=CHUNK, **kw)
    ch = grpc.aio.insecure_channel(app.endpoint)
    return app, ch, target_pb2_grpc.TargetServiceStub(ch)


def slow_chunks(app, log: list, started: threading.Event, delay_s: float = 0.03):
    """Make each prefill chunk take `delay_s` and log the model thread's calls in order."""
    worker = app.host.worker
    chunk_of, verify_batch = worker.prefill_chunk_of, worker.verify_batch

    def chunk(s, prompt, start, end, *a, **k):
        log.append(("chunk", start))
        started.set()
        time.sleep(delay_s)
        return chunk_of(s, prompt, start, end, *a, **k)

    def verify(batch):
        log.append(("verify", batch[0].session_id))
        return verify_batch(batch)

    worker.prefill_chunk_of, worker.verify_batch = chunk, verify
    app.host.runner.threads = 0  # every call on the model thread, none on the event loop


@pytest.mark.parametrize("interleave", [True, False])
async def test_a_long_prefill_lets_other_sessions_verify_between_its_chunks(interleave):
    app, ch, stub = await replica(interleave_prefill=interleave)
    try:
        params = common_pb2.SamplingParams(temperature=0.0)
        await stub.StartSession(target_pb2.TargetServiceStartSessionRequest(session_id="run", prompt_ids=[1, 2, 3],
                                                                            params=params))
        log, started = [], threading.Event()
        slow_chunks(app, log, started)
        long = asyncio.ensure_future(stub.StartSession(target_pb2.TargetServiceStartSessionRequest(
            session_id="long", prompt_ids=list(range(1, 30)), params=params)))  # 28 prefilled: 7 chunks
        while not started.is_set():
            await asyncio.sleep(0.005)
        await stub.Verify(target_pb2.VerifyRequest(session_id="run", base_position=2, feed_ids=[3]))
        resp = await long
        chunks = [i for i, (what, _) in enumerate(log) if what == "chunk"]
        at = log.index(("verify", "run"))
        assert len(chunks) == 7 and resp.position == 28
        if interleave:
            assert chunks[0] < at < chunks[-1], log  # ran between the chunks, not after the whole prefill
        else:
            assert at > chunks[-1], log
    finally:
        await ch.close()
        await app.shutdown(0)


async def cancel_mid_prefill(app, stub, sid: str) -> list:
    """Start `sid` with a 7-chunk prompt of slow chunks and cancel the call once its prefill has begun. → the log
    of the model thread's calls."""
    log, started = [], threading.Event()
    slow_chunks(app, log, started, delay_s=0.05)
    call = stub.StartSession(target_pb2.TargetServiceStartSessionRequest(session_id=sid,
                                                                         prompt_ids=list(range(1, 30))))
    while not started.is_set():
        await asyncio.sleep(0.005)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    return log


async def test_a_start_cancelled_mid_prefill_leaves_no_session_behind():
    app, ch, stub = await replica()
    try:
        log = await cancel_mid_prefill(app, stub, "gone")
        for _ in range(100):
            if "gone" not in app.host.worker.sessions and len(log) < 7:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert "gone" not in app.host.table and "gone" not in app.host.worker.sessions
        assert len(app.host.worker.free_slots) == app.host.worker.max_sessions, "its KV slot is free again"
        assert len(log) < 7, "the remaining chunks were not run"
    finally:
        await ch.close()
        await app.shutdown(0)


async def test_a_restart_cancelled_mid_prefill_leaves_no_half_session():
    """A StartSession that restarts an existing id and is cancelled between chunks: the id is gone (its next call
    gets NOT_FOUND and the coordinator rebuilds it), never half prefilled."""
    app, ch, stub = await replica()
    try:
        await stub.StartSession(target_pb2.TargetServiceStartSessionRequest(session_id="a", prompt_ids=[1, 2, 3]))
        await cancel_mid_prefill(app, stub, "a")
        await asyncio.sleep(0.3)
        assert "a" not in app.host.table and "a" not in app.host.worker.sessions
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Verify(target_pb2.VerifyRequest(session_id="a", base_position=28, feed_ids=[29]))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await ch.close()
        await app.shutdown(0)


@pytest.mark.parametrize("interleave", [False, True])
def test_a_rebuilt_target_session_holds_the_kv_its_verifies_wrote(interleave):
    """A session rebuilt from its history (failover, preemption: prompt + output, `output_start`) feeds the output
    in verify-sized blocks, so every position's K/V equals, bit for bit, what the first session's verifies wrote:
    a greedy answer goes on as it would have. bf16, whose CPU linears are row-invariant (fp32's are not: there a
    row's last bits depend on its call's row count, far below a greedy near-tie)."""
    from specdec.decoding.sampling import SamplingParams
    from specdec.modeling.linear import prepack_linears, set_row_invariant
    from specdec.workers.target import TargetWorker

    model = build_tiny_model(vocab_size=40, hidden_size=64, seed=5, max_position_embeddings=256).to(torch.bfloat16)
    set_row_invariant(model)
    prepack_linears(model)
    worker = TargetWorker(model, max_sessions=3, prefill_chunk=128)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 40, (37,), generator=gen).tolist()
    output = torch.randint(1, 40, (30,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0)
    worker.start_session("first", prompt, params)
    s = worker.sessions["first"]
    fed, at = [prompt[-1]] + output, 0
    for size in (4, 1, 3, 5, 2, 8, 4, 3):  # verify blocks of 1 + γ rows, the last prompt token first
        worker._feed(s, len(prompt) - 1 + at, fed[at:at + size])
        at += size
    history = prompt + output[:at - 1]
    if interleave:  # as SessionHost runs it: the worker opens the session, then one call per range
        r = worker.open_session("rebuilt", history, params, output_start=len(prompt))
        for start, end in worker.prefill_ranges(r, history):
            worker.prefill_chunk_of(r, history, start, end)
    else:
        worker.start_session("rebuilt", history, params, output_start=len(prompt))
        r = worker.sessions["rebuilt"]
    n = len(history) - 1
    assert r.tokens == history[:n]
    for layer in range(len(worker.kv.k)):
        for cache in (worker.kv.k[layer], worker.kv.v[layer]):
            assert torch.equal(cache[r.slot, :n], cache[s.slot, :n]), f"layer {layer}"
    assert r.chunked <= len(prompt) - 1  # the output's blocks are no prefill chunks: never reused as such
    worker.end_session("first")
    worker.start_session("next turn", history + [7], params)  # a later prompt reuses only prefilled chunks
    assert worker.sessions["next turn"].cached_tokens <= len(prompt) - 1

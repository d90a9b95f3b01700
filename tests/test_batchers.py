"""The two batchers' policies on fake workers: phase locking of verify calls, draft queue limits."""
from __future__ import annotations

import asyncio
import time

import pytest

from specdec.common.errors import CapacityError
from specdec.common.threads import ModelThread
from specdec.workers.target import VerifyArgs, VerifyOutcome
from target_service.batcher import VerifyBatcher


class SlowTarget:
    """verify_batch takes `forward_s` whatever the batch; records batch sizes."""

    def __init__(self, forward_s: float):
        self.forward_s, self.sizes = forward_s, []

    def verify_batch(self, batch):
        time.sleep(self.forward_s)
        self.sizes.append(len(batch))
        return [VerifyOutcome(0, 1) for _ in batch]


async def _alternating_sessions(window_ms: float, rounds: int = 8) -> list[int]:
    """Two sessions, each: verify (40 ms forward), then 'draft' for 25 ms, again; B starts 15 ms after A, so without
    phase locking A verifies while B drafts and the other way round, for ever."""
    worker, runner = SlowTarget(0.04), ModelThread("fake-target")
    sessions = {"a": time.monotonic(), "b": time.monotonic()}
    batcher = VerifyBatcher(worker, runner, lambda: sessions, window_ms=window_ms)
    batcher.start()

    async def session(sid: str, delay: float):
        await asyncio.sleep(delay)
        for _ in range(rounds):
            sessions[sid] = time.monotonic()
            await batcher.submit(VerifyArgs(sid, 0, [1], []))
            await asyncio.sleep(0.025)

    try:
        await asyncio.gather(session("a", 0.0), session("b", 0.015))
    finally:
        await batcher.close()
        runner.close()
    return worker.sizes


@pytest.mark.asyncio
async def test_verify_batcher_phase_locks_alternating_sessions():
    unlocked = await _alternating_sessions(window_ms=0)
    assert max(unlocked) == 1, f"without waiting the sessions should alternate: {unlocked}"
    locked = await _alternating_sessions(window_ms=100)
    assert locked.count(2) >= 6, f"the sessions should share forwards once locked: {locked}"
    assert len(locked) <= 10 < len(unlocked)


@pytest.mark.asyncio
async def test_verify_batcher_does_not_wait_for_idle_sessions():
    """An open session that has not called for longer than idle_s is not waited for."""
    worker, runner = SlowTarget(0.0), ModelThread("fake-target")
    sessions = {"a": time.monotonic(), "idle": time.monotonic() - 10.0}
    batcher = VerifyBatcher(worker, runner, lambda: sessions, window_ms=500, idle_s=1.0)
    batcher.start()
    try:
        t0 = time.monotonic()
        for _ in range(3):
            await batcher.submit(VerifyArgs("a", 0, [1], []))
        assert time.monotonic() - t0 < 0.3
    finally:
        await batcher.close()
        runner.close()


@pytest.mark.asyncio
async def test_draft_queue_limit_is_reported():
    from draft_service.batcher import DraftBatcher

    batcher = DraftBatcher(worker=None, runner=None, max_queue=2)  # never started: calls stay queued
    batcher.submit("s1", 0, [1], 4, None, 0)
    batcher.submit("s2", 0, [1], 4, None, 0)
    with pytest.raises(CapacityError, match="draft queue is full"):
        batcher.submit("s3", 0, [1], 4, None, 0)


class BlockDraft:
    """A fake draft: each call drafts `n` one-token blocks, one per `advance` (`step_s` each)."""

    def __init__(self, n: int, step_s: float = 0.0):
        self.n, self.step_s = n, step_s

    def begin(self, session_id, base, append, gamma_max, stop, block_size, features=None):
        from types import SimpleNamespace

        return SimpleNamespace(done=False, made=0, base=base)

    def advance(self, calls):
        from specdec.workers.drafting import DraftBlock

        time.sleep(self.step_s)
        out = []
        for c in calls:
            c.made += 1
            c.done = c.made >= self.n
            out.append([DraftBlock([c.base + c.made], [], "gamma_max" if c.done else "", 1, final=c.done)])
        return out


class CountingThread(ModelThread):
    def __init__(self):
        super().__init__("fake-draft")
        self.hops = 0

    async def run(self, fn, *args, **kwargs):
        self.hops += 1
        return await super().run(fn, *args, **kwargs)


@pytest.mark.asyncio
async def test_draft_blocks_reach_the_consumer_without_a_thread_hop_each():
    """A lone call's blocks stream out while the model thread drafts on: one hop for the whole call, and the
    consumer still sees the first block before the call ends."""
    from draft_service.batcher import DraftBatcher

    runner = CountingThread()
    batcher = DraftBatcher(BlockDraft(n=6, step_s=0.01), runner)
    batcher.start()
    try:
        entry = batcher.submit("s", 100, [1], 6, None, 1)
        got, first_at, t0 = [], None, time.monotonic()
        async for blk in batcher.blocks(entry):
            first_at = first_at if first_at is not None else time.monotonic() - t0
            got.append(blk)
        total = time.monotonic() - t0
    finally:
        await batcher.close()
        runner.close()
    assert [t for b in got for t in b.tokens] == [101, 102, 103, 104, 105, 106]
    assert got[-1].final and got[-1].stop_reason == "gamma_max" and not any(b.final for b in got[:-1])
    assert sum(b.draft_ns for b in got) == 6
    assert runner.hops == 1, f"the model thread returned to the loop {runner.hops} times for one call"
    assert first_at < total / 2, f"the first block came at {first_at:.3f}s of {total:.3f}s"


@pytest.mark.asyncio
async def test_draft_blocks_queued_behind_a_slow_consumer_come_as_one():
    from draft_service.batcher import DraftBatcher

    runner = ModelThread("fake-draft")
    batcher = DraftBatcher(BlockDraft(n=5), runner)
    batcher.start()
    try:
        entry = batcher.submit("s", 0, [1], 5, None, 1)
        await asyncio.sleep(0.2)  # the whole call drafts before the consumer reads
        got = [b async for b in batcher.blocks(entry)]
    finally:
        await batcher.close()
        runner.close()
    assert len(got) == 1 and got[0].tokens == [1, 2, 3, 4, 5] and got[0].final and got[0].draft_ns == 5


class ThreadRecordingTarget:
    def __init__(self):
        self.threads = []

    def verify_batch(self, batch):
        import threading

        self.threads.append(threading.current_thread().name)
        return [VerifyOutcome(0, 1) for _ in batch]


@pytest.mark.asyncio
async def test_lone_verify_runs_on_the_loop_thread_only_while_the_model_thread_is_idle():
    """One session, one torch thread: the verify skips the hand-off to the model thread and back. While the model
    thread still runs something (a prefill of another request, a cancelled call), it waits its turn there."""
    import threading

    import torch

    from specdec.common.threads import set_thread_count

    before = torch.get_num_threads()
    set_thread_count(1)
    worker, runner = ThreadRecordingTarget(), ModelThread("fake-target", threads=1)
    batcher = VerifyBatcher(worker, runner, lambda: {"a": time.monotonic()}, window_ms=0)
    batcher.start()
    try:
        await batcher.submit(VerifyArgs("a", 0, [1], []))
        assert worker.threads == [threading.current_thread().name]
        busy = asyncio.ensure_future(runner.run(time.sleep, 0.2))  # e.g. a StartSession prefill
        await asyncio.sleep(0.02)
        await batcher.submit(VerifyArgs("a", 1, [1], []))
        assert worker.threads[-1].startswith("fake-target")
        await busy
        await batcher.submit(VerifyArgs("a", 2, [1], []))
        assert worker.threads[-1] == threading.current_thread().name
        runner2 = ModelThread("fake-target-2", threads=2)  # a multi-threaded model keeps its own thread
        batcher.runner = runner2
        await batcher.submit(VerifyArgs("a", 3, [1], []))
        assert worker.threads[-1].startswith("fake-target-2")
        runner2.close()
    finally:
        await batcher.close()
        runner.close()
        set_thread_count(before)

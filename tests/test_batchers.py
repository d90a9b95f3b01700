"""The two batchers' policies on fake workers: phase locking of verify calls, draft queue limits."""
from __future__ import annotations

import asyncio
import time

import pytest

from specdec.errors import CapacityError
from specdec.server.runner import ModelThread
from specdec.workers import VerifyArgs, VerifyOutcome
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

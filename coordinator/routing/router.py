"""Driver side: hand each request to a pipeline (in-process, or round-robin over Ray pipeline actors)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from coordinator.events import DoneEvent, ErrorEvent, Event

if TYPE_CHECKING:
    from specdec.scheduling.request import PipelineRequest

log = logging.getLogger(__name__)


class LocalRouter:
    """Pipelines in the driver process (`--no-ray`, tests of pure logic)."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def stream(self, request: PipelineRequest) -> AsyncIterator[Event]:
        return self.pipeline.stream(request)

    async def stop(self, rid: str) -> None:
        self.pipeline.stop(rid)

    async def cancel(self, rid: str) -> None:
        self.pipeline.cancel(rid)

    async def close(self) -> None:
        await self.pipeline.close()

    async def max_model_len(self) -> int:
        """The longest prompt + output the target pool holds (0: unknown)."""
        pm = getattr(self, "pool_manager", None)
        return pm.max_model_len() if pm is not None else 0

    def waiting_now(self) -> float:
        """Requests waiting for free replica sessions (admission), for the metrics scrape."""
        pm = getattr(self, "pool_manager", None)
        return float(sum(pm.waiting().values())) if pm is not None else 0.0


def wanted_pipelines() -> int:
    """One pipeline actor per CPU of the Ray cluster (at least 2): more Ray workers, more pipelines."""
    import ray  # lazy: ray (~0.6 s) loads only where the coordinator runs on Ray (not with --no-ray)

    return max(2, int(ray.cluster_resources().get("CPU", 2)))


class RayRouter:
    """Requests go round-robin to pipeline actors; events come back through Ray streaming generators.

    With `fixed=None` the actor count follows the cluster (checked every `grow_every_s`), so adding Ray workers
    adds coordinator capacity without a restart. `make_actor(tag)` makes one whose requests' holder tokens start
    with `tag`: when an actor dies, its request fails UNAVAILABLE, what it held in the pools is given back, and a
    new actor takes its place (the replicas reclaim its sessions: idle, they are the first evicted, or expire)."""

    def __init__(self, actors: list, make_actor=None, fixed: int | None = None, grow_every_s: float = 30.0):
        self.actors = list(actors)
        self.make_actor, self.fixed, self.grow_every_s = make_actor, fixed, grow_every_s
        self._i = 0
        self._owner: dict[str, object] = {}
        self._tags: dict[int, str] = {}  # id(actor) -> its tag
        self._grow_task = None
        self._replacing: set = set()

    def _new_actor(self):
        tag = f"p{uuid.uuid4().hex[:8]}-"
        actor = self.make_actor(tag)
        self._tags[id(actor)] = tag
        return actor

    async def grow(self) -> int:
        want = self.fixed or wanted_pipelines()
        new = [self._new_actor() for _ in range(max(0, want - len(self.actors)))] if self.make_actor else []
        for a in new:
            await a.active.remote()
        self.actors.extend(new)
        return len(self.actors)

    async def _lost(self, actor) -> None:
        """A pipeline actor died: route nothing more to it, give back what its requests held, replace it."""
        if actor not in self.actors:
            return  # another request of it found out first
        self.actors.remove(actor)
        tag = self._tags.pop(id(actor), None)
        log.warning("pipeline actor %s died: its requests failed UNAVAILABLE; replacing it", tag)
        pool = getattr(self, "pool_actor", None)
        if pool is not None and tag:
            with contextlib.suppress(Exception):
                n = await pool.release_holders.remote(tag)
                log.warning("gave back the %d replica session(s) its requests held", n)
        if self.make_actor is not None:
            with contextlib.suppress(Exception):
                await self.grow()

    def start_autogrow(self) -> None:
        async def loop():
            while True:
                await asyncio.sleep(self.grow_every_s)
                try:
                    await self.grow()
                except Exception:  # noqa: BLE001 - try again next time
                    pass

        if self.fixed is None and self.make_actor is not None:
            self._grow_task = asyncio.get_running_loop().create_task(loop())

    async def stream(self, request: PipelineRequest) -> AsyncIterator[Event]:
        """The request's events from a pipeline actor (the typed request crosses to it pickled, as it is)."""
        import ray  # lazy: ray (~0.6 s) loads only where the coordinator runs on Ray (not with --no-ray)

        if not self.actors:
            await self.grow()
        actor = self.actors[self._i % len(self.actors)]
        self._i += 1
        rid = request.request_id
        self._owner[rid] = actor
        done = False
        try:
            try:
                async for ref in actor.stream.remote(request):
                    ev = await ref
                    done = isinstance(ev, (DoneEvent, ErrorEvent))
                    yield ev
            except ray.exceptions.RayActorError:
                done = True
                task = asyncio.ensure_future(self._lost(actor))
                self._replacing.add(task)
                task.add_done_callback(self._replacing.discard)
                yield ErrorEvent("UNAVAILABLE", "the coordinator's pipeline process serving this request died; "
                                 "retry the request (a new one replaces it)")
        finally:
            self._owner.pop(rid, None)
            if not done:  # the client went away: cancel the pipeline (it ends both sessions)
                actor.cancel.remote(rid)

    async def stop(self, rid: str) -> None:
        actor = self._owner.get(rid)
        if actor is not None:
            await actor.stop.remote(rid)

    async def cancel(self, rid: str) -> None:
        actor = self._owner.get(rid)
        if actor is not None:
            await actor.cancel.remote(rid)

    def waiting_now(self) -> float:
        """Requests waiting for free replica sessions (admission), for the metrics scrape (its own thread)."""
        import ray  # lazy: ray (~0.6 s) loads only where the coordinator runs on Ray (not with --no-ray)

        pool = getattr(self, "pool_actor", None)
        if pool is None:
            return 0.0
        try:
            return float(sum(ray.get(pool.waiting.remote(), timeout=1.0).values()))
        except Exception:  # noqa: BLE001 - a scrape must not fail: report "unknown"
            return float("nan")

    async def max_model_len(self) -> int:
        """The longest prompt + output the target pool holds (0: unknown)."""
        pool = getattr(self, "pool_actor", None)
        return await pool.max_model_len.remote() if pool is not None else 0

    async def close(self, wait_s: float = 10.0) -> None:
        import ray  # lazy: ray (~0.6 s) loads only where the coordinator runs on Ray (not with --no-ray)

        if self._grow_task is not None:
            self._grow_task.cancel()
        # the pipelines cancel what is in flight and end its replica sessions first (killed at once, they left the
        # sessions on the replicas until their TTL)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(a.close.remote() for a in self.actors),
                                                  return_exceptions=True), wait_s)
        for a in self.actors:
            ray.kill(a)
        if getattr(self, "pool_actor", None) is not None:
            ray.kill(self.pool_actor)

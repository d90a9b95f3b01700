"""Driver side: hand each request to a pipeline (in-process, or round-robin over Ray pipeline actors)."""
from __future__ import annotations

import itertools
from typing import AsyncIterator


class LocalRouter:
    """Pipelines in the driver process (`--no-ray`, tests of pure logic)."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def stream(self, request: dict) -> AsyncIterator[dict]:
        return self.pipeline.stream(request)

    async def stop(self, rid: str) -> None:
        self.pipeline.stop(rid)

    async def cancel(self, rid: str) -> None:
        self.pipeline.cancel(rid)

    async def close(self) -> None:
        await self.pipeline.close()


class RayRouter:
    """Requests go round-robin to pipeline actors; events come back through Ray streaming generators."""

    def __init__(self, actors: list):
        self.actors = actors
        self._rr = itertools.cycle(actors)
        self._owner: dict[str, object] = {}

    async def stream(self, request: dict) -> AsyncIterator[dict]:
        actor = next(self._rr)
        rid = request["request_id"]
        self._owner[rid] = actor
        done = False
        try:
            async for ref in actor.stream.remote(request):
                ev = await ref
                done = "done" in ev or "error" in ev
                yield ev
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

    async def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)

"""Ray actors: thin hosts of `PoolManager` (one per coordinator) and `Pipeline` (N, requests round-robin).

Adding Ray workers adds room for more pipeline actors; each pipeline talks to the replicas directly over gRPC,
so Ray stays off the per-round path (the actors are thin wrappers; the logic is in plain classes).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict

import ray

from coordinator.backends.pipeline import Pipeline
from coordinator.channels import Dialer
from coordinator.routing.discovery import source_from_spec
from coordinator.routing.pool import PoolManager, ReplicaUnavailableError
from specdec.scheduling.request import PipelineRequest
from specdec_rpc.logs import configure_logging


# Ray restarts it if its process dies: with what it held forgotten (the replicas' own limits still apply), and its
# pools rebuilt by the first call that finds them unstarted; the calls in flight fail UNAVAILABLE
@ray.remote(num_cpus=0, max_restarts=-1)
class PoolManagerActor:
    def __init__(self, specs: dict, refresh_s: float, health_timeout_s: float, tls: dict | None = None,
                 wait_s: float = 60.0, max_waiting: int = 256, affinity_slack: int | None = 2, preempt: bool = True,
                 log_level: str = "INFO", tokenizer_size: int = 0, log_format: str = "text"):
        # its own process: replicas joining, leaving, turning unhealthy, queues filling and draining are logged here
        configure_logging(log_level, log_format, service="coordinator")
        self.pm = PoolManager({k: source_from_spec(v) for k, v in specs.items() if v}, refresh_s,
                              health_timeout_s, dialer=Dialer.from_tls(tls), wait_s=wait_s,
                              max_waiting=max_waiting, affinity_slack=affinity_slack, preempt=preempt,
                              tokenizer_size=tokenizer_size)
        self._started: asyncio.Task | None = None
        self._acquiring: dict[str, asyncio.Task] = {}  # holder token -> its acquire in progress
        # tokens withdrawn before their acquire ran: Ray does not keep an async actor's calls in order
        self._withdrawn: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> dict:
        if self._started is None:
            self._started = asyncio.ensure_future(self.pm.start())
        await asyncio.shield(self._started)
        return self.pm.snapshot()

    async def acquire(self, kind: str, exclude: list[str], keys: list[bytes] = (), priority: int = 0,
                      holder: str = "") -> str:
        await self.start()  # a no-op, except in an instance Ray restarted
        if holder and self._withdrawn.pop(holder, 0) is None:  # its caller gave up before this call ran
            raise asyncio.CancelledError
        if holder:
            self._acquiring[holder] = asyncio.current_task()
        try:
            return await self.pm.acquire(kind, exclude, keys, priority, holder)
        finally:
            if self._acquiring.get(holder) is asyncio.current_task():
                del self._acquiring[holder]

    async def withdraw(self, kind: str, holder: str) -> None:
        """The caller of `acquire(holder=...)` went away: stop that acquire, then give back what it was handed."""
        task = self._acquiring.get(holder)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        elif not self.pm.holds(kind, holder):  # its acquire has not run yet: it must not, when it comes
            self._withdrawn[holder] = None
            while len(self._withdrawn) > 4096:
                self._withdrawn.popitem(last=False)
        self.pm.withdraw(kind, holder)

    async def release_holders(self, prefix: str) -> int:
        for holder, task in list(self._acquiring.items()):
            if holder.startswith(prefix):
                task.cancel()
        return await self.pm.release_holders(prefix)

    async def release(self, kind: str, endpoint: str, holder: str = "") -> None:
        self.pm.release(kind, endpoint, holder)

    async def report_failure(self, kind: str, endpoint: str, error: str = "") -> None:
        self.pm.report_failure(kind, endpoint, error)

    async def members(self) -> dict:
        return self.pm.members()

    async def view(self) -> dict:
        return self.pm.view()

    async def marked(self, kind: str, holder: str) -> bool:
        return self.pm.marked(kind, holder)

    async def waiting(self) -> dict:
        return self.pm.waiting()

    async def refresh(self) -> dict:
        await self.pm.refresh()
        return self.pm.snapshot()

    async def snapshot(self) -> dict:
        return self.pm.snapshot()

    async def max_model_len(self) -> int:
        return self.pm.max_model_len()


class RayPool:
    """Awaitable facade over a PoolManagerActor handle (used inside pipeline actors)."""

    def __init__(self, handle):
        self.h = handle
        self._giving_back: set[asyncio.Task] = set()  # referenced until done (the loop holds tasks weakly)

    async def acquire(self, kind, exclude=(), keys=(), priority=0, holder=""):
        ref = self.h.acquire.remote(kind, list(exclude), list(keys), priority, holder)
        try:
            return await ref
        except ray.exceptions.RayTaskError as e:  # the pool's own error: its message says what to change
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, Exception) else e) from None
        except ray.exceptions.RayActorError:
            raise ReplicaUnavailableError(f"the coordinator's pool actor was lost and is restarting; retry the "
                                          f"request ({kind} replica not pinned)", kind) from None
        except asyncio.CancelledError:
            # The request went away (client cancel, deadline) while the pool actor looked for room, maybe waiting
            # for it. The actor does not see this cancel, and a cancelled Ray call does not say whether room was
            # handed before it: the actor stops that acquire and gives back what it holds, by its token. (A
            # ray.cancel here lost room handed just before it: each early cancel shrank the pools for good.)
            if holder:
                task = asyncio.ensure_future(self._call(self.h.withdraw, kind, holder))
            else:
                task = asyncio.ensure_future(self._give_back(ref, kind))
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)
            raise

    async def _give_back(self, ref, kind: str) -> None:
        try:
            endpoint = await ref
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - cancelled or failed: nothing was handed
            return
        await self.release(kind, endpoint)

    @staticmethod
    async def _call(method, *args):
        """A pool actor call whose loss (the actor restarting) means the same as its failure: try next time."""
        try:
            return await method.remote(*args)
        except ray.exceptions.RayActorError:
            return None

    async def release(self, kind, endpoint, holder=""):
        await self._call(self.h.release, kind, endpoint, holder)

    async def report_failure(self, kind, endpoint, error=""):
        await self._call(self.h.report_failure, kind, endpoint, error)

    async def members(self):
        return await self._call(self.h.members) or {}

    async def view(self):
        view = await self._call(self.h.view)
        if view is None:
            raise ReplicaUnavailableError("the coordinator's pool actor was lost and is restarting")
        return view

    async def marked(self, kind, holder):
        return bool(await self._call(self.h.marked, kind, holder))


@ray.remote(num_cpus=0)
class PipelineActor:
    """`tag`: this actor's prefix of its requests' holder tokens; the router gives back what a dead one held."""

    def __init__(self, pool_handle, rpc_timeout_s: float, view_refresh_s: float, tls: dict | None = None,
                 replica_streams: bool = True, affinity_chunk: int = 128, tag: str = "", log_level: str = "INFO",
                 log_format: str = "text", data_plane: str = "coordinator", chain_window: int = 0,
                 replica_frames: bool = True):
        configure_logging(log_level, log_format, service="coordinator")
        self._args = (pool_handle, rpc_timeout_s, view_refresh_s, tls, replica_streams, affinity_chunk, tag,
                      data_plane, chain_window, replica_frames)
        self.pipeline = None

    def _get(self):
        if self.pipeline is None:  # grpc.aio channels must be created inside the actor's event loop
            handle, timeout, refresh, tls, streams, affinity_chunk, tag, data_plane, chain_window, frames = self._args
            self.pipeline = Pipeline(RayPool(handle), Dialer.from_tls(tls), timeout, refresh, streams,
                                     affinity_chunk, tag, data_plane, chain_window, replica_frames=frames)
        return self.pipeline

    async def stream(self, request: PipelineRequest):
        async for ev in self._get().stream(request):
            yield ev

    async def stop(self, rid: str) -> None:
        self._get().stop(rid)

    async def cancel(self, rid: str) -> bool:
        return self._get().cancel(rid)

    async def active(self) -> int:
        return self._get().active()

    async def close(self) -> None:
        """Cancel the requests in flight and end their sessions (the router kills the actor afterwards)."""
        if self.pipeline is not None:
            await self.pipeline.close()

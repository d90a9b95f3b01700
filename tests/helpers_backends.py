"""The coordinator's gRPC backends (`coordinator/backends/clients.py`) pinned to fixed replicas, for tests that run
a schedule, or single calls, over the wire without a pool manager."""
from __future__ import annotations

from coordinator.backends.clients import RemoteDraft, RemoteTarget
from coordinator.channels import Channels


class FixedPool:
    """One endpoint per kind: every acquire gets it, releases and failures change nothing, nothing is preempted."""

    def __init__(self, draft: str | None = None, target: str | None = None):
        self.endpoints = {"draft": draft, "target": target}

    async def acquire(self, kind, exclude=(), keys=(), priority=0, holder=""):
        return self.endpoints[kind]

    async def release(self, kind, endpoint, holder=""):
        pass

    async def report_failure(self, kind, endpoint, error=""):
        pass

    async def marked(self, kind, holder):
        return False


def remote_target(channels: Channels, endpoint: str, streams: bool = False) -> RemoteTarget:
    """A `TargetBackend` for one session on `endpoint` (unary calls unless `streams`)."""
    return RemoteTarget(FixedPool(target=endpoint), channels, streams=streams)


def remote_draft(channels: Channels, endpoint: str, streams: bool = False) -> RemoteDraft:
    """A `DraftBackend` for one session on `endpoint` (unary calls unless `streams`)."""
    return RemoteDraft(FixedPool(draft=endpoint), channels, streams=streams)

"""One-off calls to a replica, each on a channel of its own: its health (the standard gRPC health service), its
capacity (`GetInfo`), and ending a session whose caller died. The pools (coordinator/pool.py) and the embedded
stack use them; `end_session_request` is the EndSession message the pipelines' backends send too."""
from __future__ import annotations

import contextlib
import logging

import grpc

from coordinator.channels import Dialer
from specdec.pb import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("coordinator.pool")


@contextlib.asynccontextmanager
async def _channel(kind: str, endpoint: str, dialer: Dialer | None):
    channel = (dialer or Dialer()).open(kind, endpoint)
    try:
        yield channel
    finally:
        await channel.close()


def _stub(kind: str, channel):
    return draft_pb2_grpc.DraftServiceStub(channel) if kind == "draft" else target_pb2_grpc.TargetServiceStub(channel)


def end_session_request(kind: str, session_id: str):
    return (draft_pb2.DraftServiceEndSessionRequest(session_id=session_id) if kind == "draft"
            else target_pb2.TargetServiceEndSessionRequest(session_id=session_id))


async def grpc_health(kind: str, endpoint: str, service: str, timeout: float,
                      dialer: Dialer | None = None) -> tuple[bool, str]:
    """(SERVING?, error text) of one replica via the standard health service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with _channel(kind, endpoint, dialer) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                   timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return False, f"{e.code().name}: {e.details()}"
        ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        return ok, "" if ok else "NOT_SERVING (draining)"


async def grpc_capacity(kind: str, endpoint: str, timeout: float, dialer: Dialer | None = None) -> tuple[int, int]:
    """A replica's `ModelInfo` (max_sessions, max_position_embeddings: positions a session holds) via its
    `GetInfo`; (0, 0) if it cannot be read."""
    request = draft_pb2.DraftServiceGetInfoRequest() if kind == "draft" else target_pb2.TargetServiceGetInfoRequest()
    async with _channel(kind, endpoint, dialer) as channel:
        try:
            r = await _stub(kind, channel).GetInfo(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            log.warning("%s replica %s: GetInfo failed (%s); no session limit known for it", kind, endpoint,
                        e.code())
            return 0, 0
        return max(0, r.info.max_sessions), max(0, r.info.max_position_embeddings)


async def end_session(kind: str, endpoint: str, session_id: str, timeout: float,
                      dialer: Dialer | None = None) -> bool:
    """EndSession on a replica, best effort (a session whose caller died); → whether the replica ended one."""
    async with _channel(kind, endpoint, dialer) as channel:
        try:
            return (await _stub(kind, channel).EndSession(end_session_request(kind, session_id),
                                                          timeout=timeout)).existed
        except grpc.aio.AioRpcError:
            return False

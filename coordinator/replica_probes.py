"""One-off probes of a replica, each on a channel of its own: its health (the standard gRPC health service) and
its capacity (`GetInfo`). The pools' refresh loop (coordinator/pool.py) and the embedded stack use them."""
from __future__ import annotations

import logging

log = logging.getLogger("coordinator.pool")


async def grpc_health(endpoint: str, service: str, timeout: float, credentials=None) -> tuple[bool, str]:
    """(SERVING?, error text) of one replica via the standard health service."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.aio.secure_channel(endpoint, credentials) if credentials is not None
               else grpc.aio.insecure_channel(endpoint))
    try:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=timeout)
        ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        return ok, "" if ok else "NOT_SERVING (draining)"
    except grpc.aio.AioRpcError as e:
        return False, f"{e.code().name}: {e.details()}"
    finally:
        await channel.close()


async def grpc_capacity(kind: str, endpoint: str, timeout: float, credentials=None) -> tuple[int, int]:
    """A replica's `ModelInfo` (max_sessions, max_position_embeddings: positions a session holds) via its
    `GetInfo`; (0, 0) if it cannot be read."""
    import grpc

    from specdec.pb import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    channel = (grpc.aio.secure_channel(endpoint, credentials) if credentials is not None
               else grpc.aio.insecure_channel(endpoint))
    try:
        if kind == "draft":
            r = await draft_pb2_grpc.DraftServiceStub(channel).GetInfo(draft_pb2.DraftServiceGetInfoRequest(),
                                                                       timeout=timeout)
        else:
            r = await target_pb2_grpc.TargetServiceStub(channel).GetInfo(target_pb2.TargetServiceGetInfoRequest(),
                                                                         timeout=timeout)
        return max(0, r.info.max_sessions), max(0, r.info.max_position_embeddings)
    except grpc.aio.AioRpcError as e:
        log.warning("%s replica %s: GetInfo failed (%s); no session limit known for it", kind, endpoint, e.code())
        return 0, 0
    finally:
        await channel.close()


async def end_session(kind: str, endpoint: str, session_id: str, timeout: float, credentials=None) -> bool:
    """EndSession on a replica, best effort (a session whose caller died); → whether the replica ended one."""
    import grpc

    from specdec.pb import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    channel = (grpc.aio.secure_channel(endpoint, credentials) if credentials is not None
               else grpc.aio.insecure_channel(endpoint))
    try:
        if kind == "draft":
            r = await draft_pb2_grpc.DraftServiceStub(channel).EndSession(
                draft_pb2.DraftServiceEndSessionRequest(session_id=session_id), timeout=timeout)
        else:
            r = await target_pb2_grpc.TargetServiceStub(channel).EndSession(
                target_pb2.TargetServiceEndSessionRequest(session_id=session_id), timeout=timeout)
        return r.existed
    except grpc.aio.AioRpcError:
        return False
    finally:
        await channel.close()

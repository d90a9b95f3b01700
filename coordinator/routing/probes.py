"""One-off calls to a replica, each on a channel of its own: its health (the standard gRPC health service), its
capacity, model and tokenizer fingerprint (`GetInfo`), and ending a session whose caller died. The pools
(coordinator/routing/pool.py) and the embedded stack use them; `end_session_request` is the EndSession message the
pipelines' backends send too."""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.channels import Dialer
from specdec_rpc.pb import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("coordinator.routing.pool")


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
    async with _channel(kind, endpoint, dialer) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                   timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return False, f"{e.code().name}: {e.details()}"
        ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        return ok, "" if ok else "NOT_SERVING (draining)"


@dataclasses.dataclass
class ReplicaInfo:
    """What the pools read from a replica's `ModelInfo` (0 / '': unknown)."""
    max_sessions: int = 0
    max_context: int = 0  # max_position_embeddings: positions a session holds
    vocab: int = 0  # vocab_size: its model's rows
    model: str = ""
    tokenizer_fingerprint: str = ""  # specdec/text/pairing.py; '' for a model without a tokenizer


def _info_request(kind: str, tokenizer_prefix: int = 0):
    return (draft_pb2.DraftServiceGetInfoRequest(tokenizer_prefix=tokenizer_prefix) if kind == "draft"
            else target_pb2.TargetServiceGetInfoRequest(tokenizer_prefix=tokenizer_prefix))


async def grpc_capacity(kind: str, endpoint: str, timeout: float, dialer: Dialer | None = None) -> ReplicaInfo:
    """A replica's `ModelInfo` via its `GetInfo`; all unknown if it cannot be read."""
    async with _channel(kind, endpoint, dialer) as channel:
        try:
            r = await _stub(kind, channel).GetInfo(_info_request(kind), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            log.warning("%s replica %s: GetInfo failed (%s); no session limit known for it", kind, endpoint,
                        e.code())
            return ReplicaInfo()
        return ReplicaInfo(max(0, r.info.max_sessions), max(0, r.info.max_position_embeddings),
                           max(0, r.info.vocab_size), r.info.model, r.info.tokenizer_fingerprint)


async def grpc_tokenizer_prefix(kind: str, endpoint: str, prefix: int, timeout: float,
                                dialer: Dialer | None = None) -> str:
    """A replica's tokenizer fingerprint over its first `prefix` ids ('' if it cannot be read)."""
    async with _channel(kind, endpoint, dialer) as channel:
        try:
            r = await _stub(kind, channel).GetInfo(_info_request(kind, prefix), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            log.warning("%s replica %s: GetInfo failed (%s)", kind, endpoint, e.code())
            return ""
        return r.info.tokenizer_fingerprint


def vocabulary_mismatch(tokenizer_size: int, vocab_size: int, kind: str = "target") -> str:
    """Why a `kind` replica's model cannot be the coordinator tokenizer's ('' when it can, or either is unknown). A
    model's vocabulary holds its tokenizer's tokens plus some padding (Qwen2.5: 151,665 in 151,936); the
    coordinator's tokenizer with 64 tokens more, or with fewer than half, is another model's. A target's answers
    would be decoded with the wrong vocabulary (silently: a gpu deployment whose coordinator read the default SmolLM2
    tokenizer for a Llama target); a draft of another tokenizer proposes tokens
    that mean something else to the target, so requests would run slower than the target alone."""
    if not tokenizer_size or not vocab_size or tokenizer_size - 64 <= vocab_size <= 2 * tokenizer_size + 1024:
        return ""
    fix = ("set COORDINATOR_TOKENIZER to the target's model" if kind == "target" else
           "serve a draft of the target's tokenizer; speculative requests fail FAILED_PRECONDITION meanwhile")
    return (f"its model's vocabulary has {vocab_size} tokens and the coordinator's tokenizer {tokenizer_size}: "
            f"they are different models' ({fix})")


async def end_session(kind: str, endpoint: str, session_id: str, timeout: float,
                      dialer: Dialer | None = None) -> bool:
    """EndSession on a replica, best effort (a session whose caller died); → whether the replica ended one."""
    async with _channel(kind, endpoint, dialer) as channel:
        try:
            return (await _stub(kind, channel).EndSession(end_session_request(kind, session_id),
                                                          timeout=timeout)).existed
        except grpc.aio.AioRpcError:
            return False

"""An async TargetService client implementing `specdec.schedule.TargetBackend` over gRPC.

Used by the tests and usable by the coordinator. Create it inside the running event loop.
"""
from __future__ import annotations

import grpc

from specdec_rpc.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.sampling import SamplingParams
from specdec_rpc.convert import encode_q, features_from_proto, logprobs_from_proto
from specdec.verify import SparseDist
from specdec.workers.base import TargetFeatures
from specdec.workers.target import VerifyOutcome

METHOD_PB = {"greedy": common_pb2.VERIFY_METHOD_GREEDY, "token": common_pb2.VERIFY_METHOD_TOKEN,
             "block": common_pb2.VERIFY_METHOD_BLOCK}


class TargetClient:
    def __init__(self, channel: grpc.aio.Channel, timeout: float = 30.0):
        self.stub = target_pb2_grpc.TargetServiceStub(channel)
        self.timeout = timeout

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    want_features: bool = False) -> TargetFeatures | None:
        r = await self.stub.StartSession(target_pb2.TargetServiceStartSessionRequest(
            session_id=session_id, prompt_ids=prompt_ids, return_features=want_features,
            params=common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                             top_p=params.top_p, seed=params.seed)), timeout=self.timeout)
        return features_from_proto([r.features])[0] if r.HasField("features") else None

    @staticmethod
    def request(session_id: str, base_position: int, feed: list[int], draft: list[int],
                q: list[SparseDist] | None, method: str, feed_draft: bool = True,
                sample_bonus: bool = True) -> target_pb2.VerifyRequest:
        req = target_pb2.VerifyRequest(session_id=session_id, base_position=base_position, feed_ids=feed,
                                       draft_ids=draft, method=METHOD_PB[method], feed_draft=feed_draft,
                                       sample_bonus=sample_bonus)
        if q:
            req.q = encode_q(q)
        return req

    async def verify(self, session_id: str, base_position: int, feed: list[int], draft: list[int],
                     q: list[SparseDist] | None, method: str, feed_draft: bool = True,
                     sample_bonus: bool = True) -> VerifyOutcome:
        r = await self.stub.Verify(self.request(session_id, base_position, feed, draft, q, method, feed_draft,
                                                sample_bonus), timeout=self.timeout)
        return VerifyOutcome(r.num_accepted, r.next_token if r.HasField("next_token") else None,
                             forward_ns=r.forward_ns, verify_ns=r.verify_ns, forwarded=r.forward_ns > 0,
                             batch_size=r.batch_size,
                             features=features_from_proto([r.features])[0] if r.HasField("features") else None,
                             logprobs=logprobs_from_proto(r.logprobs) if r.HasField("logprobs") else None)

    async def end(self, session_id: str) -> None:
        await self.stub.EndSession(target_pb2.TargetServiceEndSessionRequest(session_id=session_id),
                                   timeout=self.timeout)

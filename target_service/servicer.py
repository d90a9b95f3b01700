"""TargetService servicer: proto <-> TargetWorker calls through the verify batcher (errors map in the interceptor)."""
from __future__ import annotations

import grpc

from specdec.common.errors import InvalidRequestError
from specdec.workers.target import VerifyArgs
from specdec_rpc.decode import decode_q, dense_q_to_sparse, read_sampling, tensor_from_proto
from specdec_rpc.encode import features_to_proto, logprobs_to_proto
from specdec_rpc.host import ROUNDS_WAITING, SessionHost
from specdec_rpc.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec_rpc.tracing import CallClock

from target_service.batcher import VerifyBatcher

_METHODS = {common_pb2.VERIFY_METHOD_UNSPECIFIED: "block",  # greedy sessions take the greedy path anyway
            common_pb2.VERIFY_METHOD_GREEDY: "greedy", common_pb2.VERIFY_METHOD_TOKEN: "token",
            common_pb2.VERIFY_METHOD_BLOCK: "block"}


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, host: SessionHost, batcher: VerifyBatcher):
        self.host, self.batcher, self.metrics = host, batcher, host.metrics
        self.spans = None  # a ReplicaSpans when traces are exported (specdec_rpc/tracing.py)

    async def GetInfo(self, request, context) -> target_pb2.TargetServiceGetInfoResponse:
        return target_pb2.TargetServiceGetInfoResponse(info=self.host.info_for(request.tokenizer_prefix))

    async def StartSession(self, request, context) -> target_pb2.TargetServiceStartSessionResponse:
        clock = CallClock() if self.spans is not None else None
        params = read_sampling(request.params)
        if request.reserve_positions:
            self.host.worker.check_reserve(request.reserve_positions, len(request.prompt_ids))
        position, ns, feats, cached = await self.host.start_session(request.session_id, list(request.prompt_ids),
                                                                    params, want_features=request.return_features,
                                                                    output_start=request.output_start)
        resp = target_pb2.TargetServiceStartSessionResponse(position=position, prefill_ns=ns, cached_tokens=cached,
                                                            model=self.host.info.model)
        if feats is not None:
            resp.features.CopyFrom(features_to_proto(feats))
        if params.prompt_logprobs >= 0 and (lp := self.host.worker.take_prompt_logprobs(request.session_id)):
            resp.prompt_logprobs.CopyFrom(logprobs_to_proto(lp))
        if clock is not None:
            self.spans.record("prefill", context, clock, {
                "specdec.session_id": request.session_id, "specdec.prompt_tokens": len(request.prompt_ids),
                "specdec.cached_tokens": cached, "specdec.prefill_ns": ns})
        return resp

    async def EndSession(self, request, context) -> target_pb2.TargetServiceEndSessionResponse:
        self.batcher.forget(request.session_id)
        return target_pb2.TargetServiceEndSessionResponse(existed=await self.host.end_session(request.session_id))

    async def Verify(self, request, context) -> target_pb2.VerifyResponse:
        clock = CallClock() if self.spans is not None else None
        self.host.touch(request.session_id)
        if request.method not in _METHODS:
            raise InvalidRequestError("method", f"unknown VerifyMethod {request.method}; use GREEDY, TOKEN or BLOCK")
        which = request.WhichOneof("draft_q")  # greedy sessions' callers send none (specdec_rpc/encode.py: verify_q)
        q = (decode_q(request.q) if which == "q" else
             dense_q_to_sparse(tensor_from_proto(request.q_dense, "q_dense")) if which == "q_dense" else None)
        args = VerifyArgs(request.session_id, request.base_position, list(request.feed_ids),
                          list(request.draft_ids), q or None, _METHODS[request.method],
                          request.feed_draft if request.HasField("feed_draft") else True,
                          request.sample_bonus if request.HasField("sample_bonus") else True, request.chained,
                          # a chained verify that no longer applies is skipped where a newer one of the session
                          # that applies already waits; elsewhere it is a target step (workers/target.py)
                          waiting=await _newer_chained(request) if request.chained else [])
        out, queue_ns = await self.batcher.submit(args)
        if args.draft:
            self.metrics.num_drafts.inc()
            self.metrics.num_draft_tokens.inc(len(args.draft))
            self.metrics.num_accepted_tokens.inc(out.num_accepted)
        resp = target_pb2.VerifyResponse(num_accepted=out.num_accepted, forward_ns=out.forward_ns,
                                         verify_ns=out.verify_ns, queue_ns=queue_ns, batch_size=out.batch_size)
        if out.next_token is not None:
            resp.next_token = out.next_token
        if out.committed is not None:
            resp.committed_ids.extend(out.committed)
            resp.committed_from, resp.proposed = out.committed_from, out.proposed
        if out.features is not None:
            resp.features.CopyFrom(features_to_proto(out.features))
        if out.logprobs is not None:
            resp.logprobs.CopyFrom(logprobs_to_proto(out.logprobs))
        if clock is not None:
            self.spans.record("verify", context, clock, {
                "specdec.session_id": request.session_id, "specdec.base_position": request.base_position,
                "specdec.draft_tokens": len(args.draft), "specdec.accepted_tokens": out.num_accepted,
                "specdec.batch_size": out.batch_size, "specdec.forward_ns": out.forward_ns,
                "specdec.queue_ns": queue_ns}, wait_ns=queue_ns)
        return resp

    async def VerifyRounds(self, request_iterator, context):
        async for resp in self.host.rounds(request_iterator, context, self.Verify, "verify",
                                           lambda r: target_pb2.VerifyRoundsResponse(verify=r)):
            yield resp


async def _newer_chained(request) -> list[tuple[int, list[int]]]:
    """The session's newer chained verifies waiting behind `request` on its per-round stream (none for a unary call)."""
    behind = ROUNDS_WAITING.get()
    return [] if behind is None else [(w.base_position, list(w.feed_ids) + list(w.draft_ids)) for w in await behind()
                                      if w.chained and w.session_id == request.session_id]


def add_to_server(servicer: TargetServicer, server: grpc.aio.Server) -> None:
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)

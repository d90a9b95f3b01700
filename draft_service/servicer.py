"""DraftService servicer: proto <-> DraftWorker calls, nothing else (errors map in the interceptor)."""
from __future__ import annotations

import grpc

from specdec.common.errors import InvalidRequestError, StalePositionError
from specdec.decoding.stop import StopSpec, make_stop_rule
from specdec_rpc.decode import features_from_proto, read_sampling
from specdec_rpc.encode import encode_q
from specdec_rpc.host import SessionHost
from specdec_rpc.pb import draft_pb2, draft_pb2_grpc
from specdec_rpc.tracing import CallClock

from draft_service.speculate import PEER_TIMEOUT_S, PeerChannels, speculate

_REASONS = {"gamma_max": draft_pb2.STOP_REASON_GAMMA_MAX, "preverifier": draft_pb2.STOP_REASON_PREVERIFIER,
            "cancelled": draft_pb2.STOP_REASON_CANCELLED}
_STOP_KINDS = {draft_pb2.STOP_KIND_UNSPECIFIED: "fixed", draft_pb2.STOP_KIND_FIXED: "fixed",
               draft_pb2.STOP_KIND_PREVERIFIER: "pacer"}


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, host: SessionHost, batcher):
        self.host, self.worker, self.metrics, self.batcher = host, host.worker, host.metrics, batcher
        self.committed: dict[str, int] = {}  # session id -> committed fed tokens (Commit)
        self._latest: dict[str, object] = {}  # session id -> token of its newest Draft/DraftStream call
        self.spans = None  # a ReplicaSpans when traces are exported (specdec_rpc/tracing.py)
        self.peers: PeerChannels | None = None  # the target replicas this one dials for `Speculate`

    async def GetInfo(self, request, context) -> draft_pb2.DraftServiceGetInfoResponse:
        return draft_pb2.DraftServiceGetInfoResponse(info=self.host.info_for(request.tokenizer_prefix))

    async def StartSession(self, request, context) -> draft_pb2.DraftServiceStartSessionResponse:
        clock = CallClock() if self.spans is not None else None
        params = read_sampling(request.params)
        if request.reserve_positions:
            self.host.worker.check_reserve(request.reserve_positions, len(request.prompt_ids))
        feats = features_from_proto(request.features) if self.worker.reads_features else None
        position, ns, _, cached = await self.host.start_session(request.session_id, list(request.prompt_ids), params,
                                                                features=feats, output_start=request.output_start)
        self.committed.pop(request.session_id, None)
        if clock is not None:
            self.spans.record("prefill", context, clock, {
                "specdec.session_id": request.session_id, "specdec.prompt_tokens": len(request.prompt_ids),
                "specdec.cached_tokens": cached, "specdec.prefill_ns": ns})
        return draft_pb2.DraftServiceStartSessionResponse(position=position, prefill_ns=ns, cached_tokens=cached,
                                                          model=self.host.info.model)

    async def EndSession(self, request, context) -> draft_pb2.DraftServiceEndSessionResponse:
        self.committed.pop(request.session_id, None)
        self._latest.pop(request.session_id, None)
        return draft_pb2.DraftServiceEndSessionResponse(existed=await self.host.end_session(request.session_id))

    # -- drafting ------------------------------------------------------------------------------------------
    def _stop_rule(self, stop: draft_pb2.StopRule):
        if stop.kind not in _STOP_KINDS:
            raise InvalidRequestError("stop.kind", f"unknown StopKind {stop.kind}; use FIXED or PREVERIFIER")
        threshold = stop.threshold if stop.HasField("threshold") else None
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise InvalidRequestError("stop.threshold", f"must be in [0, 1], got {threshold}")
        skip = stop.skip_below if stop.HasField("skip_below") else None
        if skip is not None and not 0.0 <= skip <= 1.0:
            raise InvalidRequestError("stop.skip_below", f"must be in [0, 1], got {skip}")
        return make_stop_rule(StopSpec(_STOP_KINDS[stop.kind], threshold, skip), self.worker.preverifier)

    def _check_base(self, sid: str, base: int, field: str = "base_position") -> None:
        self.host.touch(sid)
        floor = self.committed.get(sid, 0)
        if base < floor:
            raise StalePositionError(f"{field} {base} is below the committed position {floor} of session {sid!r}; "
                                     f"send a position >= {floor}")

    def _args(self, request):
        self._check_base(request.session_id, request.base_position)
        token = self._latest[request.session_id] = object()
        self._forget_gone()
        feats = features_from_proto(request.features) if self.worker.reads_features else None
        return token, (request.session_id, request.base_position, list(request.append_ids), request.gamma_max,
                       self._stop_rule(request.stop), request.block_size, feats)

    def _wire_q(self, sid: str, q) -> bytes:
        """A block's q as the coordinator needs it: nothing for a greedy session (its verify never reads q)."""
        s = self.worker.sessions.get(sid)
        return b"" if s is not None and s.params.greedy else encode_q(q)

    def count_blocks(self, blocks) -> None:
        self.metrics.num_draft_tokens.inc(sum(len(b.tokens) for b in blocks))
        self.metrics.num_lookup_tokens.inc(sum(b.looked_up for b in blocks))

    async def Draft(self, request, context) -> draft_pb2.DraftResponse:
        clock = CallClock() if self.spans is not None else None
        _, args = self._args(request)
        blocks, entry = await self.batcher.draft_whole(*args)
        self.metrics.num_drafts.inc()
        tokens = [t for b in blocks for t in b.tokens]
        self.count_blocks(blocks)
        if clock is not None:
            self.draft_span(context, clock, request, blocks, entry)
        return draft_pb2.DraftResponse(token_ids=tokens, q=self._wire_q(request.session_id, [d for b in blocks for d in b.q]),
                                       stop_reason=_REASONS.get(blocks[-1].stop_reason, 0),
                                       draft_ns=sum(b.draft_ns for b in blocks), block_size=blocks[-1].block_size)

    async def DraftRounds(self, request_iterator, context):
        async for resp in self.host.rounds(request_iterator, context, self.Draft, "draft",
                                           lambda r: draft_pb2.DraftRoundsResponse(draft=r)):
            yield resp

    async def DraftStream(self, request, context):
        """Blocks are sent as the batcher completes them; drafting goes on while a block is on the wire."""
        token, args = self._args(request)
        sid = request.session_id
        clock = CallClock() if self.spans is not None else None
        entry = self.batcher.submit(*args)
        offset, finished, sent = 0, False, []
        self.metrics.num_drafts.inc()
        try:
            async for block in self.batcher.blocks(entry):
                self.count_blocks([block])
                if clock is not None:
                    sent.append(block)
                yield draft_pb2.DraftStreamResponse(
                    token_ids=block.tokens, q=self._wire_q(sid, block.q), offset=offset, last=block.final,
                    stop_reason=_REASONS.get(block.stop_reason, 0), draft_ns=block.draft_ns,
                    block_size=block.block_size)
                offset += len(block.tokens)
                if block.final:
                    finished = True
                    return
        finally:
            # Client cancelled or deadline: stop the drafting at its next token, unless a newer call of this
            # session already started (the cancel would stop that one instead; this one is abandoned instead).
            entry.abandoned = True
            if clock is not None:
                self.draft_span(context, clock, request, sent, entry)
            if not finished and self._latest.get(sid) is token:
                self.worker.cancel(sid)
            if self._latest.get(sid) is token:
                del self._latest[sid]

    def draft_span(self, context, clock, request, blocks, entry) -> None:
        """The call's `draft` span, with its wait for the step loop (`entry`: None where drafted at once)."""
        self.spans.record("draft", context, clock, {
            "specdec.session_id": request.session_id, "specdec.base_position": request.base_position,
            "specdec.draft_tokens": sum(len(b.tokens) for b in blocks),
            "specdec.draft_ns": sum(b.draft_ns for b in blocks),
            "specdec.stop_reason": blocks[-1].stop_reason if blocks else "cancelled"},
            wait_ns=entry.wait_ns() if entry is not None else 0)

    async def Speculate(self, request, context):
        """The direct data plane: this request's rounds, run here against its target replica (speculate.py)."""
        async for resp in speculate(self, self.peers, request, context, PEER_TIMEOUT_S):
            yield resp

    # -- positions -----------------------------------------------------------------------------------------
    async def Rollback(self, request, context) -> draft_pb2.RollbackResponse:
        self._check_base(request.session_id, request.position, "position")
        pos = await self.host.runner.run(self._rollback, request.session_id, request.position)
        return draft_pb2.RollbackResponse(position=pos)

    def _rollback(self, sid: str, position: int) -> int:
        return self.worker.rollback(sid, position)

    async def Commit(self, request, context) -> draft_pb2.CommitResponse:
        sid = request.session_id
        self._check_base(sid, request.position, "position")
        held = await self.host.runner.run(self.worker.session_length, sid)
        if request.position > held:
            raise StalePositionError(f"position {request.position} is beyond the {held} tokens session {sid!r} "
                                     f"holds; commit at most {held}")
        self.committed[sid] = request.position
        self._forget_gone()
        return draft_pb2.CommitResponse(position=request.position)

    def _forget_gone(self) -> None:
        """Drop what is kept per session for sessions that expired or were evicted without an EndSession (a
        client that went away): bounded by twice the sessions a replica holds."""
        bound = 2 * self.host.table.max_sessions
        if len(self.committed) > bound:
            self.committed = {k: v for k, v in self.committed.items() if k in self.host.table}
        if len(self._latest) > bound:
            self._latest = {k: v for k, v in self._latest.items() if k in self.host.table}


def add_to_server(servicer: DraftServicer, server: grpc.aio.Server) -> None:
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)

"""An async DraftService client implementing `specdec.schedule.DraftBackend` over gRPC.

Used by the tests (drive the same schedule over the wire) and usable by the coordinator. Create it inside
the running event loop (grpc.aio channels bind to the loop that creates them).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from specdec_rpc.pb import draft_pb2, draft_pb2_grpc
from specdec.sampling import SamplingParams
from specdec_rpc.convert import draft_block, draft_request, features_to_proto, sampling_to_proto
from specdec.stop import StopSpec
from specdec.drafting import DraftBlock
from specdec.workers.base import TargetFeatures


class DraftClient:
    def __init__(self, channel: grpc.aio.Channel, timeout: float = 30.0):
        self.stub = draft_pb2_grpc.DraftServiceStub(channel)
        self.timeout = timeout
        self._streams: dict[str, grpc.aio.UnaryStreamCall] = {}
        self._cancelled: set = set()
        self.reads_features = False  # `probe()` asks the replica

    async def probe(self) -> None:
        info = await self.stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=self.timeout)
        self.reads_features = info.info.feature_size > 0

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    features: list[TargetFeatures] | None = None) -> None:
        await self.stub.StartSession(draft_pb2.DraftServiceStartSessionRequest(
            session_id=session_id, prompt_ids=prompt_ids, params=sampling_to_proto(params),
            features=[features_to_proto(f) for f in features or []]), timeout=self.timeout)

    async def draft(self, session_id: str, base_position: int, append: list[int], gamma_max: int, stop: StopSpec,
                    block_size: int, features: list[TargetFeatures] | None = None) -> DraftBlock:
        r = await self.stub.Draft(draft_request(draft_pb2.DraftRequest, session_id, base_position, append,
                                                gamma_max, stop, block_size, features), timeout=self.timeout)
        return draft_block(r)

    async def draft_stream(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
                           stop: StopSpec, block_size: int,
                           features: list[TargetFeatures] | None = None) -> AsyncIterator[DraftBlock]:
        call = self.stub.DraftStream(draft_request(draft_pb2.DraftStreamRequest, session_id, base_position, append,
                                                   gamma_max, stop, block_size, features), timeout=self.timeout)
        self._streams[session_id] = call
        try:
            async for r in call:
                yield draft_block(r)
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
            # our cancel() ends the stream like the in-process backend's; anything else propagates
            ours = call in self._cancelled and (isinstance(exc, asyncio.CancelledError)
                                                or exc.code() == grpc.StatusCode.CANCELLED)
            if not ours:
                raise
            self._cancelled.discard(call)
        finally:
            if self._streams.get(session_id) is call:
                del self._streams[session_id]

    async def cancel(self, session_id: str) -> None:
        call = self._streams.pop(session_id, None)
        if call is not None and not call.done():
            self._cancelled.add(call)
            call.cancel()  # the server stops drafting at its next token

    async def end(self, session_id: str) -> None:
        await self.stub.EndSession(draft_pb2.DraftServiceEndSessionRequest(session_id=session_id),
                                   timeout=self.timeout)

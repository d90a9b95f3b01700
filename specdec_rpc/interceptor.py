"""The one place where exceptions become gRPC status codes (servicers never try/except for this).

Core errors (specdec.common.errors) carry messages that say what to change; they are passed to the client
verbatim. Anything else is an INTERNAL error with the exception type and message (the traceback is logged).
Also records `specdec_rpc_latency_seconds{method}` for every call; for the bidirectional per-round streams
(`VerifyRounds`, `DraftRounds`: one response per request, in order) it records every message's latency
instead, from its request to its response.

When a drain's grace runs out (or a second signal comes), `cut_short` cancels the calls still running and each
ends with UNAVAILABLE and a message saying to retry, not gRPC's bare CANCELLED "Cancelling all calls" (which
clients do not retry, and which logged an ERROR traceback per call).

Requests are deserialized here, inside the handler, not by grpc before it: bytes that are not a valid message of
the method's request type (a string field that is not UTF-8, a truncated body) end with INVALID_ARGUMENT saying
what is wrong (specdec_rpc/wire.py), logged as one WARNING per `UNDECODABLE_LOG_S` at most, where grpc's own
deserializer answers UNKNOWN and logs an ERROR per request.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time

import grpc

from specdec.common import errors
from specdec_rpc.logs import bind
from specdec_rpc.wire import UndecodableRequest, deserialize

log = logging.getLogger(__name__)

STATUS_OF = {  # most specific first: isinstance order matters
    errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.SessionNotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.StalePositionError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ContextOverflowError: grpc.StatusCode.OUT_OF_RANGE,
    errors.CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ModelNotFoundError: grpc.StatusCode.NOT_FOUND,
}


class ServiceDraining(Exception):
    """Raised for new work while the server shuts down (→ UNAVAILABLE, safe to retry elsewhere)."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in STATUS_OF.items():
        if isinstance(exc, cls):
            return code, str(exc)
    if isinstance(exc, ServiceDraining):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or "server is shutting down; retry on another replica"
    if isinstance(exc, errors.SpecDecError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _method_name(full: str) -> str:
    return full.rsplit("/", 1)[-1]  # "/specdec.v1.TargetService/Verify" -> "Verify"


UNDECODABLE_LOG_S = 30.0  # at most one warning per this many seconds about requests that do not decode
CUT_SHORT = "the server shut down before this call finished (its drain's grace ran out); retry it"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics=None):
        self.metrics = metrics
        self.running: set[asyncio.Task] = set()  # the calls' handler tasks (health watches aside)
        self.cut = False
        self._undecodable_logged, self._undecodable_since = float("-inf"), 0

    def _decode(self, deserializer, data, method: str):
        """The request message of `data` (raw bytes; a message already when grpc deserialized it). Its session id
        (a replica call's; a per-round stream's message wraps it) is bound to the call's log lines."""
        if deserializer is None or not isinstance(data, (bytes, bytearray, memoryview)):
            return data
        try:
            request = deserialize(deserializer, data)
            sid = getattr(request, "session_id", None)
            if sid is None and method.endswith("Rounds"):
                sid = getattr(getattr(request, "verify" if method == "VerifyRounds" else "draft", None), "session_id",
                              None)
            if sid:
                # the coordinator names a request's sessions by its request id (a target-only rest: + "-ar")
                bind(session_id=sid, request_id=sid.removesuffix("-ar"))
            return request
        except UndecodableRequest as e:
            now = time.monotonic()
            self._undecodable_since += 1
            if now - self._undecodable_logged >= UNDECODABLE_LOG_S:
                log.warning("%s: %d request(s) that do not decode answered INVALID_ARGUMENT since the last such "
                            "warning; the latest: %s", method, self._undecodable_since, e)
                self._undecodable_logged, self._undecodable_since = now, 0
            raise

    def cut_short(self) -> int:
        """End every call still running with UNAVAILABLE (`CUT_SHORT`). → how many."""
        self.cut = True
        for task in self.running:
            task.cancel()
        return len(self.running)

    @contextlib.asynccontextmanager
    async def _tracked(self, context, method: str):
        """Track the call's task; a cancel from `cut_short` becomes UNAVAILABLE (any other cancel stays one)."""
        task = asyncio.current_task()
        if method not in ("Check", "Watch"):  # grpc's health servicer ends its watches itself when stopped
            self.running.add(task)
        try:
            yield
        except asyncio.CancelledError as e:
            await self._cancelled(context, e)
        finally:
            self.running.discard(task)

    async def _cancelled(self, context, cancel: asyncio.CancelledError):
        """A tracked call was cancelled: raise `cancel` again, unless `cut_short` sent it and the call can still be
        told, which ends it with UNAVAILABLE."""
        if not self.cut:
            raise cancel
        if context.done():  # the call ended already (its client went away): there is no one to tell
            raise cancel
        try:
            await context.abort(grpc.StatusCode.UNAVAILABLE, CUT_SHORT)  # counted by the caller's AbortError
        except grpc.aio.AbortError:
            raise
        except Exception:  # noqa: BLE001 - grpc could not send the status: the call is gone, end it as cancelled
            raise asyncio.CancelledError from None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = _method_name(handler_call_details.method)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self.wrap_unary(handler.unary_unary, method, handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.unary_stream:
            behavior = handler.unary_stream  # async generator, or a coroutine using context.write (health Watch)
            wrap = self._wrap_stream if inspect.isasyncgenfunction(behavior) else self.wrap_unary
            return grpc.unary_stream_rpc_method_handler(
                wrap(behavior, method, handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.stream_stream and method.endswith("Rounds"):
            return grpc.stream_stream_rpc_method_handler(
                self.wrap_rounds(handler.stream_stream, method, handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return handler  # other client-streaming RPCs (reflection): left untouched

    async def _abort(self, context, exc: Exception, method: str, request=None):
        code, message = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:  # the session names the request (the coordinator's request id + suffix)
            log.exception("%s failed (session %s)", method, getattr(request, "session_id", "") or "-")
        self._count_error(method, code)
        await context.abort(code, message)

    def _observe(self, method: str, t0: float):
        if self.metrics is not None:
            self.metrics.rpc_latency.labels(method).observe(time.perf_counter() - t0)

    def _count_error(self, method: str, code) -> None:
        if self.metrics is not None and code is not None and code != grpc.StatusCode.OK:
            self.metrics.rpc_errors.labels(method, code.name).inc()

    def _aborted(self, context, method: str) -> None:
        """A servicer's own context.abort: count the status it sent."""
        code = None
        with contextlib.suppress(Exception):  # context.code() is there from grpcio 1.38
            code = context.code()
        self._count_error(method, code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN)

    def wrap_unary(self, behavior, method, deserializer=None):
        """A unary handler with its errors mapped, the call tracked and timed (the frame port wraps its handlers
        here too, under the per-round stream's method name). The tracking is `_tracked`'s, written out: a verify or
        draft call runs through here every round, and the context manager's generator costs more than the rest."""
        tracked = method not in ("Check", "Watch")

        async def wrapped(request, context):
            t0 = time.perf_counter()
            task = asyncio.current_task()
            try:
                request = self._decode(deserializer, request, method)
                if tracked:
                    self.running.add(task)
                try:
                    return await behavior(request, context)
                except asyncio.CancelledError as e:
                    await self._cancelled(context, e)
                finally:
                    self.running.discard(task)
            except grpc.aio.AbortError:
                self._aborted(context, method)
                raise
            except Exception as exc:  # noqa: BLE001 - this is the mapping point
                await self._abort(context, exc, method, request)
            finally:
                self._observe(method, t0)
        return wrapped

    def _wrap_stream(self, behavior, method, deserializer=None):
        async def wrapped(request, context):
            t0 = time.perf_counter()
            try:
                request = self._decode(deserializer, request, method)
                async with self._tracked(context, method):
                    async for item in behavior(request, context):
                        yield item
            except grpc.aio.AbortError:
                self._aborted(context, method)
                raise
            except Exception as exc:  # noqa: BLE001
                await self._abort(context, exc, method, request)
            finally:
                self._observe(method, t0)
        return wrapped

    def wrap_rounds(self, behavior, method, deserializer=None):
        """A per-round stream answers each request before reading the next, so a message's latency runs from
        pulling its request off the stream to yielding its response."""
        async def wrapped(request_iterator, context):
            pulled: list[float] = []

            async def timed():
                async for req in request_iterator:
                    pulled.append(time.perf_counter())
                    yield self._decode(deserializer, req, method)

            try:
                async with self._tracked(context, method):
                    async for item in behavior(timed(), context):
                        if pulled:  # the oldest request pulled is the one answered (requests may be read ahead)
                            self._observe(method, pulled.pop(0))
                        yield item
            except grpc.aio.AbortError:
                self._aborted(context, method)
                raise
            except Exception as exc:  # noqa: BLE001
                await self._abort(context, exc, method)
        return wrapped

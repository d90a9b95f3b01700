"""The HTTP door's plumbing for generations in flight: a request's work cancelled when its client goes away, the
choices' streams merged, and server-sent events. Pure asyncio and starlette types, no API shapes."""
from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import Request
from fastapi.responses import StreamingResponse

from coordinator.http_api.backend import CLIENT_CLOSED, ApiError
from coordinator.tracing import TRACE_HEADERS


async def until_disconnected(request: Request, work):
    """Await `work`; cancel it if the client disconnects first (then raise ApiError 499)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ApiError(CLIENT_CLOSED, "the client disconnected")
    return task.result()


async def merged(firsts, streams):
    """(choice index, response) from every choice's stream as they come; the first error ends them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, first, events):
        try:
            await queue.put((i, first))
            async for resp in events:
                await queue.put((i, resp))
            await queue.put((i, None))
        except ApiError as e:
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, f, e)) for i, (f, e) in enumerate(zip(firsts, streams))]
    try:
        open_ = len(tasks)
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for events in streams:
            with contextlib.suppress(BaseException):
                await events.aclose()


async def gather_all(coros):
    """Every result, in order; or the first error, with the others cancelled (asyncio.gather leaves them running)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_responses(request: Request, streams) -> list:
    """Each stream's first response, before the headers are sent: a request refused at once gets its HTTP status,
    not a 200 stream. On any error every stream is closed."""
    async def first(events):
        try:
            return await anext(events)
        except StopAsyncIteration:
            raise ApiError(500, "the generation ended without an answer") from None

    try:
        return await until_disconnected(request, gather_all(first(e) for e in streams))
    except BaseException:
        for events in streams:
            with contextlib.suppress(BaseException):
                await events.aclose()
        raise


def trace_metadata(request: Request) -> list[tuple[str, str]]:
    """The request's W3C trace-context headers, as gRPC metadata would carry them (coordinator/tracing.py)."""
    return [(k, request.headers[k]) for k in TRACE_HEADERS if k in request.headers]


def sse_response(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, separators=(',', ':'))}\n\n"

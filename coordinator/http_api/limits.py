"""The OpenAI-compatible HTTP API's checks before a request reaches FastAPI (the API key, body size, requests in
flight, draining, the X-Request-Id header) and its request counter after it: an ASGI middleware."""
from __future__ import annotations

import asyncio
import hmac
import logging
import uuid

from coordinator.http_api.backend import ApiError
from coordinator.grpc_api.chat_prompt import REQUEST_ID
from specdec_rpc.aio import within

log = logging.getLogger("coordinator.http_api.app")
OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json", "/docs")  # probes, scrapers, the schema: no key
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/{id}", "/v1/models",
          "/v1/models/{id}", "/tokenize", "/detokenize", "/health", "/metrics", "/version", "/openapi.json", "/docs")


class Limits:
    """Body size, requests in flight and draining checks before a request reaches FastAPI, and the request counter
    after it."""

    def __init__(self, app, door):
        self.app, self.door = app, door

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        headers = dict(scope["headers"])
        rid, valid_rid = _request_id(headers)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message, headers=list(message.get("headers", [])) + [(b"x-request-id",
                                                                                    rid.encode())])
            await send(message)

        door, path = self.door, scope["path"]
        size = headers.get(b"content-length", b"")
        error = _refusal(door, scope, headers, valid_rid)
        body = None
        if error is None and size.isdigit() and int(size):
            # the whole body before the request counts as in flight, within a time limit: a client that sends
            # headers and then dribbles (or never sends) its body held a slot for as long as it liked
            body, error = await read_body(receive, int(size), door.client_timeout_s)
        if error is not None:
            # answered before its body was read: close the connection, or the unread body reads as the next request
            send_status = closing(send_status)
        counted = error is None and scope["method"] == "POST"
        door.in_flight += counted
        try:
            app = error.response() if error else self.app
            await app(scope, replay(body, receive) if body is not None else receive,
                      stalled_after(send_status, door.client_timeout_s))
        except StalledClient as e:  # its generation was cancelled with the response; the connection closes
            log.info("%s %s (request %s): %s; gave up on it", scope["method"], path, rid, e)
        finally:
            door.in_flight -= counted
            _count_request(door, path, status["code"])


def _request_id(headers: dict) -> tuple[str, bool]:
    """The request's id (its log lines, its replica sessions' ids, the answer's id): the client's X-Request-Id when
    valid, else a new one; and whether the client's header (if any) was valid."""
    rid = headers.get(b"x-request-id", b"").decode("latin-1")
    valid_rid = not rid or REQUEST_ID.fullmatch(rid)
    rid = rid if valid_rid else ""
    return rid or uuid.uuid4().hex, valid_rid


def _refusal(door, scope, headers: dict, valid_rid) -> ApiError | None:
    """The error that answers the request before its body is read (bad request id, wrong key, no or too large
    Content-Length, draining, too many in flight), the first that applies; None when it may go on."""
    path, post = scope["path"], scope["method"] == "POST"
    size = headers.get(b"content-length", b"")
    chunked = b"transfer-encoding" in headers  # with a Content-Length too, h11 reads it chunked: unbounded
    if not valid_rid:
        return ApiError(400, "X-Request-Id: at most 64 letters, digits and . _ : -", "X-Request-Id")
    if door.api_key and path not in OPEN_PATHS and not hmac.compare_digest(
            headers.get(b"authorization", b""), f"Bearer {door.api_key}".encode()):
        # before the body is read: a request without the key learns nothing, not even whether its body parses
        return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                        code="invalid_api_key")
    if (post and not size.isdigit()) or chunked:
        return ApiError(411, "send the body with a Content-Length header (chunked bodies are not accepted)")
    if size.isdigit() and int(size) > door.max_body_bytes:
        return ApiError(413, f"the body has {int(size)} bytes; the limit is {door.max_body_bytes} "
                             f"(COORDINATOR_MAX_MESSAGE_BYTES)")
    if door.is_draining() and path.startswith("/v1/"):
        return ApiError(503, "the coordinator is shutting down; retry on another replica")
    if post and door.in_flight >= door.max_in_flight:
        return ApiError(429, f"{door.in_flight} HTTP requests are in flight, the limit "
                             f"(COORDINATOR_HTTP_MAX_IN_FLIGHT); retry later", code="too_many_requests")
    return None


def _count_request(door, path: str, code: int) -> None:
    """Counts the answered request by its route (the path with its id folded; "other" off the API) and status."""
    if door.requests is not None:
        route = next((f"{p}{{id}}" for p in ("/v1/responses/", "/v1/models/") if path.startswith(p)), path)
        door.requests.labels(route if route in ROUTES else "other", str(code)).inc()


async def read_body(receive, size: int, timeout_s: float) -> tuple[bytes | None, ApiError | None]:
    """The request's body (`size` bytes, its Content-Length), read within `timeout_s`; or the error to answer."""
    parts = []

    async def read() -> ApiError | None:
        got = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return ApiError(400, "the connection closed before the body arrived")
            parts.append(message.get("body", b""))
            got += len(parts[-1])
            if got > size:
                return ApiError(400, f"the body is longer than its Content-Length ({size})")
            if not message.get("more_body", False):
                return None

    try:
        error = await within(read(), timeout_s)
    except asyncio.TimeoutError:
        error = ApiError(408, f"the body did not arrive within {timeout_s:g} s (COORDINATOR_HTTP_CLIENT_TIMEOUT_S)")
    return (None, error) if error is not None else (b"".join(parts), None)


def replay(body: bytes, receive):
    """The ASGI receive of a body already read: it once, then the connection's own messages (a disconnect)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return receive_again


def closing(send):
    async def send_closing(message):
        if message["type"] == "http.response.start":
            message = dict(message, headers=list(message.get("headers", [])) + [(b"connection", b"close")])
        await send(message)
    return send_closing


class StalledClient(Exception):
    """A client that took no data for too long: its response ends, and with it its generation."""


def stalled_after(send, timeout_s: float):
    """`send` that gives up on a client not taking a piece of the response within `timeout_s` (a stream whose
    reader stopped reading held its slot, and its output in memory, for as long as the connection stayed open)."""
    async def send_or_give_up(message):
        try:
            await within(send(message), timeout_s)
        except asyncio.TimeoutError:
            raise StalledClient(f"the client took no data for {timeout_s:g} s") from None
    return send_or_give_up

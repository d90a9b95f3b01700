"""The OpenAI-compatible HTTP API's checks before a request reaches FastAPI (the API key, body size, requests in
flight, draining, the X-Request-Id header) and its request counter after it: an ASGI middleware."""
from __future__ import annotations

import hmac
import uuid

from coordinator.openai_backend import ApiError
from coordinator.chat_prompt import REQUEST_ID

OPEN_PATHS = ("/health", "/metrics", "/version")  # probes and scrapers: no API key
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/{id}", "/v1/models",
          "/v1/models/{id}", "/tokenize", "/detokenize", "/health", "/metrics")


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
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        valid_rid = not rid or REQUEST_ID.fullmatch(rid)
        rid = rid if valid_rid else ""
        rid = rid or uuid.uuid4().hex  # the request's id: its log lines, its replica sessions' ids, the answer's id
        scope.setdefault("state", {})["request_id"] = rid

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message, headers=list(message.get("headers", [])) + [(b"x-request-id",
                                                                                    rid.encode())])
            await send(message)

        door, path = self.door, scope["path"]
        size = headers.get(b"content-length", b"")
        error = None
        if not valid_rid:
            error = ApiError(400, "X-Request-Id: at most 64 letters, digits and . _ : -", "X-Request-Id")
        elif door.api_key and path not in OPEN_PATHS and not hmac.compare_digest(
                headers.get(b"authorization", b""), f"Bearer {door.api_key}".encode()):
            # before the body is read: a request without the key learns nothing, not even whether its body parses
            error = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
        elif scope["method"] == "POST" and not size.isdigit():
            error = ApiError(411, "send the body with a Content-Length header (chunked bodies are not accepted)")
        elif size.isdigit() and int(size) > door.max_body_bytes:
            error = ApiError(413, f"the body has {int(size)} bytes; the limit is {door.max_body_bytes} "
                                  f"(COORDINATOR_MAX_MESSAGE_BYTES)")
        elif door.is_draining() and path.startswith("/v1/"):
            error = ApiError(503, "the coordinator is shutting down; retry on another replica")
        elif scope["method"] == "POST" and door.in_flight >= door.max_in_flight:
            error = ApiError(429, f"{door.in_flight} HTTP requests are in flight, the limit "
                                  f"(COORDINATOR_HTTP_MAX_IN_FLIGHT); retry later", code="too_many_requests")
        counted = error is None and scope["method"] == "POST"
        door.in_flight += counted
        try:
            await (error.response() if error else self.app)(scope, receive, send_status)
        finally:
            door.in_flight -= counted
            if door.requests is not None:
                route = next((f"{p}{{id}}" for p in ("/v1/responses/", "/v1/models/") if path.startswith(p)), path)
                door.requests.labels(route if route in ROUTES else "other", str(status["code"])).inc()

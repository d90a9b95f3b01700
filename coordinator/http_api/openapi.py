"""The HTTP door's OpenAPI 3 document (`GET /openapi.json`; `GET /docs` renders it), as FastAPI derives it from the
routes and their bodies (coordinator/http_api/schema.py), with what FastAPI cannot see added:

- errors: every answer that is not a success has OpenAI's error shape, `{"error": {"message", "type", "param",
  "code"}}`; an invalid body is a 400 (not FastAPI's 422), and the checks before a route (coordinator/http_api/
  limits.py) answer 401, 408, 411, 413, 429 and 503;
- the API key: with one set, every route but the open ones (/health, /metrics, /version and the schema itself)
  takes `Authorization: Bearer <key>` (the `bearer` security scheme);
- the streams: `stream: true` answers with server-sent events (`text/event-stream`).
"""
from __future__ import annotations

from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "title": "Error",
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                       "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}
ERROR_REF = {"$ref": "#/components/schemas/Error"}
DESCRIPTIONS = {"400": "The request is invalid (the message names the field), or its prompt is longer than the "
                       "context (code context_length_exceeded)",
                "401": "Missing or wrong API key", "404": "No such model or stored response",
                "408": "The body did not arrive in time", "411": "No Content-Length",
                "413": "The body is over the size limit", "429": "Too many requests in flight",
                "499": "The client went away", "500": "An unexpected failure", "503": "Shutting down, or no replica",
                "504": "A replica did not answer in time"}
POST_ERRORS = ("400", "401", "404", "408", "411", "413", "429", "503")
GENERATION_ERRORS = ("500", "504")
STREAMED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def openapi_document(app, open_paths: tuple[str, ...], api_key: bool) -> dict:
    """The door's OpenAPI document (cached on `app` by FastAPI's `app.openapi`)."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422: this door answers 400 instead
        schemas.pop(name, None)
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                "description": "the server's API key (COORDINATOR_HTTP_API_KEY), "
                                                               "when one is set"}}
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = list(POST_ERRORS if method == "post" else ("400", "401", "404", "503"))
            if path in STREAMED:
                codes += GENERATION_ERRORS
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})["text/event-stream"] = {
                    "schema": {"type": "string", "description": "with stream: true, server-sent events (`data: "
                                                                "{json}` lines, the last `data: [DONE]`)"}}
            if path in open_paths:
                codes = []
                op["security"] = []
            elif api_key:
                op["security"] = [{"bearer": []}]
            else:
                op["security"] = [{}, {"bearer": []}]  # no key set: the header is optional (and ignored)
            if path == "/health":
                responses["503"] = {"description": "Draining", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"status": {"type": "string", "enum": ["draining"]}}}}}}
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus metrics",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
            for code in codes:
                responses.setdefault(code, {"description": DESCRIPTIONS[code],
                                            "content": {"application/json": {"schema": ERROR_REF}}})
    return doc

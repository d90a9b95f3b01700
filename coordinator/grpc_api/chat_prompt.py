"""A GenerateRequest's chat side, for the coordinator: its messages and chat-template fields as the chat template
takes them (specdec/text/tokenizer.py renders them), the request ids clients may send, and the log line of a finished
request. Pure: the generated proto, no grpc."""
from __future__ import annotations

import json
import logging
import re

from coordinator.events import RequestStats
from specdec.common.errors import InvalidRequestError
from specdec.scheduling import field_rules
from specdec_rpc.pb import generation_pb2


def chat_message(m: generation_pb2.ChatMessage) -> dict:
    """A ChatMessage → the chat template's dict (`tool_calls` parsed; specdec/text/tokenizer.py adapts them)."""
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        try:
            calls = json.loads(m.tool_calls)
        except ValueError:
            calls = None
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise InvalidRequestError("messages", "an assistant message's tool_calls must be a JSON list of "
                                                  "OpenAI tool calls")
        out["tool_calls"] = calls
    for name in ("tool_call_id", "name"):
        if value := getattr(m, name):
            out[name] = value
    if m.reasoning:  # the name Qwen3's and DeepSeek's templates read
        out["reasoning_content"] = m.reasoning
    return out


# the request_id rule (specdec/scheduling/field_rules.py), for X-Request-Id
REQUEST_ID = re.compile(field_rules.REQUEST_ID)
requests_log = logging.getLogger("coordinator.requests")  # one INFO line per finished request


def request_timings(stats: RequestStats, wall_s: float) -> dict[str, float]:
    """The per-request times a finished request's line carries as fields (JSON logs: `timings`)."""
    return {"queued_s": stats.queued_s, "draft_busy_s": stats.draft_busy_s, "target_busy_s": stats.target_busy_s,
            "draft_network_s": stats.draft_network_s, "target_network_s": stats.target_network_s,
            "peer_network_s": stats.peer_network_s, "wall_s": wall_s}


def log_request(stats: RequestStats, finish: str, wall_s: float) -> None:
    """A request's one line once it ends (generated to its end, or its client went away: `finish` abort)."""
    if requests_log.isEnabledFor(logging.INFO):
        n, forwards = stats.completion_tokens, stats.target_forwards
        requests_log.info("request %s: %s, %d prompt (%d cached) + %d completion tokens, finish %s, %.3f s, %.2f "
                          "tokens per target forward, target %s, draft %s", stats.request_id, stats.mode,
                          stats.prompt_tokens, stats.cached_prompt_tokens, n, finish, wall_s,
                          n / forwards if forwards else 0.0, stats.target_replica or "-",
                          stats.draft_replica or "-", extra={
                              "request_id": stats.request_id, "mode": stats.mode, "finish": finish,
                              "prompt_tokens": stats.prompt_tokens, "completion_tokens": n,
                              "target_replica": stats.target_replica, "draft_replica": stats.draft_replica,
                              "timings": request_timings(stats, wall_s)})


def log_failure(request_id: str, code: str, message: str, wall_s: float) -> None:
    """A failed request's one line: the client's mistakes at INFO, the service's failures at WARNING (the
    SpecdecRequestErrors alert points here)."""
    level = logging.WARNING if code in ("UNAVAILABLE", "INTERNAL", "DEADLINE_EXCEEDED", "UNKNOWN") else logging.INFO
    if requests_log.isEnabledFor(level):
        requests_log.log(level, "request %s: failed %s after %.3f s: %s", request_id, code, wall_s,
                         message if len(message) <= 300 else message[:300] + "...",
                         extra={"request_id": request_id, "code": code, "timings": {"wall_s": wall_s}})


def template_options(r: generation_pb2.GenerateRequest):
    """GenerateRequest's chat-template fields → (tools or None, TemplateOptions); they apply to `messages` only."""
    from specdec.text.tokenizer import TemplateOptions

    def loads(name: str, kind: type):
        text = getattr(r, name)
        try:
            value = json.loads(text) if text else None
        except ValueError:
            value = None
        if text and not isinstance(value, kind):
            what = "list of tool definitions (OpenAI's)" if name == "tools" else "object of template variables"
            raise InvalidRequestError(name, f"must be a JSON {what}")
        return value

    tools, kwargs = loads("tools", list), loads("chat_template_kwargs", dict) or {}
    template = TemplateOptions(r.add_generation_prompt if r.HasField("add_generation_prompt") else True,
                               r.continue_final_message, kwargs)
    if tools and not r.messages:
        raise InvalidRequestError("tools", "the chat template shows them to the model: send messages")
    if template != TemplateOptions() and not r.messages:
        name = ("continue_final_message" if r.continue_final_message else
                "chat_template_kwargs" if r.chat_template_kwargs else "add_generation_prompt")
        raise InvalidRequestError(name, "applies to the chat template: send messages")
    return tools, template

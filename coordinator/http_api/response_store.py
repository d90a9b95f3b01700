"""Stored responses of the Responses API (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`), kept
in the coordinator's memory as vLLM keeps them: bounded in count (the least recently used go first) and in idle
time.

A stored response keeps its `response` object and its conversation: the input items it was generated from (an
earlier response's conversation first, when it continued one) and its output items. A request that names it as
`previous_response_id` continues that conversation: its input items come after it, and its `instructions` are its
own (OpenAI's rule: the earlier response's instructions are not carried over). Pure: no web framework.

The store is one coordinator process's: behind several coordinator replicas, a follow-up must reach the replica
that answered (session affinity), or the conversation be sent whole.
"""
from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # what it was generated from, each with an id
    output_items: list[dict[str, Any]]
    used_at: float = field(default=0.0)  # when it was stored or last read
    size: int = 0  # its JSON's bytes, about what it holds in memory

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """Input then output items: the history a follow-up continues."""
        return self.input_items + self.output_items


def as_items(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as OpenAI lists input items: each with an id, a message's text as a list of parts."""
    items = [{"type": "message", "role": "user", "content": input_}] if isinstance(input_, str) else input_
    out = []
    for item in items:
        item = dict(item)
        message = item.setdefault("type", "message") == "message"
        if message and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("id", f"{'msg' if message else 'item'}_{uuid.uuid4().hex}")
        out.append(item)
    return out


class ResponseStore:
    """At most `max_responses` responses (0: no store) of at most `max_bytes` in all, each kept until `ttl_s`
    seconds pass without its use. A conversation continued turn by turn stores its history again with each turn,
    so the bytes are bounded too: a response larger than `max_bytes` alone is not kept."""

    def __init__(self, max_responses: int, ttl_s: float, max_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic):
        self.max_responses, self.ttl_s, self.max_bytes, self.clock = max_responses, ttl_s, max_bytes, clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def describe(self) -> str:
        """How long and how many, for the messages of a lookup that found nothing."""
        return (f"this coordinator keeps a stored response {self.ttl_s:g} s after its last use, at most "
                f"{self.max_responses} of {self.max_bytes >> 20} MiB in all (COORDINATOR_RESPONSES_STORE_TTL_S, "
                f"COORDINATOR_RESPONSES_STORE, COORDINATOR_RESPONSES_STORE_MAX_MB)")

    def put(self, rid: str, response: dict, input_items: list[dict], output_items: list[dict]) -> bool:
        """Keep it (the least recently used go to make room); False: too large to keep."""
        if not self.enabled:
            return False
        self._drop(rid)
        size = len(json.dumps([response, input_items, output_items], separators=(",", ":")))
        if size > self.max_bytes:
            return False
        self._items[rid] = StoredResponse(copy.deepcopy(response), copy.deepcopy(input_items),
                                          copy.deepcopy(output_items), self.clock(), size)
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        return True

    def _drop(self, rid: str) -> bool:
        gone = self._items.pop(rid, None)
        self.bytes -= gone.size if gone is not None else 0
        return gone is not None

    def get(self, rid: str) -> StoredResponse | None:
        self._expire()
        found = self._items.get(rid)
        if found is not None:
            self._items.move_to_end(rid)
            found.used_at = self.clock()
        return found

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._drop(rid)

    def _expire(self) -> None:
        now = self.clock()
        while self._items:
            rid, oldest = next(iter(self._items.items()))
            if now - oldest.used_at < self.ttl_s:
                break
            self._drop(rid)


def items_page(items: list[dict], *, order: str = "desc", after: str | None = None, limit: int = 20) -> dict:
    """OpenAI's `input_items` list: newest first by default, `limit` of them after the item `after`."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise KeyError(after)
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}

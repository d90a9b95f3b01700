"""Stored responses (coordinator/http_api/response_store.py): the store's bounds, and over the wire with the official `openai`
client, `previous_response_id` continuing a conversation exactly as if it had been sent whole, retrieve, input items,
delete, streamed responses, `store: false`, and a coordinator that keeps none."""
from __future__ import annotations

import openai
import pytest

from coordinator.http_api.response_store import ResponseStore, as_items, items_page
from tests.test_openai_http import KEY, MODEL, api  # noqa: F401 (the module-scoped stack fixture)

module_loop = pytest.mark.asyncio(loop_scope="module")
GREEDY = dict(model=MODEL, temperature=0, max_output_tokens=10, extra_body={"mode": "sd"})


def test_store_keeps_the_most_recently_used_and_drops_idle_ones():
    now = [0.0]
    store = ResponseStore(2, ttl_s=10, clock=lambda: now[0])
    for rid in ("a", "b"):
        store.put(rid, {"id": rid}, [], [])
    now[0] = 5
    assert store.get("a").response == {"id": "a"}  # a read keeps it: b is now the least recently used
    store.put("c", {"id": "c"}, [], [])
    assert store.get("b") is None and len(store) == 2
    now[0] = 14  # a was read at 5, c stored at 5: both idle 9 s
    assert store.get("a") is not None
    now[0] = 15.5  # c idle 10.5 s, a 1.5 s
    assert store.get("c") is None and store.get("a") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 0
    off = ResponseStore(0, 10)
    off.put("x", {}, [], [])
    assert not off.enabled and off.get("x") is None


def test_store_bounds_its_bytes():
    store = ResponseStore(100, ttl_s=60, max_bytes=600)
    item = [{"type": "message", "role": "user", "content": "x" * 200}]
    assert store.put("a", {}, item, []) and store.put("b", {}, item, [])
    assert store.bytes == 2 * store.get("a").size > 400
    assert store.put("c", {}, item, [])  # 3 × ~230 bytes > 600: the least recently used (b) goes
    assert store.get("b") is None and store.get("a") is not None and store.bytes <= 600
    assert not store.put("big", {}, [{"content": "y" * 700}], []) and store.get("big") is None
    assert store.delete("a") and store.delete("c") and store.bytes == 0


def test_stored_items_are_copies_and_pages_list_them():
    items = as_items([{"role": "user", "content": "a"}, {"type": "function_call_output", "call_id": "c",
                                                          "output": "o", "id": "keep"}])
    assert items[0]["id"].startswith("msg_") and items[1]["id"] == "keep"
    assert items[0]["content"] == [{"type": "input_text", "text": "a"}] and items[0]["type"] == "message"
    assert as_items([{"role": "assistant", "content": "b"}])[0]["content"] == [{"type": "output_text", "text": "b"}]
    store = ResponseStore(4, 60)
    out = [{"type": "message", "id": "m"}]
    store.put("r", {"id": "r"}, items, out)
    out[0]["id"] = "changed"
    assert store.get("r").output_items[0]["id"] == "m" and len(store.get("r").conversation) == 3
    more = as_items([{"role": "user", "content": str(i)} for i in range(5)])
    page = items_page(more, limit=2)
    assert [x["content"][0]["text"] for x in page["data"]] == ["4", "3"] and page["has_more"]
    page = items_page(more, order="asc", after=more[1]["id"], limit=5)
    assert [x["content"][0]["text"] for x in page["data"]] == ["2", "3", "4"] and not page["has_more"]
    assert page["first_id"] == more[2]["id"] and page["last_id"] == more[4]["id"]
    with pytest.raises(KeyError):
        items_page(more, after="nope")


@module_loop
async def test_previous_response_id_continues_the_conversation_exactly(api):
    first = await api.client.responses.create(input="hello there", instructions="be brief", **GREEDY)
    assert first.model_extra["store"] is True or first.store is True
    second = await api.client.responses.create(input="and more", previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id
    # the same conversation sent whole, without storing it: the first turn's instructions are not carried over
    whole = await api.client.responses.create(
        input=[{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "and more"}], store=False, **GREEDY)
    assert second.output_text == whole.output_text and second.usage.input_tokens == whole.usage.input_tokens
    assert whole.store is False
    chat = await api.client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=10, extra_body={"mode": "sd"},
        messages=[{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "and more"}])
    assert second.output_text == chat.choices[0].message.content
    third = await api.client.responses.create(input="last", previous_response_id=second.id, **GREEDY)
    items = await api.client.responses.input_items.list(third.id, order="asc")
    roles = [(i.type, getattr(i, "role", None)) for i in items.data]
    assert roles == [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant"),
                     ("message", "user")]
    assert items.data[3].content[0].text == second.output_text and items.data[4].content[0].text == "last"
    newest = await api.client.responses.input_items.list(third.id, limit=1)
    assert newest.data[0].content[0].text == "last" and newest.has_more


@module_loop
async def test_retrieve_delete_and_what_is_not_stored(api):
    made = await api.client.responses.create(input="hello", **GREEDY)
    got = await api.client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    gone = await api.client.responses.delete(made.id)
    assert gone is None or getattr(gone, "deleted", True)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        await api.client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as err:
        await api.client.responses.create(input="x", previous_response_id=made.id, **GREEDY)
    assert err.value.body["param"] == "previous_response_id" and "COORDINATOR_RESPONSES_STORE" in err.value.message
    private = await api.client.responses.create(input="hello", store=False, **GREEDY)
    assert private.store is False
    with pytest.raises(openai.NotFoundError):
        await api.client.responses.retrieve(private.id)
    r = await api.http.get(f"/v1/responses/{private.id}/input_items", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    metrics = (await api.http.get("/metrics")).text
    stored = float(next(line.split()[1] for line in metrics.splitlines()
                        if line.startswith("specdec_responses_stored ")))
    assert stored >= 1 and "specdec_responses_stored_bytes" in metrics


@module_loop
async def test_a_streamed_response_is_stored_when_it_completes(api):
    events = [e async for e in await api.client.responses.create(input="hello", stream=True, **GREEDY)]
    final = events[-1].response
    assert final.store is True
    got = await api.client.responses.retrieve(final.id)
    assert got.output_text == final.output_text and got.status == final.status
    follow = await api.client.responses.create(input="again", previous_response_id=final.id, **GREEDY)
    whole = await api.client.responses.create(
        input=[{"role": "user", "content": "hello"}, {"role": "assistant", "content": final.output_text},
               {"role": "user", "content": "again"}], store=False, **GREEDY)
    assert follow.output_text == whole.output_text


@module_loop
async def test_a_coordinator_without_a_store_refuses_store_true(api):
    auth = {"Authorization": f"Bearer {KEY}"}
    url = api.urls["keyed"]
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    r = await api.http.post(f"{url}/v1/responses", json={**body, "store": True}, headers=auth)
    assert r.status_code == 400 and "COORDINATOR_RESPONSES_STORE=0" in r.json()["error"]["message"]
    r = await api.http.post(f"{url}/v1/responses", json=body, headers=auth)
    assert r.status_code == 200 and r.json()["store"] is False
    assert (await api.http.get(f"{url}/v1/responses/{r.json()['id']}")).status_code == 401  # the key first
    assert (await api.http.get(f"{url}/v1/responses/{r.json()['id']}", headers=auth)).status_code == 404

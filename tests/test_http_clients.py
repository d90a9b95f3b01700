"""Slow, stalled or lying HTTP clients, found by an audit (each of these held the door before): a
body with both Content-Length and chunked framing went past the size limit; a body that never arrived held an
in-flight slot; a connection that never sent its headers stayed open; a stream whose reader stopped kept its slot
and its whole output; an answer sent before the body was read left the connection open, so the unread body read as
the next request."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import pytest_asyncio

from coordinator.config import CoordinatorSettings
from coordinator.server import build_coordinator
from coordinator.stack import free_port
from tests.helpers_models import start_replica, tiny_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")
TIMEOUT = 1.5  # COORDINATOR_HTTP_CLIENT_TIMEOUT_S here


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def door():
    target, draft = tiny_pair()
    t = await start_replica("target", target)
    d = await start_replica("draft", draft, preverifier="random")
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, max_new_tokens_cap=4096,
                            log_level="WARNING", http_port=free_port(), served_model_name="tiny",
                            http_max_in_flight=2, max_message_bytes=64 * 1024, http_client_timeout_s=TIMEOUT)
    app, _ = await build_coordinator(s, eos_token_ids=set())
    await app.start()
    yield app, t, d
    for a in (app, t, d):
        await a.shutdown(0)


def in_flight(app) -> int:
    return app.http_door.in_flight


async def raw(port: int, data: bytes, read: bool = True, timeout: float = 10.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        return await asyncio.wait_for(r.read(), timeout) if read else b""  # to the close the answers ask for
    finally:
        w.close()


async def ok(port: int) -> int:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        r = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        return r.status_code


async def test_a_chunked_body_is_refused_even_with_a_content_length(door):
    app, _, _ = door
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    out = await raw(app.http_port, head + b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
    assert out.startswith(b"HTTP/1.1 411") and b"connection: close" in out.lower(), out[:300]


async def test_a_body_that_never_arrives_times_out_and_holds_no_slot(door):
    app, _, _ = door
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
            b"\r\n{\"prompt\"")
    slow = [asyncio.ensure_future(raw(app.http_port, head)) for _ in range(3)]  # more than http_max_in_flight
    await asyncio.sleep(0.3)
    assert await ok(app.http_port) == 200, "slow bodies count as in flight only once they have arrived"
    outs = await asyncio.gather(*slow)
    assert all(o.startswith(b"HTTP/1.1 408") and b"connection: close" in o.lower() for o in outs), outs[0][:300]
    assert b"COORDINATOR_HTTP_CLIENT_TIMEOUT_S" in outs[0]


async def test_a_connection_that_sends_no_headers_is_closed(door):
    app, _, _ = door
    t0 = time.monotonic()
    for partial in (b"", b"POST /v1/compl"):
        r, w = await asyncio.open_connection("127.0.0.1", app.http_port)
        w.write(partial)
        await w.drain()
        assert await asyncio.wait_for(r.read(), TIMEOUT + 5) == b"", "closed without an answer"
        w.close()
    assert time.monotonic() - t0 < 2 * (TIMEOUT + 2)
    # a kept-alive connection gets the same limit for its next request's headers, and none while it is served
    r, w = await asyncio.open_connection("127.0.0.1", app.http_port)
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await w.drain()
    assert (await r.readuntil(b"}")).startswith(b"HTTP/1.1 200")
    assert await asyncio.wait_for(r.read(), TIMEOUT + 5) == b""
    w.close()


async def test_an_early_answer_closes_the_connection_so_its_body_is_not_the_next_request(door):
    app, _, _ = door
    big = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 10000000\r\n\r\n")
    out = await raw(app.http_port, big)
    assert out.startswith(b"HTTP/1.1 413") and b"connection: close" in out.lower(), out[:300]


async def test_a_stream_whose_reader_stops_is_given_up(door):
    app, t, d = door
    # ~3 MB of events (16 choices × 250 tokens, 20 alternatives each): more than the sockets' buffers hold
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 250, "n": 16, "logprobs": 20, "stream": True,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", app.http_port))
    r, w = await asyncio.open_connection(sock=sock, limit=1024)
    w.write(head + body)
    await w.drain()
    await r.read(100)  # the headers arrive; then this client reads nothing more
    w.transport.pause_reading()
    t0 = deadline = time.monotonic()
    deadline += 60
    await asyncio.sleep(0.2)
    assert in_flight(app) == 1, "the stream is under way"
    while in_flight(app) or t.host.table or d.host.table:
        assert time.monotonic() < deadline, (in_flight(app), len(t.host.table), len(d.host.table))
        await asyncio.sleep(0.1)
    assert time.monotonic() - t0 >= TIMEOUT * 0.8, "it ended by the stall timeout, not by finishing"
    assert await ok(app.http_port) == 200
    w.close()

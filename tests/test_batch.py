"""`specdec batch` (specdec_cli/batch.py): OpenAI Batch API files answered through the HTTP API, in the input's order,
with refused requests and lines that are not requests reported per line; in-flight requests bounded."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from specdec_cli.batch import http_poster, main, run_batch
from tests.test_openai_http import MESSAGES, MODEL, api  # noqa: F401 (the module-scoped stack fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


async def test_a_batch_is_answered_in_order(api):
    chat = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 8}
    lines = [line("chat", "/v1/chat/completions", chat),
             line("text", "/v1/completions", {"model": MODEL, "prompt": "once upon a", "temperature": 0,
                                              "max_tokens": 6}),
             line("resp", "/v1/responses", {"model": MODEL, "input": "hello", "max_output_tokens": 4}),
             "{not json",
             line("other", "/v1/embeddings", {}),
             line("chat", "/v1/chat/completions", chat),  # a repeated custom_id
             line("streamed", "/v1/completions", {"model": MODEL, "prompt": "a", "stream": True}),
             line("too-many", "/v1/chat/completions", {**chat, "n": 17}),
             line("get", "/v1/completions", {"prompt": "a"}, method="GET")]
    out = []
    async with httpx.AsyncClient(base_url=api.urls["open"], timeout=60) as client:
        counts = await run_batch(lines, http_poster(client), 2, out.append)
    assert counts == {"ok": 3, "failed": 1, "invalid": 5}
    assert [r["custom_id"] for r in out] == ["chat", "text", "resp", None, "other", "chat", "streamed", "too-many",
                                             "get"]
    alone = await api.client.chat.completions.create(**chat)
    first = out[0]["response"]
    assert first["status_code"] == 200 and first["body"]["choices"][0]["message"]["content"] == \
        alone.choices[0].message.content
    assert first["request_id"] and first["body"]["id"] == f"chatcmpl-{first['request_id']}"
    assert out[1]["response"]["body"]["object"] == "text_completion"
    assert out[2]["response"]["body"]["object"] == "response"
    assert out[7]["response"]["status_code"] == 400 and out[7]["error"] is None
    assert "n" == out[7]["response"]["body"]["error"]["param"]
    for r, words in zip(out[3:7] + out[8:], ("not JSON", "one of /v1/chat", "used by an earlier line",
                                            "leave stream out", "only POST")):
        assert r["response"] is None and words in r["error"]["message"], r
    assert all(r["id"].startswith("batch_req_") for r in out)


async def test_in_flight_requests_are_bounded_and_order_kept():
    in_flight, peak, rng = 0, 0, random.Random(0)

    async def post(url, body):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(rng.uniform(0, 0.01))  # they finish out of order
        in_flight -= 1
        return 200, {"n": body["n"]}, "rid"

    out = []
    lines = [line(f"r{i}", "/v1/completions", {"n": i}) for i in range(40)]
    counts = await run_batch(lines, post, 3, out.append)
    assert counts == {"ok": 40, "failed": 0, "invalid": 0} and peak == 3
    assert [r["response"]["body"]["n"] for r in out] == list(range(40))
    assert await run_batch([], post, 3, out.append) == {"ok": 0, "failed": 0, "invalid": 0}


async def test_the_command_against_a_running_server(api, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(line(f"q{i}", "/v1/completions", {"model": MODEL, "prompt": p, "temperature": 0,
                                                               "max_tokens": 4})
                             for i, p in enumerate(["abc", "hello", "xyz"])) + "\n\n")
    rc = await asyncio.to_thread(main, ["-i", str(src), "-o", str(dst), "--url", api.urls["open"],
                                        "--concurrency", "2"])
    results = [json.loads(x) for x in dst.read_text().splitlines()]
    assert rc == 0 and [r["custom_id"] for r in results] == ["q0", "q1", "q2"]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 4 for r in results)
    src.write_text(line("bad", "/v1/completions", {"model": "nope", "prompt": "a"}) + "\n")
    rc = await asyncio.to_thread(main, ["-i", str(src), "-o", str(dst), "--url", api.urls["open"]])
    assert rc == 2 and json.loads(dst.read_text())["response"]["status_code"] == 404
    missing = ["-i", str(tmp_path / "missing.jsonl"), "-o", str(dst), "--url", api.urls["open"]]
    assert await asyncio.to_thread(main, missing) == 1
    src.write_text(line("down", "/v1/completions", {"prompt": "a"}) + "\n")  # nothing listens there
    rc = await asyncio.to_thread(main, ["-i", str(src), "-o", str(dst), "--url", "http://127.0.0.1:9"])
    failed = json.loads(dst.read_text())
    assert rc == 2 and failed["response"] is None and "ConnectError" in failed["error"]["message"]

"""COORDINATOR_API_KEY (specdec_rpc/auth.py): both front doors require it; gRPC calls without it or with another
get UNAUTHENTICATED naming the setting, health and reflection stay open, and `specdec generate --api-key` sends it."""
from __future__ import annotations

import asyncio
import sys

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_rpc.pb import generation_pb2 as g
from tests.test_grammar_wire import PROMPT, Stack

pytestmark = pytest.mark.asyncio(loop_scope="module")
KEY = "sk-both-doors"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed(tmp_path_factory):
    s = await Stack().start(tmp_path_factory.mktemp("keyed"), api_key=KEY)
    yield s
    await s.stop()


async def test_grpc_calls_need_the_key(keyed):
    request = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=3)
    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        for call in (keyed.stub.Generate(request, metadata=metadata),
                     anext(aiter(keyed.stub.GenerateStream(request, metadata=metadata)))):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "COORDINATOR_API_KEY" in e.value.details() and "Bearer" in e.value.details()
    ok = await keyed.stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),))
    assert len(ok.token_ids) == 3
    streamed = [t async for part in keyed.stub.GenerateStream(request, metadata=(("authorization", f"Bearer {KEY}"),))
                for t in part.token_ids]
    assert streamed == list(ok.token_ids)
    health = await health_pb2_grpc.HealthStub(keyed.ch).Check(health_pb2.HealthCheckRequest())  # probes: no key
    assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_http_needs_the_key_too(keyed):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert (await keyed.http.post("/v1/completions", json=body)).status_code == 401
    ok = await keyed.http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text


async def test_the_cli_sends_the_key(keyed):
    args = [sys.executable, "-m", "specdec_cli.main", "generate", "hi", "--coordinator", f"127.0.0.1:{keyed.app.port}",
            "--max-new-tokens", "2", "--json"]
    for extra, rc in (([], 1), (["--api-key", KEY], 0)):
        proc = await asyncio.create_subprocess_exec(*args, *extra, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == rc, (extra, out, err)
    assert b'"completion_tokens": 2' in out or b'"token_ids"' in out

"""Server skeleton: stub generation, conversions, sessions, settings, interceptor, health, reflection, TLS."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from pydantic_settings import SettingsConfigDict

ROOT = Path(__file__).resolve().parent.parent
try:
    from specdec_rpc.pb import common_pb2  # noqa: F401
except ImportError:  # stubs are generated at install time (`make proto`); generate them for a bare checkout
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py")], check=True)

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from specdec.common import errors  # noqa: E402
from specdec.state.sessions import SessionTable  # noqa: E402
from specdec_rpc import decode, encode  # noqa: E402
from specdec_rpc.app import ServerApp  # noqa: E402
from specdec_rpc.metrics import ServiceMetrics  # noqa: E402
from specdec_rpc.pb import common_pb2  # noqa: E402
from specdec_rpc.settings import ServerSettings, TLSSettings, resolve_device  # noqa: E402
from specdec_rpc.tls import channel_credentials  # noqa: E402


# ---------------------------------------------------------------- stubs
def test_gen_protos_check_passes():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (ROOT / "specdec_rpc" / "pb" / "draft_pb2.py").read_text()
    assert "from . import common_pb2" in text and "from specdec.v1" not in text


# ---------------------------------------------------------------- conversions
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_tensor_roundtrip(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    msg = encode.tensor_to_proto(t)
    assert list(msg.shape) == [3, 5]
    back = decode.tensor_from_proto(common_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and torch.equal(back, t)


def test_tensor_bad_size_is_invalid():
    msg = common_pb2.Tensor(data=b"\x00" * 7, dtype=common_pb2.DTYPE_FLOAT32, shape=[2])
    with pytest.raises(errors.InvalidRequestError, match="needs 8"):
        decode.tensor_from_proto(msg)
    with pytest.raises(errors.InvalidRequestError, match="dtype"):
        decode.tensor_from_proto(common_pb2.Tensor(data=b"", shape=[0]))


def test_sparse_q_roundtrip_and_size():
    from specdec.decoding.verify import SparseDist

    q = [SparseDist(ids=torch.tensor([3, 17, 40000]), probs=torch.tensor([0.5, 0.25, 0.25])),
         SparseDist(ids=torch.tensor([9]), probs=torch.tensor([1.0]))]
    data = encode.encode_q(q)
    assert len(data) < 8 * 4 + 16  # 8 bytes per entry plus a few bytes of framing
    back = decode.decode_q(data)
    assert len(back) == 2
    for a, b in zip(q, back):
        assert torch.equal(a.ids, b.ids) and b.ids.dtype == torch.int64
        assert torch.equal(a.probs.float(), b.probs) and b.probs.dtype == torch.float32
    assert decode.decode_q(b"") == []


@pytest.mark.parametrize("bad", [b"\xc1", b"\x01", encode.msgpack.packb([[b"\0" * 4, b"\0" * 8]])])
def test_sparse_q_malformed_is_invalid(bad):
    with pytest.raises(errors.InvalidRequestError, match="q"):
        decode.decode_q(bad)


def test_dense_q_to_sparse_keeps_support():
    dense = torch.tensor([[0.0, 0.7, 0.0, 0.3], [1.0, 0.0, 0.0, 0.0]])
    sp = decode.dense_q_to_sparse(dense)
    assert sp[0].ids.tolist() == [1, 3] and torch.allclose(sp[0].probs, torch.tensor([0.7, 0.3]))
    assert sp[1].ids.tolist() == [0]


def test_sampling_params_top_p_unset_means_one():
    p = decode.sampling_from_proto(common_pb2.SamplingParams(temperature=0.5, seed=3))
    assert p.top_p == 1.0 and p.temperature == 0.5 and p.seed == 3
    p = decode.sampling_from_proto(common_pb2.SamplingParams(top_p=0.9))
    assert abs(p.top_p - 0.9) < 1e-6


# ---------------------------------------------------------------- sessions
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_sessions_ttl_lru_capacity():
    clk = Clock()
    tab = SessionTable(max_sessions=2, ttl_s=10, lru_min_idle_s=1, clock=clk)
    assert tab.admit("a") == [] and tab.admit("b") == []
    with pytest.raises(errors.CapacityError, match="max_sessions=2"):
        tab.check_room("c")  # what admit will say, before work it would waste (a grammar's compile)
    with pytest.raises(errors.CapacityError, match="max_sessions=2"):
        tab.admit("c")  # both used just now
    tab.check_room("a")  # a restart reuses its slot
    clk.t = 2
    tab.check_room("c")  # the LRU session has idled long enough
    assert len(tab) == 2
    tab.touch("a")  # b is now least recently used
    assert tab.admit("c") == ["b"]
    with pytest.raises(errors.SessionNotFoundError, match="StartSession"):
        tab.touch("b")
    assert tab.admit("a") == []  # restart reuses the slot
    clk.t = 13
    with pytest.raises(errors.SessionNotFoundError, match="expired"):
        tab.touch("c")
    assert sorted(tab.reap()) == ["a", "c"] and len(tab) == 0
    with pytest.raises(errors.InvalidRequestError, match="session_id"):
        tab.admit("")


def test_a_worker_table_never_evicts_a_live_session_and_hands_back_what_expired():
    """A worker's table (lru_min_idle_s None) refuses a start when full, however idle its sessions are, and
    drops the expired ones with their values, whose slots the worker frees."""
    clk = Clock()
    tab = SessionTable(max_sessions=2, ttl_s=10, lru_min_idle_s=None, clock=clk)
    tab.add("a", "slot-a")
    tab.add("b", "slot-b")
    clk.t = 9
    with pytest.raises(errors.CapacityError, match="slots"):
        tab.check_room("c")
    with pytest.raises(errors.CapacityError, match="slots"):
        tab.make_room("c")
    assert tab.touch("b") == "slot-b" and list(tab) == ["a", "b"]
    clk.t = 11  # a expired, b not
    assert tab.get("a") == "slot-a"  # a read changes nothing
    with pytest.raises(errors.SessionNotFoundError, match="expired"):
        tab.touch("a")
    assert tab.make_room("c") == [("a", "slot-a")] and "a" not in tab and tab.values() == ["slot-b"]


# ---------------------------------------------------------------- settings
def test_settings_env_then_cli(monkeypatch):
    class S(ServerSettings):
        model_config = SettingsConfigDict(env_prefix="XTEST_")

    monkeypatch.setenv("XTEST_PORT", "123")
    monkeypatch.setenv("XTEST_DTYPE", "bfloat16")
    monkeypatch.setenv("XTEST_TLS__CERT_FILE", "/c.pem")
    s = S.from_cli([])
    assert (s.port, s.dtype, s.tls.cert_file) == (123, "bfloat16", "/c.pem")
    s = S.from_cli(["--port", "456", "--device", "cuda:1", "--threads", "1"])
    assert (s.port, s.device, s.threads, s.dtype) == (456, "cuda:1", 1, "bfloat16")
    with pytest.raises(Exception, match="device"):
        S.from_cli(["--device", "gpu"])
    with pytest.raises(Exception, match="dtype"):
        S.from_cli(["--dtype", "int8"])


def test_resolve_device_cpu_and_missing_cuda():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="--device cpu"):
            resolve_device("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resolve_device_cuda():
    assert resolve_device("cuda:0").type == "cuda"


# ---------------------------------------------------------------- a live server with a failing test service
SERVICE = "specdec.test.Fail"
CASES = {
    "invalid": (errors.InvalidRequestError("top_k", "must be >= 0"), grpc.StatusCode.INVALID_ARGUMENT),
    "notfound": (errors.SessionNotFoundError("session 'x' not found"), grpc.StatusCode.NOT_FOUND),
    "stale": (errors.StalePositionError("base_position 9 > 4 held"), grpc.StatusCode.FAILED_PRECONDITION),
    "overflow": (errors.ContextOverflowError("prompt + draft > 128"), grpc.StatusCode.OUT_OF_RANGE),
    "capacity": (errors.CapacityError("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "boom": (ZeroDivisionError("division by zero"), grpc.StatusCode.INTERNAL),
}


def _register(server):
    async def fail(request, context):
        raise CASES[request.service][0]

    async def fail_stream(request, context):
        yield health_pb2.HealthCheckResponse()
        raise CASES[request.service][0]

    kw = dict(request_deserializer=health_pb2.HealthCheckRequest.FromString,
              response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Fail": grpc.unary_unary_rpc_method_handler(fail, **kw),
        "FailStream": grpc.unary_stream_rpc_method_handler(fail_stream, **kw)}),))


def _settings(**kw):
    return ServerSettings(host="127.0.0.1", port=0, grace_s=1.0, **kw)


async def test_interceptor_maps_errors_and_records_latency():
    app = ServerApp(_settings(), SERVICE, _register)
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            fail = ch.unary_unary(f"/{SERVICE}/Fail", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                  response_deserializer=health_pb2.HealthCheckResponse.FromString)
            stream = ch.unary_stream(f"/{SERVICE}/FailStream",
                                     request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                     response_deserializer=health_pb2.HealthCheckResponse.FromString)
            for name, (exc, code) in CASES.items():
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await fail(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert ei.value.code() == code and str(exc) in ei.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    async for _ in stream(health_pb2.HealthCheckRequest(service=name), timeout=5):
                        pass
                assert ei.value.code() == code
        assert app.metrics.value("specdec_rpc_latency_seconds_count", {"method": "Fail"}) == len(CASES)
    finally:
        await app.shutdown()


async def test_health_reflection_and_graceful_shutdown():
    app = ServerApp(_settings(), SERVICE, _register)
    port = await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            r = await h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = refl.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await call.read()
        await call.done_writing()
        names = {s.name for s in resp.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

        watch = h.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stop = asyncio.ensure_future(app.shutdown())
        assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stop
    assert app.draining


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make test certificates")
async def test_mtls(tmp_path):
    d = str(tmp_path)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        (tmp_path / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", *(["-extfile", f"{name}.ext"] if ext else []), cwd=d)
    tls = TLSSettings(cert_file=f"{d}/server.pem", key_file=f"{d}/server.key", ca_file=f"{d}/ca.pem",
                      require_client_auth=True)
    app = ServerApp(_settings(tls=tls), SERVICE, _register)
    port = await app.start()
    try:
        good = channel_credentials(f"{d}/ca.pem", f"{d}/client.pem", f"{d}/client.key")
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", good) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        anon = channel_credentials(f"{d}/ca.pem")
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", anon) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await app.shutdown()


def test_metrics_names():
    m = ServiceMetrics()
    m.num_draft_tokens.inc(3)
    m.num_accepted_tokens.inc(2)
    m.sessions_active.set(1)
    m.queue_depth.set(0)
    assert m.value("specdec_num_draft_tokens_total") == 3
    assert m.value("specdec_num_accepted_tokens_total") == 2
    assert m.value("specdec_sessions_active") == 1


def test_dtype_auto_picks_bf16_where_it_is_fast():
    """`auto` (the default): bf16 on GPUs, where the CPU has native bf16 GEMMs, and where it has not but the native
    weight-streaming linear runs (target and draft); else fp32."""
    import torch

    from specdec.modeling import native
    from specdec.modeling.dtypes import auto_dtype, cpu_has_fast_bf16
    from specdec.modeling.dtypes import resolve_dtype

    class S(ServerSettings):
        model_config = SettingsConfigDict(env_prefix="XTEST2_")

    assert S.from_cli([]).dtype == "auto"
    fast = cpu_has_fast_bf16() or native.stream_linear_supported()
    assert resolve_dtype("auto", "cpu", "target") == (torch.bfloat16 if fast else torch.float32)
    assert resolve_dtype("auto", "cpu", "draft") == (torch.bfloat16 if fast else torch.float32)
    assert auto_dtype("cuda:0", "draft") == torch.bfloat16
    assert resolve_dtype("float32", "cpu", "target") == torch.float32


def test_a_server_whose_parent_is_gone_shuts_itself_down(tmp_path):
    """--exit-with-parent: an embedded stack's replica leaves when its parent does (here: named a pid that is not
    its parent, as after a re-parenting); with its real parent's pid it keeps serving."""
    import os
    import time

    from tests.helpers_models import build_tiny_model, save_model

    mdir = save_model(build_tiny_model(vocab_size=32), tmp_path / "m")

    def launch(parent: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(mdir), "--host", "127.0.0.1",
                                 "--port", "0", "--metrics-port", "0", "--threads", "1", "--grace-s", "0",
                                 "--log-level", "WARNING",
                                 "--exit-with-parent", str(parent)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    orphan, child = launch(1 if os.getpid() != 1 else 2), launch(os.getpid())
    try:
        assert orphan.wait(60) == 0, orphan.stderr.read()
        assert "is gone: shutting down" in orphan.stderr.read()
        time.sleep(1.5)  # past one watchdog period: still serving
        assert child.poll() is None, child.stderr.read()
    finally:
        for p in (orphan, child):
            if p.poll() is None:
                p.kill()
            p.wait(10)

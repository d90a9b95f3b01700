"""mTLS between the coordinator and pools found by DNS. A headless Service resolves to pod IPs, which the pods'
certificates do not name; the coordinator checks each replica's certificate against the pool's DNS name. Before
(found by an audit), every replica of a TLS deployment failed its health check with "Hostname
Verification Check failed", and the service was down."""
from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from coordinator.channels import Dialer
from coordinator.config import CoordinatorSettings
from coordinator.server import build_coordinator, client_tls
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from specdec_rpc.settings import TLSSettings
from tests.helpers_models import start_replica, target_greedy, tiny_pair

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d) -> dict:
    """A CA, and a certificate per component signed by it: each replica's names only its pool's Service."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=test-ca", cwd=d)
    sans = {"draft": "DNS:draft-headless", "target": "DNS:target-headless", "coordinator": "DNS:coordinator"}
    for name, san in sans.items():
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return {name: TLSSettings(cert_file=str(d / f"{name}.pem"), key_file=str(d / f"{name}.key"),
                              ca_file=str(d / "ca.pem"), require_client_auth=name != "coordinator")
            for name in sans}


async def pod_ips(host: str, port: int) -> list[str]:
    """The headless Services: each name resolves to its one ready pod."""
    if host not in ("draft-headless", "target-headless"):
        raise OSError(f"NXDOMAIN {host}")
    return ["127.0.0.1"]


def settings(tls: TLSSettings, draft_port: int, target_port: int) -> CoordinatorSettings:
    return CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                               draft_dns=f"draft-headless:{draft_port}", target_dns=f"target-headless:{target_port}",
                               tls=tls, log_level="WARNING")


def test_dns_pools_are_checked_against_their_service_names():
    tls = TLSSettings(ca_file="/ca.pem", cert_file="/c.pem", key_file="/c.key")
    assert client_tls(settings(tls, 1, 2))["server_names"] == {"draft": "draft-headless", "target": "target-headless"}
    static = CoordinatorSettings(ray=False, draft_endpoints="draft-0:1", target_dns="target-headless:2", tls=tls)
    assert client_tls(static)["server_names"] == {"target": "target-headless"}  # dialed by name: checked against it
    assert client_tls(CoordinatorSettings(ray=False, draft_endpoints="a:1", target_endpoints="b:2")) is None


@pytest.mark.asyncio
async def test_a_tls_stack_found_by_dns_generates(tmp_path):
    certs = make_certs(tmp_path)
    target, draft = tiny_pair()
    t = await start_replica("target", target, tls=certs["target"])
    d = await start_replica("draft", draft, tls=certs["draft"])
    s = settings(certs["coordinator"], d.port, t.port)
    assert Dialer.from_tls(client_tls(s)).server_names["draft"] == "draft-headless"  # what a Ray actor builds
    app, router = await build_coordinator(s, eos_token_ids=set(), resolve=pod_ips)
    await app.start()
    try:
        assert all(m.healthy for pool in router.pool_manager.pools.values() for m in pool.members.values())
        creds = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{app.port}", creds,
                                           options=[("grpc.ssl_target_name_override", "coordinator")]) as ch:
            for mode in ("sd", "pearl"):
                r = await gg.GenerationServiceStub(ch).Generate(
                    g.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=12, mode=mode), timeout=60)
                assert list(r.token_ids) == target_greedy(target, [1, 2, 3], 12), mode
    finally:
        for a in (app, t, d):
            await a.shutdown(0)


def test_a_vocabulary_that_is_not_the_tokenizers_is_named():
    from coordinator.routing.probes import vocabulary_mismatch

    assert vocabulary_mismatch(49152, 128256) and vocabulary_mismatch(128256, 49152)  # SmolLM2 vs Llama 3
    assert not vocabulary_mismatch(151665, 151936) and not vocabulary_mismatch(32000, 32000)  # padding: Qwen2.5
    assert not vocabulary_mismatch(0, 128256) and not vocabulary_mismatch(49152, 0)  # unknown: no opinion


@pytest.mark.asyncio
async def test_a_target_whose_vocabulary_is_not_the_tokenizers_gets_no_requests(tmp_path):
    """A coordinator whose tokenizer is another model's decoded every answer with the wrong vocabulary, silently
    (the gpu overlay read the default SmolLM2 tokenizer for a Llama target: an audit). Such a target
    replica is refused with a message saying what to set; one that fits serves."""
    from specdec.text.tokenizer import load_tokenizer
    from tests.helpers_models import build_tiny_model, save_tiny_tokenizer

    tok = load_tokenizer(save_tiny_tokenizer(tmp_path / "tok"))  # 32 tokens
    _, draft = tiny_pair()
    wide = await start_replica("target", build_tiny_model(vocab_size=4096, seed=1))
    d = await start_replica("draft", draft)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=wide.endpoint, log_level="WARNING",
                            queue_wait_s=1)
    app, router = await build_coordinator(s, tokenizer=tok, eos_token_ids=set())
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gg.GenerationServiceStub(ch).Generate(g.GenerateRequest(prompt="hello", max_new_tokens=4))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "COORDINATOR_TOKENIZER" in e.value.details()
        assert "4096 tokens" in router.pool_manager.snapshot()["target"][wide.endpoint]["error"]
    finally:
        for a in (app, wide, d):
            await a.shutdown(0)


@pytest.mark.asyncio
async def test_a_draft_whose_vocabulary_is_not_the_tokenizers_is_left_out(tmp_path):
    """A draft replica of another tokenizer proposes tokens that mean something else to the target: lossless, but
    slower than the target alone, and silent. It is refused like such a target; requests that need a draft fail
    FAILED_PRECONDITION saying why (not target-only: the operator must see it), `ar` requests are served."""
    from specdec.text.tokenizer import load_tokenizer
    from tests.helpers_models import build_tiny_model, save_tiny_tokenizer

    tok = load_tokenizer(save_tiny_tokenizer(tmp_path / "tok"))  # 32 tokens
    target, _ = tiny_pair()
    t = await start_replica("target", target)
    wide = await start_replica("draft", build_tiny_model(vocab_size=4096, hidden_size=16, num_layers=1, seed=2))
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=wide.endpoint, target_endpoints=t.endpoint, log_level="WARNING")
    app, router = await build_coordinator(s, tokenizer=tok, eos_token_ids=set())
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(g.GenerateRequest(prompt_token_ids=[3, 1, 4], max_new_tokens=6, mode="sd",
                                                      ignore_eos=True))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "4096 tokens" in e.value.details()
            r = await stub.Generate(g.GenerateRequest(prompt_token_ids=[3, 1, 4], max_new_tokens=6, mode="ar",
                                                      ignore_eos=True))
        assert list(r.token_ids) == target_greedy(target, [3, 1, 4], 6)
        error = router.pool_manager.snapshot()["draft"][wide.endpoint]["error"]
        assert "4096 tokens" in error and "draft of the target's tokenizer" in error
    finally:
        for a in (app, wide, t):
            await a.shutdown(0)

"""Pool discovery and routing: static/file/DNS sources, health, least-loaded pinning, scale-out and scale-in.

The last test runs real replicas on loopback addresses 127.0.0.2/127.0.0.3 behind a resolver the test controls
(a headless Service resolves to one address per ready pod, all on one port) and changes the pool while requests
run: every request finishes with exact output and new sessions reach the new replica.
"""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from coordinator.config import CoordinatorSettings
from coordinator.routing.discovery import DnsSource, FileSource, StaticSource, source_from_spec, split_host_port
from coordinator.routing.pool import PoolManager, ReplicaUnavailableError
from tests.helpers_models import start_replica, target_greedy, tiny_pair


class FakeDns:
    """The test's DNS server: name -> addresses, changed at will."""

    def __init__(self, **records):
        self.records = {k.replace("_", "-"): list(v) for k, v in records.items()}

    async def __call__(self, host, port):
        if host not in self.records:
            raise socket.gaierror(f"NXDOMAIN {host}")
        return list(self.records[host])


def healthy(*bad):
    async def check(endpoint, service):
        return (endpoint not in bad), ("down" if endpoint in bad else "")
    return check


def test_sources_parse(tmp_path):
    assert isinstance(source_from_spec("a:1,b:2"), StaticSource)
    assert isinstance(source_from_spec("dns:svc.ns:50061"), DnsSource)
    assert isinstance(source_from_spec(f"file:{tmp_path}/x"), FileSource)
    assert split_host_port("[::1]:5") == ("::1", 5)
    with pytest.raises(ValueError):
        split_host_port("nohost")
    s = CoordinatorSettings(draft_dns="draft-headless:50061", target_endpoints="127.0.0.1:1,127.0.0.1:2")
    assert s.pool_spec("draft") == "dns:draft-headless:50061"
    assert s.pool_spec("target") == "static:127.0.0.1:1,127.0.0.1:2"


def test_env_names_match_deploy(monkeypatch):
    """deploy/ sets COORDINATOR_DRAFT_DNS/TARGET_DNS, *_DNS_REFRESH_S, *_RAY_ADDRESS, *_GRACE_S, *_TLS__*."""
    monkeypatch.setenv("COORDINATOR_DRAFT_DNS", "draft-headless.ns.svc.cluster.local:50061")
    monkeypatch.setenv("COORDINATOR_TARGET_DNS", "target-headless.ns.svc.cluster.local:50071")
    monkeypatch.setenv("COORDINATOR_DNS_REFRESH_S", "5")
    monkeypatch.setenv("COORDINATOR_RAY_ADDRESS", "auto")
    monkeypatch.setenv("COORDINATOR_GRACE_S", "30")
    monkeypatch.setenv("COORDINATOR_TLS__CA_FILE", "/etc/specdec/tls/ca.crt")
    s = CoordinatorSettings()
    assert s.pool_spec("target") == "dns:target-headless.ns.svc.cluster.local:50071"
    assert (s.dns_refresh_s, s.ray_address, s.grace_s, s.tls.ca_file) == (5.0, "auto", 30.0, "/etc/specdec/tls/ca.crt")
    assert s.port == 50051


async def test_file_and_dns_sources(tmp_path):
    f = tmp_path / "pool.txt"
    f.write_text("# replicas\n127.0.0.1:5\n\n127.0.0.2:5\n")
    assert await FileSource(str(f)).resolve() == ["127.0.0.1:5", "127.0.0.2:5"]
    dns = FakeDns(target_headless=["10.0.0.1", "10.0.0.2"])
    src = DnsSource("target-headless:50071", dns)
    assert await src.resolve() == ["10.0.0.1:50071", "10.0.0.2:50071"]
    assert await DnsSource("missing:1", dns).resolve() == []  # NXDOMAIN = empty pool


async def test_least_loaded_routing_and_scale():
    dns = FakeDns(t=["10.0.0.1"])
    pm = PoolManager({"target": DnsSource("t:7", dns)}, refresh_s=60, health_check=healthy())
    await pm.start()
    a = await pm.acquire("target")
    assert a == "10.0.0.1:7"
    dns.records["t"].append("10.0.0.2")  # scale-out
    await pm.refresh()
    b = await pm.acquire("target")
    assert b == "10.0.0.2:7", "new sessions go to the least-loaded (the new) replica"
    c = await pm.acquire("target")
    assert c in ("10.0.0.1:7", "10.0.0.2:7")
    pm.release("target", a)
    pm.release("target", c)
    dns.records["t"] = ["10.0.0.2"]  # scale-in
    await pm.refresh()
    assert pm.members() == {"target": ["10.0.0.2:7"]}
    assert await pm.acquire("target") == "10.0.0.2:7"
    pm.report_failure("target", "10.0.0.2:7", "UNAVAILABLE")
    pm._health = healthy("10.0.0.2:7")
    with pytest.raises(ReplicaUnavailableError, match=r"10\.0\.0\.2:7"):
        await pm.acquire("target")
    await pm.stop()


async def test_unhealthy_excluded_and_no_pool():
    pm = PoolManager({"draft": StaticSource(["127.0.0.1:1", "127.0.0.1:2"])}, refresh_s=60,
                     health_check=healthy("127.0.0.1:1"))
    await pm.start()
    assert {await pm.acquire("draft") for _ in range(3)} == {"127.0.0.1:2"}
    with pytest.raises(ReplicaUnavailableError, match="no target pool"):
        await pm.acquire("target")


# ---- live scale-out / scale-in on loopback ---------------------------------------------------------------------
def _loopback_ok(ip: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _loopback_ok("127.0.0.3"), reason="needs the 127.0.0.0/8 loopback range")
async def test_scale_out_and_in_while_requests_run():
    from coordinator.server import build_coordinator
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg

    target, draft = tiny_pair()
    t1 = await start_replica("target", target, host="127.0.0.2")
    port = t1.port
    # no prompt lookup: the tiny target loops, lookup would finish the sessions before the replicas change
    d1 = await start_replica("draft", draft, host="127.0.0.2", port=0, prompt_lookup_min_ngram=0)
    dns = FakeDns(target_headless=["127.0.0.2"], draft_headless=["127.0.0.2"])
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="",
                            target_dns=f"target-headless:{port}", draft_dns=f"draft-headless:{d1.port}",
                            dns_refresh_s=0.2, pool_view_refresh_s=0.05, log_level="WARNING",
                            spec_off_batch=0)  # the 6 sessions speculate (and run long enough to move replicas)
    app, router = await build_coordinator(s, resolve=dns)
    await app.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    stub = gg.GenerationServiceStub(ch)
    prompts = [[1 + i, 2, 3 + i] for i in range(6)]
    n = 96  # long enough that sessions are still running when their replica leaves
    refs = [target_greedy(target, p, n) for p in prompts]
    modes = ["sd", "pearl", "ar", "pearl", "sd", "ar"]
    try:
        calls = [asyncio.ensure_future(stub.Generate(g.GenerateRequest(prompt_token_ids=p, max_new_tokens=n,
                                                                       mode=m)))
                 for p, m in zip(prompts, modes)]
        await asyncio.sleep(0.15)
        t2 = await start_replica("target", target, host="127.0.0.3", port=port)  # scale-out
        dns.records["target-headless"] = ["127.0.0.2", "127.0.0.3"]
        await asyncio.sleep(0.3)
        dns.records["target-headless"] = ["127.0.0.3"]  # scale-in: the first replica leaves the pool...
        await asyncio.sleep(0.3)
        await t1.shutdown(0.2)  # ...and then goes away (pod terminated)
        results = await asyncio.gather(*calls)
        for r, ref in zip(results, refs):
            assert list(r.token_ids) == ref, "failover must not change the output"
        later = await stub.Generate(g.GenerateRequest(prompt_token_ids=prompts[0], max_new_tokens=8, mode="sd"))
        assert later.stats.target_replica == f"127.0.0.3:{port}", "new sessions reach the new replica"
        assert any("127.0.0.3" in r.stats.target_replica for r in results), "live sessions moved"
        assert len(t2.host.table) == 0 and len(d1.host.table) == 0, "every session was ended"
    finally:
        await ch.close()
        await app.shutdown(0)
        for a in (t1, d1):
            await a.shutdown(0)
        if "t2" in locals():
            await t2.shutdown(0)


async def test_a_slow_health_check_is_not_a_dead_replica():
    """A check that times out counts only at the third in a row; a refused connection or NOT_SERVING at once. On a
    busy host one slow answer made a pool's only replica unroutable and requests failed UNAVAILABLE."""
    from coordinator.routing.pool import SLOW_CHECKS

    answers = {"10.0.0.1:7": (True, "")}

    async def check(endpoint, service):
        return answers[endpoint]

    pm = PoolManager({"target": StaticSource(["10.0.0.1:7"])}, refresh_s=60, health_check=check)
    await pm.start()
    answers["10.0.0.1:7"] = (False, "DEADLINE_EXCEEDED: Deadline Exceeded")
    for _ in range(SLOW_CHECKS - 1):
        await pm.refresh()
        assert pm.members() == {"target": ["10.0.0.1:7"]}
    await pm.refresh()
    assert pm.members() == {"target": []}
    answers["10.0.0.1:7"] = (True, "")
    await pm.refresh()
    assert pm.members() == {"target": ["10.0.0.1:7"]}
    answers["10.0.0.1:7"] = (False, "UNAVAILABLE: failed to connect to all addresses")
    await pm.refresh()
    assert pm.members() == {"target": []}
    await pm.stop()

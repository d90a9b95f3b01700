"""The TCP delay relay (specdec_rpc/netem.py) on real loopback sockets: the delay in both directions, a bulk
transfer that streams instead of paying the delay per chunk, the bandwidth cap, gRPC through it, and the relay as a
process of its own."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec_rpc.netem import DelayRelay, parse_address

ROOT = Path(__file__).resolve().parents[1]
SLACK_S = 0.03  # a loaded 2-core CI host: scheduling noise on top of the delay


async def _echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _round_trips(address: str, n: int = 5) -> list[float]:
    host, port = parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    times = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            writer.write(b"ping %d\n" % i)
            await writer.drain()
            assert await reader.readline() == b"ping %d\n" % i
            times.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return times


async def _bulk(address: str, nbytes: int) -> float:
    """Seconds to send nbytes through the echo server and read them all back."""
    host, port = parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    payload = os.urandom(nbytes)
    t0 = time.perf_counter()

    async def send():
        for i in range(0, nbytes, 16384):  # many small chunks: each would pay the delay if it were serialized
            writer.write(payload[i:i + 16384])
            await writer.drain()

    sender = asyncio.ensure_future(send())
    got = await reader.readexactly(nbytes)
    elapsed = time.perf_counter() - t0
    await sender
    writer.close()
    assert got == payload
    return elapsed


async def test_round_trip_pays_the_delay_both_ways():
    server, echo = await _echo_server()
    async with server:
        async with DelayRelay(echo, one_way_delay_s=0.025) as relay:
            rtts = await _round_trips(relay.address)
        assert all(0.05 <= t < 0.05 + SLACK_S for t in rtts), rtts
        async with DelayRelay(echo, one_way_delay_s=0.0) as relay:
            rtts = await _round_trips(relay.address)
        assert sorted(rtts)[len(rtts) // 2] < 0.005, rtts  # near loopback's own


async def test_bulk_transfer_is_not_limited_by_the_delay():
    """2 MiB in 16 KiB writes through a 20 ms round trip: the chunks are in flight together, so the transfer takes
    about one round trip, not one per chunk (128 × 40 ms)."""
    server, echo = await _echo_server()
    async with server:
        async with DelayRelay(echo, one_way_delay_s=0.01) as relay:
            elapsed = await _bulk(relay.address, 2 << 20)
    assert 0.02 <= elapsed < 0.5, elapsed


async def test_bandwidth_cap_holds():
    """1 MB at 8 MB/s each way: at least 0.125 s (the echo's return stream overlaps the sent one)."""
    server, echo = await _echo_server()
    nbytes, rate = 1_000_000, 8e6
    async with server:
        async with DelayRelay(echo, one_way_delay_s=0.0, bandwidth_bytes_per_s=rate) as relay:
            elapsed = await _bulk(relay.address, nbytes)
    assert nbytes / rate <= elapsed < 3 * nbytes / rate + 0.2, elapsed


async def test_a_closed_side_closes_the_other():
    server, echo = await _echo_server()
    async with server:
        async with DelayRelay(echo, one_way_delay_s=0.005) as relay:
            reader, writer = await asyncio.open_connection(*parse_address(relay.address))
            writer.write(b"last words\n")
            writer.write_eof()  # the echo server sees the end, answers, and closes its side
            assert await asyncio.wait_for(reader.read(), 2) == b"last words\n"  # then EOF arrives here
            writer.close()
            await asyncio.sleep(0.05)
            assert not relay.connections
        # nothing listens upstream: the client's connection is closed, not left hanging
        async with DelayRelay("127.0.0.1:1", one_way_delay_s=0.0) as relay:
            reader, writer = await asyncio.open_connection(*parse_address(relay.address))
            assert await asyncio.wait_for(reader.read(), 2) == b""
            writer.close()


async def test_grpc_through_the_relay():
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("specdec.v1.TestService", health_pb2.HealthCheckResponse.SERVING)
    try:
        async with DelayRelay(f"127.0.0.1:{port}", one_way_delay_s=0.01) as relay:
            async with grpc.aio.insecure_channel(relay.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                req = health_pb2.HealthCheckRequest(service="specdec.v1.TestService")
                assert (await stub.Check(req, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
                t0 = time.perf_counter()
                await stub.Check(req, timeout=5)  # on the open connection: one round trip
                assert 0.02 <= time.perf_counter() - t0 < 0.02 + SLACK_S
    finally:
        await server.stop(0)


def test_bad_arguments_say_what_to_use():
    with pytest.raises(ValueError, match="host:port"):
        DelayRelay("localhost", 0.01)
    with pytest.raises(ValueError, match="0 or more"):
        DelayRelay("127.0.0.1:80", -0.01)
    with pytest.raises(ValueError, match="more than 0"):
        DelayRelay("127.0.0.1:80", 0.01, bandwidth_bytes_per_s=0)
    p = subprocess.run([sys.executable, "-m", "specdec_rpc.netem", "--upstream", "nowhere", "--delay-ms", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "host:port" in p.stderr


async def test_process_prints_its_address_and_serves():
    server, echo = await _echo_server()
    async with server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specdec_rpc.netem", "--upstream", echo, "--delay-ms", "10",
            "--exit-with-parent", str(os.getpid()), cwd=ROOT, stdout=subprocess.PIPE)
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
            assert line.startswith("listening 127.0.0.1:"), line
            rtts = await _round_trips(line.split()[1])
            assert all(0.02 <= t < 0.02 + SLACK_S for t in rtts[1:]), rtts
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0


def test_serve_passes_the_emulated_round_trip_and_the_data_plane():
    from specdec_cli import serve

    p = serve.plan(serve.build_parser().parse_args([]))
    assert p.stack["emulate_rtt_ms"] == 0.0 and p.stack["coordinator_options"]["data_plane"] == "auto"
    p = serve.plan(serve.build_parser().parse_args(["--emulate-rtt-ms", "10", "--data-plane", "direct"]))
    assert p.stack["emulate_rtt_ms"] == 10.0 and p.stack["coordinator_options"]["data_plane"] == "direct"
    with pytest.raises(ValueError, match="--emulate-rtt-ms"):
        serve.plan(serve.build_parser().parse_args(["--emulate-rtt-ms", "-1"]))


def test_stack_refuses_a_negative_round_trip():
    from coordinator.stack import LocalStack

    with pytest.raises(ValueError, match="emulate_rtt_ms"):
        LocalStack("target", "draft", emulate_rtt_ms=-5)

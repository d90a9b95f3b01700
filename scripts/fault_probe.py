"""Replicas SIGKILLed mid-stream, and clients that go away: separately started processes (two target and two draft
replicas), a coordinator in this process (no Ray) over them, greedy streams compared with an undisturbed run.

    python scripts/fault_probe.py [--streams 8] [--kills 4] [--cancels 6]

Each kill round starts `--streams` greedy streams (sd and pacer_pearl alternating, token-id prompts), SIGKILLs a
replica (target and draft in turn) once the streams have sent a few messages, restarts it, and checks every
stream's tokens equal the undisturbed run's (nothing lost, nothing twice), with its largest gap between messages.
Then `--cancels` streams are cancelled by the client after two messages; the replicas must hold no session within
a second (each cancel reports the interval its sessions were freed in, bounded by the scrape rounds of the
replicas' metrics). Prints one JSON report.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx

from coordinator.config import CoordinatorSettings
from coordinator.server import build_coordinator
from coordinator.stack import free_port
from specdec.common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.decoding.preverifier import default_preverifier_dir
from specdec.modeling.hub import resolve_model
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg

PROMPTS = [[1, 504, 3456, 314, 260, 2564, 30, 198], [1, 9690, 198, 2683, 359, 253, 5356, 5646, 28],
           [1, 4093, 1743, 282, 1345, 314, 216, 34, 28], [1, 20777, 2226, 3890, 30, 198, 1206, 314]]


class Replica:
    def __init__(self, kind: str, model: str, logdir: str):
        self.kind, self.model, self.port, self.metrics_port = kind, model, free_port(), free_port()
        self.http: httpx.AsyncClient | None = None
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = os.path.join(logdir, f"{kind}-{self.port}.log")
        self.proc = None

    def start(self):
        cmd = [sys.executable, "-m", f"{self.kind}_service", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), "--threads", "1", "--log-level", "WARNING",
               "--grace-s", "1", "--max-sessions", "8", "--max-context", "512", "--exit-with-parent",
               str(os.getpid())]
        if self.kind == "draft" and (pv := default_preverifier_dir(DEFAULT_DRAFT)) is not None:
            cmd += ["--preverifier", str(pv)]  # pacer_pearl's
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    async def ready(self, timeout: float = 300):
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        t0 = time.monotonic()
        async with grpc.aio.insecure_channel(self.endpoint) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() - t0 < timeout:
                try:
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.kind} {self.endpoint} did not start: {self.log}")

    async def sessions(self) -> int:
        """specdec_sessions_active, from the replica's metrics port (one client per replica: building a client per
        scrape costs more than the scrape)."""
        if self.http is None:
            self.http = httpx.AsyncClient()
        text = (await self.http.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5)).text
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("specdec_sessions_active")))


async def stream(stub, k: int, max_new: int, started: asyncio.Event | None = None, n_started: list | None = None):
    req = g.GenerateRequest(prompt_token_ids=PROMPTS[k % len(PROMPTS)], max_new_tokens=max_new, temperature=0.0,
                            mode=("sd", "pacer_pearl")[k % 2], ignore_eos=True)
    ids, last, gap, msgs = [], None, 0.0, 0
    async for resp in stub.GenerateStream(req, timeout=300):
        now = time.perf_counter()
        gap = max(gap, now - last) if last is not None else gap
        last, msgs = now, msgs + 1
        ids.extend(resp.token_ids)
        if started is not None and msgs == 3:
            n_started.append(k)
            if len(n_started) >= 1:
                started.set()
    return ids, gap


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--cancels", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args()
    import tempfile

    logdir = tempfile.mkdtemp(prefix="fault-probe-")
    tdir, ddir = str(resolve_model(DEFAULT_TARGET)), str(resolve_model(DEFAULT_DRAFT))
    reps = [Replica("target", tdir, logdir), Replica("target", tdir, logdir), Replica("draft", ddir, logdir),
            Replica("draft", ddir, logdir)]
    for r in reps:
        r.start()
    await asyncio.gather(*(r.ready() for r in reps))
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=1,
                            target_endpoints=",".join(r.endpoint for r in reps[:2]),
                            draft_endpoints=",".join(r.endpoint for r in reps[2:]), log_level="WARNING",
                            dns_refresh_s=1.0)
    app, _ = await build_coordinator(s, tokenizer=None, eos_token_ids=set())
    await app.start()
    report = {"kills": [], "cancels": []}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            ref = await asyncio.gather(*(stream(stub, k, a.max_new_tokens) for k in range(a.streams)))
            ref_ids = [r[0] for r in ref]
            report["undisturbed_max_gap_s"] = round(max(r[1] for r in ref), 3)
            for n in range(a.kills):
                victim = reps[[0, 2, 1, 3][n % 4]]
                started, n_started = asyncio.Event(), []
                tasks = [asyncio.ensure_future(stream(stub, k, a.max_new_tokens, started, n_started))
                         for k in range(a.streams)]
                await started.wait()
                victim.kill()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                errors = [f"{type(r).__name__}: {getattr(r, 'details', lambda: r)()}" for r in results
                          if isinstance(r, BaseException)]
                same = sum(1 for k, r in enumerate(results) if not isinstance(r, BaseException) and r[0] == ref_ids[k])
                gaps = [r[1] for r in results if not isinstance(r, BaseException)]
                report["kills"].append({"killed": victim.kind, "identical": same, "streams": a.streams,
                                        "errors": errors, "max_gap_s": round(max(gaps, default=0.0), 3)})
                victim.start()
                await victim.ready()
                await asyncio.sleep(2.0)  # the coordinator's probes see it serving again
            for n in range(a.cancels):
                req = g.GenerateRequest(prompt_token_ids=PROMPTS[n % len(PROMPTS)], max_new_tokens=200,
                                        temperature=0.0, mode=("sd", "pacer_pearl")[n % 2], ignore_eos=True)
                call = stub.GenerateStream(req, timeout=300)
                got = 0
                async for _ in call:
                    got += 1
                    if got == 2:
                        break
                call.cancel()
                t0 = time.perf_counter()
                # scrape rounds of the four replicas' metrics: the sessions were freed after the start of the last
                # round that still saw one, and before the end of the first round that saw none
                held_at, freed = 0.0, None
                while time.perf_counter() - t0 < 5:
                    start = time.perf_counter() - t0
                    if not sum(await asyncio.gather(*(r.sessions() for r in reps))):
                        freed = time.perf_counter() - t0
                        break
                    held_at = start
                    await asyncio.sleep(0.005)
                left = sum(await asyncio.gather(*(r.sessions() for r in reps)))
                report["cancels"].append({"freed_after_s": round(held_at, 3),
                                          "freed_by_s": None if freed is None else round(freed, 3),
                                          "sessions_left": left})
    finally:
        await app.shutdown(0)
        for r in reps:
            if r.proc and r.proc.poll() is None:
                r.proc.terminate()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    asyncio.run(main())

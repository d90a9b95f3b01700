"""The embedded one-machine stack: a draft replica and a target replica (subprocesses, `threads` torch threads
each), a local Ray instance, and the coordinator's front server, all on loopback (or `host` for `serve`).

    async with LocalStack(target="default-target", draft="default-draft") as stack:
        stub = GenerationServiceStub(grpc.aio.insecure_channel(stack.address))

`emulate_rtt_ms` puts a delay relay (specdec_rpc/netem.py, a process each) on every link between the three
processes: coordinator -> target, coordinator -> draft, and draft -> target (the direct data plane's rounds), each
delaying every byte by half the round trip each way. A test and planning aid: the pools' machines apart, on one.
The relays carry the replicas' gRPC ports only, so with them the replicas serve no frame port (the per-round
messages take the gRPC streams, through the relays).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from coordinator.config import CoordinatorSettings, served_names
from coordinator.routing.probes import grpc_health
from coordinator.server import build_coordinator, init_ray
from specdec.common.settings import child_environ
from specdec.modeling.hub import resolve_model
from specdec.modeling.model import ModelConfig
from specdec.text.pairing import check_pair

log = logging.getLogger(__name__)


PORT_FLOOR = 10000  # free_port draws from [PORT_FLOOR, the kernel's ephemeral range)


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to bind(port 0) and to outgoing connections (Linux; elsewhere IANA's)."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now, for a process started later to listen on. Drawn at random below the
    kernel's ephemeral range: the replicas bind their ports only once their models have loaded, seconds later, and
    meanwhile every process that binds port 0 or opens a connection (Ray's workers, gRPC clients) takes ports from
    that range, where a port found free a moment ago is soon someone's. Falls back to a kernel-chosen port where the
    range leaves no room below it."""
    lo = _ephemeral_range()[0]
    for _ in range(64) if lo - PORT_FLOOR >= 1000 else ():
        port = random.randrange(PORT_FLOOR, lo)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def wait_serving(endpoint: str, service: str, timeout: float, proc: subprocess.Popen | None = None,
                       log_path: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    err = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path and log_path.exists() else "(its log is above)"
            raise RuntimeError(f"{service} replica on {endpoint} exited with code {proc.returncode}:\n{tail}")
        ok, err = await grpc_health("", endpoint, service, 1.0)  # a loopback replica, plaintext
        if ok:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{service} on {endpoint} not serving after {timeout:.0f}s ({err})")


def config_vocab_size(model_dir: str) -> int:
    """The vocabulary size a model directory's config.json gives (a compact draft's full one; 0: none found)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0  # a .gguf file, a directory without config.json: the replica checks on its own
    return int(cfg.get("specdec_full_vocab_size", cfg.get("vocab_size", 0)) or 0)


def option_flags(options: dict) -> list[str]:
    """Settings fields as a service's command-line flags: {"max_queue": 8, "prefix_cache": False} →
    ["--max-queue", "8", "--no-prefix-cache"]."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def check_models(target_dir: str, draft_dir: str | None, target: str, draft: str | None) -> None:
    """Refuse, before any replica starts, what would make one fail or a pair useless: a config.json that cannot be
    served exactly (specdec/modeling/model.py, one line naming the field) and a draft of another tokenizer
    (specdec/text/pairing.py, one line naming both models). A .gguf file or a directory without config.json is left to
    the replica."""
    for spec, path in ((target, target_dir), (draft, draft_dir)):
        cfg = Path(path) / "config.json" if path else None
        if cfg is not None and cfg.is_file():
            try:
                ModelConfig.from_hf(json.loads(cfg.read_text()))
            except ValueError as e:
                raise ValueError(f"{spec}: {e}") from None
    if draft_dir:
        check_pair(draft_dir, target_dir, draft or draft_dir, target)


class LocalStack:
    def __init__(self, target: str, draft: str | None, preverifier: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, threads: int = 1, ray_cpus: int = 2, pipelines: int = 1, use_ray: bool = True,
                 start_timeout_s: float = 600.0, max_new_tokens_cap: int = 4096, quiet: bool = True,
                 draft_port: int = 0, target_port: int = 0, max_sessions: int = 8, max_context: int = 2048,
                 metrics: bool = False, dtype: str = "auto", prompt_lookup_min_ngram: int | None = None,
                 http_port: int | None = None, default_mode: str = "sd", prefix_cache: bool = True,
                 replica_args: tuple[str, ...] = (), tool_call_parser: str = "", reasoning_parser: str = "",
                 grace_s: float = 1.0, log_level: str = "WARNING", coordinator_options: dict | None = None,
                 draft_options: dict | None = None, target_options: dict | None = None, emulate_rtt_ms: float = 0.0):
        self.target, self.draft, self.preverifier = target, draft, preverifier
        # settings fields beyond the ones above, by process: CoordinatorSettings fields, and the replicas' (their
        # flags: draft_service/config.py, target_service/config.py), e.g. {"device": "cuda:1"}
        self.coordinator_options = dict(coordinator_options or {})
        self.replica_options = {"draft": dict(draft_options or {}), "target": dict(target_options or {})}
        if not emulate_rtt_ms >= 0:
            raise ValueError(f"emulate_rtt_ms {emulate_rtt_ms!r}: must be 0 (no relays) or more milliseconds")
        self.emulate_rtt_ms = float(emulate_rtt_ms)  # > 0: a delay relay on every link (the module docstring)
        if self.emulate_rtt_ms > 0:  # the relays carry the gRPC ports: frames (a port of their own) would pass them by
            for kind in ("draft", "target"):
                self.replica_options[kind].setdefault("data_port", -1)
        self.relays: dict[str, str] = {}  # link ("coordinator-target", ...) -> the relay's address, once started
        self._draft_routes = self.replica_options["draft"].get("target_routes", "")  # the caller's, if any
        self.grace_s, self.log_level = grace_s, log_level  # every process's drain on shutdown, and its log level
        self.prompt_lookup_min_ngram = prompt_lookup_min_ngram  # the draft replica's (None: its default)
        self.dtype = dtype  # the replicas' --dtype
        self.prefix_cache = prefix_cache  # the replicas' --prefix-cache
        self.replica_args = tuple(replica_args)  # more flags for both replicas (A/B runs)
        self.http_port = http_port  # the OpenAI-compatible HTTP API: None off, 0 a free port
        self.http_address = ""
        self.default_mode = default_mode  # the mode of requests that name none (OpenAI clients)
        self.tool_call_parser = tool_call_parser  # the HTTP API's tool_choice "auto" ('' refuses it)
        self.reasoning_parser = reasoning_parser  # <think>...</think> apart from the answer ('' leaves it whole)
        self.host, self.port, self.threads = host, port, threads
        self.ray_cpus, self.pipelines, self.use_ray = ray_cpus, pipelines, use_ray
        self.start_timeout_s, self.cap, self.quiet = start_timeout_s, max_new_tokens_cap, quiet
        self.draft_port, self.target_port = draft_port, target_port
        # KV slots are preallocated: sessions x context positions (SmolLM2-135M: ~47 KB per position)
        self.max_sessions, self.max_context = max_sessions, max_context
        self.metrics_ports: dict[str, int] = {}  # kind -> Prometheus port of that replica (metrics=True)
        self._metrics = metrics
        self.procs: list[subprocess.Popen] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="specdec-stack-"))
        self.app = self.router = None
        self.settings: CoordinatorSettings | None = None  # the coordinator's, once started
        self.address = ""
        self._ray_started = False

    def _launch(self, kind: str, model: str, port: int, extra: list[str]) -> tuple[subprocess.Popen, Path]:
        logf = self.logdir / f"{kind}.log"
        options = self.replica_options[kind]
        if self._metrics and "metrics_port" not in options:
            self.metrics_ports[kind] = free_port()
        elif options.get("metrics_port"):
            self.metrics_ports[kind] = int(options["metrics_port"])
        cmd = [sys.executable, "-m", f"{kind}_service", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--metrics-port", str(self.metrics_ports.get(kind, 0)),
               "--threads", str(self.threads), "--log-level", self.log_level, "--grace-s", str(self.grace_s),
               "--max-sessions", str(self.max_sessions), "--max-context", str(self.max_context),
               "--dtype", self.dtype, "--prefix-cache" if self.prefix_cache else "--no-prefix-cache",
               "--exit-with-parent", str(os.getpid()),  # a parent killed without cleanup: no orphans
               *option_flags({k: v for k, v in options.items() if k != "metrics_port"}), *self.replica_args, *extra]
        env = child_environ(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        # quiet: each replica's log in a file (its tail reported if it fails to start); else on this process's stderr
        out = logf.open("w") if self.quiet else None
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                start_new_session=True)
        self.procs.append(proc)
        return proc, logf

    def _launch_relay(self, link: str, upstream: str) -> tuple[subprocess.Popen, str]:
        """A delay relay process in front of `upstream` (half the round trip each way), on a free port."""
        address = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "specdec_rpc.netem", "--upstream", upstream,
               "--delay-ms", str(self.emulate_rtt_ms / 2), "--listen-port", address.rsplit(":", 1)[1],
               "--exit-with-parent", str(os.getpid())]
        err = (self.logdir / f"relay-{link}.log").open("w") if self.quiet else None
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=child_environ(),
                                start_new_session=True)
        self.procs.append(proc)
        self.relays[link] = address
        return proc, address

    async def _relays_listening(self, procs: list[tuple[str, subprocess.Popen]]) -> None:
        """Wait for each relay's `listening` line (its socket accepts from then on)."""
        for link, proc in procs:
            try:
                line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            except asyncio.TimeoutError:
                line = b""  # stop() ends the process, and with it the read
            if not line.startswith(b"listening "):
                log_path = self.logdir / f"relay-{link}.log"
                tail = log_path.read_text()[-2000:] if log_path.exists() else "(its log is above)"
                raise RuntimeError(f"the {link} delay relay did not start (exit code {proc.poll()}):\n{tail}")

    async def start(self) -> str:
        # resolve (download/convert, with a progress bar) here, once, before the replicas load
        target_dir = str(resolve_model(self.target))
        draft_dir = str(resolve_model(self.draft)) if self.draft else None
        check_models(target_dir, draft_dir, self.target, self.draft)
        relay_procs: list[tuple[str, subprocess.Popen]] = []  # (link, relay process)
        waits: list[tuple] = []  # (endpoint, service, process, log file) of each replica
        tport, target_ep = self._start_target(target_dir, relay_procs, waits)
        draft_ep = ""
        if draft_dir:
            draft_ep = self._start_draft(draft_dir, target_dir, tport, target_ep, relay_procs, waits)
        await self._relays_listening(relay_procs)
        settings = self._coordinator_settings(target_dir, draft_ep, target_ep)
        self.settings = settings
        if self.use_ray:  # starts while the replicas load their models
            import ray  # lazy: ray (~0.6 s) loads only where the stack runs on Ray

            self._ray_started = not ray.is_initialized()
            # the actors' lines reach this process's output prefixed by Ray, which JSON lines must not be: with
            # log_format json they stay in Ray's session logs
            init_ray(settings, log_to_driver=not self.quiet and settings.log_format == "text")
        await self._start_coordinator(settings, waits)
        return self.address

    def _start_target(self, target_dir: str, relay_procs: list, waits: list) -> tuple[int, str]:
        """Launch the target replica, behind its coordinator-target relay with `emulate_rtt_ms` → (its port, the
        endpoint the coordinator dials)."""
        tport = self.target_port or free_port()
        target_ep = f"127.0.0.1:{tport}"
        if self.emulate_rtt_ms > 0:  # the coordinator dials the relays, the relays the replicas
            proc, target_ep = self._launch_relay("coordinator-target", f"127.0.0.1:{tport}")
            relay_procs.append(("coordinator-target", proc))
        proc, logf = self._launch("target", target_dir, tport, [])
        waits.append((f"127.0.0.1:{tport}", "specdec.v1.TargetService", proc, logf))
        return tport, target_ep

    def _start_draft(self, draft_dir: str, target_dir: str, tport: int, target_ep: str, relay_procs: list,
                     waits: list) -> str:
        """Launch the draft replica, behind its relays with `emulate_rtt_ms` (from the coordinator, and to the target
        replica `tport`) → the endpoint the coordinator dials."""
        dport = self.draft_port or free_port()
        draft_ep = f"127.0.0.1:{dport}"
        if self.emulate_rtt_ms > 0:
            proc, draft_ep = self._launch_relay("coordinator-draft", draft_ep)
            relay_procs.append(("coordinator-draft", proc))
            # the direct data plane: the draft replica dials the target endpoint the coordinator names
            # through a relay of its own
            proc, peer = self._launch_relay("draft-target", f"127.0.0.1:{tport}")
            relay_procs.append(("draft-target", proc))
            self.replica_options["draft"]["target_routes"] = ",".join(
                filter(None, (self._draft_routes, f"{target_ep}={peer}")))
        proc, logf = self._launch("draft", draft_dir, dport, self._draft_flags(draft_dir, target_dir))
        waits.append((f"127.0.0.1:{dport}", "specdec.v1.DraftService", proc, logf))
        return draft_ep

    def _draft_flags(self, draft_dir: str, target_dir: str) -> list[str]:
        """The draft replica's own flags: its pre-verifier, prompt lookup, and the target's vocabulary size."""
        extra = ["--preverifier", self.preverifier] if self.preverifier else []
        if self.prompt_lookup_min_ngram is not None:
            extra += ["--prompt-lookup-min-ngram", str(self.prompt_lookup_min_ngram)]
        target_vocab = config_vocab_size(target_dir)
        if 0 < config_vocab_size(draft_dir) < target_vocab:  # fewer rows, one tokenizer (specdec/text/vocab.py)
            extra += ["--target-vocab-size", str(target_vocab)]
        return extra

    def _coordinator_settings(self, target_dir: str, draft_ep: str, target_ep: str) -> CoordinatorSettings:
        return CoordinatorSettings(**{
            "host": self.host, "port": self.port, "metrics_port": 0, "tokenizer": target_dir,
            "draft_endpoints": draft_ep, "target_endpoints": target_ep, "ray": self.use_ray,
            "ray_num_cpus": self.ray_cpus, "pipelines": self.pipelines, "max_new_tokens_cap": self.cap,
            "grace_s": self.grace_s, "dns_refresh_s": 5.0, "log_level": self.log_level,
            "served_model_name": served_names(self.target), "default_mode": self.default_mode,
            "tool_call_parser": self.tool_call_parser, "reasoning_parser": self.reasoning_parser,
            "http_port": free_port(self.host) if self.http_port == 0 else self.http_port or 0,
            **self.coordinator_options})

    async def _start_coordinator(self, settings: CoordinatorSettings, waits: list) -> None:
        """Build the coordinator while the replicas load, refresh its pools once they serve, start its servers and
        set `address` (and `http_address`)."""
        # the coordinator's actors start while the replicas load; its pools are refreshed once they serve
        built = asyncio.ensure_future(build_coordinator(settings))
        try:
            await asyncio.gather(*(wait_serving(ep, svc, self.start_timeout_s, p, lf) for ep, svc, p, lf in waits))
        finally:
            self.app, self.router = await built
        pool = getattr(self.router, "pool_actor", None)
        await (pool.refresh.remote() if pool is not None else self.router.pool_manager.refresh())
        port = await self.app.start()
        host = '127.0.0.1' if self.host in ('0.0.0.0', '::', '') else self.host
        self.address = f"{host}:{port}"
        if self.app.http_port:
            self.http_address = f"http://{host}:{self.app.http_port}"

    async def stop(self) -> None:
        if self.app is not None:
            await self.app.shutdown(self.grace_s)
            self.app = None
        if self._ray_started:
            import ray  # lazy: as above

            ray.shutdown()
            self._ray_started = False
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
            if p.stdout is not None:  # a relay's
                p.stdout.close()
        self.procs.clear()
        self.relays.clear()

    async def __aenter__(self):
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc):
        await self.stop()

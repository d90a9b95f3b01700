"""Process configuration: one pydantic-settings class per service, env prefix + CLI flags.

Precedence (highest first): CLI flags, `<PREFIX>_*` environment variables (nested with `__`, e.g.
`DRAFT_TLS__CERT_FILE`), defaults. Besides this module only specdec/common/settings.py (the core's runtime switches,
read once) reads os.environ (tests/test_settings_env.py checks).
"""
from __future__ import annotations

import os
import re
import sys
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+)$")


class TLSSettings(BaseModel):
    """Optional TLS. Set cert_file + key_file to serve TLS; add ca_file + require_client_auth for mTLS."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_auth: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.key_file)


class ProcessSettings(BaseSettings):
    """Fields of every server process (the replicas and the coordinator): where it listens, its limits, its
    shutdown, TLS and logs. Subclasses set env_prefix and the default ports."""

    model_config = SettingsConfigDict(env_nested_delimiter="__", cli_kebab_case=True,
                                      cli_implicit_flags=True, extra="ignore")

    host: str = "0.0.0.0"
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port (0 disables)")
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="gRPC send/receive limit")
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    max_connection_age_ms: int = Field(0, ge=0, description="0 = unlimited; >0 makes clients re-resolve DNS")
    grace_s: float = Field(10.0, ge=0, description="drain time for in-flight RPCs on shutdown")
    drain_delay_s: float = Field(0.0, ge=0, description="wait after NOT_SERVING before stopping (LB catch-up)")
    exit_with_parent: int = Field(0, ge=0, description="shut down gracefully once the process with this pid is no "
                                  "longer this one's parent (0: never). Embedded stacks set it, so a parent killed "
                                  "without cleanup leaves no orphan servers")
    tls: TLSSettings = TLSSettings()
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = Field("text", description="log lines as text, or as one JSON object per "
                                                "line with the request id, session id, replica and timings "
                                                "(specdec_rpc/logs.py)")

    @classmethod
    def from_cli(cls, argv: list[str] | None = None, **overrides):
        """Build from env + CLI flags (argv=None reads sys.argv[1:]); overrides win over both."""
        args = sys.argv[1:] if argv is None else list(argv)
        return cls(_cli_parse_args=args, **overrides)


def startup_warnings(settings: ProcessSettings, environ=None) -> list[str]:
    """What a server logs as WARNING at start: its `<PREFIX>_*` environment variables that set no field (a misspelt
    name is otherwise ignored silently), and a replica's call queue shorter than two calls per session."""
    environ = os.environ if environ is None else environ
    prefix = settings.model_config.get("env_prefix", "")
    fields = set(type(settings).model_fields)
    out = []
    if prefix:
        def known(key: str) -> bool:
            rest = key[len(prefix):].upper()
            if rest.startswith("TLS_") and not rest.startswith("TLS__"):  # the flat spelling: read by the TLS
                return f"{prefix}TLS__{rest[4:]}" in environ            # probe, beside the nested one
            return rest.split("__")[0].lower() in fields
        unknown = sorted(k for k in environ if k.upper().startswith(prefix) and not known(k))
        if unknown:
            out.append(f"{', '.join(unknown)}: no such setting (`--help` lists them); ignored")
    queue, sessions = getattr(settings, "max_queue", None), getattr(settings, "max_sessions", None)
    if queue is not None and sessions is not None and queue < 2 * sessions:
        out.append(f"max_queue {queue} is under twice max_sessions ({sessions}): sessions can have two calls "
                   f"waiting each, and the rest are refused RESOURCE_EXHAUSTED (the coordinator backs off and "
                   f"resends them)")
    return out


class ServerSettings(ProcessSettings):
    """A model replica's fields (draft and target services), beside the process's."""

    model: str = Field("", description="model spec: local HF dir, .gguf file, hub id, or default-target/default-draft")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    dtype: str = Field("auto", description="weights/activations dtype; probabilities stay float32. auto: bf16 on "
                                          "GPUs and on CPUs with native bf16 GEMMs, else float32")
    threads: int = Field(0, ge=0, description="torch intra-op threads (0 keeps torch's default)")
    max_sessions: int = Field(16, ge=1, description="session slots (KV memory bound: each holds max_context positions)")
    session_ttl_s: float = Field(600.0, gt=0, description="idle sessions expire after this")
    data_port: int = Field(0, ge=-1, le=65535, description="the frame port: this replica's per-round streams on a "
                           "plain socket (TLS where gRPC is), the data plane's fastest wire, advertised by GetInfo "
                           "(specdec_rpc/frames.py). 0 picks a free port, -1 serves none (callers then use gRPC "
                           "streams)")
    frame_spin_us: int = Field(0, ge=0, le=100_000, description="how long a frame-port connection waits awake for "
                               "its next message before it sleeps in the event loop, in microseconds, where nothing "
                               "else waits for the loop (specdec_rpc/frames.py): a sleeping process is woken by the "
                               "kernel, which on a VM can cost more than the wait. It spends a core while it waits, "
                               "so it pays where cores are spare (a GPU host) and costs where they are not; 0: off")
    prefix_cache: bool = Field(True, description="a new session reuses the K/V of the longest run of whole prefill "
                               "chunks of its prompt that a slot holds (a live session's, or an ended one's until its "
                               "slot is reused); bitwise the same K/V as a prefill")
    prefill_chunk: int = Field(128, ge=0, description="positions per prefill forward, aligned to absolute positions; "
                               "the prefix cache reuses whole chunks (0: the whole prompt in one forward, no prefix "
                               "cache)")
    prefix_cache_slots: int = Field(2, ge=0, description="KV slots beyond max_sessions that keep recently ended "
                                    "sessions' prompts for the prefix cache while every session slot is busy (each "
                                    "costs a slot's KV memory)")
    interleave_prefill: bool = Field(True, description="run a prefill chunk by chunk, each chunk its own model-thread "
                                     "call, so other sessions' steps run between chunks (a long prompt stalls running "
                                     "streams by one chunk at a time); off: one call per prefill")
    lru_min_idle_s: float = Field(5.0, ge=0, description="when full, evict the LRU session if idle this long")
    otlp_traces_endpoint: str = Field("", description="export OpenTelemetry spans of prefill, draft, verify and "
                                      "batching waits, children of the coordinator's request spans (W3C "
                                      "traceparent), to this OTLP/gRPC endpoint (e.g. http://otel-collector:4317); "
                                      "'': no tracing")

    def worker_slots(self) -> int:
        """KV slots a worker allocates: the sessions', one for warm-up (never competing with them), and the prefix
        cache's own."""
        return self.max_sessions + 1 + (self.prefix_cache_slots if self.prefix_cache else 0)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE.match(v):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {v!r}")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {v!r}")
        return v


def resolve_device(spec: str):
    """Map a validated device string to torch.device; refuse CUDA when it is absent."""
    import torch  # lazy: settings stay importable without torch (~1.5 s)

    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {spec}: CUDA is not available on this machine; use --device cpu")
        dev = torch.device(spec)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return dev
    return torch.device("cpu")


"""Where pool members come from: a static list, a file re-read on every refresh, or a DNS name re-resolved.

A headless Kubernetes Service resolves to one A record per ready pod, all on the same port, so re-resolving the
name every few seconds is how the coordinator follows scale-out and scale-in. `resolve` is injectable so tests
can play the DNS server (loopback replicas on 127.0.0.2, 127.0.0.3, ... behind a resolver they control).
"""
from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Awaitable, Callable

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP addresses


def split_host_port(addr: str) -> tuple[str, int]:
    addr = addr.strip()
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class StaticSource:
    def __init__(self, endpoints: list[str]):
        self.endpoints = [join_host_port(*split_host_port(e)) for e in endpoints if e.strip()]

    async def resolve(self) -> list[str]:
        return list(self.endpoints)

    def __repr__(self) -> str:
        return f"static:{','.join(self.endpoints)}"


class FileSource:
    """One host:port per line (blank lines and # comments ignored), re-read on every refresh."""

    def __init__(self, path: str):
        self.path = Path(path)

    async def resolve(self) -> list[str]:
        if not self.path.is_file():
            return []
        lines = [ln.split("#", 1)[0].strip() for ln in self.path.read_text().splitlines()]
        return [join_host_port(*split_host_port(ln)) for ln in lines if ln]

    def __repr__(self) -> str:
        return f"file:{self.path}"


class DnsSource:
    """Every address `host` resolves to, each on `port` (a headless Service's ready pods)."""

    def __init__(self, addr: str, resolve: Resolver | None = None):
        self.host, self.port = split_host_port(addr)
        self._resolve = resolve or system_resolve

    async def resolve(self) -> list[str]:
        try:
            ips = await self._resolve(self.host, self.port)
        except OSError:  # NXDOMAIN / no ready pods: an empty pool, not an error of the coordinator
            return []
        return [join_host_port(ip, self.port) for ip in ips]

    def __repr__(self) -> str:
        return f"dns:{join_host_port(self.host, self.port)}"


def source_from_spec(spec: str, resolve: Resolver | None = None):
    """'static:a:1,b:2' | 'dns:host:port' | 'file:/path' | 'a:1,b:2' (static)."""
    kind, sep, rest = spec.partition(":")
    if sep and kind == "dns":
        return DnsSource(rest, resolve)
    if sep and kind == "file":
        return FileSource(rest)
    if sep and kind == "static":
        return StaticSource(rest.split(","))
    return StaticSource(spec.split(","))

"""How the coordinator dials replicas (`Dialer`: plaintext or TLS), and one gRPC channel (and stub) per replica
endpoint, shared by every request of a pipeline process."""
from __future__ import annotations

import ssl

import grpc

from specdec_rpc.channels import CHANNEL_OPTIONS, open_channel
from specdec_rpc.frames import FrameCall, FramePorts, client_ssl_context
from specdec_rpc.pb import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

# per-round stream method and response message of each kind of replica (their frame ports serve the same)
_ROUNDS = {"draft": ("DraftRounds", draft_pb2.DraftRoundsResponse),
           "target": ("VerifyRounds", target_pb2.VerifyRoundsResponse)}


class Dialer:
    """Opens channels to replicas: plaintext, or TLS with `credentials`. `server_names` (kind -> name): the name a
    replica's certificate is checked against. A pool found by DNS (`dns:host:port`, a headless Service) is dialed
    by pod IP, which no certificate names, so its replicas are checked against `host`; a replica dialed by name
    is checked against that name (no entry)."""

    def __init__(self, credentials: grpc.ChannelCredentials | None = None,
                 server_names: dict[str, str] | None = None, ssl_context: ssl.SSLContext | None = None):
        """`ssl_context`: the same trust and identity for the replicas' frame ports (None: plaintext)."""
        self.credentials = credentials
        self.server_names = dict(server_names or {})
        self.ssl_context = ssl_context

    @classmethod
    def from_tls(cls, tls: dict | None) -> "Dialer":
        """From `coordinator.server.client_tls`'s picklable dict (file paths and server names): the credentials
        are built in the process that dials (a Ray actor's own)."""
        if not tls:
            return cls()
        from specdec_rpc.tls import channel_credentials

        return cls(channel_credentials(tls["ca_file"], tls.get("cert_file"), tls.get("key_file")),
                   tls.get("server_names"),
                   client_ssl_context(tls["ca_file"], tls.get("cert_file"), tls.get("key_file")))

    def open(self, kind: str, endpoint: str, options=()) -> grpc.aio.Channel:
        return open_channel(endpoint, self.credentials, self.server_names.get(kind, ""), options)


class Channels:
    """One channel (and stub) per replica, shared by all requests of a pipeline process."""

    def __init__(self, dialer: Dialer | None = None):
        self.dialer = dialer or Dialer()
        self._ch: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, str], object] = {}  # (kind, endpoint) -> stub, built once
        self._feature_size: dict[str, int] = {}  # draft endpoint -> ModelInfo.feature_size
        self.frame_ports = FramePorts(self.dialer.ssl_context)  # the replicas' frame ports (specdec_rpc/frames.py)

    async def draft_feature_size(self, endpoint: str, timeout: float) -> int:
        """Whether (and how wide) the draft replica reads target features; asked once per endpoint."""
        if endpoint not in self._feature_size:
            r = await self.draft(endpoint).GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=timeout)
            self._feature_size[endpoint] = r.info.feature_size
        return self._feature_size[endpoint]

    async def frame_call(self, kind: str, endpoint: str, metadata, timeout: float) -> FrameCall | None:
        """A per-round call on the replica's frame port, or None where it serves none (`FramePorts`)."""
        if kind == "draft":
            get_info = lambda: self.draft(endpoint).GetInfo(draft_pb2.DraftServiceGetInfoRequest(),  # noqa: E731
                                                            timeout=timeout)
        else:
            get_info = lambda: self.target(endpoint).GetInfo(target_pb2.TargetServiceGetInfoRequest(),  # noqa: E731
                                                             timeout=timeout)
        method, response = _ROUNDS[kind]
        return await self.frame_ports.open(endpoint, method, response, get_info, metadata,
                                           self.dialer.server_names.get(kind, ""))

    def channel(self, kind: str, endpoint: str) -> grpc.aio.Channel:
        ch = self._ch.get(endpoint)
        if ch is None:
            ch = self._ch[endpoint] = self.dialer.open(kind, endpoint, CHANNEL_OPTIONS)
        return ch

    def _stub(self, kind: str, endpoint: str, cls):
        stub = self._stubs.get((kind, endpoint))
        if stub is None:
            stub = self._stubs[kind, endpoint] = cls(self.channel(kind, endpoint))
        return stub

    def draft(self, endpoint: str) -> draft_pb2_grpc.DraftServiceStub:
        return self._stub("draft", endpoint, draft_pb2_grpc.DraftServiceStub)

    def target(self, endpoint: str) -> target_pb2_grpc.TargetServiceStub:
        return self._stub("target", endpoint, target_pb2_grpc.TargetServiceStub)

    async def drop_except(self, keep: set[str]) -> None:
        for ep in [e for e in self._ch if e not in keep]:
            self._feature_size.pop(ep, None)
            self.frame_ports.forget(ep)
            self._stubs.pop(("draft", ep), None)
            self._stubs.pop(("target", ep), None)
            await self._ch.pop(ep).close()

    async def close(self) -> None:
        await self.drop_except(set())

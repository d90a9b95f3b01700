"""How a process dials a replica: the channel options every caller of a replica uses (the coordinator's pools,
and a draft replica calling its target on the direct data plane), plaintext or TLS."""
from __future__ import annotations

import grpc

CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
                   ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                   ("grpc.max_send_message_length", 16 * 1024 * 1024),
                   # a replica back after an outage (a restart on the same address) is reached within ~2 s: gRPC's
                   # default backoff grows to 120 s, and meanwhile every call failed UNAVAILABLE while the health
                   # check, on a channel of its own, said SERVING (8 s after a 20 s outage, 13 s after 60 s)
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 2_000)]


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None, server_name: str = "",
                 options=CHANNEL_OPTIONS) -> grpc.aio.Channel:
    """A channel to `address`: plaintext without `credentials`, else TLS, the peer's certificate checked against
    `server_name` where given (a replica dialed by pod IP), else against the address's host."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    extra = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.aio.secure_channel(address, credentials, options=list(options) + extra)

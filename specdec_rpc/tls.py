"""Optional TLS / mTLS credentials from PEM files (cert-manager or a mounted Secret)."""
from __future__ import annotations

from pathlib import Path

import grpc

from specdec_rpc.settings import TLSSettings


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"TLS {what} file {path!r} not found; fix tls.{what}_file")
    return p.read_bytes()


def server_credentials(tls: TLSSettings) -> grpc.ServerCredentials | None:
    """None when TLS is off. With require_client_auth, clients must present a cert signed by ca_file."""
    if not tls.enabled:
        return None
    if not (tls.cert_file and tls.key_file):
        raise ValueError("TLS needs both tls.cert_file and tls.key_file")
    if tls.require_client_auth and not tls.ca_file:
        raise ValueError("mTLS (tls.require_client_auth) needs tls.ca_file to check client certificates")
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file, "key"), _read(tls.cert_file, "cert"))],
        root_certificates=_read(tls.ca_file, "ca"),
        require_client_auth=tls.require_client_auth,
    )


def channel_credentials(ca_file: str | None = None, cert_file: str | None = None,
                        key_file: str | None = None) -> grpc.ChannelCredentials:
    """Client side: trust ca_file (system roots if None); present cert/key for mTLS."""
    return grpc.ssl_channel_credentials(_read(ca_file, "ca"), _read(key_file, "key"), _read(cert_file, "cert"))

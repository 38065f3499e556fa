"""TLS on the gRPC control plane: the certificate files of servers and clients.

A master started with ``--tls-cert`` and ``--tls-key`` (PEM files) serves gRPC over TLS
only; with ``--tls-client-ca`` too, it also requires each caller to present a certificate
signed by that CA (mutual TLS). A caller verifies the master's certificate against
``ca`` (a CA file; empty: the system's roots) and presents ``cert``/``key`` when given::

    MasterClient("10.0.0.5:50051", tls=TlsFiles(ca="/etc/kvstore/ca.pem"))
    KVClient.connect("10.0.0.5:50051", ns, ca_file="/etc/kvstore/ca.pem")
    kvctl --ca-file /etc/kvstore/ca.pem status              # or $KVSTORE_TLS_CA

Nodes take ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` as their client certificate).
A private key file must be readable by its owner only (a server or client refuses one
others can read, as with the auth file). A plaintext caller of a TLS port is refused by
the TLS handshake: its calls fail ``UNAVAILABLE`` (:class:`~kvstore.errors.Unreachable`).
A node started with ``--data-tls`` serves ``tls://`` with the same certificate; clients
verify it with the same files (:func:`data_context`).
"""

from __future__ import annotations

import os
import ssl
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.errors import InvalidArgument

__all__ = [
    "TlsFiles",
    "channel_credentials",
    "data_context",
    "server_credentials",
    "tls_from_env",
]


@dataclass(frozen=True)
class TlsFiles:
    """PEM file paths; empty strings: not given."""

    cert: str = ""
    """This side's certificate chain (a server's; a client's for mutual TLS)."""
    key: str = ""
    """Its private key."""
    ca: str = ""
    """A client: the CA the server's certificate must chain to (empty: system roots). A
    server: the CA its callers' certificates must chain to (empty: none required)."""

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgument(f"TLS {name} file must be a path string")
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("a TLS certificate needs its key and a key its certificate")

    @property
    def on(self) -> bool:
        """Whether anything is configured (a client: use TLS at all)."""
        return bool(self.cert or self.key or self.ca)


def _read(path: str, what: str, *, private: bool = False) -> bytes:
    p = Path(path)
    try:
        mode = p.stat().st_mode
        data = p.read_bytes()
    except (OSError, ValueError) as exc:  # (ValueError: a NUL in the path)
        raise InvalidArgument(f"TLS {what} {p}: {getattr(exc, 'strerror', None) or exc}") from None
    if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InvalidArgument(
            f"TLS {what} {p} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it"
        )
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"TLS {what} {p} is not a PEM file")
    return data


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """A server's credentials: ``cert``/``key`` required; ``ca`` set: client certificates
    required. Raises InvalidArgument naming the file and the problem."""
    if not files.cert:
        raise InvalidArgument("a TLS server needs --tls-cert and --tls-key")
    pair = (_read(files.key, "key", private=True), _read(files.cert, "certificate"))
    roots = _read(files.ca, "client CA") if files.ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=roots, require_client_auth=roots is not None
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A client's credentials (see :class:`TlsFiles`). Raises InvalidArgument."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files.ca, "CA") if files.ca else None,
        private_key=_read(files.key, "key", private=True) if files.key else None,
        certificate_chain=_read(files.cert, "certificate") if files.cert else None,
    )


def tls_from_env(
    cert: str | None = None,
    key: str | None = None,
    ca: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> TlsFiles:
    """The files given, each one not given (None) from ``$KVSTORE_TLS_CERT``,
    ``$KVSTORE_TLS_KEY``, ``$KVSTORE_TLS_CA`` (empty: unset); given ones win, so a
    half-set environment does not stand in the way of explicit files."""
    env = os.environ if environ is None else environ
    return TlsFiles(
        cert=env.get("KVSTORE_TLS_CERT", "") if cert is None else cert,
        key=env.get("KVSTORE_TLS_KEY", "") if key is None else key,
        ca=env.get("KVSTORE_TLS_CA", "") if ca is None else ca,
    )


def data_context(files: TlsFiles | None) -> ssl.SSLContext | None:
    """The context that verifies ``tls://`` data ports with the same files (the CA, and the
    client certificate if any); None when nothing is set (the system's roots then)."""
    if files is None or not files.on:
        return None
    from kvstore.transport.tls import client_context

    if files.key:
        _read(files.key, "key", private=True)
    return client_context(files.ca, files.cert, files.key)

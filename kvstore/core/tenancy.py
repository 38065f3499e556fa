"""Tenants the servers enforce: every name a client sends is scoped by its tenant.

With an auth file, every client token names its tenant (:mod:`kvstore.control.auth`) and a
data-port connection carries the tenant of its ticket (:mod:`kvstore.dataplane.handshake`).
A master and a node never take a client's namespace id as it comes: both derive the id
the pool stores under, the **pool id**, from the tenant and the client's id::

    tag(t)        = HMAC-SHA256(K, "tag" || t)[:8]
    pool_id(t, n) = tag(t) || HMAC-SHA256(K, "ns" || u16 len(t) || t || n)[:8]
    K             = HMAC-SHA256(cluster secret, "kvstore tenant scope v1")

so two tenants that send the same namespace and tokens (same block hashes) address
different slots, index entries, watches and aborts, and no client can name another
tenant's entries: it does not know ``K``, and whatever it sends is scoped by its own
tenant. This is the salt the server derives; a client's ``cache_salt`` still separates
namespaces within its tenant. Object keys are scoped the same way (:meth:`object_key`).
The tag prefix lets a master tell whether a pool id is a tenant's (:meth:`owns`: a
tenant's event stream) with no table. Without a cluster secret there are no tenants:
every id is its own pool id, as in the loopback quick start.
"""

from __future__ import annotations

import hmac
import struct

__all__ = ["TAG_BYTES", "TenantScope"]

TAG_BYTES = 8
"""Leading bytes of a pool id that name its tenant."""
_OBJECT_MARK = "\x00t:"
"""Object keys of a tenant start with this. Isolation does not rest on it (whatever key a
client sends is prefixed with its own tenant's tag); it marks the key in logs."""


class TenantScope:
    """Pool ids and object keys of tenants under one cluster secret (``None``: no tenants,
    every id its own)."""

    def __init__(self, cluster_secret: str | None) -> None:
        self._key = (
            hmac.digest(cluster_secret.encode(), b"kvstore tenant scope v1", "sha256")
            if cluster_secret
            else None
        )
        self._tags: dict[str, bytes] = {}

    @property
    def enabled(self) -> bool:
        """Whether ids are scoped (a cluster secret is configured)."""
        return self._key is not None

    def tag(self, tenant: str) -> bytes:
        """The 8 bytes every pool id of ``tenant`` starts with."""
        tag = self._tags.get(tenant)
        if tag is None:
            assert self._key is not None
            tag = hmac.digest(self._key, b"tag" + tenant.encode(), "sha256")[:TAG_BYTES]
            if len(self._tags) < 65536:  # (bounded: tenants come from auth files and tickets)
                self._tags[tenant] = tag
        return tag

    def pool_id(self, tenant: str, ns_id: bytes) -> bytes:
        """The id ``tenant``'s namespace ``ns_id`` is stored under (``ns_id`` itself for no
        tenant or no secret)."""
        if self._key is None or not tenant:
            return ns_id
        raw = tenant.encode()
        mac = hmac.digest(self._key, b"ns" + struct.pack("<H", len(raw)) + raw + ns_id, "sha256")
        return self.tag(tenant) + mac[: 16 - TAG_BYTES]

    def object_key(self, tenant: str, key: str) -> str:
        """The key ``tenant``'s object ``key`` is stored under."""
        if self._key is None or not tenant:
            return key
        return f"{_OBJECT_MARK}{self.tag(tenant).hex()}:{key}"

    def owns(self, tenant: str, pool_id: bytes) -> bool:
        """Whether ``pool_id`` is one of ``tenant``'s (every id, for no tenant)."""
        if self._key is None or not tenant:
            return True
        return pool_id[:TAG_BYTES] == self.tag(tenant)

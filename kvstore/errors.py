"""The one exception tree of kvstore; ``kvclient.errors`` re-exports it.

Every error the server, the client library or the core raises is a subclass of
:class:`KVStoreError`. Foreign exceptions (grpc, OSError, redis, NIXL) are translated at
the boundary with ``raise ... from exc`` so callers catch one family::

    KVStoreError
    ├── InvalidArgument          bad call: wrong shape, dtype, size string, flag ...
    │   ├── BadShape             tensor shape/dtype does not fit the namespace
    │   └── NamespaceMismatch    chunk or request belongs to another namespace
    ├── ChunkError               a buffer is not a valid chunk (never decoded)
    │   ├── ChunkFormatError     garbage, truncated, inconsistent header
    │   ├── ChunkVersionError    magic right, version unknown
    │   ├── ChecksumError        payload bits flipped
    │   ├── ChunkKeyMismatch     chunk carries another (block, layer, shard)
    │   └── ChunkSpecMismatch    chunk's shape, dtype or scheme is not its namespace's
    ├── CapacityError            pool full, oversized put, allocator exhausted
    ├── TransportError           data or control plane failure
    │   ├── Unreachable          cannot connect (refused, unknown host, no live node)
    │   │   └── MasterUnreachable  a node could not reach the master to commit (not stored)
    │   ├── PeerDisconnected     peer went away mid-exchange
    │   ├── ProtocolError        garbage, oversized or truncated frame
    │   └── UnknownScheme        address scheme with no registered backend
    ├── KVTimeout                a deadline passed (also a ``TimeoutError``)
    ├── Miss                     requested KV is not (or no longer) in the pool
    ├── StaleEpoch               a node spoke with a dead epoch: it must re-register
    ├── NodeIdTaken              a node id held by another process's live registration
    ├── Cancelled                the operation's handle was cancelled
    ├── Closed                   the client or server was closed
    └── Unauthorized             no valid token, or its role may not do this
        └── PermissionDenied     a valid token whose role may not call this
"""

from __future__ import annotations

__all__ = [
    "BadShape",
    "Cancelled",
    "CapacityError",
    "ChecksumError",
    "ChunkError",
    "ChunkFormatError",
    "ChunkKeyMismatch",
    "ChunkSpecMismatch",
    "ChunkVersionError",
    "Closed",
    "InvalidArgument",
    "KVStoreError",
    "KVTimeout",
    "MasterUnreachable",
    "Miss",
    "NamespaceMismatch",
    "NodeIdTaken",
    "PeerDisconnected",
    "PermissionDenied",
    "ProtocolError",
    "StaleEpoch",
    "TransportError",
    "Unauthorized",
    "UnknownScheme",
    "Unreachable",
]


class KVStoreError(Exception):
    """Base of every error kvstore raises."""


class InvalidArgument(KVStoreError, ValueError):
    """A call's arguments are invalid; nothing was changed."""


class BadShape(InvalidArgument):
    """A tensor's shape or dtype does not match the namespace or the call."""


class NamespaceMismatch(InvalidArgument):
    """A chunk, slot or request belongs to a different namespace."""


class ChunkError(KVStoreError):
    """A buffer is not a valid chunk; it was not decoded."""


class ChunkFormatError(ChunkError):
    """Garbage, a truncated buffer or an inconsistent header."""


class ChunkVersionError(ChunkError):
    """The magic matches but the format version is not one this build reads."""


class ChecksumError(ChunkError):
    """The chunk's checksum does not match its contents (bits flipped in flight or at rest)."""


class ChunkKeyMismatch(ChunkError):
    """The chunk is valid but carries another (block hash, layer, shard) than expected."""


class ChunkSpecMismatch(ChunkError):
    """The chunk is valid but its shape, dtype or scheme is not what its namespace stores
    (for example a chunk encoded from bfloat16 put into a float16 namespace)."""


class CapacityError(KVStoreError):
    """No room: the pool or a slab is full, or a value exceeds the configured maximum."""


class TransportError(KVStoreError):
    """A data-plane or control-plane exchange failed."""


class Unreachable(TransportError, ConnectionError):
    """The peer cannot be reached (refused, unresolvable, no live node)."""


class MasterUnreachable(Unreachable):
    """A node could not reach the pool's master to commit what a request changed (a put's
    chunks, an object, an eviction): the node answers, but nothing of it is known stored.
    Chunks that landed may still become readable once the node reaches the master again
    (it re-reports what it holds when it registers)."""


class PeerDisconnected(TransportError, ConnectionError):
    """The peer closed or died in the middle of an exchange."""


class ProtocolError(TransportError):
    """The peer sent something that is not a valid frame or message."""


class UnknownScheme(TransportError, ValueError):
    """An address uses a scheme that has no registered transport backend."""


class KVTimeout(KVStoreError, TimeoutError):
    """A deadline passed before the operation completed."""


class Miss(KVStoreError):
    """Requested KV is not in the pool. ``layer`` and ``blocks`` say what was missing."""

    def __init__(
        self, message: str, *, layer: int | None = None, blocks: list[int] | None = None
    ) -> None:
        super().__init__(message)
        self.layer = layer
        self.blocks = list(blocks or [])


class StaleEpoch(KVStoreError):
    """A node spoke with an epoch that is not its current live one: it must re-register.

    On the wire this is gRPC ``FAILED_PRECONDITION``.
    """


class Cancelled(KVStoreError):
    """The operation's handle was cancelled before it completed."""


class Closed(KVStoreError):
    """The client, connection or server has been closed."""


class Unauthorized(KVStoreError):
    """The master refused the call: no token, or one it does not know (gRPC
    ``UNAUTHENTICATED``); or a node's data port refused the connection's handshake (no
    ticket, an expired or forged one), or the node could not prove the cluster secret.
    Configure a token (``token=``, ``$KVSTORE_TOKEN``)."""


class NodeIdTaken(KVStoreError):
    """A node id is held by another process's live registration (gRPC ``ALREADY_EXISTS``):
    it frees when that registration's lease ends without a heartbeat. A restarted node
    waits for that; two live nodes need two ids."""


class PermissionDenied(Unauthorized):
    """A known token whose role may not make this call (gRPC ``PERMISSION_DENIED``; on a
    data port, a request the connection's role may not make)."""

"""The node's data-plane protocol in one place: typed messages
(:mod:`kvstore.dataplane.messages`, their limits and checked field readers in
:mod:`kvstore.dataplane.fields`) and :class:`NodeClient`, one method per exchange
(:mod:`kvstore.dataplane.client`). Cheap to import: no torch, no NIXL."""

from kvstore.dataplane.client import Connections, Dial, NodeClient
from kvstore.dataplane.messages import (
    BUSY,
    MAX_CHUNKS_PER_REQUEST,
    SEND,
    STORED,
    ChunkRef,
    PutChunk,
)

__all__ = [
    "BUSY",
    "MAX_CHUNKS_PER_REQUEST",
    "SEND",
    "STORED",
    "ChunkRef",
    "Connections",
    "Dial",
    "NodeClient",
    "PutChunk",
]

"""kvclient: the library inference engines embed to read and write the kvstore pool.

Pure parts need no server: :func:`block_hashes`, :func:`encode_chunk`,
:func:`decode_chunk`. Every error raised is a :class:`kvclient.errors.KVStoreError`.
"""

from __future__ import annotations

from kvstore.core.codec import ChunkKey, decode_chunk, encode_chunk
from kvstore.core.hashing import BlockHash, Namespace, block_hashes
from kvstore.core.routing import Instance, RouteChoice

from . import errors
from .client import KVClient
from .errors import KVStoreError
from .handles import Handle, Result, StreamHandle
from .routing import PoolIndex
from .sync import SyncKVClient

__all__ = [
    "BlockHash",
    "ChunkKey",
    "Handle",
    "Instance",
    "KVClient",
    "KVStoreError",
    "Namespace",
    "PoolIndex",
    "Result",
    "RouteChoice",
    "StreamHandle",
    "SyncKVClient",
    "block_hashes",
    "decode_chunk",
    "encode_chunk",
    "errors",
]

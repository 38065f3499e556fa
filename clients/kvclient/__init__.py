"""kvclient: the library inference engines embed to read and write the kvstore pool.

Pure parts need no server: :func:`block_hashes`, :func:`encode_chunk`,
:func:`decode_chunk`. Every error raised is a :class:`kvclient.errors.KVStoreError`.
"""

from __future__ import annotations

from kvstore.core.codec import ChunkKey, decode_chunk, encode_chunk
from kvstore.core.hashing import BlockHash, Namespace, block_hashes

from . import errors
from .client import KVClient
from .errors import KVStoreError
from .handles import Handle, Result, StreamHandle
from .sync import SyncKVClient

__all__ = [
    "BlockHash",
    "ChunkKey",
    "Handle",
    "KVClient",
    "KVStoreError",
    "Namespace",
    "Result",
    "StreamHandle",
    "SyncKVClient",
    "block_hashes",
    "decode_chunk",
    "encode_chunk",
    "errors",
]

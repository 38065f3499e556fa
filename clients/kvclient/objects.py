"""``put_object`` / ``get_object`` / ``exists`` / ``remove`` of :class:`~kvclient.KVClient`:
small named values beside the KV (engine metadata, say), placed like
blocks (HRW on the key's hash), never evicted automatically, the last writer wins.

The last writer is the one whose put started last by its host's clock: every value carries
its writer's version (``time.time_ns()`` at the put), a node keeps the newer of two values
of a key, the master lists holders newest version first, and a read takes the newest
version only. Placement moves as nodes join and fill, so two puts of a key may land on
different nodes: a put then removes the key from the holders it did not write (best
effort), and a read never falls back to an older version, which would be a stale value.
Clocks of different writers are trusted to within the time between their puts of a key.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import xxhash

from kvstore.dataplane.messages import MAX_KEY_LEN
from kvstore.errors import CapacityError, InvalidArgument, KVTimeout, TransportError

from . import args

if TYPE_CHECKING:
    from .client import ClientCore as _Base
else:
    _Base = object

__all__ = ["ObjectOps"]

logger = logging.getLogger("kvclient")


class ObjectOps(_Base):
    """Mixin of :class:`~kvclient.KVClient` with the object calls."""

    def _object_key(self, key: str) -> bytes:
        key = args.text(key, "object key", MAX_KEY_LEN, empty=False)
        return xxhash.xxh3_128_digest(key.encode())

    async def put_object(
        self, key: str, value: bytes | bytearray | memoryview, *, timeout: float | None = None
    ) -> None:
        """Store ``value`` under ``key``, replacing what it held (the last writer wins).

        Raises :class:`CapacityError` over ``max_object_bytes`` or when the node is full,
        :class:`KVTimeout`, transport errors.
        """
        hkey = self._object_key(key)
        if isinstance(value, str):
            raise InvalidArgument("value must be bytes-like, got str (encode it)")
        try:
            view = memoryview(value)
        except TypeError:
            raise InvalidArgument(f"value must be bytes-like, got {type(value).__name__}") from None
        if not view.c_contiguous:
            raise InvalidArgument("value is not one contiguous buffer (copy it into one)")
        try:
            view = view.cast("B")
        except (TypeError, ValueError) as exc:  # (a view of an odd format)
            raise InvalidArgument(f"value is not one contiguous buffer: {exc}") from None
        if view.nbytes > self.max_object_bytes:
            raise CapacityError(
                f"object of {view.nbytes} bytes exceeds max_object_bytes={self.max_object_bytes}"
            )

        version = time.time_ns()

        async def run() -> None:
            nodes = await self._live_nodes()
            placed = {n.data_uri for n in self._place(hkey, nodes)}
            for uri in placed:
                await self._node(uri).put_object(key, view, version)
            for holder in await self._master.lookup_object(key):
                if holder.data_uri not in placed and holder.version <= version:
                    await self._forget_object(holder.data_uri, key)

        try:
            await self._deadline(run(), timeout, "put_object")
        except (TransportError, KVTimeout):  # (the node, or the link to it, failed)
            self._distrust_nodes()
            raise

    async def get_object(self, key: str, *, timeout: float | None = None) -> bytes | None:
        """The value stored under ``key``, or ``None`` when it is not in the pool."""
        self._object_key(key)

        async def run() -> bytes | None:
            holders = await self._master.lookup_object(key)
            newest = max((h.version for h in holders), default=0)
            for holder in holders:
                if holder.version < newest:
                    continue  # (an older value: stale while a newer one is known)
                try:
                    value = await self._node(holder.data_uri).get_object(key)
                    if value is not None:
                        return value
                except TransportError as exc:
                    logger.warning("get_object from %s failed: %s", holder.data_uri, exc)
            return None

        return await self._deadline(run(), timeout, "get_object")  # type: ignore[no-any-return]

    async def _forget_object(self, uri: str, key: str) -> None:
        """Remove ``key`` from the node at ``uri``, which holds an older value of it (a
        failure is logged: a read never takes the older value while a newer is listed)."""
        try:
            await self._node(uri).remove_object(key)
        except (TransportError, KVTimeout) as exc:
            logger.warning("removing the older %r from %s failed: %s", key, uri, exc)

    async def exists(self, key: str, *, timeout: float | None = None) -> bool:
        """Whether a live node holds ``key``."""
        self._object_key(key)
        holders = await self._deadline(self._master.lookup_object(key), timeout, "exists")
        return bool(holders)

    async def remove(self, key: str, *, timeout: float | None = None) -> bool:
        """Remove ``key`` from every holder; True if something was removed."""
        self._object_key(key)

        async def run() -> bool:
            removed = False
            for holder in await self._master.lookup_object(key):
                removed = await self._node(holder.data_uri).remove_object(key) or removed
            return removed

        return bool(await self._deadline(run(), timeout, "remove"))

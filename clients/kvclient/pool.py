"""Data-plane connections to storage nodes, reused across calls.

One request is in flight per connection (see ``kvstore.node.protocol``), so each node gets
a small bounded pool. A connection that saw an error mid-exchange is closed, never
returned to the pool: its byte stream may be unframed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvstore.errors import Closed
from kvstore.transport import connect
from kvstore.transport.base import Connection

__all__ = ["ConnectionPool"]


class ConnectionPool:
    """Up to ``per_node`` connections per data URI; ``close()`` closes them all."""

    def __init__(self, per_node: int = 4) -> None:
        self._per_node = per_node
        self._idle: dict[str, deque[Connection]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._closed = False

    @asynccontextmanager
    async def use(self, uri: str, timeout: float) -> AsyncIterator[Connection]:
        """A connection to ``uri`` for one exchange.

        Waits for a free connection at most ``timeout`` seconds (the caller's deadline
        bounds it). On normal exit the connection returns to the pool; when the body raises,
        it is closed. Raises :class:`Closed` after :meth:`close`, and what ``connect``
        raises (``Unreachable``, ``KVTimeout``).
        """
        if self._closed:
            raise Closed("client is closed")
        sem = self._slots.setdefault(uri, asyncio.Semaphore(self._per_node))
        async with sem:
            idle = self._idle.setdefault(uri, deque())
            conn = None
            while idle and conn is None:
                candidate = idle.popleft()
                conn = None if candidate.closed else candidate
            if conn is None:
                conn = await connect(uri, timeout=timeout)
            try:
                yield conn
            except BaseException:
                await conn.close()
                raise
            if self._closed or conn.closed:
                await conn.close()
            else:
                idle.append(conn)

    async def discard(self, uri: str) -> None:
        """Close the idle connections to ``uri`` (after the node failed)."""
        for conn in self._idle.pop(uri, deque()):
            await conn.close()

    async def close(self) -> None:
        """Close every idle connection; connections in use close when released."""
        self._closed = True
        for uri in list(self._idle):
            await self.discard(uri)

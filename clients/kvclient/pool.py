"""Data-plane connections to storage nodes, reused across calls.

One request is in flight per connection (see ``kvstore.dataplane.messages``), so each node gets
a small bounded pool. A connection that saw an error mid-exchange is closed, never
returned to the pool: its byte stream may be unframed.

A node closes a connection that carried no request for its ``idle_timeout_s`` (60 s by
default). The pool never lets that reach a caller: it retires a kept connection after
``max_idle_s`` (30 s by default, below the node's, so the pool lets go first), and before
handing one out it checks that the node has not closed it meanwhile
(:meth:`~kvstore.transport.base.Connection.reusable`: a node configured with a shorter
timeout, or one that restarted); either way the caller's exchange runs on a fresh one.

With ``tickets`` (a secured pool) each new connection first authenticates
(:mod:`kvstore.dataplane.handshake`): one round trip, once per connection, not per exchange.
A node serving ``tls://`` is verified with ``ssl_context`` (the CA of the client's TLS
files).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvstore.dataplane.handshake import TicketSource, dial
from kvstore.errors import Closed, InvalidArgument
from kvstore.transport.base import Connection

__all__ = ["DEFAULT_MAX_IDLE_S", "ConnectionPool"]

DEFAULT_MAX_IDLE_S = 30.0
"""How long a kept connection may sit unused before the pool closes it instead of reusing
it: half the node's default ``idle_timeout_s`` (60 s), so that the client retires a
connection well before the node would close it under a request."""


class ConnectionPool:
    """Up to ``per_node`` connections per data URI; ``close()`` closes them all.

    Raises :class:`InvalidArgument` for ``per_node`` < 1 or ``max_idle_s`` not > 0.
    """

    def __init__(
        self,
        per_node: int = 4,
        *,
        max_idle_s: float = DEFAULT_MAX_IDLE_S,
        tickets: TicketSource | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if per_node < 1:
            raise InvalidArgument(f"per_node must be >= 1, got {per_node}")
        if not max_idle_s > 0:
            raise InvalidArgument(f"max_idle_s must be > 0, got {max_idle_s}")
        self._per_node = per_node
        self._max_idle_s = max_idle_s
        self._tickets = tickets
        self._ssl_context = ssl_context
        self._idle: dict[str, deque[tuple[Connection, float]]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._closed = False

    @asynccontextmanager
    async def use(self, uri: str, timeout: float) -> AsyncIterator[Connection]:
        """A connection to ``uri`` for one exchange.

        A kept connection is reused only when it sat unused less than ``max_idle_s`` and is
        still :meth:`~kvstore.transport.base.Connection.reusable`; else it is closed and a
        new one dialled. Waits for a free connection at most ``timeout`` seconds (the
        caller's deadline bounds it). On normal exit the connection returns to the pool;
        when the body raises, it is closed. Raises :class:`Closed` after :meth:`close`, and
        what ``connect`` raises (``Unreachable``, ``KVTimeout``).
        """
        if self._closed:
            raise Closed("client is closed")
        sem = self._slots.setdefault(uri, asyncio.Semaphore(self._per_node))
        async with sem:
            idle = self._idle.setdefault(uri, deque())
            conn = await self._kept(idle)
            if conn is None:
                conn = await dial(uri, timeout, self._tickets, self._ssl_context)
            try:
                yield conn
            except BaseException:
                await conn.close()
                raise
            if self._closed or conn.closed:
                await conn.close()
            else:
                idle.append((conn, time.monotonic()))

    async def _kept(self, idle: deque[tuple[Connection, float]]) -> Connection | None:
        """The most recently returned kept connection still fit to reuse; closes the rest
        it looks at (stale ones age out from the front)."""
        fresh_since = time.monotonic() - self._max_idle_s
        while idle and idle[0][1] < fresh_since:
            await idle.popleft()[0].close()
        while idle:
            conn, _ = idle.pop()
            if conn.reusable():
                return conn
            await conn.close()
        return None

    async def discard(self, uri: str) -> None:
        """Close the idle connections to ``uri`` (after the node failed)."""
        for conn, _ in self._idle.pop(uri, deque()):
            await conn.close()

    async def close(self) -> None:
        """Close every idle connection; connections in use close when released."""
        self._closed = True
        for uri in list(self._idle):
            await self.discard(uri)

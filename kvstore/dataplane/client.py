"""``NodeClient``: one storage node's data port, one method per exchange of
:mod:`kvstore.dataplane.messages`. The client library, ``kvctl``, the benchmarks and the tests
speak to nodes through it; nothing else builds or parses a data-plane header.

Every method runs one exchange on a connection from its :class:`Connections` (a pool, or a
fresh dial per exchange) and gives it back on success; a failure mid-exchange closes that
connection (its byte stream may be unframed). Each step has the client's ``timeout_s``.
Raises what the node's :class:`~kvstore.dataplane.messages.Error` stands for and the
transport's errors (:class:`~kvstore.errors.TransportError` subclasses,
:class:`~kvstore.errors.KVTimeout`). Imports neither torch nor NIXL.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

from kvstore.dataplane.handshake import TicketSource, dial
from kvstore.dataplane.messages import (
    Ack,
    ChunkRef,
    Data,
    Evict,
    Evicted,
    Found,
    Get,
    GetObject,
    Held,
    Hold,
    Landed,
    Lease,
    Leased,
    NodeStats,
    Put,
    PutChunk,
    PutObject,
    Ready,
    Release,
    Removed,
    RemoveObject,
    Report,
    Reported,
    Stats,
    Unheld,
    Unhold,
    expect,
)
from kvstore.errors import ProtocolError
from kvstore.transport.base import Buffer, Connection

__all__ = ["Connections", "Dial", "NodeClient"]


class Connections(Protocol):
    """Where a :class:`NodeClient` gets a connection for one exchange (kvclient's
    ``ConnectionPool`` is one): the connection goes back on normal exit, is closed when the
    body raises."""

    def use(self, uri: str, timeout: float) -> AbstractAsyncContextManager[Connection]:
        """A connection to ``uri`` for one exchange, dialled within ``timeout``."""
        ...


class Dial:
    """:class:`Connections` that dials a new connection per exchange and closes it after
    (for ``kvctl`` and one-off exchanges); with ``tickets``, each authenticates first;
    ``ssl_context`` verifies ``tls://`` nodes."""

    def __init__(
        self, tickets: TicketSource | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.tickets = tickets
        self.ssl_context = ssl_context

    @asynccontextmanager
    async def use(self, uri: str, timeout: float) -> AsyncIterator[Connection]:
        """A fresh connection to ``uri``, closed when the exchange ends."""
        conn = await dial(uri, timeout, self.tickets, self.ssl_context)
        try:
            yield conn
        finally:
            await conn.close()


class NodeClient:
    """The data port of the node at ``uri``; see the module docstring for errors."""

    def __init__(
        self, uri: str, connections: Connections | None = None, *, timeout_s: float = 10.0
    ):
        self.uri = uri
        self.timeout_s = timeout_s
        self._connections = connections if connections is not None else Dial()

    def _use(self) -> AbstractAsyncContextManager[Connection]:
        return self._connections.use(self.uri, self.timeout_s)

    async def _ask(
        self, conn: Connection, request: Any, buffers: Sequence[Buffer] = ()
    ) -> dict[str, Any]:
        await conn.send(request.header(), buffers, timeout=self.timeout_s)
        frame = await conn.recv_header(self.timeout_s)
        if frame.sizes and frame.header.get("op") != "data":
            raise ProtocolError(f"answer {frame.header.get('op')!r} carries an unexpected payload")
        return frame.header

    # ---------------------------------------------------------------- chunks

    async def put(
        self,
        ns: bytes,
        chunks: Sequence[PutChunk],
        buffers: Sequence[Buffer],
        wait_s: float = 0.0,
        *,
        tenant: str = "",
    ) -> Ack:
        """``tcp://`` put of ``chunks`` in one round trip: one frame carries every chunk
        (``buffers[i]`` holds chunk ``i``); the node checks and commits those it stores and
        acks. ``wait_s``: how long the node may wait for another writer's transfer of one of
        these chunks before answering it BUSY (not stored). ``tenant``: whose chunks they
        are (a node's or an admin's connection only; a client's are its own)."""
        request = Put(ns, tuple(chunks), wait_s, tenant=tenant)
        async with self._use() as conn:
            return expect(await self._ask(conn, request, buffers), Ack)

    async def reserve(
        self,
        ns: bytes,
        chunks: Sequence[PutChunk],
        write: Callable[[Ready], Awaitable[None]],
        wait_s: float = 0.0,
        *,
        writer: str = "",
        grant: Sequence[int] = (),
    ) -> Ack:
        """``ucx://`` put: the node pins slots and answers their spans; ``write(ready)``
        WRITEs each SEND chunk (``ready.sending()``) into its span; then ``landed``, and the
        node checks and commits them; its ack says what is stored (and, given ``writer``
        and ``grant``, which of those chunk indices of these blocks it granted)."""
        async with self._use() as conn:
            request = Put(ns, tuple(chunks), wait_s, True, False, writer, tuple(grant))
            ready = expect(await self._ask(conn, request), Ready, "reserved")
            self._check_accept(ready, len(chunks))
            await write(ready)
            return expect(await self._ask(conn, Landed()), Ack)

    async def write(
        self,
        ns: bytes,
        chunks: Sequence[PutChunk],
        writer: str,
        grant: Sequence[int] = (),
        wait_s: float = 0.0,
    ) -> Ack:
        """``ucx://`` put of chunks this writer has already WRITTEN at the locations of its
        grants: one round trip. The node checks and commits those it granted (the rest are
        ``failed``) and may grant ``grant`` again."""
        async with self._use() as conn:
            request = Put(ns, tuple(chunks), wait_s, True, True, writer, tuple(grant))
            return expect(await self._ask(conn, request), Ack)

    @staticmethod
    def _check_accept(ready: Ready, n: int) -> None:
        if len(ready.accept) != n:
            raise ProtocolError(f"node answered {len(ready.accept)} accept values for {n} chunks")

    async def get(
        self,
        ns_id: bytes,
        chunks: Sequence[ChunkRef],
        into: Callable[[list[int]], Sequence[Buffer]],
    ) -> list[int]:
        """``tcp://`` read: the positions of ``chunks`` found, their bytes received into
        ``into(found)`` (one writable buffer per found chunk, sized as the node sends)."""
        async with self._use() as conn:
            header = await self._ask(conn, Get(ns_id, tuple(chunks)))
            found = expect(header, Found).present(len(chunks))
            await conn.recv_payload_into(into(found), self.timeout_s)
        return found

    @asynccontextmanager
    async def lease(
        self, ns_id: bytes, chunks: Sequence[ChunkRef], lease_s: float
    ) -> AsyncIterator[tuple[list[int], Leased]]:
        """``ucx://`` read: ``async with node.lease(...) as (found, leased):`` — the found
        positions and their spans, pinned on the node until the block exits (then
        ``release``) or ``leased.lease_s`` passes."""
        async with self._use() as conn:
            leased = expect(await self._ask(conn, Lease(ns_id, tuple(chunks), lease_s)), Leased)
            found = Found(leased.found).present(len(chunks))
            yield found, leased
            await conn.send(Release().header(), timeout=self.timeout_s)

    async def report(self, ns_id: bytes, chunks: Sequence[ChunkRef]) -> int:
        """Tell the node these chunks failed verification here; how many it dropped."""
        async with self._use() as conn:
            return expect(await self._ask(conn, Report(ns_id, tuple(chunks))), Reported).dropped

    async def hold(self, ns_id: bytes, blocks: Sequence[bytes], ttl_s: float) -> Held:
        """Pin the leading present ``blocks`` for ``ttl_s``."""
        async with self._use() as conn:
            return expect(await self._ask(conn, Hold(ns_id, tuple(blocks), ttl_s)), Held)

    async def unhold(self, hold_id: str) -> bool:
        """Release a hold; whether it existed."""
        async with self._use() as conn:
            return expect(await self._ask(conn, Unhold(hold_id)), Unheld, "ok").released

    async def evict(
        self, ns_id: bytes, blocks: Sequence[bytes] | None = None, *, tenant: str = ""
    ) -> Evicted:
        """Evict ``blocks`` of a namespace (all of it when None); pinned slots are kept.
        ``tenant``: whose namespace it is (an admin's connection; ``""``: the connection's
        own tenant, or the untenanted ids)."""
        request = Evict(ns_id, None if blocks is None else tuple(blocks), tenant)
        async with self._use() as conn:
            return expect(await self._ask(conn, request), Evicted)

    async def stats(self) -> dict[str, Any]:
        """The node's own counters (see :class:`~kvstore.dataplane.messages.NodeStats`)."""
        async with self._use() as conn:
            return expect(await self._ask(conn, Stats()), NodeStats).counters

    # ---------------------------------------------------------------- objects

    async def put_object(self, key: str, value: Buffer, version: int = 0) -> None:
        """Store ``value`` under ``key`` (a byte buffer) as the writer's ``version`` (the
        node keeps it unless it holds a newer one)."""
        view = memoryview(value).cast("B")
        async with self._use() as conn:
            ready = expect(await self._ask(conn, PutObject(key, view.nbytes, version)), Ready)
            expect(await self._ask(conn, Data(), [view] if ready.sending() else []), Ack)

    async def get_object(self, key: str) -> bytes | None:
        """The value of ``key`` on this node, or None."""
        async with self._use() as conn:
            found = expect(await self._ask(conn, GetObject(key)), Found).present(1)
            values = await conn.recv_payload(self.timeout_s)
        if found and len(values) != 1:
            raise ProtocolError("an object answer carries one value")
        return bytes(values[0]) if found else None

    async def remove_object(self, key: str) -> bool:
        """Remove ``key`` here; whether it existed."""
        async with self._use() as conn:
            return expect(await self._ask(conn, RemoveObject(key)), Removed, "ok").removed

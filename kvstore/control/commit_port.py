"""Node commits over the master's commit port: one framed exchange per batch.

Every put's ack waits for its node's commit, so on a cluster (a ``kvstore master`` apart
from its nodes) the commit's round trip is on every put's path. Over gRPC a commit costs
its node and its master far more than the master's own work: a ``CommitStream`` message
~0.3-0.45 ms of the node's CPU and ~0.3-0.6 ms of the master's on the AMD VM, against
59-74 µs for the master's apply (``bench/commit_path.py``), almost all of it grpc.aio's
per-message overhead. The master therefore also listens on a *commit port*, framed as a
node's data port frames its exchanges (:mod:`kvstore.transport.framing`); a node sends
its batches there and keeps ``CommitStream`` and the unary ``Commit`` as its fallbacks
(``bench/commit_rpc.py`` measures the three side by side; docs/decisions.md).

The exchange, one batch at a time on a connection (the node speaks first)::

    N: {op: commit} + one buffer: the batch as a serialized CommitRequest (session too)
    M: {op: committed, applied_seq}
     | {op: refused, status, message}   the master's verdict on the batch, as the status
                                        ``Commit`` answers it with (its gRPC name)

The master applies each batch exactly as ``Commit`` does (the same session check, epoch
and seq rules and latency metric). A master with an auth file first runs the data port's
handshake (:mod:`kvstore.dataplane.handshake`) on each connection, and serves only a
ticket of role ``node`` (one the node issues itself from the cluster secret); one with
TLS serves ``tls://`` with its gRPC certificate. Anything else on the port (garbage, a
frame of another op, an idle or half-sent connection) is answered ``{op: error}`` where it
can be and closed (a batch over the size bound is closed unanswered), and costs no other
connection anything: the port is a :class:`~kvstore.transport.base.Listener` with its
bounds.

A master tells a node its commit port in ``RegisterResponse.commit_port`` and
``CommitResponse.commit_port`` (0: none); the node dials it on the host it reaches that
master at. Imports neither torch nor NIXL.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvstore.dataplane.handshake import (
    Peer,
    RoleForbidden,
    TicketSource,
    accept,
    dial,
)
from kvstore.dataplane.messages import Error
from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    ProtocolError,
    TransportError,
    Unauthorized,
)
from kvstore.transport import listen
from kvstore.transport.base import Connection, Listener, with_timeout
from kvstore.transport.framing import Frame, FrameLimits

__all__ = ["CommitLink", "CommitPort", "CommitRefused", "commit_uri"]

log = logging.getLogger("kvstore.control.commit_port")

HEADER_BYTES = 4096
"""Longest frame header the port takes (``{op: commit}`` needs a dozen bytes)."""
IDLE_S = 300.0
"""A connection without a frame for this long is closed (its node dials again)."""
START_S = 10.0
"""A frame's prefix must arrive whole within this long of its first byte (and a TLS or
ticket handshake complete within it)."""
IO_S = 10.0
"""Most time the master waits for a batch's bytes, or to send an answer."""
APPLY_S = 10.0
"""Most time a batch may take to apply (a node's whole commit deadline, by default): one
past it is answered DEADLINE_EXCEEDED, as gRPC ends a call at its deadline, so a store
that hangs holds no connection for longer."""
MAX_CONNECTIONS = 4096
"""Connections served at once: a node keeps one."""


class CommitRefused(Exception):
    """The master's verdict on a batch: ``status`` is what ``Commit`` answers it with
    (:class:`~kvstore.control.client.MasterClient` raises its typed error)."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def commit_uri(master: str, port: int, *, tls: bool) -> str:
    """The commit port's URI on the host of ``master`` (its gRPC ``host:port``)."""
    host = master.rsplit(":", 1)[0] if master.count(":") == 1 or master.startswith("[") else master
    return f"{'tls' if tls else 'tcp'}://{host}:{port}"


# ------------------------------------------------------------------------------- master side


class CommitPort:
    """The master's commit port: a listener on ``host:port`` (0: a free port) applying each
    batch with ``apply`` (the serialized CommitRequest → the applied seq; raises the
    master's typed errors; at most :data:`APPLY_S`). ``root``: the ticket root of the
    cluster secret (None: no handshake); ``ssl_context``: a TLS server context (None:
    plaintext); ``on_link``: called once per connection, at its first commit (a node's link
    sends one; a port scanner's connection never does)."""

    def __init__(
        self,
        apply: Callable[[bytes | bytearray], Awaitable[int]],
        status_of: Callable[[KVStoreError], grpc.StatusCode],
        *,
        host: str,
        port: int,
        max_bytes: int,
        root: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        on_link: Callable[[], None] | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"commit port {port} out of range")
        self._apply = apply
        self._status_of = status_of
        self._root = root
        self._on_link = on_link
        scheme = "tls" if ssl_context is not None else "tcp"
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
        options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context else {}
        self._listener: Listener = listen(
            f"{scheme}://{bracketed}:{port}",
            self._serve,
            limits=FrameLimits(
                max_header_bytes=HEADER_BYTES,
                max_buffers=1,
                max_buffer_bytes=max_bytes,
                max_payload_bytes=max_bytes,
            ),
            max_connections=MAX_CONNECTIONS,
            idle_timeout=IDLE_S,
            header_timeout=START_S,
            refusal=lambda exc: Error.of(exc).header(),
            **options,
        )
        self.port = 0
        """The bound port (after :meth:`start`)."""

    async def start(self) -> None:
        """Bind and serve. Raises :class:`TransportError` if the port cannot be bound."""
        await self._listener.start()
        self.port = int(self._listener.address.rsplit(":", 1)[1])

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting and close every connection (a batch being applied gets
        ``grace`` seconds); idempotent."""
        await self._listener.stop(grace)

    async def _serve(self, conn: Connection) -> None:
        """One node's connection: the handshake (with a cluster secret), then its batches
        one after another until it closes."""
        if self._root is not None:
            try:
                peer = await accept(conn, self._root, START_S)
            except (KVStoreError, OSError) as exc:
                log.info("commit connection %s refused: %s", conn.peer, exc)
                return
            if not await self._node_only(conn, peer):
                return
        counted = False
        while not conn.closed:
            try:
                frame = await conn.recv_header(timeout=None)
            except KVStoreError:  # closed, idle, garbage (the listener's bounds)
                return
            try:
                if frame.header.get("op") != "commit" or len(frame.sizes) != 1:
                    raise ProtocolError(
                        "the commit port takes {op: commit} with one buffer, a CommitRequest"
                    )
                (data,) = await conn.recv_payload(IO_S)
                if not counted and self._on_link is not None:
                    counted = True  # (a node's link: it sent a commit; garbage never does)
                    self._on_link()
            except KVStoreError as exc:
                log.info("commit connection %s closed: %s", conn.peer, exc)
                if not conn.closed:
                    await _answer(conn, Error.of(exc).header())
                return
            try:
                applied = await with_timeout(self._apply(data), APPLY_S, "apply a commit")
            except KVStoreError as exc:
                status = self._status_of(exc)
                answer = {"op": "refused", "status": status.name, "message": str(exc)}
            else:
                answer = {"op": "committed", "applied_seq": applied}
            if not await _answer(conn, answer):
                return

    async def _node_only(self, conn: Connection, peer: Peer) -> bool:
        if peer.role == "node":
            return True
        exc = RoleForbidden(f"the commit port serves nodes, not a {peer.role!r} ticket")
        log.info("commit connection %s refused: %s", conn.peer, exc)
        await _answer(conn, Error.of(exc).header())
        return False


async def _answer(conn: Connection, header: dict[str, Any]) -> bool:
    """Send ``header``; False (the connection closed) when it cannot go."""
    try:
        await conn.send(header, timeout=IO_S)
    except KVStoreError:
        await conn.close()
        return False
    return True


# --------------------------------------------------------------------------------- node side


class CommitLink:
    """A node's connection to its master's commit port (``uri``, dialled on first use and
    kept). ``tickets``: the node's own tickets (None: the master does not authenticate);
    ``ssl_context``: verifies a ``tls://`` port; ``dial_s``: the most a dial may take of a
    commit's time. One batch at a time (:attr:`busy`)."""

    def __init__(
        self,
        uri: str,
        tickets: TicketSource | None = None,
        ssl_context: ssl.SSLContext | None = None,
        dial_s: float = 1.0,
    ) -> None:
        self.uri = uri
        self._tickets = tickets
        self._ssl = ssl_context
        self._dial_s = dial_s
        self._conn: Connection | None = None
        self.busy = False
        """A batch is in flight on the link."""

    async def commit(self, request: bytes, timeout: float) -> int | None:
        """Send the serialized CommitRequest ``request``; the master's applied seq.

        None when no verdict came and the batch should go another way (a seq applied
        already is not applied again, so that is safe): the port could not be dialled
        within ``dial_s`` (its handshake included), or the connection broke without an
        answer (a kept connection that breaks as the batch goes is dialled once more
        first: the master may have closed it, idle or restarted). Raises
        :class:`CommitRefused` (the master's verdict), :class:`KVTimeout` (no answer
        within ``timeout``), :class:`~kvstore.errors.Unauthorized` (the port refused this
        node's ticket, or the master could not prove the cluster secret) and
        :class:`ProtocolError` (the port answered anything but a verdict: an error, a
        frame with a payload, nonsense); the link is closed on each but a verdict.
        """
        deadline = time.monotonic() + timeout
        self.busy = True
        try:
            redial = True
            while True:
                conn = self._conn
                if conn is not None and not conn.reusable():  # (closed by the master)
                    await self.close()
                    conn = None
                if conn is None:
                    redial = False
                    left = max(deadline - time.monotonic(), 0.001)
                    try:
                        conn = self._conn = await with_timeout(
                            dial(self.uri, left, self._tickets, self._ssl),
                            min(left, self._dial_s),
                            f"dial the commit port at {self.uri}",
                        )
                    except Unauthorized:
                        raise
                    except (KVStoreError, OSError):  # refused, unreachable, too slow
                        return None
                try:
                    left = max(deadline - time.monotonic(), 0.001)
                    await conn.send({"op": "commit"}, [request], timeout=left)
                    left = max(deadline - time.monotonic(), 0.001)
                    frame = await conn.recv_header(timeout=left)
                except KVTimeout:
                    await self.close()  # (its answer would meet the next batch)
                    raise
                except (TransportError, OSError):  # (OSError: a socket's own)
                    await self.close()
                    if redial:
                        redial = False
                        continue
                    return None
                except BaseException:  # cancelled: its answer would meet the next batch
                    await self.close()
                    raise
                return await self._verdict(frame)
        finally:
            self.busy = False

    async def _verdict(self, frame: Frame) -> int:
        header, op = frame.header, frame.header.get("op")
        if not frame.sizes:
            if op == "committed":
                applied = header.get("applied_seq")
                if type(applied) is int and applied >= 0:
                    return applied
            elif op == "refused":
                status = grpc.StatusCode.__members__.get(str(header.get("status")))
                if status is not None:
                    raise CommitRefused(status, str(header.get("message", ""))[:1000])
        await self.close()
        if op == "error":
            message = str(header.get("message", ""))[:1000]
            raise ProtocolError(f"the commit port at {self.uri} refused the batch: {message}")
        raise ProtocolError(f"the commit port at {self.uri} answered {str(op)[:40]!r}")

    async def close(self) -> None:
        """Close the connection (the next batch dials again); idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

"""The ``inproc://name`` backend: the TCP semantics over in-memory queues, one event loop.

For unit tests of node and client logic without sockets. Frames go through the real
:mod:`~kvstore.transport.framing` code — the sender encodes the prefix with its limits, the
receiver parses it with its own — so header validation, limits and error types match
``tcp://``. Each direction is a bounded queue (``queue_frames`` frames and ``queue_bytes``
bytes; one frame larger than ``queue_bytes`` still passes when the queue is empty), playing
the part of the socket buffers: a sender blocks while the peer does not read.

Copies: ``send`` copies every payload buffer once (so the caller may reuse it as soon as the
call returns, as with TCP), and the receiver copies it once more into its views. Closing
behaves like TCP: frames sent before a close are still delivered, then the reader sees
:class:`~kvstore.errors.PeerDisconnected`; a writer whose peer closed sees it at once.

``inproc://`` (empty name) listens under a fresh unique name; listeners live in a
process-wide registry and a connection must be opened from the listener's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    PeerDisconnected,
    TransportError,
    Unreachable,
)
from kvstore.transport.base import (
    DEFAULT_MAX_CONNECTIONS,
    Backend,
    Connection,
    Handler,
    Listener,
    Refusal,
)
from kvstore.transport.framing import DEFAULT_LIMITS, Frame, FrameLimits, parse_prefix

__all__ = [
    "BACKEND",
    "DEFAULT_QUEUE_BYTES",
    "DEFAULT_QUEUE_FRAMES",
    "InprocBackend",
    "InprocConnection",
    "InprocListener",
]

DEFAULT_QUEUE_FRAMES = 64
"""Frames one direction of a connection queues before its sender blocks."""
DEFAULT_QUEUE_BYTES = 64 * 1024 * 1024
"""Bytes one direction queues before its sender blocks (one bigger frame still passes)."""

_SCHEME = "inproc://"
_LISTENERS: dict[str, InprocListener] = {}
_ids = itertools.count(1)

_Item = tuple[bytes, list[bytes]]


class _Pipe:
    """One direction of a connection: a bounded frame queue with at most one waiter a side."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self._items: deque[tuple[_Item, int]] = deque()
        self._bytes = 0
        self._max_frames = max_frames
        self._max_bytes = max_bytes
        self._writer_gone = False
        self._reader_gone = False
        self._waiters: dict[str, asyncio.Future[None]] = {}

    def queued_bytes(self) -> int:
        return self._bytes

    def quiet(self) -> bool:
        """Nothing queued and the writer still open."""
        return not self._items and not self._writer_gone and not self._reader_gone

    async def readable(self) -> None:
        """Return once a frame is queued or the writer closed (a ``get`` then answers)."""
        while not self._items and not self._writer_gone:
            await self._wait("reader")

    async def put(self, item: _Item, nbytes: int) -> None:
        while not self._reader_gone and self._full(nbytes):
            await self._wait("writer")
        if self._reader_gone:
            raise PeerDisconnected("the peer closed the connection")
        self._items.append((item, nbytes))
        self._bytes += nbytes
        self._wake("reader")

    async def get(self) -> _Item:
        while not self._items:
            if self._writer_gone:
                raise PeerDisconnected("the peer closed the connection")
            await self._wait("reader")
        item, nbytes = self._items.popleft()
        self._bytes -= nbytes
        self._wake("writer")
        return item

    def close_writer(self, exc: KVStoreError) -> None:
        """The writing side closed: queued frames stay readable, then EOF."""
        self._writer_gone = True
        self._fail("writer", exc)
        self._wake("reader")

    def close_reader(self, exc: KVStoreError) -> None:
        """The reading side closed: drop what is queued, writers see the peer gone."""
        self._reader_gone = True
        self._items.clear()
        self._bytes = 0
        self._fail("reader", exc)
        self._wake("writer")

    def _full(self, nbytes: int) -> bool:
        if not self._items:
            return False
        return len(self._items) >= self._max_frames or self._bytes + nbytes > self._max_bytes

    async def _wait(self, side: str) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[side] = fut
        try:
            await fut
        finally:
            if self._waiters.get(side) is fut:
                del self._waiters[side]

    def _wake(self, side: str) -> None:
        fut = self._waiters.get(side)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _fail(self, side: str, exc: KVStoreError) -> None:
        fut = self._waiters.get(side)
        if fut is not None and not fut.done():
            fut.set_exception(exc)


class InprocConnection(Connection):
    """A :class:`~kvstore.transport.base.Connection` over two in-memory :class:`_Pipe` s."""

    def __init__(
        self, inbox: _Pipe, outbox: _Pipe, *, peer: str, limits: FrameLimits = DEFAULT_LIMITS
    ) -> None:
        super().__init__(peer=peer, limits=limits)
        self._inbox = inbox
        self._outbox = outbox
        self._payload: list[bytes] = []

    async def _write_frame(self, prefix: bytes, views: list[memoryview]) -> None:
        buffers = [bytes(v) for v in views]  # the one copy that frees the caller's memory
        await self._outbox.put((prefix, buffers), len(prefix) + sum(map(len, buffers)))

    async def _await_frame(self) -> None:
        await self._inbox.readable()

    async def _read_prefix(self) -> tuple[Frame, int]:
        prefix, buffers = await self._inbox.get()
        frame, length = parse_prefix(prefix, self.limits)
        self._payload = buffers
        return frame, length

    async def _read_payload(
        self,
        targets: list[memoryview | None],
        sizes: list[int],
        on_progress: Callable[[int, int], None] | None,
    ) -> None:
        payload, self._payload = self._payload, []
        if len(targets) == 1 and len(payload) != 1:  # the whole payload into one target
            (target,), at = targets, 0
            for buf in payload:
                if target is not None:
                    target[at : at + len(buf)] = buf
                at += len(buf)
            return
        for i, (target, buf) in enumerate(zip(targets, payload, strict=True)):
            if target is not None:
                target[:] = buf
                if on_progress is not None:
                    on_progress(i, len(target))

    def _buffered(self) -> int:
        return self._inbox.queued_bytes()

    def _quiet(self) -> bool:
        return self._inbox.quiet()

    def _abort(self, exc: KVStoreError) -> None:
        self._payload = []
        self._outbox.close_writer(exc)
        self._inbox.close_reader(exc)


class InprocListener(Listener):
    """A :class:`~kvstore.transport.base.Listener` registered under ``inproc://name``."""

    def __init__(
        self,
        uri: str,
        handler: Handler,
        *,
        limits: FrameLimits = DEFAULT_LIMITS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout: float | None = None,
        header_timeout: float | None = None,
        refusal: Refusal | None = None,
    ) -> None:
        super().__init__(
            handler,
            limits=limits,
            max_connections=max_connections,
            idle_timeout=idle_timeout,
            header_timeout=header_timeout,
            refusal=refusal,
        )
        self._name = _name_of(uri)
        self._bound = ""
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def address(self) -> str:
        """``inproc://name`` as registered (a generated name when started with none)."""
        if not self._bound:
            raise InvalidArgument("inproc listener is not started")
        return _SCHEME + self._bound

    async def _bind(self) -> None:
        name = self._name or f"auto-{next(_ids)}"
        if name in _LISTENERS:
            raise TransportError(f"cannot listen on {_SCHEME}{name}: the name is taken")
        self._loop = asyncio.get_running_loop()
        self._bound = name
        _LISTENERS[name] = self

    async def _unbind(self) -> None:
        if _LISTENERS.get(self._bound) is self:
            del _LISTENERS[self._bound]

    def _connect(
        self, client_limits: FrameLimits, queue_frames: int, queue_bytes: int
    ) -> InprocConnection:
        if self._loop is not asyncio.get_running_loop():
            raise Unreachable(f"{self.address} listens in another event loop")
        to_server = _Pipe(queue_frames, queue_bytes)
        to_client = _Pipe(queue_frames, queue_bytes)
        client_id = next(_ids)
        client = InprocConnection(to_client, to_server, peer=self.address, limits=client_limits)
        server = InprocConnection(
            to_server, to_client, peer=f"{self.address}/client-{client_id}", limits=self.limits
        )
        self._accepted(server)
        return client


def _name_of(uri: str) -> str:
    if not uri.startswith(_SCHEME):
        raise InvalidArgument(f"bad inproc address {uri!r}: expected inproc://name")
    name = uri[len(_SCHEME) :]
    if "/" in name or any(c.isspace() for c in name):
        raise InvalidArgument(f"bad inproc address {uri!r}: the name may not hold '/' or spaces")
    return name


class InprocBackend(Backend):
    """Connects and listens on ``inproc://name``.

    Options ``queue_frames`` and ``queue_bytes`` bound each direction's queue.
    """

    async def connect(
        self, uri: str, *, timeout: float | None, limits: FrameLimits, **options: Any
    ) -> InprocConnection:
        """Connect to a started listener of this process; never waits (``timeout`` unused).

        Raises :class:`~kvstore.errors.Unreachable` when no listener has that name.
        """
        queue_frames, queue_bytes = _options(options)
        name = _name_of(uri)
        listener = _LISTENERS.get(name)
        if listener is None:
            raise Unreachable(f"cannot connect to {uri}: nothing listens there")
        return listener._connect(limits, queue_frames, queue_bytes)

    def listener(
        self,
        uri: str,
        handler: Handler,
        *,
        limits: FrameLimits,
        max_connections: int,
        idle_timeout: float | None = None,
        header_timeout: float | None = None,
        refusal: Refusal | None = None,
        **options: Any,
    ) -> InprocListener:
        """An unstarted :class:`InprocListener`; see :class:`Backend`."""
        if options:
            raise InvalidArgument(f"unknown inproc:// listen options: {sorted(options)}")
        return InprocListener(
            uri,
            handler,
            limits=limits,
            max_connections=max_connections,
            idle_timeout=idle_timeout,
            header_timeout=header_timeout,
            refusal=refusal,
        )


def _options(options: dict[str, Any]) -> tuple[int, int]:
    unknown = set(options) - {"queue_frames", "queue_bytes"}
    if unknown:
        raise InvalidArgument(f"unknown inproc:// options: {sorted(unknown)}")
    frames = options.get("queue_frames", DEFAULT_QUEUE_FRAMES)
    nbytes = options.get("queue_bytes", DEFAULT_QUEUE_BYTES)
    for name, value in (("queue_frames", frames), ("queue_bytes", nbytes)):
        if not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
    return frames, nbytes


BACKEND = InprocBackend()
"""The instance the registry in :mod:`kvstore.transport` hands out for ``inproc://``."""

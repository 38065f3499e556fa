"""The data-plane seam: :class:`Connection`, :class:`Listener` and :class:`Backend`.

A connection carries *frames* (see :mod:`kvstore.transport.framing`): a small JSON-able
header dict plus zero or more raw payload buffers. Receiving is split in two so that the
receiver decides where the payload goes only after it has seen the header::

    frame = await conn.recv_header(timeout=5)          # header + payload sizes
    view = arena.allocate(frame.sizes[0])              # e.g. a slot in a storage arena
    await conn.recv_payload_into([view], timeout=5)    # bytes land straight in the slot

The public methods of :class:`Connection` and :class:`Listener` are written once, here, and
carry the whole contract (state checks, timeouts, closing on a broken stream, byte counts).
A backend implements a handful of private primitives (``_write_frame``, ``_await_frame``,
``_read_prefix``, ``_read_payload``, ``_buffered``, ``_quiet``, ``_abort`` and a listener's
``_bind``/``_unbind``), so every backend behaves alike and one conformance suite tests them
all.

Rules shared by every backend:

* One frame at a time in each direction. Concurrent :meth:`Connection.send` calls are
  serialised; only one task may receive on a connection at a time.
* A timeout or cancellation in the middle of a frame leaves the byte stream unframed, so the
  connection is closed before :class:`~kvstore.errors.KVTimeout` (or the cancellation)
  propagates. The one exception is :meth:`Connection.recv_header`: it keeps whatever part of
  the next frame has arrived, so a header wait that times out leaves the connection usable.
* After the peer closed, receives raise :class:`~kvstore.errors.PeerDisconnected` (frames the
  peer sent before closing are still delivered). After a local :meth:`Connection.close`,
  every call raises :class:`~kvstore.errors.Closed`.

A listener guards itself against peers that hold connections without using them (every
guard is off unless set; the storage node sets them all, see ``NodeConfig``):

* ``idle_timeout``: a header wait with no timeout of its own (a handler waiting for the next
  request) that sees no byte for that long closes the connection and raises ``Closed``.
* ``header_timeout``: once a frame's first byte has arrived, its whole prefix must arrive
  within that long, across however many ``recv_header`` calls; else the connection is closed
  and ``KVTimeout`` raised. A trickle cannot hold a connection; payloads are bounded by the
  caller's own per-step ``timeout``.
* Both are enforced by one watchdog task per listener, which sweeps its connections four
  times per the shorter timeout (so a deadline fires up to a quarter late) instead of a
  timer per frame; a connection without guards never reads the clock.
* ``max_connections``: at the bound, a new connection first displaces the oldest one that has
  not started a single frame within ``header_timeout`` of being accepted (idle sockets opened
  to fill the bound), else the one that has waited longest, at least ``header_timeout``, for
  its next request (sockets held idle after a request); else it is refused. With
  ``refusal`` set, the refused peer is sent ``refusal(CapacityError(...))`` as a frame before
  the close, so its client raises a typed error that names the limit rather than seeing a
  bare reset; a connection with a request under way is never touched.
* Memory: a backend grows what it holds for a prefix with the bytes that actually arrived,
  never with the lengths a prefix announces (:mod:`.framing` bounds those).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvstore.errors import (
    CapacityError,
    Closed,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    PeerDisconnected,
    ProtocolError,
)
from kvstore.transport.framing import DEFAULT_LIMITS, Frame, FrameLimits, encode_prefix

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "MAX_REFUSING",
    "PROGRESS_BYTES",
    "REFUSAL_DRAIN_S",
    "REFUSAL_LINGER_S",
    "Backend",
    "Connection",
    "Handler",
    "Listener",
    "Refusal",
    "as_byte_view",
    "with_timeout",
]

logger = logging.getLogger("kvstore.transport")

T = TypeVar("T")

DEFAULT_MAX_CONNECTIONS = 1024
"""Default bound on the connections one listener serves at once."""

MAX_REFUSING = 64
"""Refused connections kept open at once to deliver their refusal (see
:data:`REFUSAL_LINGER_S`); past that a refused connection is closed bare. Bounds what a
connection flood costs beyond ``max_connections``: 64 file descriptors and 64 short tasks."""

REFUSAL_LINGER_S = 1.0
"""How long a refused connection waits for the client's next frame to start (or its close)
after the refusal frame was sent. Meanwhile what the client sends is read and dropped,
because closing a socket with unread bytes resets the connection, and a client still
writing its request would then see the reset instead of the refusal. A kvclient has its
CapacityError 1.4 ms after connecting (median, loopback) and then closes."""

REFUSAL_DRAIN_S = 10.0
"""Longest a refused connection is kept in all. A ``tcp://`` put sends its whole batch (up
to a 1 GiB frame) before it reads an answer, so the refused side drains a frame that has
started for this long: 1 GiB takes 0.9 s at 10 Gbit/s. Past it, or silent for
:data:`REFUSAL_LINGER_S`, the connection is closed."""

_REFUSAL_LOG_S = 10.0
"""At most one warning per listener per this many seconds about refused connections."""

_WATCH_PER_TIMEOUT = 4
"""A listener's watchdog runs this many times per its shorter guard timeout, so a deadline
fires at most a quarter late. One sweep instead of a timer per frame: an
``asyncio.timeout`` around each header wait measured +30 us per 340 us round trip here
(9%); one sweep over 1024 ``tcp://`` connections 0.28 ms, every 1.25 s at the node's
default timeouts."""

PROGRESS_BYTES = 128 * 2**10
"""Largest piece a socket backend receives at once while a caller watches progress: well
inside a core's L2, so the caller reads each piece from cache (measured here: xxh3 of a
just-received piece ~60 GB/s, of the same bytes from memory ~8.5 GB/s). 128 KiB measured
best for 4 MiB chunks against 64 KiB, 256 KiB and 1 MiB (docs/decisions.md)."""

Handler = Callable[["Connection"], Awaitable[None]]
"""``async def handler(conn)``: serves one accepted connection, in its own task."""

Refusal = Callable[[KVStoreError], dict[str, Any]]
"""Builds the header of the frame a refused connection is sent, from the error that says why
(a :class:`~kvstore.errors.CapacityError` naming the limit); the node passes its data-plane
``Error`` message's header."""

Buffer = Any
"""bytes, bytearray, memoryview, a C-contiguous numpy array or a contiguous CPU torch tensor."""


def as_byte_view(buf: Buffer, *, writable: bool = False) -> memoryview:
    """View ``buf``'s memory as a flat unsigned-byte memoryview, without copying.

    Accepts anything exposing the buffer protocol (bytes, bytearray, memoryview, numpy) and
    CPU torch tensors (through ``.numpy()``). Never blocks. Raises
    :class:`~kvstore.errors.InvalidArgument` for objects without a buffer, non-contiguous
    memory, device tensors, or a read-only buffer when ``writable`` is set.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        buf = _tensor_as_numpy(buf)
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise InvalidArgument(f"{type(buf).__name__} does not expose a byte buffer") from exc
    if writable and view.readonly:
        raise InvalidArgument(f"cannot receive into a read-only {type(buf).__name__}")
    if not view.c_contiguous:
        raise InvalidArgument(f"{type(buf).__name__} buffer is not C-contiguous")
    if view.ndim == 1 and view.format == "B":
        return view
    if view.nbytes == 0:
        return memoryview(b"") if not writable else memoryview(bytearray())
    try:
        return view.cast("B")
    except TypeError as exc:
        raise InvalidArgument(f"cannot view {type(buf).__name__} as bytes: {exc}") from exc


def _tensor_as_numpy(tensor: Any) -> Any:
    """A numpy array sharing the memory of a contiguous CPU tensor, viewed as uint8."""
    if tensor.device.type != "cpu":
        raise InvalidArgument(
            f"a {tensor.device.type} tensor cannot be sent or received as host memory"
        )
    if not tensor.is_contiguous():
        raise InvalidArgument("tensor is not contiguous")
    flat = tensor.detach().reshape(-1)
    try:
        if flat.dtype != sys.modules["torch"].uint8:
            flat = flat.view(sys.modules["torch"].uint8)
        return flat.numpy()
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(f"cannot view a {tensor.dtype} tensor as bytes: {exc}") from exc


async def with_timeout(aw: Awaitable[T], timeout: float | None, what: str) -> T:
    """Await ``aw`` for at most ``timeout`` seconds (``None``: no limit).

    Raises :class:`~kvstore.errors.KVTimeout` naming ``what`` when the time runs out; the
    awaited operation is cancelled first (as with ``asyncio.timeout``: the calling task is
    cancelled, and the cancellation turned into the timeout where it began). A cancellation
    of the task from elsewhere propagates as it is. The deadline is kept by the loop's
    :class:`_Deadlines`, not by a timer of its own (docs/decisions.md).
    """
    if timeout is None:
        return await aw
    loop = asyncio.get_running_loop()
    last_loop, deadlines = _last_deadlines  # (one tuple: read whole, whichever thread swaps it)
    if last_loop is not loop or deadlines is None:
        deadlines = _deadlines_of(loop)
    task = asyncio.current_task(loop)
    if task is None:
        raise RuntimeError("with_timeout must be awaited inside a task")
    cancelling = task.cancelling()
    entry = deadlines.add(task, loop.time() + timeout)
    try:
        return await aw
    except asyncio.CancelledError as exc:
        if entry.fired:
            entry.fired = False  # (uncancelled here, once)
            if task.uncancel() <= cancelling:
                raise KVTimeout(f"{what} timed out after {timeout:g} s") from exc
        raise
    except TimeoutError as exc:  # one from inside ``aw``: named as this wait's
        if isinstance(exc, KVTimeout):
            raise
        raise KVTimeout(f"{what} timed out after {timeout:g} s") from exc
    finally:
        del deadlines.live[entry]
        if entry.fired:  # the deadline passed but ``aw`` swallowed its cancellation
            task.uncancel()


class _Deadline:
    """One :func:`with_timeout` in progress: its task, its loop-time deadline, and whether
    the deadline passed (its task was cancelled for it)."""

    __slots__ = ("deadline", "fired", "task")

    def __init__(self, task: asyncio.Task[Any], deadline: float) -> None:
        self.task = task
        self.deadline = deadline
        self.fired = False


class _Deadlines:
    """Every :func:`with_timeout` in progress on one event loop, under one lazy timer.

    ``asyncio.timeout`` schedules a timer per call and cancels it when the call ends: a heap
    push, a cancelled handle left in the loop's heap and the context manager's own steps,
    5.0-5.6 µs a wait here against 1.6 µs for this (docs/decisions.md). This keeps one timer per
    loop, armed at the earliest deadline it knows of. A call whose deadline is later than
    the armed one (the usual case: deadlines of a fixed timeout grow with the clock) costs
    an insertion and a removal in a dict. When the timer fires it cancels the tasks whose
    deadlines passed and re-arms itself at the earliest one left, so a deadline fires on
    time, never late; the scan is over the calls in progress, once per firing."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.live: dict[_Deadline, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._armed = 0.0

    def add(self, task: asyncio.Task[Any], deadline: float) -> _Deadline:
        """Register ``task``'s ``deadline``; the caller removes the entry from ``live``."""
        entry = _Deadline(task, deadline)
        self.live[entry] = None
        if self._timer is None or deadline < self._armed:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(deadline, self._fire)
            self._armed = deadline
        return entry

    def _fire(self) -> None:
        self._timer = None
        now, soonest = self.loop.time(), None
        for entry in self.live:
            if entry.fired:
                continue
            if entry.deadline <= now:
                entry.fired = True
                entry.task.cancel()
            elif soonest is None or entry.deadline < soonest:
                soonest = entry.deadline
        if soonest is not None:
            self._timer = self.loop.call_at(soonest, self._fire)
            self._armed = soonest


_deadlines_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Deadlines] = (
    weakref.WeakKeyDictionary()
)
_last_deadlines: tuple[asyncio.AbstractEventLoop | None, _Deadlines | None] = (None, None)
"""The loop :func:`with_timeout` ran on last and its deadlines: the common case without a
lookup (a process runs one busy loop, or one per thread)."""


def _deadlines_of(loop: asyncio.AbstractEventLoop) -> _Deadlines:
    global _last_deadlines
    deadlines = _deadlines_by_loop.get(loop)
    if deadlines is None:
        deadlines = _deadlines_by_loop[loop] = _Deadlines(loop)
    _last_deadlines = (loop, deadlines)
    return deadlines


class Connection(abc.ABC):
    """One framed, bidirectional, ordered connection to a peer.

    ``bytes_sent`` and ``bytes_received`` count every byte of every complete frame (prefix
    and payload) for metrics. ``limits`` bound the frames this side accepts and sends. Not
    thread-safe: use a connection only from the event loop that created it.
    """

    def __init__(self, *, peer: str, limits: FrameLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.bytes_sent = 0
        self.bytes_received = 0
        self._peer = peer
        self._pending: Frame | None = None
        self._reading = False
        self._awaiting_header = False
        self._draining = False
        self._send_lock = asyncio.Lock()
        self._closed_as: tuple[type[KVStoreError], str] | None = None
        # Guards a listener sets on the connections it accepts, enforced by its watchdog
        # (see the module notes); connections without guards never read the clock.
        self._idle_timeout: float | None = None
        self._header_timeout: float | None = None
        self._opened_at = 0.0
        self._idle_since: float | None = None
        """Loop time a header wait with no timeout of its own began; None when none runs."""
        self._header_began: float | None = None
        """Loop time the next frame's first byte arrived; None while none has."""
        self._late = False
        """The watchdog closed this connection because a header was late."""

    @property
    def peer(self) -> str:
        """The peer's address as a URI (e.g. ``tcp://10.0.0.7:50052``); never blocks."""
        return self._peer

    @property
    def closed(self) -> bool:
        """True once the connection was closed, by either side or after a failure."""
        return self._closed_as is not None

    async def send(
        self,
        header: dict[str, Any],
        buffers: Sequence[Buffer] = (),
        *,
        timeout: float | None = None,
    ) -> None:
        """Send one frame: ``header`` (a JSON-able dict) and ``buffers`` as its payload.

        Buffers are sent without copying (see :func:`as_byte_view` for what is accepted);
        once the call returns they may be reused. Blocks until every byte is handed to the
        backend, at most ``timeout`` seconds. Raises
        :class:`~kvstore.errors.InvalidArgument` (bad header or buffer, frame over
        ``limits``; nothing sent), :class:`~kvstore.errors.PeerDisconnected`,
        :class:`~kvstore.errors.Closed`, or :class:`~kvstore.errors.KVTimeout`. A send that
        fails, times out or is cancelled after it began closes the connection.
        """
        self._raise_if_closed()
        views = [as_byte_view(b) for b in buffers]
        prefix = encode_prefix(header, [v.nbytes for v in views], self.limits)
        if self._send_lock.locked():  # another frame is being written: wait in turn
            await with_timeout(self._locked_send(prefix, views), timeout, f"send to {self._peer}")
            return
        # Fast path, measured ~25 µs less per round trip: write what the kernel takes now,
        # with no deadline armed; only a remainder waits, under the deadline.
        await self._send_lock.acquire()  # (unlocked: returns without suspending)
        try:
            iov = [memoryview(prefix), *(v for v in views if v.nbytes)]
            try:
                rest = self._write_now(iov)
                if rest is None:
                    await with_timeout(
                        self._write_frame(prefix, views), timeout, f"send to {self._peer}"
                    )
                elif rest:
                    await with_timeout(self._write_rest(rest), timeout, f"send to {self._peer}")
            except BaseException as exc:
                self._fail(exc)  # a frame may be half written: the stream is unframed now
                raise
        finally:
            self._send_lock.release()
        self.bytes_sent += len(prefix) + sum(v.nbytes for v in views)

    async def recv_header(self, timeout: float | None = None) -> Frame:
        """Wait for the next frame and return its header and payload sizes.

        Blocks up to ``timeout`` seconds; ``None``: no deadline of the caller's, though on a
        connection accepted by a listener with an ``idle_timeout`` the wait ends after that
        long without a byte (the connection is closed; raises ``Closed``). On a connection
        whose listener has a ``header_timeout``, a prefix must arrive whole within that long
        of its first byte, or the connection is closed and ``KVTimeout`` raised. The
        payload, if any, must then be consumed with :meth:`recv_payload_into`,
        :meth:`recv_payload` or :meth:`discard_payload` before the next header. Raises
        :class:`~kvstore.errors.KVTimeout` (when ``timeout`` ran out the connection stays
        usable and keeps what part of the frame arrived),
        :class:`~kvstore.errors.PeerDisconnected`, :class:`~kvstore.errors.ProtocolError`
        (garbage or a frame over ``limits``; the connection is closed),
        :class:`~kvstore.errors.Closed`, or :class:`~kvstore.errors.InvalidArgument` when
        the previous payload is unread.
        """
        self._begin_read(header=True)
        try:
            if self._draining and self._buffered() == 0:
                self._shut(Closed, "the listener is stopping")
                self._raise_if_closed()
            self._awaiting_header = True
            frame, nbytes = await with_timeout(
                self._watched_prefix(idle_wait=timeout is None),
                timeout,
                f"recv_header from {self._peer}",
            )
        except (KVTimeout, asyncio.CancelledError):
            raise
        except BaseException as exc:
            self._fail(exc)
            if self._late and isinstance(exc, Closed):
                raise KVTimeout(f"recv_header from {self._peer}: {exc}") from exc
            raise
        finally:
            self._reading = False
            self._awaiting_header = False
        self.bytes_received += nbytes
        self._pending = frame if frame.sizes else None
        return frame

    def reusable(self) -> bool:
        """Whether a new exchange may start on this connection now.

        True when it is open, no payload is pending, no receive is in progress, nothing of
        a next frame has arrived and the peer has not closed its end. Never blocks (on a
        socket: one non-blocking peek). A connection pool asks this before handing out a
        kept connection, so that one the server closed while it sat idle is dialled anew
        instead of failing the caller's request; False means close it.
        """
        if self.closed or self._pending is not None or self._reading:
            return False
        return self._quiet()

    async def recv_payload_into(
        self,
        views: Sequence[Buffer | None],
        timeout: float | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Receive the pending frame's payload straight into caller-provided ``views``.

        One writable view per payload buffer, each exactly that buffer's size; a ``None``
        entry discards that buffer. ``on_progress(i, upto)``, if given, is called on the
        event loop each time bytes ``[0, upto)`` of view ``i`` have arrived (views in order,
        ``upto`` growing to the view's size; a backend that receives from a socket does so in
        pieces of at most :data:`PROGRESS_BYTES` then), so the caller can read each piece
        while it is still in cache and start on a view while the rest arrives; it must not
        block. Blocks up to ``timeout`` seconds.
        Raises
        :class:`~kvstore.errors.ProtocolError` when the count or a size differs from the
        frame's (nothing is read; the payload stays pending),
        :class:`~kvstore.errors.InvalidArgument` for a non-writable view or when no payload
        is pending, and otherwise like :meth:`recv_header` — except that a timeout here
        closes the connection.
        """
        self._raise_if_closed()
        frame = self._pending
        if frame is None:
            if views:
                raise InvalidArgument("no frame payload is pending on this connection")
            return
        targets = _payload_targets(views, frame.sizes)
        await self._receive(frame, targets, frame.sizes, timeout, on_progress)

    async def recv_payload_whole(self, target: Buffer, timeout: float | None = None) -> None:
        """Receive the pending frame's whole payload into the one writable ``target``, its
        buffers back to back as they travel (``target`` is exactly the payload's length):
        one receive where :meth:`recv_payload_into` takes one a buffer, for a frame of many
        small buffers. Blocks and raises like :meth:`recv_payload_into`."""
        self._raise_if_closed()
        frame = self._pending
        if frame is None:
            raise InvalidArgument("no frame payload is pending on this connection")
        total = frame.payload_bytes
        (view,) = _payload_targets([target], [total])
        await self._receive(frame, [view], [total], timeout, None)

    async def _receive(
        self,
        frame: Frame,
        targets: list[memoryview | None],
        sizes: list[int],
        timeout: float | None,
        on_progress: Callable[[int, int], None] | None,
    ) -> None:
        self._begin_read(header=False)
        try:
            await with_timeout(
                self._read_payload(targets, sizes, on_progress),
                timeout,
                f"recv from {self._peer}",
            )
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._reading = False
        self._pending = None
        self.bytes_received += frame.payload_bytes

    async def recv_payload(self, timeout: float | None = None) -> list[bytearray]:
        """Receive the pending frame's payload into fresh bytearrays, one per buffer.

        Returns ``[]`` when no payload is pending. Blocks and raises like
        :meth:`recv_payload_into`.
        """
        if self._pending is None:
            self._raise_if_closed()
            return []
        buffers = [bytearray(size) for size in self._pending.sizes]
        await self.recv_payload_into(buffers, timeout)
        return buffers

    async def discard_payload(self, timeout: float | None = None) -> None:
        """Read and drop the pending frame's payload (no-op when none is pending).

        Blocks and raises like :meth:`recv_payload_into`.
        """
        if self._pending is not None:
            await self.recv_payload_into([None] * len(self._pending.sizes), timeout)

    async def recv(self, timeout: float | None = None) -> tuple[dict[str, Any], list[bytearray]]:
        """Receive one whole frame: its header and its payload in fresh bytearrays.

        ``timeout`` bounds the whole frame. Raises like :meth:`recv_header` and
        :meth:`recv_payload_into`.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        frame = await self.recv_header(timeout)
        rest = None if deadline is None else max(0.0, deadline - loop.time())
        return frame.header, await self.recv_payload(rest)

    async def close(self) -> None:
        """Close the connection; idempotent, never raises, wakes any blocked call.

        Blocked and later calls raise :class:`~kvstore.errors.Closed`.
        """
        self._shut(Closed, "the connection was closed locally")

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<{type(self).__name__} peer={self._peer} {state}>"

    # -- primitives each backend implements -----------------------------------------------

    @abc.abstractmethod
    async def _write_frame(self, prefix: bytes, views: list[memoryview]) -> None:
        """Write ``prefix`` then every view, in order, as one frame; raise on failure."""

    def _write_now(self, iov: list[memoryview]) -> list[memoryview] | None:
        """Write what can be written of ``iov`` without blocking; what is left (empty: all
        of it). None, writing nothing, for a backend without this fast path."""
        return None

    async def _write_rest(self, iov: list[memoryview]) -> None:
        """Finish a frame :meth:`_write_now` began: write ``iov``, in order."""
        raise NotImplementedError

    @abc.abstractmethod
    async def _await_frame(self) -> None:
        """Return once at least one byte of the next frame has arrived (at once if some
        has), or raise what a receive raises (e.g. ``PeerDisconnected`` at EOF).

        Must lose nothing when cancelled.
        """

    @abc.abstractmethod
    async def _read_prefix(self) -> tuple[Frame, int]:
        """Read and parse the next prefix (with ``self.limits``); return it and its length.

        Must keep partial progress when cancelled so that a later call resumes, and must
        hold memory in proportion to the prefix bytes received, not to the lengths they
        announce.
        """

    @abc.abstractmethod
    async def _read_payload(
        self,
        targets: list[memoryview | None],
        sizes: list[int],
        on_progress: Callable[[int, int], None] | None,
    ) -> None:
        """Read the payload buffers into ``targets`` (``None``: discard ``sizes[i]`` bytes),
        calling ``on_progress(i, upto)`` as target ``i`` fills (see :meth:`recv_payload_into`)."""

    @abc.abstractmethod
    def _buffered(self) -> int:
        """Bytes of the next frame already received; 0 means the connection is idle."""

    @abc.abstractmethod
    def _quiet(self) -> bool:
        """True when nothing of a next frame has arrived and the peer has not closed its
        end (nor failed the connection); never blocks."""

    @abc.abstractmethod
    def _abort(self, exc: KVStoreError) -> None:
        """Release the backend's resources at once and fail blocked waits with ``exc``."""

    # -- shared machinery -----------------------------------------------------------------

    async def _watched_prefix(self, *, idle_wait: bool) -> tuple[Frame, int]:
        """:meth:`_read_prefix`, telling a listener's watchdog when an idle wait (one with
        no timeout of the caller's) and when a header began. No clock, no timer, no extra
        step on a connection without guards."""
        if self._header_began is None and (
            self._header_timeout is not None or (idle_wait and self._idle_timeout is not None)
        ):
            loop = asyncio.get_running_loop()
            self._idle_since = loop.time() if idle_wait else None
            try:
                await self._await_frame()
            finally:
                self._idle_since = None
            self._header_began = loop.time()
        result = await self._read_prefix()
        self._header_began = None
        return result

    def _expire(self, now: float) -> None:
        """Watchdog: close this connection when it has waited ``idle_timeout`` for a request
        (with nothing arrived) or a header began ``header_timeout`` ago."""
        idle, since = self._idle_timeout, self._idle_since
        if idle is not None and since is not None and now - since >= idle:
            if self._buffered() == 0:  # not a request that arrived as the watchdog woke
                self._shut(Closed, f"closed after {idle:g} s without a request")
            return
        limit, began = self._header_timeout, self._header_began
        if limit is not None and began is not None and now - began >= limit:
            self._late = True
            self._shut(Closed, f"closed: a frame header took longer than {limit:g} s")

    def _never_started(self, accepted_before: float) -> bool:
        """Whether this connection was accepted before ``accepted_before`` (loop time) and
        has not sent a byte of any frame since: an idle socket holding a listener's slot.
        False once closed (a displaced connection stays listed until its handler ends)."""
        return (
            not self.closed
            and self._awaiting_header
            and self.bytes_received == 0
            and self._header_began is None
            and self._opened_at <= accepted_before
            and self._buffered() == 0
        )

    def _idle_since_before(self, before: float) -> bool:
        """Whether this connection has waited for its next request since ``before`` (loop
        time) or longer, with nothing of it arrived: displaceable at a listener's bound (a
        client's pool finds the close before it reuses the socket)."""
        since = self._idle_since
        return (
            not self.closed
            and since is not None
            and since <= before
            and self._awaiting_header
            and self._header_began is None
            and self._buffered() == 0
        )

    async def _locked_send(self, prefix: bytes, views: list[memoryview]) -> None:
        async with self._send_lock:
            self._raise_if_closed()
            try:
                await self._write_frame(prefix, views)
            except BaseException as exc:
                self._fail(exc)  # a frame may be half written: the stream is unframed now
                raise
        self.bytes_sent += len(prefix) + sum(v.nbytes for v in views)

    def _begin_read(self, *, header: bool) -> None:
        self._raise_if_closed()
        if self._reading:
            raise InvalidArgument("another task is already receiving on this connection")
        if header and self._pending is not None:
            raise InvalidArgument(
                "the previous frame's payload is unread: receive or discard it first"
            )
        self._reading = True

    def _raise_if_closed(self) -> None:
        if self._closed_as is not None:
            cls, message = self._closed_as
            raise cls(f"{self._peer}: {message}")

    def _fail(self, exc: BaseException) -> None:
        """Close after ``exc`` broke the connection, remembering how it ended."""
        if isinstance(exc, PeerDisconnected):
            self._shut(PeerDisconnected, "the peer closed the connection")
        elif isinstance(exc, ProtocolError):
            self._shut(Closed, f"closed after a protocol error: {exc}")
        else:
            self._shut(Closed, f"closed after {type(exc).__name__} mid-frame")

    def _shut(self, cls: type[KVStoreError], message: str) -> None:
        if self._closed_as is not None:
            return
        self._closed_as = (cls, message)
        self._pending = None
        self._abort(cls(f"{self._peer}: {message}"))

    def _drain(self) -> None:
        """Listener stop: close now if idle, else after the frame exchange in progress."""
        self._draining = True
        if self._awaiting_header and self._buffered() == 0:
            self._shut(Closed, "the listener is stopping")


def _payload_targets(views: Sequence[Buffer | None], sizes: list[int]) -> list[memoryview | None]:
    """Validate receive views against a frame's sizes; raise ProtocolError on mismatch."""
    if len(views) != len(sizes):
        raise ProtocolError(f"frame has {len(sizes)} payload buffers, got {len(views)} views")
    targets: list[memoryview | None] = []
    for i, (view, size) in enumerate(zip(views, sizes, strict=True)):
        if view is None:
            targets.append(None)
            continue
        target = as_byte_view(view, writable=True)
        if target.nbytes != size:
            raise ProtocolError(f"payload buffer {i} is {size} bytes, view is {target.nbytes}")
        targets.append(target)
    return targets


class Listener(abc.ABC):
    """Accepts connections and runs ``handler(conn)`` for each, in its own task.

    An exception escaping a handler is logged and closes only that connection; the
    connection is closed when its handler returns. At most ``max_connections`` are served at
    once. One more displaces the oldest connection that has not started a frame within
    ``header_timeout`` of being accepted (counted in ``displaced``; none without a
    ``header_timeout``), or else is refused and counted in ``rejected``: with ``refusal``,
    it is sent ``refusal(CapacityError(...))`` as one frame and closed once its peer closes
    (at most :data:`REFUSAL_LINGER_S`), without, it is closed at once (the client sees
    :class:`~kvstore.errors.PeerDisconnected`). ``idle_timeout`` and ``header_timeout``
    apply to every accepted connection (see :meth:`Connection.recv_header`). Raises
    :class:`~kvstore.errors.InvalidArgument` for a bound below 1 or a timeout not > 0.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        limits: FrameLimits = DEFAULT_LIMITS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout: float | None = None,
        header_timeout: float | None = None,
        refusal: Refusal | None = None,
    ) -> None:
        if not isinstance(max_connections, int) or max_connections < 1:
            raise InvalidArgument(f"max_connections must be >= 1, got {max_connections!r}")
        for name, value in (("idle_timeout", idle_timeout), ("header_timeout", header_timeout)):
            if value is not None and (not isinstance(value, int | float) or not value > 0):
                raise InvalidArgument(f"{name} must be > 0 seconds or None, got {value!r}")
        self.limits = limits
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.header_timeout = header_timeout
        self.rejected = 0
        self.displaced = 0
        self._handler = handler
        self._refusal = refusal
        self._tasks: dict[Connection, asyncio.Task[None]] = {}
        self._refusing: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._warned_at = -_REFUSAL_LOG_S
        self._state = "new"

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The URI clients connect to, with the real port after binding port 0.

        Raises :class:`~kvstore.errors.InvalidArgument` before :meth:`start`.
        """

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._tasks)

    async def start(self) -> None:
        """Bind and start accepting; returns once the address is bound (blocks briefly).

        Raises :class:`~kvstore.errors.TransportError` when the address cannot be bound and
        :class:`~kvstore.errors.InvalidArgument` when called twice.
        """
        if self._state != "new":
            raise InvalidArgument(f"listener already {self._state}")
        await self._bind()
        self._state = "started"
        guards = [t for t in (self.idle_timeout, self.header_timeout) if t is not None]
        if guards:
            self._watchdog = asyncio.get_running_loop().create_task(
                self._watch(min(guards) / _WATCH_PER_TIMEOUT), name="listener watchdog"
            )

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, then close every connection; idempotent, never raises.

        Idle connections (a handler waiting for a header with nothing received) are closed at
        once — their ``recv_header`` raises :class:`~kvstore.errors.Closed`. Handlers busy
        with a frame exchange get up to ``grace`` seconds to finish (their next header wait
        raises ``Closed``); then the rest are cancelled. Blocks until all handlers ended.
        """
        if self._state != "started":
            self._state = "stopped"
            return
        self._state = "stopped"
        await self._unbind()
        background = [*self._refusing, *([self._watchdog] if self._watchdog else [])]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for conn in list(self._tasks):
            conn._drain()
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, grace))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def __aenter__(self) -> Listener:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- primitives each backend implements -----------------------------------------------

    @abc.abstractmethod
    async def _bind(self) -> None:
        """Bind the address and start accepting, calling :meth:`_accepted` per connection."""

    @abc.abstractmethod
    async def _unbind(self) -> None:
        """Stop accepting and release the address."""

    # -- shared machinery -----------------------------------------------------------------

    def _accepted(self, conn: Connection) -> None:
        """Serve ``conn`` in a new task; at the bound, make room or refuse it; close it when
        stopping."""
        if self._state != "started":
            conn._shut(Closed, "the listener is stopping")
            return
        loop = asyncio.get_running_loop()
        conn._idle_timeout = self.idle_timeout
        conn._header_timeout = self.header_timeout
        conn._opened_at = loop.time()
        if len(self._tasks) >= self.max_connections and not self._displace(conn._opened_at):
            self._refuse(conn)
            return
        self._tasks[conn] = loop.create_task(self._serve(conn), name=f"serve {conn.peer}")

    def _displace(self, now: float) -> bool:
        """Close, to make room: the oldest connection that never started a frame within
        ``header_timeout`` of being accepted, else the one that has waited longest for its
        next request, at least ``header_timeout`` (a peer that sent one request, even an
        authenticated one, then holds its socket idle: one tenant could otherwise keep
        every other out); False when there is none."""
        if self.header_timeout is None:
            return False
        before = now - self.header_timeout
        for conn in self._tasks:  # in the order accepted: the first one found is the oldest
            if conn._opened_at > before:
                break
            if conn._never_started(before):
                self.displaced += 1
                logger.info("displacing %s: no request since it connected", conn.peer)
                conn._shut(Closed, "displaced: no request within the header timeout")
                return True
        idle = [c for c in self._tasks if c._idle_since_before(before)]
        if not idle:
            return False
        conn = min(idle, key=lambda c: c._idle_since or 0.0)
        self.displaced += 1
        waited = now - (conn._idle_since or now)
        logger.info("displacing %s: no request for %.0f s", conn.peer, waited)
        conn._shut(Closed, "displaced: idle while the listener was at its limit")
        return True

    def _refuse(self, conn: Connection) -> None:
        """Refuse ``conn``: a refusal frame when one is configured and few are in flight,
        else a bare close."""
        self.rejected += 1
        now = time.monotonic()
        if now - self._warned_at >= _REFUSAL_LOG_S:
            self._warned_at = now
            logger.warning(
                "refusing %s: %d connections already served (%d refused so far)",
                conn.peer,
                self.max_connections,
                self.rejected,
            )
        if self._refusal is None or len(self._refusing) >= MAX_REFUSING:
            conn._shut(Closed, "the listener is at its connection limit")
            return
        task = asyncio.get_running_loop().create_task(
            self._send_refusal(conn, self._refusal), name=f"refuse {conn.peer}"
        )
        self._refusing.add(task)
        task.add_done_callback(self._refusing.discard)

    async def _send_refusal(self, conn: Connection, refusal: Refusal) -> None:
        """Send the refusal frame, then read and drop what the peer sends until it closes
        (closing with its request unread would reset the connection, and the peer could
        lose the refusal): each frame must start within :data:`REFUSAL_LINGER_S`, and all
        of it ends after :data:`REFUSAL_DRAIN_S`."""
        limit = f"its limit of {self.max_connections} connections"
        error = CapacityError(f"{self.address} is at {limit}; try again later")
        try:
            async with asyncio.timeout(REFUSAL_DRAIN_S):
                await conn.send(refusal(error), timeout=REFUSAL_LINGER_S)
                while True:
                    await conn.recv_header(timeout=REFUSAL_LINGER_S)
                    await conn.discard_payload()
        except (KVStoreError, TimeoutError) as exc:
            logger.debug("refused %s: %s", conn.peer, exc)
        except Exception:
            logger.exception("refusal frame for %s failed", conn.peer)
        finally:
            await conn.close()

    async def _watch(self, period: float) -> None:
        """Close the connections past their idle or header deadline, every ``period`` s."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for conn in list(self._tasks):
                conn._expire(now)

    async def _serve(self, conn: Connection) -> None:
        try:
            await self._handler(conn)
        except (PeerDisconnected, Closed) as exc:
            logger.debug("connection %s ended: %s", conn.peer, exc)
        except KVTimeout as exc:  # a peer too slow (or a header deadline): not our failure
            logger.info("connection %s closed: %s", conn.peer, exc)
        except KVStoreError as exc:
            logger.warning("connection %s closed: %s: %s", conn.peer, type(exc).__name__, exc)
        except Exception:
            logger.exception("handler for %s failed; closing that connection", conn.peer)
        finally:
            await conn.close()
            self._tasks.pop(conn, None)


class Backend(abc.ABC):
    """One address scheme's implementation, found through the registry in
    :mod:`kvstore.transport`. Each backend module exposes one as ``BACKEND``."""

    @abc.abstractmethod
    async def connect(
        self, uri: str, *, timeout: float | None, limits: FrameLimits, **options: Any
    ) -> Connection:
        """Open a connection to ``uri``. Raises ``Unreachable``, ``KVTimeout``,
        ``InvalidArgument`` (malformed address or unknown option)."""

    @abc.abstractmethod
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
    ) -> Listener:
        """Build an unstarted listener for ``uri`` (the guards as in :class:`Listener`);
        raises ``InvalidArgument`` when malformed."""

"""The ``ucx://`` fast path: one-sided READ and WRITE between registered memory, via NIXL.

A :class:`NixlAgent` owns one NIXL agent (UCX backend), **one worker thread** and **one
lock**. NIXL's Python binding is synchronous and has no timeouts, so registrations, peers,
notifications and large transfers run on the worker thread and the event loop awaits them;
small transfers are posted on the loop's own thread (see *Polling*). Every NIXL call is
made holding the lock: an initiator's agent (no progress thread, ``NIXL_THREAD_SYNC_NONE``)
locks nothing itself and NIXL gives it UCX workers in ``UCS_THREAD_MODE_SERIALIZED``: any
thread may call, one at a time. The binding releases the GIL while it posts (a 6.7 ms
post on the worker left the loop's thread running)::

    async with NixlAgent("node-7f3a", host="10.0.0.7", progress_thread=True) as node:
        arena_reg = await node.register(arena.tensor)     # once: the whole arena
        publish(await node.metadata())                    # ~0.4 KiB, after registering
    async with NixlAgent("client-91c2", host=None) as client:     # an initiator
        await client.register(buffers)                    # its receive/send buffers
        peer = await client.add_peer(node_metadata)
        await client.read(peer, [Span.from_wire(w) for w in wire], [buffers[:n]], timeout=5)

**Descriptors.** A :class:`Span` is ``(addr, nbytes, dev_id, mem)``: an address inside
memory some agent registered, its length, the device (CUDA index for ``"VRAM"``, 0 for
``"DRAM"``) and the memory kind. The node describes each chunk of a slot with
``arena_reg.span(offset, nbytes)`` and sends ``span.to_wire()`` — ``[addr, nbytes, dev_id,
mem_code]`` with ``mem_code`` 0 = DRAM, 1 = VRAM, four JSON-able ints — in its control
answer (reserve/lease); the client rebuilds it with :meth:`Span.from_wire`. ``remote[i]`` and
``local[i]`` pair up and must have the same length. Local entries may be spans, ``(addr,
nbytes)`` tuples or contiguous tensor views; each must lie inside a registration of this
agent (checked here, with a clear error, before NIXL sees it). One call becomes one NIXL
transfer per (local kind, remote kind) pair, all posted at once and awaited together.

**Progress.** A target (the node) must make UCX progress or peers cannot even connect (the
handshake needs it, also over CMA; a passive target leaves transfers ``PROC`` forever).
NIXL's progress thread does it event-driven (``poll()`` on the worker's fd;
``progress_delay_us`` only bounds the sleep), so a node passes ``progress_thread=True`` and
idles under 1 % of a core. The wrapper ``nixl_cu12._api.nixl_agent`` hard-codes that delay to
0, which spins a core, hence this module drives ``nixl_cu12._bindings`` directly. An
initiator runs without the thread: its own polling drives UCX, and while it has peers and
nothing to do its worker thread progresses UCX every :data:`IDLE_PROGRESS_S` (a peer waiting
for it to acknowledge a connection spins a core until it does).

**Polling.** A call of at most :data:`INLINE_BYTES` (all its spans together) is posted on
the event loop's thread if the lock is free — the loop never waits for it: held by the
worker, the call goes to the worker. Over CMA the post itself copies the bytes and returns
DONE, so such a call ends without a thread hop (the loop waits for that copy: ~0.13 ms at
1 MiB). One still in flight after its post (RDMA, TCP, a first connection) is checked on
the loop, yielding to other tasks between checks, for :data:`INLINE_SPIN_S`, then handed to
the worker. An agent made with ``alone_inline_bytes`` (an engine's client: its loop has
nothing else to serve meanwhile) also posts larger calls, up to that many bytes, on the
loop when none of its other transfers is in flight. There, and for larger calls posted
there, a transfer is polled with
``getXferStatus`` in slices of at most :data:`POLL_SLICE_S`, sleeping between checks with
exponential backoff from 20 µs to 1 ms (never a busy spin; the lock is held for each check,
not across the sleeps). Between slices other queued work (another transfer, a registration)
gets the thread, so several transfers interleave on it. The worker takes its jobs from a
``SimpleQueue`` and answers through ``loop.call_soon_threadsafe``.

**Measured** (``python bench/nixl_calls.py``: two processes on loopback over CMA, two
shared cores, p50 per call, ÷ the raw binding posting and spinning on the caller's thread).
When every call hopped to a ``ThreadPoolExecutor``, a 64 B WRITE took ~255 µs (raw 11 µs):
the hop there and back ~115 µs (two thread wake-ups), validating the spans 23 µs, post and
release on the worker with ``@contextmanager`` translation 42 µs (the binding's part 14 µs,
descriptor lists included), the rest asyncio's future chaining. Now the same call takes
~47 µs (4.4x raw; was 23x): validation 7 µs, descriptor lists 5 µs, create, post and
release ~15 µs, the rest Python around them. The hop to the worker (``SimpleQueue`` and
``call_soon_threadsafe``) costs ~60 µs round trip, not ~115 µs: 512 KiB x 8 went from 2.0x
to 1.5x raw, 4 MiB x 1 from 1.8x to 1.5x, 4 MiB x 8 from 1.09x to 1.05x (medians of six
runs on a loaded machine; docs/decisions.md has the table). Not taken: cached
prepared descriptor lists (``prepXferDlist`` + ``makeXferReq``: 3.3 µs to create and
release a request against 4.1 µs for ``createXferReq``, 2.8 µs to prepare each list; at
most ~5 µs a call and only when the very same spans repeat, which chunks do not); a 1 µs
timer slack for the worker's backoff sleeps (a 20 µs sleep takes ~75 µs with Linux's
default 50 µs slack; over ``UCX_TLS=tcp`` within noise).

**Failures.** A dead peer (``nixlRemoteDisconnectError`` or an error status) raises
:class:`~kvstore.errors.PeerDisconnected` (measured: milliseconds after a ``kill -9``). At the
deadline the handles are released — NIXL cancels in-flight transfers on release; a handle it
refuses to release is *parked* and retried before every later post and at close
(:attr:`NixlAgent.pending_releases`) — and :class:`~kvstore.errors.KVTimeout` is raised,
by whichever thread polls the transfer then (the loop while it spins, else the worker).
After a timeout or a cancelled call **treat both sides' spans as possibly still written**:
the node quarantines the slot, the client keeps that buffer out of use. NIXL's exceptions
are translated (``raise ... from``): garbage metadata or spans outside the peer's
registrations → :class:`~kvstore.errors.ProtocolError`, the rest →
:class:`~kvstore.errors.TransportError`; after close → :class:`~kvstore.errors.Closed`.

**Environment.** UCX reads its configuration from the environment when an agent is
created, so :meth:`NixlAgent.start` sets ``UCX_NET_DEVICES`` (under a module lock, just
for the creation of the agent, restoring the environment after) to the interface that
owns ``host`` (:func:`net_device_for`: loopback → ``lo``) and
``UCX_WARN_UNUSED_ENV_VARS=n`` (unless already set). ``host=None`` (or a wildcard)
leaves UCX on every interface. Over RDMA pass ``net_devices`` explicitly (e.g.
``"mlx5_0:1"``): the interface owning an IP is not the IB device UCX needs.

Its parts: :mod:`~kvstore.transport.nixl_spans` (spans, registrations, the checks that pair
them into descriptor rows), :mod:`~kvstore.transport.nixl_worker` (the worker thread),
:mod:`~kvstore.transport.nixl_binding` (the binding: lazy import, error translation) and
:mod:`~kvstore.transport.nixl_env` (which interface UCX serves).

Importing this module does not import ``nixl_cu12``; constructing a :class:`NixlAgent`
does, and raises :class:`~kvstore.errors.UnknownScheme` when it is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.errors import (
    Closed,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    PeerDisconnected,
    TransportError,
)
from kvstore.transport.nixl_binding import (
    NAME_MAX,
    agent_name_of,
    import_bindings,
    segment,
    translate,
    translating,
)
from kvstore.transport.nixl_env import ENV_LOCK, UCX_ENV, net_device_for, set_ucx_env
from kvstore.transport.nixl_spans import (
    MAX_DESCRIPTORS,
    MEM_KINDS,
    Groups,
    Registration,
    Span,
    pair_up,
    tensor_region,
)
from kvstore.transport.nixl_worker import Done, Job, Worker

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALONE_INLINE_BYTES",
    "DEFAULT_PROGRESS_DELAY_US",
    "INLINE_BYTES",
    "INLINE_SPIN_S",
    "MAX_DESCRIPTORS",
    "MEM_KINDS",
    "POLL_SLICE_S",
    "NixlAgent",
    "Registration",
    "Span",
    "net_device_for",
]

logger = logging.getLogger("kvstore.transport.nixl")

T = TypeVar("T")


DEFAULT_PROGRESS_DELAY_US = 10_000
"""Longest sleep of NIXL's progress thread between checks, in µs (it wakes on events)."""

POLL_SLICE_S = 0.005
"""Longest one poll of a transfer holds the worker thread before other work gets a turn."""

IDLE_PROGRESS_S = 0.05
"""An initiator (no progress thread) with peers progresses its UCX worker at least this
often, from its worker thread, while it has nothing else to do. A peer's UCX answers a new
connection by opening its own side over the initiator's socket and waits for the
initiator's acknowledgement with the socket armed for writing: until the initiator's worker
makes progress, the peer's progress thread wakes at once, each time, and spins a core (a
node spun at 100% of a core for as long as a client that had connected stayed idle).
Progressed this often, a peer's wait ends within this long; idle, it costs the initiator
20 short wake-ups a second."""

MAX_KEPT_NOTIFS = 4096
"""Notifications an initiator's idle progress keeps for :meth:`NixlAgent.poll_notifs`; past
it the oldest are dropped (logged)."""


INLINE_BYTES = 1 << 20
"""Largest call (bytes, all spans together) posted on the event loop's thread instead of
the worker's. Over CMA the post copies the bytes before it returns (measured, cache hot:
5 µs for 64 B, 64 µs for 512 KiB, 0.13 ms for 1 MiB, 0.52 ms for 4 MiB, 6.7 ms for 32 MiB)
and the loop waits for that copy, while posting on the loop saves ~110-125 µs a call at
any size (p50, ``bench/nixl_calls.py`` sizes with this cap at 0 / 1 MiB / 64 MiB: 1 MiB
WRITE 278 / 173 / 172 µs, 4 MiB WRITE 720 / 703 / 578 µs, raw 136 and 524 µs). Up to 1 MiB
the loop's stall is no longer than the hop it saves; above, it grows with the size while
the saving does not. Over RDMA a post returns before the bytes move: re-measure there."""

ALONE_INLINE_BYTES = 8 << 20
"""What an engine's client agent (``clients/kvclient/ucx.py``) passes as
``alone_inline_bytes``: a call of up to 8 MiB is posted on its loop when no other transfer
of the agent is in flight, so a layer put one at a time skips the worker's hop. Measured
(two processes, 512 KiB x 8 layer puts, alternating 40 at a time in one run, p50 per put):
2.81 / 2.41 ms with 1 MiB against 2.60 / 2.22 ms with this, two runs. The loop waits for
the copy meanwhile (~1 ms at 8 MiB here); with transfers in flight, the worker takes the
call as before, so they still overlap."""

INLINE_SPIN_S = 100e-6
"""How long a transfer posted on the loop but still in flight (RDMA, TCP, a first
connection) is polled there, yielding to other tasks between checks, before the worker
thread takes it over with its backoff sleeps. Measured over ``UCX_TLS=tcp`` on loopback,
p50 µs at 0 / 50 / 100 / 200 µs of spin: 64 KiB READ 256 / 145 / 144 / 144, 256 KiB READ
462 / 440 / 401 / 275, 64 B within noise (96-100); at most one hand-off's cost of CPU."""

_FIRST_PAUSE_S = 20e-6
_MAX_PAUSE_S = 1e-3


@dataclass(eq=False)
class _Transfer:
    """One read/write: its NIXL handles and polling state (touched under the agent's lock)."""

    op: str
    peer: str
    deadline: float
    handles: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    pause: float = _FIRST_PAUSE_S


def _settle(
    future: asyncio.Future[Any],
    result: Any,
    exc: BaseException | None,
    orphan: Callable[[Any], None] | None,
) -> None:
    """On the loop: hand a job's outcome to its future, or to ``orphan`` if nobody waits."""
    if future.cancelled():
        if exc is None and orphan is not None:
            orphan(result)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class NixlAgent:
    """One NIXL agent (UCX backend), its worker thread, and small transfers on the loop.

    ``NixlAgent(...)`` imports ``nixl_cu12`` (raising :class:`~kvstore.errors.UnknownScheme`
    without it) but creates nothing; ``await start()`` (or ``async with``) creates the agent.
    ``name`` must be unique among the agents that talk to each other (NIXL keys peers by
    it). ``host`` picks ``UCX_NET_DEVICES`` (see the module docstring; ``None`` = all
    interfaces), ``net_devices`` overrides it. A target (storage node) passes
    ``progress_thread=True``; an initiator leaves it off. ``alone_inline_bytes``: the
    largest call posted on the loop while no other transfer of this agent is in flight
    (default :data:`INLINE_BYTES`, the cap for every call, which also applies below it;
    see :data:`ALONE_INLINE_BYTES`).
    Owned by one event loop.
    """

    def __init__(
        self,
        name: str,
        *,
        host: str | None = "127.0.0.1",
        progress_thread: bool = False,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        net_devices: str | None = None,
        alone_inline_bytes: int = INLINE_BYTES,
    ) -> None:
        if not isinstance(name, str) or not name or len(name) > NAME_MAX:
            raise InvalidArgument(f"agent name must be a non-empty str of <= {NAME_MAX} chars")
        if type(progress_delay_us) is not int or not 0 < progress_delay_us <= 10_000_000:
            raise InvalidArgument("progress_delay_us must be an int in (0, 10_000_000]")
        self._nixl = import_bindings()
        self._name = name
        self._net_devices = net_devices if net_devices is not None else net_device_for(host)
        self._progress_thread = bool(progress_thread)
        self._progress_delay_us = progress_delay_us
        if type(alone_inline_bytes) is not int or alone_inline_bytes < 0:
            raise InvalidArgument("alone_inline_bytes must be an int >= 0")
        self._alone_inline = alone_inline_bytes
        self._state = "new"
        self._worker: Worker | None = None
        self._teardown: Future[None] | None = None
        self._registrations: list[Registration] = []  # touched on the event loop only
        # Every NIXL call, and everything below, happens with this lock held: the worker
        # thread waits for it, the event loop only ever tries it (and hands off if busy).
        self._lock = threading.Lock()
        self._agent: Any = None
        self._peers: dict[str, bytes] = {}
        self._live: set[_Transfer] = set()
        self._parked: list[int] = []
        self._kept_notifs: dict[str, list[bytes]] = {}  # (the worker thread's: _w_idle)
        self._kept = 0

    # ---- lifecycle ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """This agent's name (what peers' :meth:`add_peer` returns for it)."""
        return self._name

    @property
    def peers(self) -> frozenset[str]:
        """Names of the peers added and not removed."""
        return frozenset(self._peers)

    @property
    def pending_releases(self) -> int:
        """Transfer handles NIXL refused to release (after a timeout); retried later."""
        return len(self._parked)

    async def start(self) -> NixlAgent:
        """Create the NIXL agent and its UCX backend on the worker thread (~0.5 s).

        Idempotent. Raises :class:`~kvstore.errors.TransportError` if NIXL cannot create it
        (no UCX plugin, UCX failure) and :class:`~kvstore.errors.Closed` after close().
        """
        if self._state == "started":
            return self
        if self._state == "closed":
            raise Closed(f"NIXL agent {self._name!r} is closed")
        idle = None if self._progress_thread else self._w_idle
        worker = self._worker = Worker(f"nixl-{self._name}", idle, IDLE_PROGRESS_S)
        self._state = "started"
        try:
            await self._call(self._w_create)
        except BaseException:
            self._state = "closed"
            self._worker = None
            worker.stop()
            raise
        return self

    async def __aenter__(self) -> NixlAgent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, timeout: float = 5.0) -> None:
        """Release every handle, deregister all memory, drop all peers, destroy the agent and
        stop the worker thread. Idempotent; returns within about ``timeout`` seconds even if
        NIXL hangs (then logs an error and leaves the thread behind). Never raises."""
        if self._state == "new":
            self._state = "closed"
        if self._worker is None:
            return  # never started, or start() failed and already stopped the thread
        if self._teardown is None:
            self._state = "closed"
            teardown: Future[None] = Future()
            self._teardown = teardown
            self._worker.submit(Job(self._w_locked, (self._w_teardown,), _resolver(teardown)))
            self._worker.stop()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._teardown), timeout)
        except TimeoutError:
            logger.error("NIXL agent %r did not close within %.1f s", self._name, timeout)
        except Exception:
            logger.exception("closing NIXL agent %r failed", self._name)
        self._registrations.clear()

    # ---- memory and peers --------------------------------------------------------------

    async def register(self, tensor: torch.Tensor) -> Registration:
        """Register a contiguous CPU (``DRAM``) or CUDA (``VRAM``) tensor's bytes.

        Register big regions once (the node: its whole arena) — registration pins and maps
        memory and is slow. Publish :meth:`metadata` after registering. Raises
        :class:`~kvstore.errors.InvalidArgument` (not a contiguous CPU/CUDA tensor, empty)
        or :class:`~kvstore.errors.TransportError` (NIXL refused).
        """
        addr, nbytes, mem, dev_id = tensor_region(tensor)
        dlist = await self._call(self._w_register, addr, nbytes, mem, dev_id)
        reg = Registration(addr, nbytes, mem, dev_id, tensor, dlist)
        self._registrations.append(reg)
        return reg

    async def deregister(self, registration: Registration) -> bool:
        """Deregister; False if it was not registered here. It does not revoke transfers
        peers already prepared (hence leases and self-checking chunks). Raises
        :class:`~kvstore.errors.TransportError` if NIXL refuses."""
        if registration not in self._registrations:
            return False
        self._registrations.remove(registration)
        await self._call(self._w_deregister, registration._dlist)
        return True

    async def metadata(self) -> bytes:
        """This agent's metadata (connection info and registrations, a few hundred bytes)
        for a peer's :meth:`add_peer`. Call it again after registering more memory."""
        return await self._call(lambda: bytes(self._live_agent().getLocalMD()))

    async def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name (the ``peer`` of read/write).

        Same metadata again is a no-op; new metadata under a known name (the peer restarted
        or registered more memory) replaces the old. Does not connect yet (the first
        transfer does). Raises :class:`~kvstore.errors.ProtocolError` for garbage metadata
        and :class:`~kvstore.errors.TransportError` if NIXL refuses it.
        """
        if not isinstance(metadata, (bytes, bytearray)) or not metadata:
            raise InvalidArgument("peer metadata must be non-empty bytes")
        return await self._call(self._w_add_peer, bytes(metadata))

    async def remove_peer(self, name: str) -> bool:
        """Forget a peer and disconnect from it; False if it was not known."""
        return await self._call(self._w_remove_peer, name)

    # ---- transfers ---------------------------------------------------------------------

    async def read(
        self,
        peer: str,
        remote: Sequence[Any],
        local: Sequence[Any],
        *,
        timeout: float = 10.0,
        notif: bytes | None = None,
    ) -> int:
        """READ ``remote[i]`` (the peer's memory) into ``local[i]``; returns bytes moved.

        ``remote``: :class:`Span` or ``(addr, nbytes[, dev_id[, mem]])``; ``local``: spans,
        ``(addr, nbytes)`` or contiguous tensor views inside this agent's registrations.
        Blocks (awaits) until every byte landed or ``timeout`` seconds passed; a call of at
        most :data:`INLINE_BYTES` is posted on the loop's thread (which waits for a CMA
        copy of that size). ``notif`` is delivered to the peer's :meth:`poll_notifs` after
        the transfer (only when all spans pair one memory kind with one). Raises
        :class:`~kvstore.errors.InvalidArgument` (unknown peer, unregistered local memory,
        length mismatch), :class:`~kvstore.errors.KVTimeout`,
        :class:`~kvstore.errors.PeerDisconnected`, :class:`~kvstore.errors.ProtocolError`
        (remote spans the peer did not register), :class:`~kvstore.errors.TransportError`,
        :class:`~kvstore.errors.Closed`. After a timeout or cancellation the spans may still
        be written (module docstring).
        """
        return await self._transfer("READ", peer, remote, local, timeout, notif)

    async def write(
        self,
        peer: str,
        remote: Sequence[Any],
        local: Sequence[Any],
        *,
        timeout: float = 10.0,
        notif: bytes | None = None,
    ) -> int:
        """WRITE ``local[i]`` into ``remote[i]`` (the peer's memory); returns bytes moved.
        Same arguments, blocking and errors as :meth:`read`."""
        return await self._transfer("WRITE", peer, remote, local, timeout, notif)

    async def notify(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer``'s :meth:`poll_notifs`, not bound to a transfer.
        Raises :class:`~kvstore.errors.InvalidArgument` (unknown peer),
        :class:`~kvstore.errors.PeerDisconnected`, :class:`~kvstore.errors.TransportError`."""
        await self._call(self._w_notify, peer, bytes(message))

    async def poll_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name (empty dict if
        none). Never waits for one to arrive."""
        return await self._call(self._w_poll_notifs)

    # ---- event-loop side ---------------------------------------------------------------

    def _check_open(self) -> Worker:
        if self._state == "new":
            raise InvalidArgument(f"NIXL agent {self._name!r}: call start() first")
        if self._state == "closed" or self._worker is None:
            raise Closed(f"NIXL agent {self._name!r} is closed")
        return self._worker

    async def _call(
        self,
        fn: Callable[..., T],
        *args: Any,
        locked: bool = True,
        orphan: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the worker thread (holding the lock unless ``locked`` is
        False: ``fn`` then takes it itself) and await its result. Cancelled before its turn,
        it never runs; cancelled later, its result goes to ``orphan`` (on the loop)."""
        worker = self._check_open()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def done(result: Any, exc: BaseException | None) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # that loop closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, result, exc, orphan)

        job = Job(self._w_locked, (fn, *args), done) if locked else Job(fn, args, done)
        job.skip = future.cancelled
        worker.submit(job)
        return await future

    async def _transfer(
        self,
        op: str,
        peer: str,
        remote: Sequence[Any],
        local: Sequence[Any],
        timeout: float,
        notif: bytes | None,
    ) -> int:
        if not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise InvalidArgument(f"timeout must be a positive finite number, got {timeout!r}")
        groups, total = pair_up(remote, local, self._registrations)
        if notif is not None and len(groups) > 1:
            raise InvalidArgument("notif needs every span pair to share one memory kind pair")
        if not groups:
            return 0
        self._check_open()
        deadline = time.monotonic() + timeout
        inline = total <= INLINE_BYTES or (total <= self._alone_inline and not self._live)
        if inline and self._lock.acquire(False):
            try:  # the fast path: post and check here, no thread hop
                transfer = self._post(op, peer, groups, notif or b"", deadline)
                done = self._sweep(transfer)  # over CMA the post did it all: this releases
            finally:
                self._lock.release()
            if not done:
                done = await self._spin(transfer)
        else:
            transfer, done = await self._call(
                self._w_post,
                op,
                peer,
                groups,
                notif or b"",
                deadline,
                locked=False,
                orphan=lambda posted: self._abandon_soon(posted[0]),
            )
        try:
            while not done:
                done = await self._call(self._w_poll, transfer, locked=False)
        except asyncio.CancelledError:
            self._abandon_soon(transfer)
            raise
        return total

    async def _spin(self, transfer: _Transfer) -> bool:
        """Poll a transfer posted on the loop for up to :data:`INLINE_SPIN_S`, yielding
        between checks; True when done, False to hand it to the worker thread."""
        end = time.monotonic() + INLINE_SPIN_S
        try:
            while time.monotonic() < end:
                await asyncio.sleep(0)
                if not self._lock.acquire(False):
                    return False  # the worker is in a NIXL call: it polls this one next
                try:
                    if self._sweep(transfer):
                        return True
                finally:
                    self._lock.release()
        except asyncio.CancelledError:
            self._abandon_soon(transfer)
            raise
        return False

    def _abandon_soon(self, transfer: _Transfer) -> None:
        """Release a transfer's handles from the loop: here if the lock is free, else queued
        for the worker. After close the teardown has released them already."""
        if self._lock.acquire(False):
            try:
                self._abandon(transfer)
            finally:
                self._lock.release()
            return
        with contextlib.suppress(KVStoreError):
            self._check_open().submit(Job(self._w_locked, (self._abandon, transfer), _ignore))

    # ---- under the lock (either thread) ------------------------------------------------

    def _live_agent(self) -> Any:
        if self._agent is None:
            raise Closed(f"NIXL agent {self._name!r} is closed")
        return self._agent

    def _post(self, op: str, peer: str, groups: Groups, notif: bytes, deadline: float) -> _Transfer:
        """Create and post one NIXL request per group; ``pending`` holds those in flight."""
        agent = self._live_agent()
        self._require_peer(peer)
        if self._parked:
            self._retry_parked()
        b = self._nixl
        code = b.NIXL_READ if op == "READ" else b.NIXL_WRITE
        transfer = _Transfer(op, peer, deadline)
        self._live.add(transfer)
        try:
            for (lmem, rmem), (lrows, rrows) in groups.items():
                ldl = b.nixlXferDList(segment(b, lmem), lrows)
                rdl = b.nixlXferDList(segment(b, rmem), rrows)
                handle = agent.createXferReq(code, ldl, rdl, peer, notif)
                transfer.handles.append(handle)
                status = agent.postXferReq(handle)
                if status != b.NIXL_SUCCESS and self._in_progress(status, transfer):
                    transfer.pending.append(handle)
        except BaseException as exc:
            self._abandon(transfer)
            translated = translate(b, exc, f"{op} with {peer!r}")
            if translated is exc:
                raise
            raise translated from exc
        return transfer

    def _sweep(self, transfer: _Transfer) -> bool:
        """Check every pending handle once: True when all are done (then released); raises
        :class:`~kvstore.errors.KVTimeout` past the deadline, after releasing them."""
        try:
            agent = self._live_agent()
            if transfer.pending:
                transfer.pending = [
                    h
                    for h in transfer.pending
                    if self._in_progress(agent.getXferStatus(h), transfer)
                ]
            if not transfer.pending:
                self._abandon(transfer)  # releases the completed handles
                return True
            if time.monotonic() >= transfer.deadline:
                raise KVTimeout(
                    f"{transfer.op} with {transfer.peer!r} missed its deadline; it was "
                    "cancelled, but treat its spans as possibly still being written"
                )
        except BaseException as exc:
            self._abandon(transfer)
            translated = translate(self._nixl, exc, f"{transfer.op} with {transfer.peer!r}")
            if translated is exc:
                raise
            raise translated from exc
        return False

    def _in_progress(self, status: Any, transfer: _Transfer) -> bool:
        b = self._nixl
        if status == b.NIXL_SUCCESS:
            return False
        if status == b.NIXL_IN_PROG:
            return True
        raise PeerDisconnected(f"{transfer.op} with {transfer.peer!r} failed: {status}")

    def _abandon(self, transfer: _Transfer) -> None:
        """Release a transfer's handles (cancelling what is in flight); park refusals."""
        handles, transfer.handles, transfer.pending = transfer.handles, [], []
        self._live.discard(transfer)
        for handle in handles:
            if not self._release(handle):
                self._parked.append(handle)
                logger.warning("NIXL refused to release a %s handle; parked", transfer.op)

    def _retry_parked(self) -> None:
        self._parked = [h for h in self._parked if not self._release(h)]

    def _release(self, handle: int) -> bool:
        try:
            return bool(self._live_agent().releaseXferReq(handle) == self._nixl.NIXL_SUCCESS)
        except Exception:
            return False

    def _require_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise InvalidArgument(f"unknown NIXL peer {peer!r}; add_peer() its metadata first")

    def _check(self, status: Any, what: str) -> None:
        if status != self._nixl.NIXL_SUCCESS:
            raise TransportError(f"NIXL could not {what}: {status}")

    def _translated(self, what: str) -> contextlib.AbstractContextManager[None]:
        return translating(self._nixl, what)

    # ---- worker thread -----------------------------------------------------------------

    def _w_locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return fn(*args)

    def _w_create(self) -> None:
        b = self._nixl
        config = b.nixlAgentConfig()
        config.useProgThread = self._progress_thread
        config.useListenThread = False
        config.pthrDelay = self._progress_delay_us
        config.syncMode = (
            b.NIXL_THREAD_SYNC_RW if self._progress_thread else b.NIXL_THREAD_SYNC_NONE
        )
        with ENV_LOCK, self._translated(f"create NIXL agent {self._name!r}"):
            saved = {k: os.environ.get(k) for k in UCX_ENV}
            set_ucx_env(self._net_devices)
            try:
                agent = b.nixlAgent(self._name, config)
                if "UCX" not in agent.getAvailPlugins():
                    raise TransportError("NIXL has no UCX plugin")
                agent.createBackend("UCX", {})
            finally:
                # UCX read its settings when the backend was created; put the process
                # environment back so child processes do not inherit this agent's choice.
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
        self._agent = agent

    def _w_register(self, addr: int, nbytes: int, mem: str, dev_id: int) -> Any:
        b = self._nixl
        dlist = b.nixlRegDList(segment(b, mem), [(addr, nbytes, dev_id, "")])
        with self._translated("register memory"):
            self._check(self._live_agent().registerMem(dlist), "register memory")
        return dlist

    def _w_deregister(self, dlist: Any) -> None:
        with self._translated("deregister memory"):
            self._check(self._live_agent().deregisterMem(dlist), "deregister memory")

    def _w_add_peer(self, metadata: bytes) -> str:
        agent = self._live_agent()
        known = agent_name_of(metadata)
        if known is not None and self._peers.get(known) == metadata:
            return known
        if known is not None and known in self._peers:
            self._w_remove_peer(known)
        with self._translated("load peer metadata"):
            name = agent.loadRemoteMD(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers[name] = metadata
        return name

    def _w_remove_peer(self, name: str) -> bool:
        agent = self._live_agent()
        if self._peers.pop(name, None) is None:
            return False
        try:
            agent.invalidateRemoteMD(name)
        except Exception as exc:
            logger.warning("NIXL: forgetting peer %r failed: %s", name, exc)
        return True

    def _w_notify(self, peer: str, message: bytes) -> None:
        agent = self._live_agent()
        self._require_peer(peer)
        with self._translated(f"notify {peer!r}"):
            self._check(agent.genNotif(peer, message), f"notify {peer!r}")

    def _w_poll_notifs(self) -> dict[str, list[bytes]]:
        with self._translated("poll notifications"):
            got = self._live_agent().getNotifs({})
        self._keep_notifs(got)
        out, self._kept_notifs, self._kept = self._kept_notifs, {}, 0
        return out

    def _w_idle(self) -> None:
        """The worker thread had no job for :data:`IDLE_PROGRESS_S`: progress the UCX
        worker once, if this agent has peers and nobody holds the lock (whoever does is
        progressing it), keeping what notifications it brings for :meth:`poll_notifs`."""
        if self._agent is None or not self._peers or not self._lock.acquire(blocking=False):
            return
        try:
            got = self._agent.getNotifs({})
        except Exception as exc:  # (a peer gone: the next call says so to its caller)
            logger.debug("NIXL: idle progress failed: %s", exc)
            return
        finally:
            self._lock.release()
        self._keep_notifs(got)

    def _keep_notifs(self, got: dict[Any, list[Any]]) -> None:
        for k, v in got.items():
            if v:
                self._kept_notifs.setdefault(str(k), []).extend(bytes(m) for m in v)
                self._kept += len(v)
        while self._kept > MAX_KEPT_NOTIFS:
            name = next(iter(self._kept_notifs))
            dropped = self._kept_notifs[name][: self._kept - MAX_KEPT_NOTIFS]
            del self._kept_notifs[name][: len(dropped)]
            if not self._kept_notifs[name]:
                del self._kept_notifs[name]
            self._kept -= len(dropped)
            logger.warning("NIXL: %d notifications from %r dropped unread", len(dropped), name)

    def _w_post(
        self, op: str, peer: str, groups: Groups, notif: bytes, deadline: float
    ) -> tuple[_Transfer, bool]:
        """Post a transfer and poll its first slice (one thread hop when it is quick)."""
        with self._lock:
            transfer = self._post(op, peer, groups, notif, deadline)
        return transfer, self._w_poll(transfer)

    def _w_poll(self, transfer: _Transfer) -> bool:
        """Poll for up to :data:`POLL_SLICE_S`, taking the lock only for each check; True
        when done, False to be called again."""
        slice_end = min(transfer.deadline, time.monotonic() + POLL_SLICE_S)
        while True:
            with self._lock:
                if self._sweep(transfer):
                    return True
            now = time.monotonic()
            if now >= slice_end:
                return False
            time.sleep(min(transfer.pause, slice_end - now))
            transfer.pause = min(transfer.pause * 2, _MAX_PAUSE_S)

    def _w_teardown(self) -> None:
        if self._agent is None:
            return
        for transfer in list(self._live):
            self._abandon(transfer)
        self._retry_parked()
        if self._parked:
            logger.warning(
                "NIXL: %d handles never released; the agent frees them", len(self._parked)
            )
        for reg in list(self._registrations):
            try:
                self._agent.deregisterMem(reg._dlist)
            except Exception as exc:
                logger.warning("NIXL: deregistering %r failed: %s", reg, exc)
        for name in list(self._peers):
            self._w_remove_peer(name)
        self._parked.clear()
        self._agent = None  # the binding's destructor stops the progress thread


def _resolver(future: Future[Any]) -> Done:
    """A job callback that completes a ``concurrent.futures`` future (any thread awaits it)."""

    def done(result: Any, exc: BaseException | None) -> None:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    return done


def _ignore(result: Any, exc: BaseException | None) -> None:
    if exc is not None and not isinstance(exc, KVStoreError):
        logger.warning("NIXL: releasing a transfer failed: %s", exc)

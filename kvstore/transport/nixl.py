"""The ``ucx://`` fast path: one-sided READ and WRITE between registered memory, via NIXL.

A :class:`NixlAgent` owns one NIXL agent (UCX backend) and **one worker thread**; every
NIXL call runs on that thread, because NIXL's Python binding is synchronous and has no
timeouts. The event loop only ever awaits futures of that thread::

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
initiator runs without the thread: its own polling drives UCX.

**Polling.** A transfer is posted on the worker thread (over CMA the post itself copies the
bytes, so it returns DONE), then polled with ``getXferStatus`` in slices of at most
:data:`POLL_SLICE_S`, sleeping between checks with exponential backoff from 20 µs to 1 ms
(never a busy spin). Between slices other queued work (another transfer, a registration)
gets the thread, so several transfers interleave on it.

**Failures.** A dead peer (``nixlRemoteDisconnectError`` or an error status) raises
:class:`~kvstore.errors.PeerDisconnected` (measured: milliseconds after a ``kill -9``). At the
deadline the handles are released — NIXL cancels in-flight transfers on release; a handle it
refuses to release is *parked* and retried before every later post and at close
(:attr:`NixlAgent.pending_releases`) — and :class:`~kvstore.errors.KVTimeout` is raised.
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

Importing this module does not import ``nixl_cu12``; constructing a :class:`NixlAgent`
does, and raises :class:`~kvstore.errors.UnknownScheme` when it is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import ipaddress
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from kvstore.errors import (
    Closed,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    PeerDisconnected,
    ProtocolError,
    TransportError,
    UnknownScheme,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_PROGRESS_DELAY_US",
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

MEM_KINDS: tuple[str, ...] = ("DRAM", "VRAM")
"""Memory kinds, indexed by their wire code (0 = host memory, 1 = CUDA memory)."""

DEFAULT_PROGRESS_DELAY_US = 10_000
"""Longest sleep of NIXL's progress thread between checks, in µs (it wakes on events)."""

POLL_SLICE_S = 0.005
"""Longest one poll of a transfer holds the worker thread before other work gets a turn."""

MAX_DESCRIPTORS = 65_536
"""Most span pairs one read or write may carry."""

_FIRST_PAUSE_S = 20e-6
_MAX_PAUSE_S = 1e-3
_NAME_MAX = 256
_MD_PREFIX = b"nixlSerDes|Agent"
_SIOCGIFADDR = 0x8915
_ENV_LOCK = threading.Lock()
_UCX_ENV = ("UCX_NET_DEVICES", "UCX_WARN_UNUSED_ENV_VARS")
_UNSET = object()
_operator_net_devices: object = _UNSET  # UCX_NET_DEVICES before this module first set it


class Span(NamedTuple):
    """``nbytes`` bytes at ``addr`` in registered memory of kind ``mem`` on device ``dev_id``."""

    addr: int
    nbytes: int
    dev_id: int = 0
    mem: str = "DRAM"

    def to_wire(self) -> list[int]:
        """``[addr, nbytes, dev_id, mem_code]`` (JSON-able; mem_code indexes :data:`MEM_KINDS`)."""
        return [self.addr, self.nbytes, self.dev_id, MEM_KINDS.index(self.mem)]

    @classmethod
    def from_wire(cls, item: Any) -> Span:
        """Rebuild a span a peer sent; raises :class:`~kvstore.errors.ProtocolError` unless it
        is 2 to 4 non-negative ints (addr and nbytes non-zero, a known mem code)."""
        try:
            return _remote_span(item)
        except InvalidArgument as exc:
            raise ProtocolError(str(exc)) from exc


@dataclass(frozen=True, eq=False)
class Registration:
    """Memory registered with an agent: ``nbytes`` at ``addr`` of kind ``mem`` on ``dev_id``.

    Holds a reference to the registered tensor so it outlives the registration.
    """

    addr: int
    nbytes: int
    mem: str
    dev_id: int
    tensor: Any = field(repr=False)
    _dlist: Any = field(repr=False)

    def span(self, offset: int = 0, nbytes: int | None = None) -> Span:
        """The span of ``[offset, offset + nbytes)`` of this registration (default: to the
        end). Never blocks; raises :class:`~kvstore.errors.InvalidArgument` out of range."""
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n <= 0 or offset + n > self.nbytes:
            raise InvalidArgument(f"[{offset}, +{n}) is outside a {self.nbytes}-byte registration")
        return Span(self.addr + offset, n, self.dev_id, self.mem)

    def covers(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies inside this registration."""
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


@dataclass(eq=False)
class _Transfer:
    """One read/write on the worker side: its NIXL handles and polling state."""

    op: str
    peer: str
    deadline: float
    handles: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    pause: float = _FIRST_PAUSE_S


_Groups = dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]


class NixlAgent:
    """One NIXL agent (UCX backend) and the one thread that makes all its calls.

    ``NixlAgent(...)`` imports ``nixl_cu12`` (raising :class:`~kvstore.errors.UnknownScheme`
    without it) but creates nothing; ``await start()`` (or ``async with``) creates the agent.
    ``name`` must be unique among the agents that talk to each other (NIXL keys peers by
    it). ``host`` picks ``UCX_NET_DEVICES`` (see the module docstring; ``None`` = all
    interfaces), ``net_devices`` overrides it. A target (storage node) passes
    ``progress_thread=True``; an initiator leaves it off. Owned by one event loop.
    """

    def __init__(
        self,
        name: str,
        *,
        host: str | None = "127.0.0.1",
        progress_thread: bool = False,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        net_devices: str | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or len(name) > _NAME_MAX:
            raise InvalidArgument(f"agent name must be a non-empty str of <= {_NAME_MAX} chars")
        if type(progress_delay_us) is not int or not 0 < progress_delay_us <= 10_000_000:
            raise InvalidArgument("progress_delay_us must be an int in (0, 10_000_000]")
        self._nixl = _import_bindings()
        self._name = name
        self._net_devices = net_devices if net_devices is not None else net_device_for(host)
        self._progress_thread = bool(progress_thread)
        self._progress_delay_us = progress_delay_us
        self._state = "new"
        self._executor: ThreadPoolExecutor | None = None
        self._teardown: Future[None] | None = None
        self._registrations: list[Registration] = []  # touched on the event loop only
        # Everything below is touched on the worker thread only.
        self._agent: Any = None
        self._peers: dict[str, bytes] = {}
        self._live: set[_Transfer] = set()
        self._parked: list[int] = []

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
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"nixl-{self._name}")
        self._state = "started"
        try:
            await self._call(self._w_create)
        except BaseException:
            self._state = "closed"
            self._executor.shutdown(wait=False, cancel_futures=True)
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
        if self._executor is None:
            return
        if self._teardown is None:
            self._state = "closed"
            try:
                self._teardown = self._executor.submit(self._w_teardown)
            except RuntimeError:
                return  # start() failed and already stopped the thread
            finally:
                self._executor.shutdown(wait=False)
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
        addr, nbytes, mem, dev_id = _tensor_region(tensor)
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
        Blocks (awaits) until every byte landed or ``timeout`` seconds passed. ``notif`` is
        delivered to the peer's :meth:`poll_notifs` after the transfer (only when all spans
        pair one memory kind with one). Raises :class:`~kvstore.errors.InvalidArgument`
        (unknown peer, unregistered local memory, length mismatch),
        :class:`~kvstore.errors.KVTimeout`, :class:`~kvstore.errors.PeerDisconnected`,
        :class:`~kvstore.errors.ProtocolError` (remote spans the peer did not register),
        :class:`~kvstore.errors.TransportError`, :class:`~kvstore.errors.Closed`. After a
        timeout or cancellation the spans may still be written (module docstring).
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

    # ---- event-loop side helpers -------------------------------------------------------

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._state == "new":
            raise InvalidArgument(f"NIXL agent {self._name!r}: call start() first")
        if self._state == "closed" or self._executor is None:
            raise Closed(f"NIXL agent {self._name!r} is closed")
        try:
            return self._executor.submit(fn, *args)
        except RuntimeError as exc:  # shut down between the check and the submit
            raise Closed(f"NIXL agent {self._name!r} is closed") from exc

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._submit(fn, *args))

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
        groups, total = _pair_up(remote, local, self._registrations)
        if notif is not None and len(groups) > 1:
            raise InvalidArgument("notif needs every span pair to share one memory kind pair")
        if not groups:
            return 0
        deadline = time.monotonic() + timeout
        posting = self._submit(self._w_post, op, peer, groups, notif or b"", deadline)
        try:
            transfer, done = await asyncio.wrap_future(posting)
        except asyncio.CancelledError:
            posting.add_done_callback(self._abandon_posted)
            raise
        try:
            while not done:
                done = await self._call(self._w_poll, transfer)
        except asyncio.CancelledError:
            self._abandon_soon(transfer)
            raise
        return total

    def _abandon_posted(self, posting: Future[tuple[_Transfer, bool]]) -> None:
        if not posting.cancelled() and posting.exception() is None:
            self._abandon_soon(posting.result()[0])

    def _abandon_soon(self, transfer: _Transfer) -> None:
        try:
            self._submit(self._w_abandon, transfer)
        except KVStoreError:
            pass  # closing: the teardown releases every live transfer

    # ---- worker thread -----------------------------------------------------------------

    def _live_agent(self) -> Any:
        if self._agent is None:
            raise Closed(f"NIXL agent {self._name!r} is closed")
        return self._agent

    def _w_create(self) -> None:
        b = self._nixl
        config = b.nixlAgentConfig()
        config.useProgThread = self._progress_thread
        config.useListenThread = False
        config.pthrDelay = self._progress_delay_us
        config.syncMode = (
            b.NIXL_THREAD_SYNC_RW if self._progress_thread else b.NIXL_THREAD_SYNC_NONE
        )
        with _ENV_LOCK, self._translated(f"create NIXL agent {self._name!r}"):
            saved = {k: os.environ.get(k) for k in _UCX_ENV}
            _set_ucx_env(self._net_devices)
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
        dlist = b.nixlRegDList(_segment(b, mem), [(addr, nbytes, dev_id, "")])
        with self._translated("register memory"):
            self._check(self._live_agent().registerMem(dlist), "register memory")
        return dlist

    def _w_deregister(self, dlist: Any) -> None:
        with self._translated("deregister memory"):
            self._check(self._live_agent().deregisterMem(dlist), "deregister memory")

    def _w_add_peer(self, metadata: bytes) -> str:
        agent = self._live_agent()
        known = _agent_name_of(metadata)
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
        return {str(k): [bytes(m) for m in v] for k, v in got.items() if v}

    def _w_post(
        self, op: str, peer: str, groups: _Groups, notif: bytes, deadline: float
    ) -> tuple[_Transfer, bool]:
        """Post a transfer and poll its first slice (one thread hop when it is quick)."""
        agent = self._live_agent()
        self._require_peer(peer)
        self._w_retry_parked()
        b = self._nixl
        code = b.NIXL_READ if op == "READ" else b.NIXL_WRITE
        transfer = _Transfer(op, peer, deadline)
        self._live.add(transfer)
        try:
            with self._translated(f"{op} with {peer!r}"):
                for (lmem, rmem), (larr, rarr) in groups.items():
                    ldl = b.nixlXferDList(_segment(b, lmem), larr)
                    rdl = b.nixlXferDList(_segment(b, rmem), rarr)
                    handle = agent.createXferReq(code, ldl, rdl, peer, notif)
                    transfer.handles.append(handle)
                    if self._in_progress(agent.postXferReq(handle), transfer):
                        transfer.pending.append(handle)
        except BaseException:
            self._w_abandon(transfer)
            raise
        return transfer, self._w_poll(transfer)

    def _w_poll(self, transfer: _Transfer) -> bool:
        """Poll for up to :data:`POLL_SLICE_S`; True when done, False to be called again."""
        agent = self._live_agent()
        slice_end = min(transfer.deadline, time.monotonic() + POLL_SLICE_S)
        try:
            with self._translated(f"{transfer.op} with {transfer.peer!r}"):
                while True:
                    transfer.pending = [
                        h
                        for h in transfer.pending
                        if self._in_progress(agent.getXferStatus(h), transfer)
                    ]
                    if not transfer.pending:
                        self._w_abandon(transfer)  # releases completed handles
                        return True
                    now = time.monotonic()
                    if now >= transfer.deadline:
                        raise KVTimeout(
                            f"{transfer.op} with {transfer.peer!r} missed its deadline; it was "
                            "cancelled, but treat its spans as possibly still being written"
                        )
                    if now >= slice_end:
                        return False
                    time.sleep(min(transfer.pause, slice_end - now))
                    transfer.pause = min(transfer.pause * 2, _MAX_PAUSE_S)
        except BaseException:
            self._w_abandon(transfer)
            raise

    def _in_progress(self, status: Any, transfer: _Transfer) -> bool:
        b = self._nixl
        if status == b.NIXL_SUCCESS:
            return False
        if status == b.NIXL_IN_PROG:
            return True
        raise PeerDisconnected(f"{transfer.op} with {transfer.peer!r} failed: {status}")

    def _w_abandon(self, transfer: _Transfer) -> None:
        """Release a transfer's handles (cancelling what is in flight); park refusals."""
        handles, transfer.handles, transfer.pending = transfer.handles, [], []
        self._live.discard(transfer)
        for handle in handles:
            if not self._release(handle):
                self._parked.append(handle)
                logger.warning("NIXL refused to release a %s handle; parked", transfer.op)

    def _w_retry_parked(self) -> None:
        if self._parked:
            self._parked = [h for h in self._parked if not self._release(h)]

    def _release(self, handle: int) -> bool:
        try:
            return bool(self._live_agent().releaseXferReq(handle) == self._nixl.NIXL_SUCCESS)
        except Exception:
            return False

    def _w_teardown(self) -> None:
        if self._agent is None:
            return
        for transfer in list(self._live):
            self._w_abandon(transfer)
        self._w_retry_parked()
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

    def _require_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise InvalidArgument(f"unknown NIXL peer {peer!r}; add_peer() its metadata first")

    def _check(self, status: Any, what: str) -> None:
        if status != self._nixl.NIXL_SUCCESS:
            raise TransportError(f"NIXL could not {what}: {status}")

    def _translated(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _translating(self._nixl, what)


@contextlib.contextmanager
def _translating(b: Any, what: str) -> Iterator[None]:
    """Map NIXL's exceptions onto kvstore's tree (``raise ... from``); ours pass through."""
    try:
        yield
    except KVStoreError:
        raise
    except b.nixlRemoteDisconnectError as exc:
        raise PeerDisconnected(f"{what}: the peer disconnected") from exc
    except (b.nixlMismatchError, b.nixlInvalidParamError) as exc:
        raise ProtocolError(f"{what}: NIXL rejected it ({exc})") from exc
    except b.nixlNotFoundError as exc:
        raise ProtocolError(f"{what}: spans are not inside memory the peer registered") from exc
    except Exception as exc:
        raise TransportError(f"{what}: {type(exc).__name__}: {exc}") from exc


# ---- pure helpers -----------------------------------------------------------------------


def _import_bindings() -> Any:
    try:
        return importlib.import_module("nixl_cu12._bindings")
    except (ImportError, OSError) as exc:
        raise UnknownScheme(f"ucx:// needs nixl-cu12: {exc}") from exc


def _segment(bindings: Any, mem: str) -> Any:
    return bindings.DRAM_SEG if mem == "DRAM" else bindings.VRAM_SEG


def _tensor_region(tensor: Any) -> tuple[int, int, str, int]:
    """``(addr, nbytes, mem, dev_id)`` of a contiguous CPU/CUDA tensor."""
    if not hasattr(tensor, "data_ptr") or not hasattr(tensor, "is_contiguous"):
        raise InvalidArgument(f"expected a torch tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise InvalidArgument("tensor must be contiguous")
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    if nbytes == 0:
        raise InvalidArgument("tensor is empty")
    kind = tensor.device.type
    if kind == "cpu":
        return int(tensor.data_ptr()), nbytes, "DRAM", 0
    if kind == "cuda":
        return int(tensor.data_ptr()), nbytes, "VRAM", int(tensor.device.index or 0)
    raise InvalidArgument(f"cannot register {kind} memory with NIXL (cpu or cuda only)")


def _remote_span(item: Any) -> Span:
    if not isinstance(item, (tuple, list)) or not 2 <= len(item) <= 4:
        raise InvalidArgument(f"a remote span is (addr, nbytes[, dev_id[, mem]]), got {item!r}")
    span = Span(*item)
    mem = MEM_KINDS[span.mem] if span.mem in (0, 1) and type(span.mem) is int else span.mem
    ints = (span.addr, span.nbytes, span.dev_id)
    if not all(type(v) is int for v in ints) or min(ints) < 0 or 0 in ints[:2]:
        raise InvalidArgument(f"bad remote span {item!r}")
    if mem not in MEM_KINDS:
        raise InvalidArgument(f"bad memory kind in remote span {item!r}")
    return span._replace(mem=mem)


def _local_span(item: Any, registrations: Iterable[Registration]) -> Span:
    if hasattr(item, "data_ptr"):
        addr, nbytes, _, _ = _tensor_region(item)
    elif isinstance(item, (tuple, list)) and len(item) >= 2:
        addr, nbytes = item[0], item[1]
        if type(addr) is not int or type(nbytes) is not int or nbytes <= 0:
            raise InvalidArgument(f"bad local span {item!r}")
    else:
        raise InvalidArgument(f"a local span is a tensor, Span or (addr, nbytes), got {item!r}")
    for reg in registrations:
        if reg.covers(addr, nbytes):
            return Span(addr, nbytes, reg.dev_id, reg.mem)
    raise InvalidArgument(
        f"local [{addr:#x}, +{nbytes}) is not inside memory this agent registered"
    )


def _pair_up(
    remote: Sequence[Any], local: Sequence[Any], registrations: Sequence[Registration]
) -> tuple[_Groups, int]:
    """Validate span pairs and group them by (local kind, remote kind) as Nx3 uint64 arrays."""
    if len(remote) != len(local):
        raise InvalidArgument(f"{len(remote)} remote spans but {len(local)} local ones")
    if len(remote) > MAX_DESCRIPTORS:
        raise InvalidArgument(f"{len(remote)} spans in one call; the limit is {MAX_DESCRIPTORS}")
    rows: dict[tuple[str, str], tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]]
    rows = {}
    total = 0
    for r_item, l_item in zip(remote, local, strict=True):
        r, lo = _remote_span(r_item), _local_span(l_item, registrations)
        if r.nbytes != lo.nbytes:
            raise InvalidArgument(f"span lengths differ: remote {r.nbytes}, local {lo.nbytes}")
        lrows, rrows = rows.setdefault((lo.mem, r.mem), ([], []))
        lrows.append((lo.addr, lo.nbytes, lo.dev_id))
        rrows.append((r.addr, r.nbytes, r.dev_id))
        total += r.nbytes
    groups = {
        kinds: (np.array(lrows, dtype=np.uint64), np.array(rrows, dtype=np.uint64))
        for kinds, (lrows, rrows) in rows.items()
    }
    return groups, total


def _agent_name_of(metadata: bytes) -> str | None:
    """The agent name inside NIXL metadata (``nixlSerDes|Agent`` + u64 length + name), or
    None if the layout is not the one NIXL 1.x writes."""
    head = len(_MD_PREFIX)
    if not metadata.startswith(_MD_PREFIX) or len(metadata) < head + 8:
        return None
    (size,) = struct.unpack_from("<Q", metadata, head)
    if not 0 < size <= _NAME_MAX or len(metadata) < head + 8 + size:
        return None
    try:
        return metadata[head + 8 : head + 8 + size].decode()
    except UnicodeDecodeError:
        return None


def net_device_for(host: str | None) -> str | None:
    """The network interface UCX should use to serve ``host``, or None for all of them.

    Loopback addresses give the loopback interface (``lo``); ``None``, ``""``, ``0.0.0.0``
    and ``::`` give None; a name is resolved first. The owner is the interface whose
    primary IPv4 address (``SIOCGIFADDR``) or any IPv6 address (``/proc/net/if_inet6``)
    equals it; Linux only. Blocks on name resolution. Raises
    :class:`~kvstore.errors.InvalidArgument` if it does not resolve or no interface owns it.
    """
    if host is None or host in ("", "*"):
        return None
    try:
        family_addr = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
        addr = ipaddress.ip_address(str(family_addr).split("%")[0])
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot resolve host {host!r}: {exc}") from exc
    if addr.is_unspecified:
        return None
    if addr.is_loopback:
        addr = ipaddress.ip_address("127.0.0.1" if addr.version == 4 else "::1")
    owner = _ipv4_owner(addr) if addr.version == 4 else _ipv6_owner(addr)
    if owner is None:
        raise InvalidArgument(f"no local network interface has address {addr} (host {host!r})")
    return owner


def _ipv4_owner(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == str(addr):
                return name
    return None


def _ipv6_owner(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == addr:
                    return fields[5]
    except OSError:
        return None
    return None


def _set_ucx_env(net_devices: str | None) -> None:
    """Point UCX at ``net_devices`` (None: what the operator had) before creating an agent."""
    global _operator_net_devices
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if _operator_net_devices is _UNSET:
        _operator_net_devices = os.environ.get("UCX_NET_DEVICES")
    wanted = net_devices if net_devices is not None else _operator_net_devices
    if isinstance(wanted, str):
        os.environ["UCX_NET_DEVICES"] = wanted
    else:
        os.environ.pop("UCX_NET_DEVICES", None)

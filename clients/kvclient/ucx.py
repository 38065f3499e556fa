"""The client's ``ucx://`` path: one NIXL agent, registered staging per device, per-peer choice.

Bulk bytes to and from nodes that serve ``ucx`` move by one-sided NIXL WRITE (put) and READ
(get) between the client's registered staging memory and the node's registered arena; the
small control messages (reserve / landed, lease / release) stay on the node's ``tcp://``
connection (see :mod:`kvstore.dataplane.messages`).

Staging: per device the KV lives on (the host, each CUDA device), one contiguous arena of
``staging_bytes`` (default 256 MiB), registered once when that device is first used (host
memory as NIXL ``DRAM``, CUDA memory as ``VRAM``: registration pins and maps memory and is
too slow per call), carved into extents per transfer; a transfer waits for room within its
deadline. An extent whose transfer timed out or was cancelled may still be written or read
by UCX, so it is kept out of use for a grace period before it is freed.

Copies a chunk takes. Host KV: put — quantized straight into staging, then one transfer
by UCX (CMA on one host, RDMA between hosts) into the node's slot; get — one transfer from
the slot into staging, then verified and dequantized straight into ``out``. CUDA KV
(GPU-direct: a chunk never passes through host memory): put — quantized on the caller's
stream when the put is called, copied on the device into the GPU's registered staging when
it is sent (:mod:`kvclient.encoding`), one transfer; get — one transfer into the GPU's
staging, verified and dequantized there. Where a GPU's memory cannot be registered, its
chunks go through host staging instead (one more copy each way).

Per-peer choice (:func:`prefer_ucx`): same host (CMA/shared memory) or an RDMA NIC present
→ ``ucx``; otherwise our ``tcp://``, which beats UCX's TCP emulation (measured: READ
1.7-1.8 GB/s vs 2.2-3.2 for ``tcp://``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from kvstore.core.arena import Arena, populate
from kvstore.dataplane.location import SlotLocation
from kvstore.errors import CapacityError, Closed, KVStoreError, UnknownScheme
from kvstore.transport.nixl import ALONE_INLINE_BYTES, NixlAgent, Registration, Span
from kvstore.transport.nixl_binding import import_bindings

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Grants",
    "UcxPath",
    "UcxStats",
    "nixl_available",
    "prefer_ucx",
    "staging_device",
]

logger = logging.getLogger("kvclient.ucx")

DEFAULT_STAGING_BYTES = 256 * 2**20
"""Registered staging memory per client for ``ucx://`` transfers."""

GREETING = b"kvclient-warm-up"
"""The notification a client's warm-up sends each ``ucx`` node (:meth:`UcxPath.greet`)."""

_GRACE_S = 30.0  # how long an extent of a failed transfer stays out of use

_GRANT_TRUST = 0.5
"""Share of a grant's ``grant_s`` a writer counts on: it never WRITEs into a granted slot
later than this (the node's clock started first), so a grant the node ended is never
written into."""

_MAX_GRANTS = 65536
"""Grants a client remembers at once."""


@lru_cache(maxsize=1)
def nixl_available() -> bool:
    """Whether ``nixl-cu12`` can be imported here (checked once; imported the way
    :func:`~kvstore.transport.nixl_binding.import_bindings` imports it)."""
    try:
        import_bindings()
    except UnknownScheme:
        return False
    return True


@lru_cache(maxsize=1)
def _rdma_present() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


@lru_cache(maxsize=256)
def _is_local(host: str) -> bool:
    """Whether ``host`` is this machine (loopback or one of its addresses)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return False
    if addr.is_loopback:
        return True
    try:
        probe = socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET)
        with probe:
            probe.bind((str(addr), 0))  # only succeeds for an address of this host
        return True
    except OSError:
        return False


def prefer_ucx(transport: str, host: str, metadata: bytes) -> bool:
    """``ucx`` for a node that serves it, when NIXL is here and the peer is on this host
    (CMA) or RDMA exists; ``tcp`` otherwise."""
    if transport != "ucx" or not metadata or not nixl_available():
        return False
    return _is_local(host) or _rdma_present()


def agent_host(hosts: Sequence[str]) -> str | None:
    """The host a client's agent should take its UCX interfaces from, given the hosts of
    the ``ucx`` nodes it will talk to: theirs when every one is this host (loopback
    then), else None (every interface: UCX picks each peer's route)."""
    return hosts[0] if hosts and all(_is_local(h) for h in hosts) else None


def staging_device(device: torch.device | str | None) -> torch.device:
    """The device whose staging a transfer for tensors on ``device`` uses: the host, or
    the CUDA device itself (``"cuda"`` means the current one)."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev if dev.type == "cuda" else torch.device("cpu")


@dataclass
class UcxStats:
    """What a client's ``ucx://`` transfers did, in chunks (monotonic)."""

    written_in_place: int = 0
    """Chunks WRITE'd from the staging the put's encode left them in (host KV: encoded
    there; CUDA KV: copied there on the device after the encode)."""
    written_copied: int = 0
    """Chunks copied into staging at the WRITE instead (the put's chunks did not fit one
    extent)."""
    read: dict[str, int] = field(default_factory=dict)
    """Chunks READ into staging, by the staging's device (``"cpu"``, ``"cuda:0"``)."""


class UcxPath:
    """A client's NIXL agent and per-device staging arenas, created on first use; owned by
    one loop."""

    def __init__(self, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.stats = UcxStats()
        self._staging_bytes = staging_bytes
        self._agent: NixlAgent | None = None
        self._arenas: dict[torch.device, Arena] = {}
        self._no_staging: set[torch.device] = set()
        self._regs: list[Registration] = []
        self._peers: dict[bytes, str] = {}
        self._room = asyncio.Condition()
        self._lock = asyncio.Lock()
        self._closed = False

    async def _ensure(self, host: str | None = None) -> NixlAgent:
        """The agent, created on first use with the host's staging. UCX's interfaces follow
        the first peer's host when it is this host's (loopback for a node here, like a
        node's follow its ``--host``); a peer on another host, or none, leaves UCX every
        interface (no interface here owns that host's address, and UCX picks the route)."""
        if self._agent is not None and not self._closed:
            return self._agent  # (no lock: a device's registration must not stall transfers)
        async with self._lock:
            if self._closed:
                raise Closed("client is closed")
            if self._agent is None:
                name = f"kvclient-{uuid.uuid4().hex[:12]}"
                here = host if host is not None and _is_local(host) else None
                agent = NixlAgent(name, host=here, alone_inline_bytes=ALONE_INLINE_BYTES)
                try:
                    await agent.start()
                    await self._add_arena(agent, torch.device("cpu"))
                except BaseException:  # (failed or cancelled: the next call starts afresh)
                    await asyncio.shield(agent.close())
                    raise
                self._agent = agent  # only with its host staging registered
            return self._agent

    async def _add_arena(self, agent: NixlAgent, device: torch.device) -> Arena:
        """Allocate and register ``device``'s staging with ``agent`` (holding ``_lock``)."""
        arena = Arena(self._staging_bytes, device=device)
        self._regs.append(await agent.register(arena.tensor))
        self._arenas[device] = arena
        return arena

    async def _arena(self, device: torch.device) -> Arena:
        """``device``'s staging arena, registered on first use; the host's where a device's
        cannot be had (no memory for it, or NIXL/UCX refuses device memory: e.g. UCX built
        without CUDA, or a second GPU on one agent), remembered so it is tried once."""
        host = torch.device("cpu")
        await self._ensure()
        arena = self._arenas.get(device) or self._arenas.get(host)
        if device in self._arenas or device in self._no_staging or arena is None:
            if arena is None:
                raise Closed("client is closed")
            return arena
        async with self._lock:
            if self._closed:
                raise Closed("client is closed")
            if device in self._arenas:
                return self._arenas[device]
            assert self._agent is not None
            try:
                return await self._add_arena(self._agent, device)
            except (KVStoreError, RuntimeError) as exc:  # (torch's out-of-memory included)
                self._no_staging.add(device)
                logger.warning("no ucx:// staging on %s (%s): its chunks pass through host "
                               "staging", device, exc)  # fmt: skip
                return self._arenas[host]

    async def greet(self, metadata: bytes, host: str | None = None) -> str:
        """:meth:`peer`, then a NIXL notification to it (:data:`GREETING`): sending it makes
        UCX set its endpoint to the node up (done once this agent's UCX has progressed:
        its idle progress, :data:`~kvstore.transport.nixl.IDLE_PROGRESS_S`), which the
        first transfer would do otherwise (measured: the first WRITE after a warm-up took
        10.6-11.5 ms without it, 0.8-1.3 with it; the greeting 1.3 ms). The node reads and
        drops it at its next sweep. NIXL's ``makeConnection`` did not do this (measured:
        no faster)."""
        name = await self.peer(metadata, host)
        await (await self._ensure()).notify(name, GREETING)
        return name

    async def peer(self, metadata: bytes, host: str | None = None) -> str:
        """The agent name of the node whose NIXL metadata this is (loaded once)."""
        name = self._peers.get(metadata)
        if name is None:
            agent = await self._ensure(host)
            name = await agent.add_peer(metadata)
            self._peers[metadata] = name
        return name

    async def start(self, host: str | None, device: torch.device) -> None:
        """Start the agent now (``host`` as for a first peer there) with the host's staging
        and ``device``'s registered, and map the host staging's pages on a thread, so that
        transfers do not fault them in one by one (best effort: a refusal is logged).
        Raises what starting NIXL and registering raise."""
        await self._ensure(host)
        await self._arena(device)
        host_staging = self._arenas.get(torch.device("cpu"))
        if host_staging is None:
            return
        try:
            await asyncio.to_thread(populate, host_staging.tensor)
        except OSError as exc:  # (e.g. ENOMEM under a memory limit: pages fault in later)
            logger.warning("ucx:// staging not mapped ahead (%s)", exc)

    def fits(self, rows: int, row_bytes: int) -> bool:
        """Whether one transfer of ``rows`` rows can take staging (at most half of it)."""
        return rows * row_bytes <= self._staging_bytes // 2

    def rows_per_transfer(self, row_bytes: int) -> int:
        """How many rows of ``row_bytes`` one staging extent may hold."""
        return max(1, (self._staging_bytes // 4) // max(1, row_bytes))

    def devices(self) -> list[torch.device]:
        """The devices whose staging is registered so far."""
        return list(self._arenas)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie inside registered staging memory (of any device)."""
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        return any(reg.covers(ptr, nbytes) for reg in self._regs)

    @asynccontextmanager
    async def staging(
        self, rows: int, row_bytes: int, device: torch.device | str | None = None
    ) -> AsyncIterator[torch.Tensor]:
        """A ``[rows, row_bytes]`` uint8 view of registered memory on ``device`` (default the
        host; see :func:`staging_device`), or on the host where that device has no staging
        (see :meth:`_arena`), for one transfer.

        Waits for room (the caller's deadline bounds the wait). Raises
        :class:`CapacityError` when the request can never fit. If the body raises, the
        extent is freed only after a grace period (UCX may still touch it).
        """
        arena = await self._arena(staging_device(device))
        nbytes = max(1, rows * row_bytes)
        if nbytes > arena.capacity_bytes // 2:
            raise CapacityError(
                f"a {nbytes}-byte transfer exceeds half the {arena.capacity_bytes}-byte "
                "ucx staging arena; raise staging_bytes"
            )
        async with self._room:
            while (offset := arena.alloc_extent(nbytes)) is None:
                await self._room.wait()
        ok = False
        try:
            yield arena.view(offset, nbytes)[: rows * row_bytes].view(rows, row_bytes)
            ok = True
        finally:
            if ok:
                await self._free(arena, offset)
            else:
                asyncio.get_running_loop().call_later(
                    _GRACE_S, lambda: asyncio.ensure_future(self._free(arena, offset))
                )

    async def _free(self, arena: Arena, offset: int) -> None:
        if self._arenas.get(arena.device) is not arena:
            return  # closed meanwhile
        async with self._room:
            arena.free_extent(offset)
            self._room.notify_all()

    async def write(self, peer: str, spans: list[list[int]], local: list[torch.Tensor],
                    timeout: float) -> int:  # fmt: skip
        """One-sided WRITE of ``local[i]`` into the node's ``spans[i]``; bytes moved."""
        agent = await self._ensure()
        return await agent.write(peer, [_span(s) for s in spans], local, timeout=timeout)

    async def read(self, peer: str, spans: list[list[int]], local: list[torch.Tensor],
                   timeout: float) -> int:  # fmt: skip
        """One-sided READ of the node's ``spans[i]`` into ``local[i]``; bytes moved."""
        agent = await self._ensure()
        moved = await agent.read(peer, [_span(s) for s in spans], local, timeout=timeout)
        if local:
            where = str(local[0].device)
            self.stats.read[where] = self.stats.read.get(where, 0) + len(local)
        return moved

    async def close(self) -> None:
        """Close the agent (bounded); idempotent."""
        async with self._lock:
            self._closed = True
            agent, self._agent = self._agent, None
            self._arenas, self._regs = {}, []
        if agent is not None:
            await agent.close()


def _span(wire: list[int]) -> Span:
    return Span.from_wire(wire)


class Grants:
    """The chunks nodes granted this writer: ``(node, block, chunk index)`` → where to
    WRITE it and until when. A ``ucx://`` put of chunks that are all granted is a WRITE and
    one ``write`` exchange; a node ends a grant once it is used, so each is taken once.
    Owned by one loop; never blocks."""

    def __init__(self) -> None:
        self._by_chunk: dict[tuple[str, bytes, int], tuple[SlotLocation, float]] = {}

    def take(
        self, node_id: str, blocks: list[bytes], index: int, nbytes: int
    ) -> list[list[int]] | None:
        """The spans to WRITE chunk ``index`` (``nbytes`` long) of ``blocks`` at, taking
        their grants, when every one is granted by ``node_id`` (the node and its epoch: a
        restarted node's memory is another) and still good; None (taking nothing)
        otherwise."""
        now = asyncio.get_running_loop().time()
        keys = [(node_id, b, index) for b in blocks]
        spans = []
        for k in keys:
            got = self._by_chunk.get(k)
            span = got[0].span(index, nbytes) if got is not None and got[1] > now else None
            if span is None:
                return None
            spans.append(span)
        for k in keys:
            del self._by_chunk[k]
        return spans

    def keep(
        self,
        node_id: str,
        blocks: list[bytes],
        grants: tuple[tuple[int, int, bytes], ...],
        grant_s: float,
    ) -> None:
        """Remember what an ack of ``node_id`` granted for the put of ``blocks`` (for
        :data:`_GRANT_TRUST` of ``grant_s``; at most :data:`_MAX_GRANTS`)."""
        if not grants:
            return
        now = asyncio.get_running_loop().time()
        if len(self._by_chunk) + len(grants) > _MAX_GRANTS:
            self._by_chunk = {k: g for k, g in self._by_chunk.items() if g[1] > now}
        until = now + grant_s * _GRANT_TRUST
        for position, index, raw in grants:
            loc = SlotLocation.unpack(raw)
            if loc is None or not 0 <= position < len(blocks):
                continue
            if len(self._by_chunk) < _MAX_GRANTS:
                self._by_chunk[node_id, blocks[position], index] = (loc, until)

    def __len__(self) -> int:
        return len(self._by_chunk)

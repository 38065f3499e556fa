"""Plain records of the control plane, shared by the index store, the master and its client.

No I/O and no protobuf here: the master converts to and from the wire in
:mod:`kvstore.control.wire`; everything else speaks these frozen dataclasses.

A *mask* is a Python ``int`` whose bit ``i`` says chunk ``i`` (``layer * tp_size +
shard``) is present. On the wire it travels as little-endian bytes, which is exactly
``int.to_bytes(n, "little")``: chunk ``i`` is bit ``i % 8`` of byte ``i // 8``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "BlockAdd",
    "BlockRef",
    "CommitBatch",
    "EventKind",
    "HeartbeatReply",
    "Holder",
    "Holding",
    "IndexCounts",
    "IndexEvent",
    "MasterStats",
    "NodeInfo",
    "NodeRecord",
    "ObjectAdd",
    "ObjectHolder",
    "PrefixMatch",
    "Registration",
    "TenantUsage",
    "Tier",
    "WatchEvent",
    "WatchKind",
    "chunks_of",
    "mask_from_bytes",
    "mask_of",
    "mask_to_bytes",
]


def mask_of(chunks: Iterable[int]) -> int:
    """The mask with a bit set for every chunk index in ``chunks``."""
    mask = 0
    for chunk in chunks:
        mask |= 1 << chunk
    return mask


def chunks_of(mask: int, limit: int = 0) -> list[int]:
    """Chunk indices set in ``mask``, ascending; with ``limit > 0`` only those below it."""
    if limit > 0:
        mask &= (1 << limit) - 1
    out: list[int] = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def mask_to_bytes(mask: int, chunks_per_block: int = 0) -> bytes:
    """``mask`` as little-endian bytes: ``ceil(chunks_per_block / 8)`` of them (bits above
    cut off) when ``chunks_per_block > 0``, else as few as hold the highest set bit."""
    if chunks_per_block > 0:
        mask &= (1 << chunks_per_block) - 1
        return mask.to_bytes((chunks_per_block + 7) // 8, "little")
    return mask.to_bytes((mask.bit_length() + 7) // 8, "little")


def mask_from_bytes(raw: bytes) -> int:
    """Inverse of :func:`mask_to_bytes`."""
    return int.from_bytes(raw, "little")


@dataclass(frozen=True)
class Tier:
    """One memory tier of a node ("gpu", "host", ...) and its usage in bytes."""

    name: str
    capacity_bytes: int
    used_bytes: int = 0


@dataclass(frozen=True)
class NodeRecord:
    """A node's registry entry (``kv:n:{id}`` in Redis).

    ``epoch`` is the node's current epoch (0 in a record passed to ``register_node``, which
    assigns it); ``alive`` is False once that epoch is dead; ``draining`` is the operator's
    "no new placements" mark and survives re-registration.
    """

    node_id: str
    data_uri: str
    transport: str = "tcp"
    nixl_metadata: bytes = b""
    tiers: tuple[Tier, ...] = ()
    version: str = ""
    host: str = ""
    epoch: int = 0
    alive: bool = True
    draining: bool = False
    session: bytes = b""
    """SHA-256 digest of the registering process's key (empty: none); while the record is
    alive, only that key may register the id again, heartbeat, commit or deregister."""


@dataclass(frozen=True)
class Holding:
    """One node's index entry for one block: the epoch it was committed under, its mask and
    the slot's location as the node last committed it (opaque here; empty if none)."""

    epoch: int
    mask: int
    location: bytes = b""

    def chunks(self, limit: int = 0) -> list[int]:
        """Chunk indices present (see :func:`chunks_of`)."""
        return chunks_of(self.mask, limit)


@dataclass(frozen=True)
class BlockAdd:
    """Commit item: the node now holds ``chunks`` of block ``block_hash`` in ``ns_id``, in
    the slot at ``location`` (see :mod:`kvstore.dataplane.location`; empty: none given)."""

    ns_id: bytes
    block_hash: bytes
    chunks: tuple[int, ...]
    location: bytes = b""


@dataclass(frozen=True)
class BlockRef:
    """Commit item: the node evicted its whole slot of this block."""

    ns_id: bytes
    block_hash: bytes


@dataclass(frozen=True)
class ObjectAdd:
    """Commit item: the node now holds the ``put_object`` value ``key`` (``nbytes`` long)
    of writer version ``version`` (0: none given)."""

    key: str
    nbytes: int
    version: int = 0


@dataclass(frozen=True)
class CommitBatch:
    """One node's batch of index changes under ``(epoch, seq)``.

    Removals (``evicts``, ``object_removes``) are applied before additions.
    """

    node_id: str
    epoch: int
    seq: int
    adds: tuple[BlockAdd, ...] = ()
    evicts: tuple[BlockRef, ...] = ()
    object_adds: tuple[ObjectAdd, ...] = ()
    object_removes: tuple[str, ...] = ()
    tiers: tuple[Tier, ...] = ()
    """The node's tier usage as of this batch (empty: not reported)."""


@dataclass(frozen=True)
class ObjectHolder:
    """A live holder of a ``put_object`` value (``data_uri`` is empty inside the store) and
    the version of the value it holds."""

    node_id: str
    epoch: int
    nbytes: int
    data_uri: str = ""
    version: int = 0


@dataclass(frozen=True)
class IndexCounts:
    """Distinct blocks and objects with at least one holder."""

    blocks: int
    objects: int


class EventKind(enum.Enum):
    """Kinds of :class:`IndexEvent` an index store publishes."""

    COMMIT = "commit"
    EVICT = "evict"
    ABORT = "abort"
    NODE_DEAD = "node_dead"


@dataclass(frozen=True)
class IndexEvent:
    """A change published by the index store to its subscribers.

    COMMIT: ``node_id``/``epoch`` now hold ``chunks`` (the chunks of that add) of the block.
    EVICT: ``node_id`` evicted its slot of the block. ABORT: a writer gave up on the block.
    NODE_DEAD: every entry of ``node_id``'s ``epoch`` is dead (``ns_id``/``block_hash`` are
    empty; one event per death, delivered to every subscription).
    """

    kind: EventKind
    ns_id: bytes = b""
    block_hash: bytes = b""
    node_id: str = ""
    epoch: int = 0
    chunks: tuple[int, ...] = ()
    reason: str = ""
    location: bytes = b""
    """COMMIT: the slot's location the add carried."""


# -- what the master client returns ------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    """A node's registration: its epoch and the lease (heartbeat every ``lease_s / 3``)."""

    epoch: int
    lease_s: float


@dataclass(frozen=True)
class HeartbeatReply:
    """``ok``: lease renewed. ``reregister``: the master does not know this node/epoch.
    ``draining``: the node's draining mark (it copies its blocks away while set)."""

    ok: bool
    reregister: bool
    draining: bool = False


@dataclass(frozen=True)
class Holder:
    """A live holder of a block as the master reports it."""

    node_id: str
    data_uri: str
    epoch: int
    mask: int
    location: bytes = b""
    """Where its slot lives (:class:`kvstore.dataplane.location.SlotLocation`, packed);
    empty when the node serves no one-sided reads."""

    def chunks(self, limit: int = 0) -> list[int]:
        """Chunk indices this holder has (see :func:`chunks_of`)."""
        return chunks_of(self.mask, limit)

    def has(self, chunk: int) -> bool:
        """True if this holder has chunk index ``chunk``."""
        return bool(self.mask >> chunk & 1)


class PrefixMatch(NamedTuple):
    """``blocks`` leading blocks fully present; ``holders[i]`` for each of them
    (unpacks as ``blocks, holders = match``)."""

    blocks: int
    holders: list[list[Holder]]


@dataclass(frozen=True)
class NodeInfo:
    """A node as ``Nodes()`` reports it (registry + liveness)."""

    node_id: str
    alive: bool
    suspect: bool
    draining: bool
    lease_age_s: float
    epoch: int
    data_uri: str
    transport: str
    nixl_metadata: bytes
    tiers: tuple[Tier, ...]
    version: str
    host: str
    counters: Mapping[str, int] = field(default_factory=dict)
    """The node's own counters as of its last heartbeat (slots, pinned_slots, leases,
    holds, inflight, grants, scrub_pending, scrubbed, scrub_dropped, objects, ...)."""

    @property
    def placeable(self) -> bool:
        """True if new blocks may be placed here: alive, not suspect, not draining."""
        return self.alive and not self.suspect and not self.draining

    @property
    def free_bytes(self) -> int:
        """Free bytes summed over the memory tiers (the HRW placement weight): puts land
        in memory, so a disk tier, which only keeps blocks longer, weighs nothing here (a
        node with a large disk would otherwise take nearly every block of the pool)."""
        return sum(max(0, t.capacity_bytes - t.used_bytes) for t in self.tiers if t.name != "disk")

    @property
    def room_bytes(self) -> int:
        """How much more it can keep without letting a block of its own go (a drain's
        placement weight): its disk's free bytes where it has a disk tier (its memory
        caches the disk there: every block is written to it, and a full disk drops its
        oldest blocks for new ones), else its memory tiers' free bytes."""
        for t in self.tiers:
            if t.name == "disk":
                return max(0, t.capacity_bytes - t.used_bytes)
        return self.free_bytes


class WatchKind(str, enum.Enum):  # noqa: UP042 (str() stays "WatchKind.X", as shipped)
    """Kinds of :class:`WatchEvent` on a ``Watch`` stream (equal to their names as str)."""

    COMMIT = "COMMIT"
    EVICT = "EVICT"
    ABORT = "ABORT"
    SNAPSHOT_DONE = "SNAPSHOT_DONE"


@dataclass(frozen=True)
class WatchEvent:
    """One event of a ``Watch`` stream; ``block_index`` indexes the watched hashes."""

    kind: WatchKind
    block_index: int = 0
    chunks: tuple[int, ...] = ()
    node_id: str = ""
    epoch: int = 0
    reason: str = ""
    location: bytes = b""
    """COMMIT: where the holder's slot lives (as :attr:`Holder.location`)."""


@dataclass(frozen=True)
class MasterStats:
    """Pool totals: exactly the fields of ``kvctl status --json``."""

    nodes: int
    live_nodes: int
    capacity_bytes: int
    used_bytes: int
    blocks: int
    objects: int
    hits: int
    misses: int
    tenants: tuple[TenantUsage, ...] = ()
    """By tenant (``kvctl stats``): every tenant for an admin, a client's own."""


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's share of the pool, over the live nodes' last heartbeats."""

    tenant: str
    used_bytes: int
    quota_bytes: int
    """0: no quota."""
    evictions: int
    """Its slots evicted to make room, so far."""


class ClusterEventKind(enum.Enum):
    STORED = 1  # node_id (epoch) now holds chunks of the block
    REMOVED = 2  # node_id no longer holds the block
    NODE_DEAD = 3  # every block node_id held under epoch is gone
    CLEARED = 4  # drop the index: rebuild it from what follows (the snapshot, if asked for)
    SNAPSHOT_DONE = 5  # the STORED events since CLEARED are the whole index as of its seq


@dataclass(frozen=True)
class ClusterEvent:
    """One numbered change of the pool's index (fields unused by a kind are empty)."""

    seq: int
    kind: ClusterEventKind
    ns_id: bytes = b""
    block_hash: bytes = b""
    node_id: str = ""
    epoch: int = 0
    chunks: tuple[int, ...] = ()
    medium: str = ""
    """STORED: ``"gpu"`` or ``"host"`` where the slot's location says, else empty."""
    reason: str = ""

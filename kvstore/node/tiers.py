"""A node's memory tiers: host memory always, with ``--gpu-mem`` a GPU tier before it.

Each :class:`MemoryTier` is one arena, its pure :class:`~kvstore.core.slots.SlotTable` and its
NIXL registration (``ucx://`` nodes). A block lives in one tier at most. :class:`Tiers`
journals every eviction of every tier until the master link reports it.

With a GPU tier, blocks move between tiers outside any request (:meth:`Tiers.move_one`,
which the node runs between requests): a new block lands in the GPU tier when it has free
room and in host memory otherwise, so an allocation never waits for a copy; while the GPU
tier has less than :data:`FREE_SHARE` of it free, its least recently used blocks move to
host memory (one device → host copy of their landed chunks) instead of leaving the node;
and a block read from host memory moves back up into the GPU tier's free room.

With a disk tier (:mod:`kvstore.node.disk_tier`, ``--disk-path``) below host memory, host
memory's LRU victims whose disk copy is current stay on the node (the host table's demote
hook), and :meth:`Tiers.location` and the commit items say which tier holds each copy.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstore.control.records import BlockAdd, Tier
from kvstore.core.arena import Arena
from kvstore.core.slots import Slot, SlotKey, SlotTable, TierStats
from kvstore.dataplane.location import SlotLocation, tier_mark
from kvstore.errors import InvalidArgument, KVStoreError, ProtocolError
from kvstore.metrics import Metrics
from kvstore.transport.nixl import Registration

if TYPE_CHECKING:
    from kvstore.node.disk_tier import DiskTier

__all__ = [
    "FREE_SHARE",
    "MAX_PROMOTIONS",
    "MemoryTier",
    "Tiers",
    "gpu_device",
    "host_copy",
    "landed_bits",
    "tier_stats",
]

logger = logging.getLogger("kvstore.node")

FREE_SHARE = 1 / 8
"""The share of the GPU tier's slots kept free for new blocks (at least one): below it, its
least recently used blocks move to host memory; a promotion never takes the tier below
it."""
MAX_PROMOTIONS = 256
"""Host blocks read and waiting to move up (the most recently read are kept)."""


@dataclass
class MemoryTier:
    """One memory tier of the node: its arena, its slots and its NIXL registration."""

    name: str
    arena: Arena
    table: SlotTable
    reg: Registration | None = None

    def owns(self, slot: Slot) -> bool:
        """Whether ``slot`` lives in this tier (quarantined or not)."""
        return self.table.holds(slot)

    def holds(self, view: torch.Tensor) -> bool:
        """Whether ``view`` lies inside this tier's arena."""
        base, t = view.data_ptr(), self.arena.tensor
        return view.device == t.device and t.data_ptr() <= base < t.data_ptr() + t.numel()


class Tiers:
    """The node's tiers, fastest first (``[gpu, host]`` with a GPU tier, else ``[host]``).

    ``host_mem`` bytes of host memory (on huge pages where the kernel has them, unless
    ``huge_pages`` is False); ``gpu_mem`` bytes on ``gpu`` (0: no GPU tier).
    Raises :class:`InvalidArgument` for a device torch cannot use.
    """

    def __init__(
        self,
        host_mem: int,
        gpu_mem: int = 0,
        gpu: str = "cuda",
        metrics: Metrics | None = None,
        *,
        huge_pages: bool = True,
    ) -> None:
        self.metrics = metrics or Metrics()
        arena = Arena(host_mem, device="cpu", huge_pages=huge_pages)
        self.host = MemoryTier("host", arena, SlotTable(arena, demote=self._to_disk))
        self.disk: DiskTier | None = None
        """The disk tier below host memory (``--disk-path``; set by the node)."""
        self.all = [self.host]
        if gpu_mem:
            device_arena = Arena(gpu_mem, device=gpu_device(gpu))
            table = SlotTable(device_arena, demote=self._demote)
            self.all.insert(0, MemoryTier("gpu", device_arena, table))
        self._unreported: list[tuple[str, SlotKey]] = []
        """Evictions (tier, key) not yet reported to the master, beyond the tables' own."""
        self._moved: list[Slot] = []
        """Slots moved to another tier whose new location the master has not heard of."""
        self._sending: list[Slot] = []
        """The moves the last :meth:`take_moves` took (put back if their commit fails)."""
        self._relocated: list[BlockAdd] = []
        """Blocks now held on disk only whose old location the master still has."""
        self._sending_relocated: list[BlockAdd] = []
        self._promotions: dict[SlotKey, None] = {}
        """Host blocks read since they were last considered, least recent first."""
        self._slot_bytes = 0
        """The slot size of the last put (what the GPU tier keeps room for)."""
        self.wake: Callable[[], None] = lambda: None
        """Called when :meth:`move_one` has work (the node sets it to wake its mover)."""
        self.movable: Callable[[Slot], bool] = lambda slot: True
        """Whether a host slot may move up now (the node: not while its scrub is pending)."""
        self.promoting = True
        """False while the node drains: its blocks are being copied away, and a moved
        block would be copied again (a drain tracks what it copied by slot)."""

    def __iter__(self) -> Iterator[MemoryTier]:
        return iter(self.all)

    def __getitem__(self, i: int) -> MemoryTier:
        return self.all[i]

    def __len__(self) -> int:
        return len(self.all)

    @property
    def fastest(self) -> MemoryTier:
        """Where puts start new blocks (when it has free room): the GPU tier if there is
        one."""
        return self.all[0]

    def start_tier(self, ns_id: bytes, parent: bytes | None) -> MemoryTier:
        """Where a put starts a new block: the fastest tier, but host memory when its parent
        block is there. A child above its parent would break the rule that a block
        leaves the node only after its children: host memory evicts a parent whose
        children it does not hold."""
        if parent is not None and self.host.table.find((ns_id, parent)) is not None:
            return self.host
        return self.fastest

    def in_gpu(self, view: torch.Tensor) -> bool:
        """Whether ``view`` lies in the GPU tier (on a CUDA device, or on the CPU in tests:
        either way it takes the device path)."""
        return self.all[0] is not self.host and self.all[0].holds(view)

    def lookup(self, key: SlotKey) -> tuple[MemoryTier, Slot] | None:
        """The tier holding ``key``'s readable slot and the slot (None when absent or
        quarantined; a key lives in one tier at most)."""
        for tier in self.all:
            slot = tier.table.get(key)
            if slot is not None:
                return tier, slot
        return None

    def holder(self, key: SlotKey) -> MemoryTier | None:
        """The tier holding ``key``'s slot, quarantined or not."""
        for tier in self.all:  # (a loop, not a generator: called per chunk of every put)
            if tier.table.find(key) is not None:
                return tier
        return None

    def owner(self, slot: Slot) -> MemoryTier | None:
        """The tier ``slot`` lives in (quarantined or not); None once it is gone."""
        for tier in self.all:
            if tier.table.holds(slot):
                return tier
        return None

    def tier_of(self, slot: Slot) -> MemoryTier:
        """The tier ``slot`` lives in; :class:`ProtocolError` once it is gone."""
        if (tier := self.owner(slot)) is not None:
            return tier
        raise ProtocolError(f"slot {slot.key[1].hex()} is no longer held here")

    def span(self, view: torch.Tensor) -> list[int]:
        """The NIXL span (wire form) of ``view``; :class:`InvalidArgument` when its tier is
        not registered (the node does not serve ``ucx://``)."""
        for tier in self.all:
            if tier.reg is not None and tier.holds(view):
                offset = view.data_ptr() - tier.arena.tensor.data_ptr()
                return tier.reg.span(offset, view.numel()).to_wire()  # type: ignore[no-any-return]
        raise InvalidArgument("this node does not serve ucx://")

    def location(self, slot: Slot, tier: MemoryTier | None = None) -> bytes:
        """``slot``'s packed :class:`SlotLocation` in its tier's NIXL registration (``tier``:
        the tier it lives in, when the caller knows), for readers that READ it directly;
        the tier's mark (:func:`~kvstore.dataplane.location.tier_mark`) when that tier is
        not registered (no ``ucx://``); empty once the slot is gone."""
        if slot.location and slot.alive:
            return slot.location  # (computed in the tier it lives in: a slot never moves)
        tier = tier or self.owner(slot)
        if tier is None:
            return b""
        if tier.reg is None:
            slot.location = tier_mark(tier.name)
            return slot.location
        span = tier.reg.span(slot.offset, slot.slot_bytes)
        mem = span.to_wire()[3]
        where = SlotLocation(span.addr, slot.chunk_bytes, slot.num_chunks, span.dev_id, mem)
        slot.location = where.pack()
        return slot.location

    def add_of(
        self, slot: Slot, chunks: tuple[int, ...] | None = None, tier: MemoryTier | None = None
    ) -> BlockAdd:
        """The commit item saying this node holds ``chunks`` (default: every landed chunk)
        of ``slot``'s block, with the slot's location (``tier``: as for :meth:`location`)."""
        landed = tuple(landed_bits(slot.landed_mask)) if chunks is None else chunks
        return BlockAdd(slot.key[0], slot.key[1], landed, self.location(slot, tier))

    def take_moves(self) -> list[BlockAdd]:
        """Commit items for the slots demoted to host memory since the last call (their
        location changed), each taken once; slots gone meanwhile are left out (their
        eviction is reported instead)."""
        moved, self._moved = self._moved, []
        relocated, self._relocated = self._relocated, []
        self._sending, self._sending_relocated = moved, relocated
        adds = [self.add_of(s) for s in moved if s.alive and self.owner(s) and s.landed_mask]
        if self.disk is not None:  # (each only while it is still on disk and nowhere else)
            on_disk = self.disk.store
            adds += [a for a in relocated if (a.ns_id, a.block_hash) in on_disk
                     and self.holder((a.ns_id, a.block_hash)) is None]  # fmt: skip
        return adds

    def moved(self, slot: Slot) -> None:
        """``slot``'s block has a new location readers may READ (committed with the next
        batch)."""
        self._moved.append(slot)

    def relocated(self, add: BlockAdd) -> None:
        """A block left host memory for the disk tier: the index learns it (the disk's
        tier mark replaces its location with the next commit: readers then ask the node)."""
        self._relocated.append(add)

    def stored(self, slots: list[Slot]) -> None:
        """Host slots whose chunks landed: the disk tier writes the complete ones."""
        if self.disk is not None:
            self.disk.queue(slots)

    def on_disk(self, chunks: list[tuple[SlotKey, bytes | None, int]]) -> frozenset[int]:
        """Positions of ``chunks`` (key, parent, index) held only on the disk tier: no memory
        tier holds the block, and its disk record has the chunk (a put stores them STORED:
        the first writer wins, as in memory)."""
        if self.disk is None:
            return frozenset()
        index = self.disk.store.index
        held = [(i, index.get(key), key, c) for i, (key, _, c) in enumerate(chunks)]
        return frozenset(
            i for i, rec, key, c in held
            if rec is not None and rec.mask >> c & 1 and self.holder(key) is None
        )  # fmt: skip

    def _to_disk(self, victim: Slot) -> bool:
        """Host memory's demote hook: True when the disk tier keeps the block."""
        return self.disk is not None and self.disk.demote(victim)

    def evicted_from(self, tier: str, keys: list[SlotKey]) -> None:
        """Journal evictions off the node from the tier named ``tier`` (the disk's)."""
        self._unreported.extend((tier, k) for k in keys)

    def put_back(self, gone: list[tuple[str, SlotKey]]) -> None:
        """The commit carrying evictions ``gone`` and the moves last taken failed: both go
        with the next one (the master applies a batch's removals before its additions, so
        a block evicted and stored again meanwhile ends up held). Moves are rebuilt from
        their slots then, so a slot gone meanwhile is left out."""
        self._unreported = [*gone, *self._unreported]
        self._moved = [*self._sending, *self._moved]
        self._relocated = [*self._sending_relocated, *self._relocated]
        self._sending, self._sending_relocated = [], []

    def evicted(self, tier: MemoryTier, keys: list[SlotKey]) -> None:
        """Journal evictions the caller made in ``tier`` (reported with the next commit)."""
        self._unreported.extend((tier.name, k) for k in keys)

    def take_evictions(self) -> list[tuple[str, SlotKey]]:
        """Every eviction (tier name, key) not yet taken; each is taken exactly once."""
        gone = [(t.name, k) for t in self.all for k in t.table.take_evictions()]
        gone, self._unreported = [*self._unreported, *gone], []
        return gone

    def set_quotas(self, quotas: Mapping[str, int]) -> None:
        """This node's byte quotas by tenant, each counted over every tier (see
        :meth:`~kvstore.core.slots.SlotTable.set_quotas`): ``tcp://`` puts land in host
        memory only, so a share per tier would hold a tenant to part of its quota."""
        for tier in self.all:
            tier.table.set_quotas(quotas, self._tenant_used)

    def _tenant_used(self, tenant: str) -> int:
        return sum(t.table.owned_bytes(tenant) for t in self.all)

    def tenant_bytes(self) -> dict[str, int]:
        """Bytes of slots held, by tenant, over every tier."""
        return dict(sum((Counter(t.table.owner_bytes()) for t in self.all), Counter()))

    def tenant_evictions(self) -> dict[str, int]:
        """LRU evictions so far (off the node, not demotions), by tenant, over every tier."""
        return dict(sum((Counter(t.table.owner_evictions) for t in self.all), Counter()))

    def usage(self) -> list[Tier]:
        """Capacity and use per tier, as the master records them. Sent with every commit:
        O(1) per tier (an arena's full stats count its spans)."""
        tiers = [
            Tier(t.name, t.arena.capacity_bytes, t.arena.capacity_bytes - t.arena.free_bytes)
            for t in self.all
        ]
        if self.disk is not None:
            store = self.disk.store
            tiers.append(Tier(self.disk.name, store.capacity, store.live_bytes))
        return tiers

    # -- moves between tiers -------------------------------------------------------------

    def _room(self, slot_bytes: int) -> tuple[int, int]:
        """(free slots of ``slot_bytes`` in the GPU tier, the slots it keeps free)."""
        try:
            free, total = self.all[0].arena.slot_room(slot_bytes)
        except KVStoreError:  # a slot that never fits the tier
            return 0, 0
        return free, max(1, math.ceil(total * FREE_SHARE))

    def short_of_room(self) -> bool:
        """Whether the GPU tier has fewer free slots than :data:`FREE_SHARE` of what it
        holds, for the slot size its puts last took (False without a GPU tier or a put)."""
        if len(self.all) == 1 or not self._slot_bytes:
            return False
        free, keep = self._room(self._slot_bytes)
        return free < keep

    def allocated(self, slot_bytes: int = 0) -> None:
        """A put allocated slots of ``slot_bytes`` (0: let go of its slots): wake the mover
        if the GPU tier is short of room."""
        self._slot_bytes = slot_bytes or self._slot_bytes
        if self.short_of_room():
            self.wake()

    def nudge(self) -> None:
        """Reads let go of their slots: wake the mover if promotions wait (a block is not
        moved while a read pins it)."""
        if self._promotions:
            self.wake()

    def hit(self, keys: list[SlotKey]) -> None:
        """Blocks were read from host memory: candidates to move up into the GPU tier."""
        if len(self.all) == 1 or not keys:
            return
        for key in keys:
            self._promotions.pop(key, None)
            self._promotions[key] = None
        while len(self._promotions) > MAX_PROMOTIONS:
            del self._promotions[next(iter(self._promotions))]
        self.wake()

    def move_one(self) -> bool:
        """One move, synchronous, never inside a request: while the GPU tier is short of
        :data:`FREE_SHARE` free, demote its least recently used block (to host memory, or
        off the node when host memory has no room for it); else promote the most recently
        read host block that fits in the GPU tier's free room. Whether there may be more
        to do. Never raises for a failed copy (logged; the block stays where it was, or a
        demoted one is dropped as an eviction)."""
        if len(self.all) == 1:
            return False
        if self.short_of_room():
            return self.all[0].table.evict_lru() is not None
        if not self.promoting:
            return False
        for key in reversed(list(self._promotions)):  # most recently read first (<= 256)
            moved = self._promote(key)
            if moved is not None:  # moved, or not to be moved: forget it
                del self._promotions[key]
            if moved:
                return True
        return False

    def _promote(self, key: SlotKey) -> bool | None:
        """Move host block ``key`` into the GPU tier: True if moved, None to try it again
        later (pinned: being read or written; its scrub pending; its parent still in host
        memory, to move first), False if it is not to be moved now (gone, empty, or no
        room beyond the tier's free share)."""
        gpu, host = self.all[0], self.host
        slot = host.table.get(key)
        if slot is None or not slot.landed_mask or gpu.table.find(key) is not None:
            return False  # gone, empty, or (a bug) in both tiers
        parent_here = slot.parent is not None and host.table.find((key[0], slot.parent))
        if slot.pins or not self.movable(slot) or parent_here:
            return None  # a parent moves up before its children (see start_tier)
        free, keep = self._room(slot.slot_bytes)
        if free - 1 < keep:  # a promotion never makes the mover demote
            return False
        try:
            res = gpu.table.allocate(
                key, slot.slot_bytes, slot.chunk_bytes, slot.num_chunks, slot.parent,
                slot.owner, evict=False,
            )  # fmt: skip
        except KVStoreError:
            return False
        if self.short_of_room():  # the last put's slot size ran short: no room after all
            gpu.table.evict(key)
            return False
        try:
            gpu.table.slot_view(res.slot).copy_(host.table.slot_view(slot))
            for index in landed_bits(slot.landed_mask):
                gpu.table.mark_landed(res.slot, index)
        except Exception:
            logger.exception("moving slot %s into the GPU tier failed", key[1].hex())
            gpu.table.evict(key)
            return False
        if not host.table.evict(key):  # unpinned, so removed now (not an eviction off
            gpu.table.evict(key)  # the node); were it not, the copy above would go
            return False
        self.metrics.tier_moves.labels(to=gpu.name).inc()
        if gpu.reg is not None:
            self._moved.append(res.slot)
        return True

    def _demote(self, victim: Slot) -> bool:
        """The GPU tier's LRU victim moves to host memory instead of leaving the node (one
        device → host copy of its landed chunks); False, dropping it, when host memory has
        no room or the copy fails. The master's entry stays (the block is still on this
        node); its new location goes with the next commit. Never raises (a
        :class:`SlotTable` demote hook)."""
        gpu, host = self.all[0], self.host
        if not victim.landed_mask:
            return False
        if host.table.find(victim.key) is not None:  # a key lives in one tier: a bug
            logger.error("slot %s is in both tiers; dropping the GPU copy", victim.key[1].hex())
            return False
        try:
            res = host.table.allocate(
                victim.key, victim.slot_bytes, victim.chunk_bytes, victim.num_chunks,
                victim.parent, victim.owner,
            )  # fmt: skip
        except KVStoreError:
            return False
        self.evicted(host, res.evicted)
        try:
            host.table.slot_view(res.slot).copy_(gpu.table.slot_view(victim))
            for index in landed_bits(victim.landed_mask):
                host.table.mark_landed(res.slot, index)
        except Exception:
            logger.exception("moving slot %s to host memory failed", victim.key[1].hex())
            host.table.evict(victim.key)
            return False
        # (a dropped victim is journaled and counted with the other evictions it reports)
        self.metrics.evictions.labels(tier=gpu.name).inc()
        self.metrics.tier_moves.labels(to=host.name).inc()
        if host.reg is not None:
            self._moved.append(res.slot)
        self.stored([res.slot])
        return True


def host_copy(view: torch.Tensor) -> torch.Tensor:
    """A host copy of a device view (what ``tcp://`` sends for the GPU tier)."""
    return torch.empty_like(view, device="cpu").copy_(view)


def gpu_device(name: str) -> torch.device:
    """The GPU tier's device; InvalidArgument when torch cannot use it."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(f"bad GPU tier device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("--gpu-mem needs a CUDA device, and torch sees none")
    return device


def landed_bits(mask: int) -> list[int]:
    """The chunk indices set in a landed bitmask."""
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def tier_stats(name: str, st: TierStats) -> dict[str, Any]:
    """One tier's entry of the node's ``stats`` answer."""
    return {
        "name": name,
        "slots": st.slots,
        "pinned_slots": st.pinned_slots,
        "capacity_bytes": st.capacity_bytes,
        "used_bytes": st.used_bytes,
    }

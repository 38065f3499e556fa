"""The storage node's slot table: slots per (namespace, block), leases, eviction, objects.

Pure state over one :class:`~kvstore.core.arena.Arena` (one tier); the node's servers only
carry its decisions out. Nothing blocks, nothing does I/O, time is passed in (``now=``) or
read from an injected ``clock``. Not thread-safe: one event loop owns a table.

Slot life cycle::

    allocate ──> LIVE ──(quarantine)──> QUARANTINED ──(unquarantine)──> LIVE
                  │  pin/release (leases), mark_landed, touch
                  └──(LRU eviction | evict | drop_namespace)──> gone (its memory reused)

- A **slot** holds every chunk (layer x shard) of one block at ``offset + i * chunk_bytes``
  with a bitmask of chunks that have landed. ``get`` returns None for a missing or
  quarantined slot; operations on a slot that is gone raise :class:`Miss`.
- **Leases** own pins: ``with table.pinned(slot) as view:`` or ``lease = table.pin(slot,
  ttl_s)``; ``Lease.release()`` is idempotent and ``expire_leases(now)`` releases the leases
  of clients that went away. A pinned slot is never evicted or reused.
- **Eviction** takes whole slots, least recently used first, among the *evictable* ones:
  live (not quarantined), unpinned, and with no cached child in their prefix chain (a slot
  allocated with ``parent=h`` is the child of ``(ns, h)``). So along a chain the tail goes
  first; ``touch`` stamps a request's blocks tail to head, so the tail is also the older.
  With quotas (:meth:`SlotTable.set_quotas`), the least recently used slot of an owner
  (tenant) over its quota goes before anyone else's.
  Every LRU eviction is journaled and reported in the next :class:`AllocResult`
  (``evicted``) or by :meth:`SlotTable.take_evictions` — it cannot be lost, even when an
  allocation evicts and still fails.
- **Quarantine**: a slot whose transfer timed out may still be read or written by a peer.
  It is unreadable (``get`` misses, ``pin`` and views raise), never evicted or reused, and
  still counts as used until the caller calls ``unquarantine`` (then it may ``evict`` it).
- **Objects** (:class:`ObjectStore`): ``put_object`` values in the arena's extent heap,
  published only when their bytes are complete, pinned by the same leases, never evicted
  automatically; they may evict LRU slots to make room, within a byte quota.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvstore.core.arena import Arena, Lease, LeaseBook, expiry_time
from kvstore.core.lru import OwnerLRU
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, Miss

__all__ = [
    "AllocResult",
    "Lease",
    "ObjectStore",
    "ObjectWrite",
    "Slot",
    "SlotKey",
    "SlotTable",
    "StoredObject",
    "TierStats",
]

SlotKey = tuple[bytes, bytes]
"""``(ns_id, block_hash)``: what a slot holds."""


class Slot:
    """One block's slot. Attributes are read-only outside :class:`SlotTable`.

    ``offset`` is the byte offset in the arena; chunk ``i`` lives at ``offset + i *
    chunk_bytes``; ``stride`` is the bytes it occupies; ``landed_mask`` has bit ``i`` set
    once chunk ``i`` landed; ``pins`` counts live leases; ``alive`` turns False when the
    slot leaves the table (its memory may then belong to another slot).
    """

    __slots__ = (
        "alive",
        "chunk_bytes",
        "heap_stamp",
        "key",
        "landed_mask",
        "location",
        "num_chunks",
        "offset",
        "owner",
        "parent",
        "pins",
        "quarantined",
        "slot_bytes",
        "stamp",
        "stride",
    )

    def __init__(
        self,
        key: SlotKey,
        offset: int,
        slot_bytes: int,
        stride: int,
        chunk_bytes: int,
        num_chunks: int,
        parent: bytes | None,
        owner: str = "",
    ) -> None:
        self.key = key
        self.owner = owner
        """The tenant whose block it is (``""``: none); quotas count by owner."""
        self.offset = offset
        self.slot_bytes = slot_bytes
        self.stride = stride
        self.chunk_bytes = chunk_bytes
        self.num_chunks = num_chunks
        self.parent = parent
        self.landed_mask = 0
        self.pins = 0
        self.quarantined = False
        self.alive = True
        self.stamp = 0
        self.heap_stamp = -1
        self.location = b""
        """Where the slot lies, packed for readers, as its holder computed it once (empty:
        not yet). The slot's memory never moves while it lives, so it stays true."""

    @property
    def ns_id(self) -> bytes:
        """The namespace id half of the key."""
        return self.key[0]

    @property
    def block_hash(self) -> bytes:
        """The block hash half of the key."""
        return self.key[1]

    @property
    def complete(self) -> bool:
        """True once every chunk has landed."""
        return self.landed_mask == (1 << self.num_chunks) - 1

    def __repr__(self) -> str:
        return (
            f"Slot({self.key[1].hex()[:12]}…, offset={self.offset}, "
            f"landed={self.landed_mask:#x}/{self.num_chunks}, pins={self.pins}"
            f"{', quarantined' if self.quarantined else ''}{'' if self.alive else ', gone'})"
        )


class AllocResult(NamedTuple):
    """What :meth:`SlotTable.allocate` did: the slot, whether it is new, and the keys of
    every slot evicted since the last report (send them to the master)."""

    slot: Slot
    created: bool
    evicted: list[SlotKey]


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's accounting (bytes unless named otherwise); ``used + free == capacity``."""

    device: str
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    pinned_bytes: int
    """Bytes of slots with at least one live lease (a subset of used)."""
    slot_bytes: int
    object_bytes: int
    slots: int
    pinned_slots: int
    quarantined_slots: int
    evictable_slots: int
    leases: int


class SlotTable:
    """Slots of one tier: allocation with LRU eviction, landing masks, leases, quarantine.

    Every method is O(1) or O(log n) (the LRU and expiry heaps) unless its docstring says
    otherwise, and none blocks. ``clock`` is read only when a ``now=`` argument is omitted.
    """

    def __init__(
        self,
        arena: Arena,
        *,
        clock: Callable[[], float] = time.monotonic,
        demote: Callable[[Slot], bool] | None = None,
    ) -> None:
        """``demote(victim)``, if given, is offered every LRU victim just before its memory
        is reused; True means it copied the slot to another tier of the same node, so the
        key is not journaled as evicted. It must not raise."""
        self.arena = arena
        self._clock = clock
        self._demote = demote
        self._slots: dict[SlotKey, Slot] = {}
        self._children: dict[SlotKey, int] = {}
        self._evictable: dict[SlotKey, Slot] = {}
        self._lru: OwnerLRU[Slot] = OwnerLRU(self._evictable)
        self._owner_bytes: dict[str, int] = {}
        self._quotas: dict[str, int] = {}
        self._used: Callable[[str], int] = self.owned_bytes
        self.owner_evictions: dict[str, int] = {}
        """LRU evictions so far, by owner of the slot evicted."""
        self._tick = 0
        self._cold_tick = -1
        """Stamps of slots allocated cold count down from -2, below every warm stamp (-1
        is a slot's ``heap_stamp`` when it has no entry in the LRU heaps)."""
        self._leases: LeaseBook[Slot] = LeaseBook(self._on_release)
        self._journal: list[SlotKey] = []
        self._pinned_bytes = 0
        self._pinned_slots = 0
        self._quarantined = 0

    def __len__(self) -> int:
        return len(self._slots)

    # ---- allocation and eviction ----------------------------------------------------

    def allocate(
        self,
        key: SlotKey,
        slot_bytes: int,
        chunk_bytes: int,
        num_chunks: int,
        parent: bytes | None = None,
        owner: str = "",
        *,
        evict: bool = True,
        cold: bool = False,
    ) -> AllocResult:
        """The slot for ``key``, allocating it (most recently used) if absent, for
        ``owner`` (a tenant; see :meth:`set_quotas`). ``evict=False``: only from free room
        (:class:`CapacityError` when there is none), never evicting or demoting.
        ``cold=True``: the new slot is the next victim instead (older than every slot
        allocated warm), until a :meth:`touch` warms it: a block staged up from a lower
        tier for one read, which must not displace blocks in use.

        ``parent`` is the previous block's hash in the prefix chain (None for the first
        block); the parent is never evicted to make room for its child. If ``key`` already
        has a live slot of the same geometry it is returned with ``created=False`` (first
        writer wins). Evicts LRU slots as needed; ``evicted`` carries every eviction not yet
        reported. A new slot is evictable until pinned: pin it while its bytes land.
        Raises :class:`InvalidArgument` for a bad key or geometry (also a
        geometry that differs from the existing slot's) and :class:`CapacityError` when
        evicting everything evictable does not make room, or ``key`` is quarantined.
        """
        slot = self._slots.get(key)
        if slot is not None:
            return self._existing(slot, slot_bytes, chunk_bytes, num_chunks)
        _check_request(key, slot_bytes, chunk_bytes, num_chunks, parent)
        parent_key = None if parent is None else (key[0], parent)
        if parent_key is not None:
            self._add_child(parent_key)
        try:
            stride = self.arena.slot_stride(slot_bytes)
            offset = self._alloc_offset(slot_bytes, owner, stride, evict)
        except KVStoreError:
            if parent_key is not None:
                self._drop_child(parent_key)
            raise
        slot = Slot(key, offset, slot_bytes, stride, chunk_bytes, num_chunks, parent, owner)
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + stride
        if cold:
            self._cold_tick -= 1
            slot.stamp = self._cold_tick
        else:
            self._tick += 1
            slot.stamp = self._tick
        self._slots[key] = slot
        self._refresh(slot)
        return AllocResult(slot, True, self.take_evictions())

    def _existing(
        self, slot: Slot, slot_bytes: int, chunk_bytes: int, num_chunks: int
    ) -> AllocResult:
        if slot.quarantined:
            raise CapacityError(f"slot {slot.key[1].hex()} is quarantined")
        if (slot.slot_bytes, slot.chunk_bytes, slot.num_chunks) != (
            slot_bytes,
            chunk_bytes,
            num_chunks,
        ):
            raise InvalidArgument(
                f"slot {slot.key[1].hex()} exists with geometry "
                f"({slot.slot_bytes}, {slot.chunk_bytes}, {slot.num_chunks})"
            )
        return AllocResult(slot, False, self.take_evictions())

    def _alloc_offset(
        self, slot_bytes: int, owner: str = "", stride: int = 0, evict: bool = True
    ) -> int:
        arena = self.arena
        first = True
        while (offset := arena.alloc_slot(slot_bytes)) is None:
            if not evict:
                raise CapacityError(f"no free room for a {slot_bytes}-byte slot")
            if first and arena.free_bytes + self._unpinned_bytes() < stride:
                # Evicting every unpinned slot could not make room: evict none of them.
                raise CapacityError(
                    f"no room for a {slot_bytes}-byte slot: {arena.free_bytes} bytes free and "
                    f"{self._unpinned_bytes()} in unpinned slots; evicted nothing"
                )
            first = False
            victim = self._pop_lru(owner, stride)
            if victim is None:
                raise CapacityError(
                    f"no room for a {slot_bytes}-byte slot: {len(self._slots)} slots, "
                    f"{self._pinned_slots} pinned, {self._quarantined} quarantined, none evictable"
                )
            self._evict_victim(victim)
        return offset

    def _unpinned_bytes(self) -> int:
        """Bytes of this table's slots that no lease pins: at most what evicting could free
        (quarantined slots and parents of pinned children are in it too)."""
        return sum(self._owner_bytes.values()) - self._pinned_bytes

    def _evict_victim(self, victim: Slot) -> None:
        moved = self._demote is not None and self._demote(victim)
        self._remove(victim)
        if not moved:
            self._journal.append(victim.key)
            self.owner_evictions[victim.owner] = self.owner_evictions.get(victim.owner, 0) + 1

    def evict_lru(self) -> SlotKey | None:
        """Evict the least recently used evictable slot; its key (journaled for the next
        report unless demoted), or None if nothing is evictable. Used by
        :class:`ObjectStore`."""
        victim = self._pop_lru()
        if victim is None:
            return None
        self._evict_victim(victim)
        return victim.key

    def take_evictions(self) -> list[SlotKey]:
        """Keys of LRU evictions not yet reported (each is reported exactly once)."""
        journal = self._journal
        if not journal:
            return []
        self._journal = []
        return journal

    def evict(self, key: SlotKey) -> bool:
        """Remove ``key``'s slot now, regardless of LRU and chain order (not journaled: the
        caller reports it). False, changing nothing, if absent, pinned or quarantined."""
        slot = self._slots.get(key)
        if slot is None or slot.pins or slot.quarantined:
            return False
        self._remove(slot)
        return True

    def drop_namespace(self, ns_id: bytes) -> list[SlotKey]:
        """Remove every slot of ``ns_id`` that is neither pinned nor quarantined; the removed
        keys (not journaled). Slots still pinned or quarantined stay. O(slots)."""
        doomed = [s for s in self._slots.values() if s.key[0] == ns_id]
        removed = []
        for slot in doomed:
            if not slot.pins and not slot.quarantined:
                self._remove(slot)
                removed.append(slot.key)
        return removed

    def touch(self, keys_in_prefix_order: Sequence[SlotKey]) -> None:
        """Mark a request's blocks as just used, stamping them tail first so that the head
        is the most recent and the tail the oldest. Absent keys are ignored."""
        slots, evictable = self._slots, self._evictable
        tick = self._tick
        for key in reversed(keys_in_prefix_order):
            slot = slots.get(key)
            if slot is None:
                continue
            tick += 1
            slot.stamp = tick
            if key in evictable:
                self._push(slot)
        self._tick = tick

    # ---- lookups, views, landing -----------------------------------------------------

    def get(self, key: SlotKey) -> Slot | None:
        """The readable slot for ``key``; None if absent or quarantined (a miss)."""
        slot = self._slots.get(key)
        if slot is None or slot.quarantined:
            return None
        return slot

    def find(self, key: SlotKey) -> Slot | None:
        """``key``'s slot, quarantined or not; None if absent."""
        return self._slots.get(key)

    def holds(self, slot: Slot) -> bool:
        """Whether ``slot`` is this table's slot for its key, quarantined or not."""
        return self._slots.get(slot.key) is slot

    def slots(self) -> list[Slot]:
        """Every slot in the table, quarantined ones included (re-registration). O(slots)."""
        return list(self._slots.values())

    def quarantined(self) -> list[Slot]:
        """Every quarantined slot. O(slots)."""
        return [s for s in self._slots.values() if s.quarantined]

    def chunk_view(self, slot: Slot, index: int) -> torch.Tensor:
        """``uint8`` view (no copy) of chunk ``index``'s bytes inside ``slot``.

        Valid while the slot stays in the table; hold a lease across any await. Raises
        :class:`Miss` if the slot is gone or quarantined, :class:`InvalidArgument` for a
        bad index.
        """
        self._check_usable(slot)
        if not 0 <= index < slot.num_chunks:
            raise InvalidArgument(f"chunk index {index} outside [0, {slot.num_chunks})")
        start = slot.offset + index * slot.chunk_bytes
        return self.arena.tensor[start : start + slot.chunk_bytes]

    def slot_view(self, slot: Slot) -> torch.Tensor:
        """``uint8`` view of the whole slot (``slot_bytes`` long); raises like ``chunk_view``."""
        self._check_usable(slot)
        return self.arena.tensor[slot.offset : slot.offset + slot.slot_bytes]

    def mark_landed(self, slot: Slot, index: int) -> bool:
        """Record that chunk ``index`` landed (call after checking its header and checksum).
        True if newly landed, False if it already had (first writer wins). Raises like
        :meth:`chunk_view`."""
        self._check_usable(slot)
        if not 0 <= index < slot.num_chunks:
            raise InvalidArgument(f"chunk index {index} outside [0, {slot.num_chunks})")
        bit = 1 << index
        if slot.landed_mask & bit:
            return False
        slot.landed_mask |= bit
        return True

    def drop_chunk(self, slot: Slot, index: int) -> bool:
        """Forget that chunk ``index`` landed (it failed a check after it was stored), so
        the next writer of it stores it again. True if it had landed. Raises like
        :meth:`mark_landed`."""
        self._check_usable(slot)
        if not 0 <= index < slot.num_chunks:
            raise InvalidArgument(f"chunk index {index} outside [0, {slot.num_chunks})")
        bit = 1 << index
        had = bool(slot.landed_mask & bit)
        slot.landed_mask &= ~bit
        return had

    def landed(self, slot: Slot) -> int:
        """The landed bitmask (bit ``i`` = chunk ``i``); raises like :meth:`chunk_view`."""
        self._check_usable(slot)
        return slot.landed_mask

    def _check_usable(self, slot: Slot) -> None:
        if self._slots.get(slot.key) is not slot:
            raise Miss(f"slot {slot.key[1].hex()} is no longer in this tier")
        if slot.quarantined:
            raise Miss(f"slot {slot.key[1].hex()} is quarantined")

    # ---- leases and quarantine -------------------------------------------------------

    def pin(
        self, slot: Slot, ttl_s: float | None = None, *, now: float | None = None
    ) -> Lease[Slot]:
        """Pin ``slot`` until the returned lease is released or, with ``ttl_s``, expires at
        ``now + ttl_s`` (see :meth:`expire_leases`). Raises :class:`Miss` if the slot is
        gone or quarantined, :class:`InvalidArgument` for a bad ``ttl_s``."""
        self._check_usable(slot)
        expires_at = expiry_time(ttl_s, now, self._clock)
        slot.pins += 1
        if slot.pins == 1:
            self._pinned_bytes += slot.stride
            self._pinned_slots += 1
            self._evictable.pop(slot.key, None)
        return self._leases.issue(slot, expires_at)

    @contextmanager
    def pinned(self, slot: Slot, ttl_s: float | None = None) -> Iterator[torch.Tensor]:
        """``with table.pinned(slot) as view:`` — the whole slot, pinned for the block."""
        with self.pin(slot, ttl_s):
            yield self.arena.tensor[slot.offset : slot.offset + slot.slot_bytes]

    def lease(self, lease_id: int) -> Lease[Slot] | None:
        """The live lease with ``lease_id``; None if released, expired or unknown."""
        return self._leases.live.get(lease_id)

    def expire_leases(self, now: float | None = None) -> list[Lease[Slot]]:
        """Release and return every lease whose ``expires_at <= now`` (O(k log n))."""
        return self._leases.expire(self._clock() if now is None else now)

    def _on_release(self, slot: Slot) -> None:
        slot.pins -= 1
        if slot.pins == 0:
            self._pinned_bytes -= slot.stride
            self._pinned_slots -= 1
            self._refresh(slot)

    def quarantine(self, slot: Slot) -> None:
        """Quarantine ``slot`` (its transfer timed out): unreadable, never evicted or reused,
        still counted as used; leases stay valid. Idempotent. Raises :class:`Miss` if gone."""
        if self._slots.get(slot.key) is not slot:
            raise Miss(f"slot {slot.key[1].hex()} is no longer in this tier")
        if not slot.quarantined:
            slot.quarantined = True
            self._quarantined += 1
            self._evictable.pop(slot.key, None)

    def unquarantine(self, slot: Slot) -> None:
        """End ``slot``'s quarantine: readable and evictable again (the caller may
        :meth:`evict` it if its contents are suspect). Idempotent. Raises :class:`Miss` if gone."""
        if self._slots.get(slot.key) is not slot:
            raise Miss(f"slot {slot.key[1].hex()} is no longer in this tier")
        if slot.quarantined:
            slot.quarantined = False
            self._quarantined -= 1
            self._refresh(slot)

    # ---- LRU internals ---------------------------------------------------------------

    def _refresh(self, slot: Slot) -> None:
        """Put ``slot`` in or out of the evictable set after any change to its state."""
        key = slot.key
        if slot.pins == 0 and not slot.quarantined and key not in self._children:
            if key not in self._evictable:
                self._evictable[key] = slot
                if slot.heap_stamp != slot.stamp:
                    self._push(slot)
        else:
            self._evictable.pop(key, None)

    def _push(self, slot: Slot) -> None:
        self._lru.push(slot)

    def _pop_lru(self, writer: str = "", stride: int = 0) -> Slot | None:
        """The next victim: the least recently used evictable slot of an owner over its
        quota (``writer`` counts as over once ``stride`` more bytes would put it over),
        else of an owner with no quota (blocks of no tenant included), else the least
        recently used of all: an owner within its quota loses blocks only when nobody over
        or without one has any left."""
        if not self._quotas:
            return self._lru.pop()
        used, quotas = self._used, self._quotas

        def over(owner: str) -> bool:
            quota = quotas.get(owner)
            extra = stride if owner == writer else 0
            return quota is not None and used(owner) + extra > quota

        def unlimited(owner: str) -> bool:
            return owner not in quotas

        return self._lru.pop(over, unlimited)

    # ---- quotas ----------------------------------------------------------------------

    def set_quotas(
        self, quotas: Mapping[str, int], used: Callable[[str], int] | None = None
    ) -> None:
        """Byte quotas by owner (an owner not named has none). A quota is what its owner
        keeps under pressure: an owner beyond it may still use free memory, but the next
        eviction takes its least recently used block before anyone else's, so a flood by
        one owner cannot evict another's within its quota. ``used(owner)``: the bytes the
        quota counts (default this table's; a node's tiers share one quota)."""
        self._quotas = {o: int(q) for o, q in quotas.items() if o}
        self._used = used or self.owned_bytes

    def owned_bytes(self, owner: str) -> int:
        """Bytes of ``owner``'s slots in this table."""
        return self._owner_bytes.get(owner, 0)

    def owner_bytes(self) -> dict[str, int]:
        """Bytes of slots held, by owner (owners holding none left out)."""
        return {o: n for o, n in self._owner_bytes.items() if n}

    def _add_child(self, parent_key: SlotKey) -> None:
        count = self._children.get(parent_key, 0)
        self._children[parent_key] = count + 1
        if count == 0 and parent_key in self._slots:
            self._refresh(self._slots[parent_key])

    def _drop_child(self, parent_key: SlotKey) -> None:
        count = self._children[parent_key] - 1
        if count:
            self._children[parent_key] = count
            return
        del self._children[parent_key]
        parent = self._slots.get(parent_key)
        if parent is not None:
            self._refresh(parent)

    def _remove(self, slot: Slot) -> None:
        key = slot.key
        del self._slots[key]
        left = self._owner_bytes[slot.owner] - slot.stride
        if left:
            self._owner_bytes[slot.owner] = left
        else:
            del self._owner_bytes[slot.owner]
        self._evictable.pop(key, None)
        self.arena.free_slot(slot.offset)
        slot.alive = False
        if slot.parent is not None:
            self._drop_child((key[0], slot.parent))

    # ---- accounting ------------------------------------------------------------------

    def stats(self) -> TierStats:
        """The tier's :class:`TierStats` (the arena's stats are O(spans); the arena is
        shared with objects)."""
        arena = self.arena.stats()
        return TierStats(
            device=str(self.arena.device),
            capacity_bytes=arena.capacity_bytes,
            used_bytes=arena.used_bytes,
            free_bytes=arena.free_bytes,
            pinned_bytes=self._pinned_bytes,
            slot_bytes=arena.slot_bytes,
            object_bytes=arena.object_bytes,
            slots=len(self._slots),
            pinned_slots=self._pinned_slots,
            quarantined_slots=self._quarantined,
            evictable_slots=len(self._evictable),
            leases=len(self._leases.live),
        )

    def validate(self) -> None:
        """Check every invariant from scratch; raise :class:`KVStoreError` if one is broken.

        The arena's own (:meth:`Arena.validate`: no overlap, free + used == capacity, ...),
        plus: the arena's live slots are exactly this table's, pin counts and pinned bytes
        match the live leases, child counts match the live slots' parents, and the LRU
        holds exactly the evictable slots. O(slots + leases + LRU heap).
        """
        self.arena.validate()
        live = {s.offset: s.stride for s in self._slots.values()}
        if live != self.arena.live_slots():
            raise KVStoreError("slot invariant: table and arena disagree on live slots")
        pins: dict[SlotKey, int] = {}
        for lease in self._leases.live.values():
            if lease.released or self._slots.get(lease.target.key) is not lease.target:
                raise KVStoreError(f"slot invariant: lease {lease.id} pins a dead slot")
            pins[lease.target.key] = pins.get(lease.target.key, 0) + 1
        children: dict[SlotKey, int] = {}
        for s in self._slots.values():
            if s.parent is not None:
                children[(s.key[0], s.parent)] = children.get((s.key[0], s.parent), 0) + 1
        if children != self._children:
            raise KVStoreError("slot invariant: child counts are out of date")
        self._validate_slots(pins)

    def _validate_slots(self, pins: dict[SlotKey, int]) -> None:
        in_heap = {id(s) for stamp, s in self._lru.entries() if s.stamp == stamp == s.heap_stamp}
        pinned_bytes = quarantined = 0
        evictable: dict[SlotKey, Slot] = {}
        for key, s in self._slots.items():
            if s.key != key or not s.alive or s.pins != pins.get(key, 0):
                raise KVStoreError(f"slot invariant: slot {key[1].hex()} has a bad key/pin count")
            if s.landed_mask >> s.num_chunks or s.num_chunks * s.chunk_bytes > s.slot_bytes:
                raise KVStoreError(f"slot invariant: slot {key[1].hex()} has a bad mask/geometry")
            pinned_bytes += s.stride if s.pins else 0
            quarantined += s.quarantined
            if not s.pins and not s.quarantined and key not in self._children:
                evictable[key] = s
                if id(s) not in in_heap:
                    raise KVStoreError(f"slot invariant: evictable {key[1].hex()} not in LRU")
        if evictable != self._evictable:
            raise KVStoreError("slot invariant: the LRU set is not exactly the evictable slots")
        if pinned_bytes != self._pinned_bytes or quarantined != self._quarantined:
            raise KVStoreError("slot invariant: pinned/quarantined counters are out of date")
        if sum(1 for s in self._slots.values() if s.pins) != self._pinned_slots:
            raise KVStoreError("slot invariant: pinned slot counter is out of date")
        owners: dict[str, int] = {}
        for s in self._slots.values():
            owners[s.owner] = owners.get(s.owner, 0) + s.stride
        if owners != self._owner_bytes:
            raise KVStoreError("slot invariant: bytes by owner are out of date")


def _check_request(
    key: SlotKey, slot_bytes: int, chunk_bytes: int, num_chunks: int, parent: bytes | None
) -> None:
    # `type(x) is` on purpose: cheap on the hot path, and rejects bool and bytes subclasses.
    if not (type(key) is tuple and len(key) == 2 and type(key[0]) is type(key[1]) is bytes):
        raise InvalidArgument(f"slot key must be (ns_id: bytes, block_hash: bytes), got {key!r}")
    if not (type(slot_bytes) is type(chunk_bytes) is type(num_chunks) is int):
        raise InvalidArgument(
            f"slot_bytes, chunk_bytes, num_chunks must be ints, got "
            f"{slot_bytes!r}, {chunk_bytes!r}, {num_chunks!r}"
        )
    if chunk_bytes <= 0 or num_chunks <= 0 or num_chunks * chunk_bytes > slot_bytes:
        raise InvalidArgument(
            f"{num_chunks} chunks of {chunk_bytes} bytes do not fit a {slot_bytes}-byte slot"
        )
    if parent is not None and (type(parent) is not bytes or parent == key[1]):
        raise InvalidArgument(f"parent must be another block's hash (bytes), got {parent!r}")


_PENDING, _LIVE, _RETIRED, _FREED = range(4)


class StoredObject:
    """One ``put_object`` value in the arena. Attributes are read-only outside the store."""

    __slots__ = ("key", "nbytes", "offset", "pins", "state", "version")

    def __init__(self, key: str, offset: int, nbytes: int, version: int = 0) -> None:
        self.key = key
        self.offset = offset
        self.nbytes = nbytes
        self.version = version
        """Its writer's version (the client's clock at the put, in ns; 0: none given)."""
        self.pins = 0
        self.state = _PENDING


class ObjectWrite:
    """A reserved, not yet visible value: fill ``view``, then :meth:`commit` to publish it.

    ``with store.put(key, n) as w: w.view.copy_(src); w.commit()`` — leaving the block
    without committing aborts. ``commit`` and ``abort`` are idempotent and never block.
    """

    __slots__ = ("_committed", "_obj", "_store", "view")

    def __init__(self, store: ObjectStore, obj: StoredObject, view: torch.Tensor) -> None:
        self._store = store
        self._obj = obj
        self._committed: bool | None = None  # (what commit answered)
        self.view = view
        """``uint8`` view of the reserved bytes (``nbytes`` long)."""

    @property
    def key(self) -> str:
        """The object's key."""
        return self._obj.key

    def commit(self) -> bool:
        """Publish the value under its key, replacing (and freeing once unpinned) the one
        it held, unless that one has a newer version: then this one is dropped (the last
        writer wins by version, not by arrival). Whether it was published. Raises
        :class:`InvalidArgument` if the write was aborted."""
        obj = self._obj
        if obj.state == _PENDING:
            self._committed = self._store._commit(obj)
        elif self._committed is None:
            raise InvalidArgument(f"object write for {obj.key!r} was aborted")
        return self._committed

    def abort(self) -> None:
        """Give the reserved bytes back; no-op once committed or aborted."""
        if self._obj.state == _PENDING:
            self._store._abort(self._obj)

    def __enter__(self) -> ObjectWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class ObjectStore:
    """``put_object`` values in the arena's extent heap, by string key.

    Values are at most ``max_object_bytes`` (default 64 MiB) and all of them together (pending
    and still-pinned replaced ones included) at most ``max_total_bytes`` (default a quarter
    of the arena). Objects are never evicted automatically — a stored value stays until it
    is removed or replaced; when the arena has no room, ``make_room`` (e.g.
    :meth:`SlotTable.evict_lru`, returning None when nothing is left) is called until there
    is. Reads pin with the same :class:`Lease`; removing or replacing a pinned value hides it
    at once and frees it when the last lease goes. Nothing blocks.
    """

    def __init__(
        self,
        arena: Arena,
        *,
        max_object_bytes: int = 64 << 20,
        max_total_bytes: int | None = None,
        make_room: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.arena = arena
        self.max_object_bytes = max_object_bytes
        self.max_total_bytes = (
            arena.capacity_bytes // 4 if max_total_bytes is None else max_total_bytes
        )
        self._make_room = make_room
        self._clock = clock
        self._objects: dict[str, StoredObject] = {}
        self._hidden: dict[int, StoredObject] = {}  # pending or retired-but-pinned, by offset
        self._leases: LeaseBook[StoredObject] = LeaseBook(self._on_release)
        self.used_bytes = 0
        """Bytes of every extent this store holds (rounded), pending and retired included."""

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: object) -> bool:
        return key in self._objects

    def items(self) -> list[tuple[str, int, int]]:
        """``(key, nbytes, version)`` of every published value (re-registration).
        O(objects)."""
        return [(key, obj.nbytes, obj.version) for key, obj in self._objects.items()]

    def version(self, key: str) -> int | None:
        """The version of ``key``'s published value; None if absent."""
        obj = self._objects.get(key)
        return None if obj is None else obj.version

    def put(self, key: str, nbytes: int, version: int = 0) -> ObjectWrite:
        """Reserve ``nbytes`` for ``key`` (a value of writer version ``version``); the
        value is invisible until ``commit``.

        May call ``make_room`` (evicting slots) until the arena has room. Raises
        :class:`InvalidArgument` for a bad key or size and :class:`CapacityError` if the
        value is over ``max_object_bytes``, would exceed ``max_total_bytes``, or no room
        can be made.
        """
        if not isinstance(key, str) or not key or len(key) > 4096:
            raise InvalidArgument(
                f"object key must be a non-empty str of <= 4096 chars, got {key!r}"
            )
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise InvalidArgument(f"nbytes must be an int >= 0, got {nbytes!r}")
        if nbytes > self.max_object_bytes:
            raise CapacityError(f"object of {nbytes} bytes exceeds {self.max_object_bytes}")
        size = self.arena.extent_size(nbytes)
        if self.used_bytes + size > self.max_total_bytes:
            raise CapacityError(f"objects would exceed their quota of {self.max_total_bytes} bytes")
        while (offset := self.arena.alloc_extent(nbytes)) is None:
            if self._make_room is None or self._make_room() is None:
                raise CapacityError(f"no room for a {nbytes}-byte object")
        obj = StoredObject(key, offset, nbytes, version)
        self._hidden[offset] = obj
        self.used_bytes += size
        return ObjectWrite(self, obj, self.arena.view(offset, nbytes))

    def get(self, key: str) -> torch.Tensor | None:
        """``uint8`` view of ``key``'s value; None if absent. Pin it across any await."""
        obj = self._objects.get(key)
        return None if obj is None else self.arena.view(obj.offset, obj.nbytes)

    def pin(
        self, key: str, ttl_s: float | None = None, *, now: float | None = None
    ) -> Lease[StoredObject] | None:
        """Pin ``key``'s value (``lease.target``); None if absent. Raises
        :class:`InvalidArgument` for a bad ``ttl_s``."""
        obj = self._objects.get(key)
        if obj is None:
            return None
        expires_at = expiry_time(ttl_s, now, self._clock)
        obj.pins += 1
        return self._leases.issue(obj, expires_at)

    @contextmanager
    def pinned(self, key: str, ttl_s: float | None = None) -> Iterator[torch.Tensor | None]:
        """``with store.pinned(key) as view:`` — the value pinned for the block, or None."""
        lease = self.pin(key, ttl_s)
        if lease is None:
            yield None
            return
        with lease:
            yield self.arena.view(lease.target.offset, lease.target.nbytes)

    def remove(self, key: str) -> bool:
        """Remove ``key``; False if absent. A pinned value is freed when its last lease goes."""
        obj = self._objects.pop(key, None)
        if obj is None:
            return False
        self._retire(obj)
        return True

    def expire_leases(self, now: float | None = None) -> list[Lease[StoredObject]]:
        """Release and return every lease whose ``expires_at <= now``."""
        return self._leases.expire(self._clock() if now is None else now)

    def _commit(self, obj: StoredObject) -> bool:
        del self._hidden[obj.offset]
        old = self._objects.get(obj.key)
        if old is not None and old.version > obj.version:  # (a newer write came first)
            self._free(obj)
            return False
        obj.state = _LIVE
        self._objects[obj.key] = obj
        if old is not None:
            self._retire(old)
        return True

    def _abort(self, obj: StoredObject) -> None:
        del self._hidden[obj.offset]
        self._free(obj)

    def _retire(self, obj: StoredObject) -> None:
        obj.state = _RETIRED
        if obj.pins:
            self._hidden[obj.offset] = obj
        else:
            self._free(obj)

    def _free(self, obj: StoredObject) -> None:
        obj.state = _FREED
        self.arena.free_extent(obj.offset)
        self.used_bytes -= self.arena.extent_size(obj.nbytes)

    def _on_release(self, obj: StoredObject) -> None:
        obj.pins -= 1
        if obj.pins == 0 and obj.state == _RETIRED:
            del self._hidden[obj.offset]
            self._free(obj)

    def validate(self) -> None:
        """Raise :class:`KVStoreError` unless this store's extents, pins and byte count agree
        with each other and with the arena (call ``arena.validate()`` for the arena itself).
        O(objects + leases)."""
        pins: dict[int, int] = {}
        for lease in self._leases.live.values():
            pins[id(lease.target)] = pins.get(id(lease.target), 0) + 1
        held = list(self._objects.values()) + list(self._hidden.values())
        mine = {o.offset: self.arena.extent_size(o.nbytes) for o in held}
        arena_extents = self.arena.live_extents()
        if len(mine) != len(held) or any(arena_extents.get(k) != v for k, v in mine.items()):
            raise KVStoreError("object invariant: extents disagree with the arena")
        if sum(mine.values()) != self.used_bytes or self.used_bytes > self.max_total_bytes:
            raise KVStoreError("object invariant: used_bytes is out of date or over quota")
        for obj in held:
            if obj.pins != pins.get(id(obj), 0):
                raise KVStoreError(f"object invariant: {obj.key!r} pin count != live leases")
        for key, obj in self._objects.items():
            if obj.key != key or obj.state != _LIVE:
                raise KVStoreError(f"object invariant: {key!r} is listed but not live")
        for obj in self._hidden.values():
            if obj.state not in (_PENDING, _RETIRED) or (obj.state == _RETIRED and not obj.pins):
                raise KVStoreError(f"object invariant: {obj.key!r} hidden in a bad state")

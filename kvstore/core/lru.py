"""The slot table's eviction order: evictable slots, least recently used first, kept in
one heap per owner (a tenant, ``""`` for none) so that an over-quota owner's oldest slot is
found as fast as the oldest of all.

Heaps with lazy deletion: an entry ``(stamp, slot)`` is current while the slot still
carries that stamp and is still in the table's evictable set; anything else is skipped
when it reaches the top. A slot's ``heap_stamp`` is the stamp of its entry in the heaps
(-1: none), so a slot is pushed again only when it has no current entry.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["OwnerLRU"]


class _Evictable(Protocol):
    key: tuple[bytes, bytes]
    owner: str
    stamp: int
    heap_stamp: int


S = TypeVar("S", bound=_Evictable)


class OwnerLRU(Generic[S]):
    """LRU order over ``evictable`` (the table's own dict: key -> slot), per owner.

    :meth:`pop` is O(owners + log n) amortised; the heaps are rebuilt when stale entries
    outnumber live ones (bounded memory)."""

    def __init__(self, evictable: dict[tuple[bytes, bytes], S]) -> None:
        self._evictable = evictable
        self._heaps: dict[str, list[tuple[int, S]]] = {}
        self._entries = 0

    def push(self, slot: S) -> None:
        """Add ``slot`` at its current stamp (the caller checked it has no entry there)."""
        heapq.heappush(self._heaps.setdefault(slot.owner, []), (slot.stamp, slot))
        slot.heap_stamp = slot.stamp
        self._entries += 1
        if self._entries > 2 * len(self._evictable) + 1024:
            self._rebuild()

    def pop(self, *prefer: Callable[[str], bool]) -> S | None:
        """Remove and return the least recently used evictable slot, taken among the owners
        the first of ``prefer`` says yes to that has one, else among all; None when nothing
        is evictable."""
        best = None
        for wanted in prefer:
            best = self._oldest(wanted)
            if best is not None:
                break
        if best is None:
            best = self._oldest(None)
        if best is None:
            return None
        heap = self._heaps[best.owner]
        heapq.heappop(heap)
        if not heap:
            del self._heaps[best.owner]
        self._entries -= 1
        best.heap_stamp = -1
        return best

    def entries(self) -> Iterator[tuple[int, S]]:
        """Every entry of every heap, current or not (for the table's invariant check)."""
        for heap in self._heaps.values():
            yield from heap

    def _oldest(self, prefer: Callable[[str], bool] | None) -> S | None:
        """The oldest current entry among the owners ``prefer`` says yes to (all: None)."""
        best: S | None = None
        for owner in [o for o in self._heaps if prefer is None or prefer(o)]:
            top = self._top(owner)  # (may drop an owner's emptied heap)
            if top is not None and (best is None or top.stamp < best.stamp):
                best = top
        return best

    def _top(self, owner: str) -> S | None:
        """``owner``'s oldest current entry, left in its heap; stale tops are dropped, and
        the heap once empty."""
        heap = self._heaps.get(owner)
        if heap is None:
            return None
        while heap:
            stamp, slot = heap[0]
            if slot.stamp == stamp and self._evictable.get(slot.key) is slot:
                return slot
            heapq.heappop(heap)
            self._entries -= 1
            if slot.heap_stamp == stamp:
                slot.heap_stamp = -1
        del self._heaps[owner]
        return None

    def _rebuild(self) -> None:
        for heap in self._heaps.values():
            for _, slot in heap:
                slot.heap_stamp = -1
        heaps: dict[str, list[tuple[int, S]]] = {}
        for slot in self._evictable.values():
            heaps.setdefault(slot.owner, []).append((slot.stamp, slot))
            slot.heap_stamp = slot.stamp
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps
        self._entries = len(self._evictable)

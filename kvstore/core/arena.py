"""One tier's memory: a contiguous arena carved into pages, slot slabs and object extents.

Pure bookkeeping over one ``torch.uint8`` tensor; nothing here does I/O or allocates a
tensor after construction. Layout::

    arena tensor: n_pages x page_bytes, one allocation (pinned host memory where CUDA exists)
    |<- page ->|<- page ->|<- page ->| ...
    [ slab span: k slots of one stride + tail ][ free run ][ object span: extents ][ ... ]

- **Pages** (``page_bytes``, default 256 KiB or smaller for a small arena, a multiple of
  4 KiB) are the unit everything else is carved from. Free pages form runs in a coalescing
  page heap; spans of consecutive pages are handed to slab classes or to the object heap on
  demand and come back the moment they are empty, so slots of every namespace and objects
  share one tier without static partitioning.
- **Slab classes**: one per slot stride (slot size rounded up to :data:`SLOT_ALIGN`). A span
  holds ``k`` slots; :func:`slab_geometry` picks the fewest pages whose tail waste is at
  most 1/32 of the span (a 16 MiB + header KV slot gets its own 65-page span, a 64 KiB slot
  shares a one-page span with three others). Alloc/free is a pop/push on the span's free
  stack: O(1), and no external fragmentation among slots of one class.
- **Object extents**: variable-size, :data:`EXTENT_ALIGN`-aligned extents inside object
  spans (at least :data:`OBJECT_SPAN_BYTES`, or as many pages as one big object needs).
  Segregated fit (power-of-two bins, bounded first-fit in the exact bin, any extent of a
  larger bin otherwise); a freed extent coalesces with free neighbours inside its span.

**Leases** (:class:`Lease`, :class:`LeaseBook`) are how the tables built on an arena
(``kvstore.core.slots``) pin what they hand out: owned objects with an idempotent
``release()`` and an optional expiry, never hand-counted references.

Accounting: ``free_bytes`` is what some allocation could use without evicting (free pages,
free slots in slab spans, free extents in object spans); ``used_bytes = capacity_bytes -
free_bytes`` (live slots and extents at their rounded sizes plus span tails).
:meth:`Arena.validate` re-derives all of it from scratch.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import math
import mmap
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Generic, TypeVar

import torch

from kvstore.core.sizes import parse_size
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError

__all__ = [
    "EXTENT_ALIGN",
    "HUGE_PAGE",
    "OBJECT_SPAN_BYTES",
    "SLOT_ALIGN",
    "Arena",
    "ArenaStats",
    "ExtentHeap",
    "Lease",
    "default_page_bytes",
    "host_memory",
    "huge_page_bytes",
    "parse_size",
    "populate",
    "slab_geometry",
]

KiB = 1 << 10
MiB = 1 << 20

SLOT_ALIGN = 256
"""Slot strides are rounded up to this (GPU copy and RDMA friendly; slabs start page-aligned)."""

EXTENT_ALIGN = 256
"""Object extents are rounded up to, and start at, multiples of this."""

OBJECT_SPAN_BYTES = 1 * MiB
"""Smallest span the object heap takes from the page heap (big objects get bigger ones)."""

PAGE_ALIGN = 4 * KiB
HUGE_PAGE = 2 * MiB
"""Size and alignment of a transparent huge page (x86-64, and arm64 with 4 KiB pages)."""
MAX_SPAN_BYTES = 16 * MiB
"""Slab spans of small slots are at most this big (slots bigger than this get one each)."""

_MAX_TAIL_WASTE = Fraction(1, 32)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def default_page_bytes(capacity_bytes: int) -> int:
    """The page size an arena of ``capacity_bytes`` uses unless told: 256 KiB, or a smaller
    power of two (down to 4 KiB) so that the arena has at least 64 pages."""
    target = max(PAGE_ALIGN, capacity_bytes // 64)
    return min(256 * KiB, 1 << (target.bit_length() - 1))


def slab_geometry(stride: int, page_bytes: int, max_pages: int | None = None) -> tuple[int, int]:
    """``(slots_per_span, pages_per_span)`` for slots of ``stride`` bytes.

    The fewest pages (from the fewest that hold one slot up to ``MAX_SPAN_BYTES``, or the
    one-slot span for bigger slots) whose tail waste is at most 1/32 of the span; if none
    qualifies, the candidate with the smallest waste fraction. ``max_pages`` caps the span
    (the arena's page count). Pure; raises :class:`CapacityError` if one slot needs more
    than ``max_pages`` pages.
    """
    first = -(-stride // page_bytes)
    if max_pages is not None and first > max_pages:
        raise CapacityError(f"a {stride}-byte slot needs {first} pages; the arena has {max_pages}")
    last = max(first, MAX_SPAN_BYTES // page_bytes)
    if max_pages is not None:
        last = min(last, max_pages)
    best = (Fraction(2), 1, first)
    for pages in range(first, last + 1):
        span = pages * page_bytes
        slots = span // stride
        waste = Fraction(span - slots * stride, span)
        if waste <= _MAX_TAIL_WASTE:
            return slots, pages
        if waste < best[0]:
            best = (waste, slots, pages)
    return best[1], best[2]


class ExtentHeap:
    """Free extents of an integer address space (pages or bytes), coalesced on free.

    Extents are kept in ``start -> length`` and ``end -> start`` maps (O(1) neighbour
    lookup) and in power-of-two size bins with a non-empty bitmap. :meth:`alloc` is a
    segregated fit: the first of at most 16 extents in the request's own bin that is big
    enough, else the first extent of the next non-empty bigger bin; it carves from the
    extent's start. All calls are O(1) apart from that bounded scan; nothing blocks.
    """

    __slots__ = ("_bins", "_by_end", "_by_start", "_nonempty", "free_units")

    _SCAN = 16

    def __init__(self) -> None:
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._bins: list[dict[int, None]] = [{} for _ in range(64)]
        self._nonempty = 0
        self.free_units = 0
        """Total length of all free extents."""

    def __len__(self) -> int:
        return len(self._by_start)

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        b = length.bit_length() - 1
        self._bins[b][start] = None
        self._nonempty |= 1 << b
        self.free_units += length

    def _remove(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        b = length.bit_length() - 1
        bin_ = self._bins[b]
        del bin_[start]
        if not bin_:
            self._nonempty &= ~(1 << b)
        self.free_units -= length
        return length

    def add(self, start: int, length: int) -> None:
        """Add ``[start, start+length)`` as one free extent, without merging (a new region)."""
        if length <= 0:
            raise InvalidArgument(f"extent length must be > 0, got {length}")
        self._insert(start, length)

    def take(self, start: int, length: int) -> bool:
        """Remove the free extent that is exactly ``[start, start+length)``; False if absent."""
        if self._by_start.get(start) != length:
            return False
        self._remove(start)
        return True

    def alloc(self, length: int) -> int | None:
        """Carve ``length`` units; the start, or None when no free extent is big enough."""
        b = length.bit_length() - 1
        found = None
        by_start = self._by_start
        for n, start in enumerate(self._bins[b]):
            if by_start[start] >= length:
                found = start
                break
            if n >= self._SCAN:
                break
        if found is None:
            higher = self._nonempty >> (b + 1)
            if not higher:
                return None
            b += (higher & -higher).bit_length()
            found = next(iter(self._bins[b]))
        have = self._remove(found)
        if have > length:
            self._insert(found + length, have - length)
        return found

    def free(self, start: int, length: int, lo: int, hi: int) -> tuple[int, int]:
        """Return ``[start, start+length)``, merging with free neighbours inside ``[lo, hi)``.

        ``lo``/``hi`` are the bounds of the region the extent belongs to (the whole page
        space, or one object span), so merges never cross a span boundary. Returns the
        merged free extent ``(start, length)``. The caller guarantees the range was in use.
        """
        left = self._by_end.get(start)
        if left is not None and left >= lo:
            length += self._remove(left)
            start = left
        right = start + length
        if right < hi and right in self._by_start:
            length += self._remove(right)
        self._insert(start, length)
        return start, length

    def extents(self) -> Iterator[tuple[int, int]]:
        """Every free extent as ``(start, length)``, in no particular order."""
        return iter(list(self._by_start.items()))

    def check(self) -> None:
        """Raise :class:`KVStoreError` if the maps, bins or bitmap disagree."""
        if len(self._by_end) != len(self._by_start):
            raise KVStoreError("extent heap: start/end maps differ in size")
        total = 0
        for start, length in self._by_start.items():
            total += length
            b = length.bit_length() - 1
            if self._by_end.get(start + length) != start or start not in self._bins[b]:
                raise KVStoreError(f"extent heap: extent ({start}, {length}) is mis-indexed")
        binned = sum(len(bin_) for bin_ in self._bins)
        bitmap = sum(1 << b for b, bin_ in enumerate(self._bins) if bin_)
        if binned != len(self._by_start) or bitmap != self._nonempty:
            raise KVStoreError("extent heap: bins or bitmap out of date")
        if total != self.free_units:
            raise KVStoreError(f"extent heap: free_units {self.free_units} != {total}")


T = TypeVar("T")


class Lease(Generic[T]):
    """Ownership of a pin on ``target`` (a ``Slot`` or ``StoredObject`` of kvstore.core.slots).

    ``release()`` is idempotent; the lease is also a context manager that releases on exit.
    ``id`` is unique within its table (the node hands it to clients); ``expires_at`` is None
    for a lease without a TTL. ``released`` tells whether it still pins its target.
    """

    __slots__ = ("_book", "expires_at", "id", "target")

    def __init__(self, book: LeaseBook[T], lease_id: int, target: T, expires_at: float | None):
        self._book: LeaseBook[T] | None = book
        self.id = lease_id
        self.target = target
        self.expires_at = expires_at

    @property
    def released(self) -> bool:
        """True once released (by ``release()``, a context exit or expiry)."""
        return self._book is None

    def release(self) -> None:
        """Drop the pin. Idempotent, never raises, never blocks."""
        book = self._book
        if book is not None:
            self._book = None
            book.drop(self)

    def __enter__(self) -> Lease[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._book is None else f"expires_at={self.expires_at}"
        return f"Lease(id={self.id}, {state})"


class LeaseBook(Generic[T]):
    """The leases of one table: live ones by id plus an expiry heap (lazy deletion,
    compacted when mostly garbage). ``on_release(target)`` runs once per released lease."""

    def __init__(self, on_release: Callable[[T], None]) -> None:
        self.live: dict[int, Lease[T]] = {}
        self._expiry: list[tuple[float, int]] = []
        self._next_id = 0
        self._on_release = on_release

    def issue(self, target: T, expires_at: float | None) -> Lease[T]:
        """A new live lease on ``target`` (the caller has counted the pin). O(log n)."""
        self._next_id += 1
        lease = Lease(self, self._next_id, target, expires_at)
        self.live[lease.id] = lease
        if expires_at is not None:
            heapq.heappush(self._expiry, (expires_at, lease.id))
            if len(self._expiry) > 2 * len(self.live) + 1024:
                self._expiry = [(t, i) for t, i in self._expiry if i in self.live]
                heapq.heapify(self._expiry)
        return lease

    def drop(self, lease: Lease[T]) -> None:
        """Forget ``lease`` and run ``on_release``; only :meth:`Lease.release` calls this."""
        del self.live[lease.id]
        self._on_release(lease.target)

    def expire(self, now: float) -> list[Lease[T]]:
        """Release and return every live lease with ``expires_at <= now``. O(k log n)."""
        expired: list[Lease[T]] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self.live.get(lease_id)
            if lease is not None:
                lease.release()
                expired.append(lease)
        return expired


def expiry_time(ttl_s: float | None, now: float | None, clock: Callable[[], float]) -> float | None:
    """``now + ttl_s`` (``clock()`` when ``now`` is None); None without a TTL. Raises
    :class:`InvalidArgument` unless ``ttl_s`` is None or a positive finite number."""
    if ttl_s is None:
        return None
    if not (isinstance(ttl_s, (int, float)) and ttl_s > 0 and math.isfinite(ttl_s)):
        raise InvalidArgument(f"ttl_s must be a positive finite number, got {ttl_s!r}")
    return (clock() if now is None else now) + ttl_s


class _SlabClass:
    """All spans of one slot stride; ``partial`` holds the spans with a free slot."""

    __slots__ = ("partial", "slots_per_span", "span_pages", "stride")

    def __init__(self, stride: int, slots_per_span: int, span_pages: int) -> None:
        self.stride = stride
        self.slots_per_span = slots_per_span
        self.span_pages = span_pages
        self.partial: dict[int, _Span] = {}


class _Span:
    """Consecutive pages lent to one slab class (``cls`` set) or to the object heap."""

    __slots__ = ("cls", "end", "free", "page", "start", "used")

    def __init__(self, page: int, npages: int, page_bytes: int, cls: _SlabClass | None) -> None:
        self.page = page
        self.start = page * page_bytes
        self.end = self.start + npages * page_bytes
        self.cls = cls
        self.used = 0
        """Live slots (slab span) or live extent bytes (object span)."""
        self.free: list[int] = []
        if cls is not None:
            top = self.start + (cls.slots_per_span - 1) * cls.stride
            self.free = list(range(top, self.start - 1, -cls.stride))


@dataclass(frozen=True, slots=True)
class ArenaStats:
    """A snapshot of one arena's accounting (bytes unless named otherwise)."""

    capacity_bytes: int
    used_bytes: int
    """capacity_bytes - free_bytes: live slots and extents (rounded) plus span tails."""
    free_bytes: int
    """Usable without eviction by some allocation: free pages + free slots + free extents."""
    free_page_bytes: int
    slot_bytes: int
    """Live slots at their stride."""
    object_bytes: int
    """Live extents at their rounded size."""
    slots: int
    extents: int
    slab_spans: int
    object_spans: int
    page_bytes: int


class Arena:
    """One tier's memory: a contiguous ``uint8`` tensor, carved as the module docstring says.

    ``capacity_bytes`` (int or size string) is rounded down to whole pages; ``device`` is any
    torch device (``"cpu"``, ``"cuda:0"``); ``pin_memory=None`` pins host memory exactly when
    CUDA is available. Unpinned host memory is mapped on its own, 2 MiB-aligned, and with
    ``huge_pages`` (the default) advised for transparent huge pages (:func:`host_memory`).
    Construction allocates the tensor once (raises :class:`CapacityError` if the device
    cannot, :class:`InvalidArgument` for a bad size or device); afterwards nothing allocates
    tensors except :meth:`view`. Not thread-safe: one event loop owns it.
    """

    def __init__(
        self,
        capacity_bytes: int | str,
        device: str | torch.device = "cpu",
        pin_memory: bool | None = None,
        page_bytes: int | str | None = None,
        *,
        huge_pages: bool = True,
    ) -> None:
        capacity = parse_size(capacity_bytes)
        page = default_page_bytes(capacity) if page_bytes is None else parse_size(page_bytes)
        if page <= 0 or page % PAGE_ALIGN:
            raise InvalidArgument(f"page_bytes must be a positive multiple of 4096, got {page}")
        if capacity < page:
            raise InvalidArgument(f"capacity {capacity} is smaller than one page ({page})")
        self.page_bytes = page
        self.n_pages = capacity // page
        self.capacity_bytes = self.n_pages * page
        self._tensor, self.huge_pages = _allocate(
            self.capacity_bytes, device, pin_memory, huge_pages
        )
        """Whether this host memory was advised for huge pages (the kernel took the advice;
        whether it found them is :meth:`huge_page_bytes`)."""
        self.device = self._tensor.device
        self.pinned = bool(self._tensor.device.type == "cpu" and self._tensor.is_pinned())
        self._pages = ExtentHeap()
        self._pages.add(0, self.n_pages)
        self._spans: dict[int, _Span] = {}
        self._classes: dict[int, _SlabClass] = {}
        self._slots: dict[int, _Span] = {}
        self._slot_bytes = 0
        self._slab_free_bytes = 0
        self._objects = ExtentHeap()
        self._extents: dict[int, tuple[int, _Span]] = {}
        self._extent_bytes = 0
        self._object_span_pages = -(-OBJECT_SPAN_BYTES // page)
        # page -> the object span covering it (O(1) extent -> span; slab pages stay None)
        self._page_owner: list[_Span | None] = [None] * self.n_pages

    @property
    def tensor(self) -> torch.Tensor:
        """The whole arena (register it with NIXL once; never resize it)."""
        return self._tensor

    def populate(
        self, stop: threading.Event | None = None, progress: Callable[[int], None] | None = None
    ) -> int:
        """Blocking: map every page of a host arena now (:func:`populate`); the bytes."""
        return populate(self._tensor, stop, progress)

    def huge_page_bytes(self) -> int:
        """Bytes of this host arena backed by huge pages now (:func:`huge_page_bytes`)."""
        return huge_page_bytes(self._tensor) if self.device.type == "cpu" else 0

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``uint8`` view of ``[offset, offset+nbytes)`` (no copy). Raises on out-of-range."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity_bytes:
            raise InvalidArgument(f"range [{offset}, +{nbytes}) is outside the arena")
        return self._tensor[offset : offset + nbytes]

    # ---- slots -----------------------------------------------------------------------

    @staticmethod
    def slot_stride(slot_bytes: int) -> int:
        """The bytes a slot of ``slot_bytes`` occupies (rounded up to :data:`SLOT_ALIGN`)."""
        return _round_up(slot_bytes, SLOT_ALIGN)

    def slab_class(self, slot_bytes: int) -> tuple[int, int, int]:
        """``(stride, slots_per_span, pages_per_span)`` this arena uses for ``slot_bytes``.

        Raises :class:`InvalidArgument` for ``slot_bytes <= 0`` and :class:`CapacityError`
        if one slot can never fit in this arena.
        """
        cls = self._class(slot_bytes)
        return cls.stride, cls.slots_per_span, cls.span_pages

    def _class(self, slot_bytes: int) -> _SlabClass:
        stride = -(-slot_bytes // SLOT_ALIGN) * SLOT_ALIGN
        cls = self._classes.get(stride)
        if cls is None:
            if slot_bytes <= 0:
                raise InvalidArgument(f"slot_bytes must be > 0, got {slot_bytes}")
            slots, pages = slab_geometry(stride, self.page_bytes, self.n_pages)
            cls = self._classes[stride] = _SlabClass(stride, slots, pages)
        return cls

    def slot_room(self, slot_bytes: int) -> tuple[int, int]:
        """``(free, total)``: slots of ``slot_bytes`` this arena could hand out now without
        evicting — the free ones in its spans, plus the spans its runs of free pages could
        make (pages freed between other sizes' spans make runs too short for one) — and at
        most when empty. O(spans of that size with a free slot + runs of free pages).
        Raises as :meth:`slab_class`."""
        cls = self._class(slot_bytes)
        free = sum(len(span.free) for span in cls.partial.values())
        spans = sum(length // cls.span_pages for _, length in self._pages.extents())
        free += spans * cls.slots_per_span
        return free, self.n_pages // cls.span_pages * cls.slots_per_span

    def alloc_slot(self, slot_bytes: int) -> int | None:
        """Allocate one slot; its byte offset, or None if there is no room right now.

        O(1) from a partial span of the slot's class, else one page-heap carve for a new
        span. Never evicts. Raises :class:`CapacityError` if a slot this big can never fit.
        """
        cls = self._class(slot_bytes)
        partial = cls.partial
        if partial:
            span = next(iter(partial.values()))
        else:
            page = self._pages.alloc(cls.span_pages)
            if page is None:
                return None
            span = _Span(page, cls.span_pages, self.page_bytes, cls)
            self._spans[page] = span
            partial[page] = span
            self._slab_free_bytes += cls.slots_per_span * cls.stride
        offset = span.free.pop()
        if not span.free:
            del partial[span.page]
        span.used += 1
        self._slots[offset] = span
        self._slot_bytes += cls.stride
        self._slab_free_bytes -= cls.stride
        return offset

    def free_slot(self, offset: int) -> None:
        """Free the slot at ``offset``; its span goes back to the page heap once empty.

        O(1) plus a page-heap merge when a span empties. Raises :class:`InvalidArgument`
        if ``offset`` is not a live slot.
        """
        span = self._slots.pop(offset, None)
        if span is None or span.cls is None:
            raise InvalidArgument(f"offset {offset} is not a live slot")
        cls = span.cls
        self._slot_bytes -= cls.stride
        span.used -= 1
        if span.used == 0:
            cls.partial.pop(span.page, None)
            self._slab_free_bytes -= (cls.slots_per_span - 1) * cls.stride
            self._release_span(span, cls.span_pages)
            return
        if not span.free:
            cls.partial[span.page] = span
        span.free.append(offset)
        self._slab_free_bytes += cls.stride

    def _release_span(self, span: _Span, npages: int) -> None:
        del self._spans[span.page]
        self._pages.free(span.page, npages, 0, self.n_pages)

    # ---- object extents --------------------------------------------------------------

    @staticmethod
    def extent_size(nbytes: int) -> int:
        """Bytes an extent of ``nbytes`` occupies (at least one :data:`EXTENT_ALIGN` unit)."""
        return _round_up(max(nbytes, 1), EXTENT_ALIGN)

    def alloc_extent(self, nbytes: int) -> int | None:
        """Allocate an object extent; its byte offset, or None if there is no room now.

        Takes a new object span from the page heap when no free extent fits. Never evicts.
        Raises :class:`InvalidArgument` for a negative size and :class:`CapacityError` if
        the extent can never fit in this arena.
        """
        if nbytes < 0:
            raise InvalidArgument(f"nbytes must be >= 0, got {nbytes}")
        size = self.extent_size(nbytes)
        if size > self.capacity_bytes:
            raise CapacityError(f"a {nbytes}-byte object exceeds the arena ({self.capacity_bytes})")
        offset = self._objects.alloc(size)
        if offset is None:
            npages = max(self._object_span_pages, -(-size // self.page_bytes))
            page = self._pages.alloc(npages)
            if page is None and npages > -(-size // self.page_bytes):
                npages = -(-size // self.page_bytes)
                page = self._pages.alloc(npages)
            if page is None:
                return None
            span = self._spans[page] = _Span(page, npages, self.page_bytes, None)
            self._page_owner[page : page + npages] = [span] * npages
            self._objects.add(span.start, span.end - span.start)
            offset = self._objects.alloc(size)
            if offset is None:  # the new span is at least `size` long
                raise KVStoreError("arena invariant: fresh object span cannot hold the extent")
        span = self._span_of(offset)
        span.used += size
        self._extents[offset] = (size, span)
        self._extent_bytes += size
        return offset

    def free_extent(self, offset: int) -> None:
        """Free the extent at ``offset``, coalescing inside its span; an empty span goes
        back to the page heap. Raises :class:`InvalidArgument` if it is not a live extent."""
        entry = self._extents.pop(offset, None)
        if entry is None:
            raise InvalidArgument(f"offset {offset} is not a live extent")
        size, span = entry
        self._extent_bytes -= size
        span.used -= size
        start, length = self._objects.free(offset, size, span.start, span.end)
        if span.used == 0:
            if start != span.start or length != span.end - span.start:
                raise KVStoreError("arena invariant: empty object span is not one free extent")
            self._objects.take(start, length)
            npages = length // self.page_bytes
            self._page_owner[span.page : span.page + npages] = [None] * npages
            self._release_span(span, npages)

    def _span_of(self, offset: int) -> _Span:
        span = self._page_owner[offset // self.page_bytes]
        if span is None:
            raise KVStoreError(f"arena invariant: byte {offset} is not in an object span")
        return span

    # ---- accounting ------------------------------------------------------------------

    def stats(self) -> ArenaStats:
        """The current :class:`ArenaStats` (O(spans): it counts slab spans; no locks,
        nothing blocks). :attr:`free_bytes` alone is O(1)."""
        free = (
            self._pages.free_units * self.page_bytes
            + self._slab_free_bytes
            + self._objects.free_units
        )
        slab_spans = sum(1 for s in self._spans.values() if s.cls is not None)
        return ArenaStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.capacity_bytes - free,
            free_bytes=free,
            free_page_bytes=self._pages.free_units * self.page_bytes,
            slot_bytes=self._slot_bytes,
            object_bytes=self._extent_bytes,
            slots=len(self._slots),
            extents=len(self._extents),
            slab_spans=slab_spans,
            object_spans=len(self._spans) - slab_spans,
            page_bytes=self.page_bytes,
        )

    @property
    def free_bytes(self) -> int:
        """Bytes usable without eviction by some allocation (see :class:`ArenaStats`)."""
        return (
            self._pages.free_units * self.page_bytes
            + self._slab_free_bytes
            + self._objects.free_units
        )

    def live_slots(self) -> dict[int, int]:
        """Every live slot as ``offset -> stride`` (for validation; O(slots))."""
        return {off: span.cls.stride for off, span in self._slots.items() if span.cls}

    def live_extents(self) -> dict[int, int]:
        """Every live object extent as ``offset -> size`` (for validation; O(extents))."""
        return {off: size for off, (size, _) in self._extents.items()}

    def validate(self) -> None:
        """Re-derive every invariant from scratch; raise :class:`KVStoreError` if one fails.

        Checked: pages are exactly covered by free runs and spans, free runs are coalesced;
        in each slab span live and free slots are disjoint, aligned and exactly
        ``slots_per_span``; in each object span live and free extents tile the span with no
        two free neighbours; the counters behind :meth:`stats` match. O(arena state).
        """
        self._pages.check()
        self._objects.check()
        pieces = [(p, n, "free") for p, n in self._pages.extents()]
        by_span: dict[int, list[int]] = {}
        for offset, span in self._slots.items():
            by_span.setdefault(span.page, []).append(offset)
        slot_bytes = slab_free = 0
        for page, span in self._spans.items():
            if span.cls is None:
                pieces.append((page, (span.end - span.start) // self.page_bytes, "obj"))
                continue
            cls = span.cls
            pieces.append((page, cls.span_pages, "slab"))
            live = by_span.pop(page, [])
            _check_slab_span(span, live)
            slot_bytes += len(live) * cls.stride
            slab_free += len(span.free) * cls.stride
            if (page in cls.partial) != bool(span.free):
                raise KVStoreError(f"arena invariant: span at page {page} partial-list mismatch")
        if by_span:
            raise KVStoreError(f"arena invariant: slots in unknown spans {sorted(by_span)}")
        owners: list[_Span | None] = [None] * self.n_pages
        for span in self._spans.values():
            if span.cls is None:
                npages = (span.end - span.start) // self.page_bytes
                owners[span.page : span.page + npages] = [span] * npages
        if any(a is not b for a, b in zip(owners, self._page_owner, strict=True)):
            raise KVStoreError("arena invariant: page -> object span map is out of date")
        _check_tiling(pieces, self.n_pages)
        if slot_bytes != self._slot_bytes or slab_free != self._slab_free_bytes:
            raise KVStoreError("arena invariant: slot byte counters are out of date")
        self._validate_objects()

    def _validate_objects(self) -> None:
        ranges: dict[int, list[tuple[int, int, bool]]] = {}
        for offset, (size, span) in self._extents.items():
            ranges.setdefault(span.page, []).append((offset, size, True))
        for start, length in self._objects.extents():
            span = self._span_of(start)
            ranges.setdefault(span.page, []).append((start, length, False))
        total = 0
        for page, items in ranges.items():
            owner = self._spans.get(page)
            if owner is None or owner.cls is not None:
                raise KVStoreError(f"arena invariant: extent outside an object span at {page}")
            items.sort()
            pos, prev_free, used = owner.start, False, 0
            for start, length, live in items:
                if start != pos or start % EXTENT_ALIGN:
                    raise KVStoreError(f"arena invariant: extent gap/overlap at byte {start}")
                if not live and prev_free:
                    raise KVStoreError(f"arena invariant: uncoalesced free extents at {start}")
                pos, prev_free = start + length, not live
                used += length if live else 0
            if pos != owner.end or used != owner.used:
                raise KVStoreError(f"arena invariant: object span at page {page} mis-tiled")
            total += used
        empty = [p for p, s in self._spans.items() if s.cls is None and p not in ranges]
        if empty or total != self._extent_bytes:
            raise KVStoreError("arena invariant: object span or extent counters are out of date")


def _check_slab_span(span: _Span, live: list[int]) -> None:
    cls = span.cls
    if cls is None:
        return
    every = set(live) | set(span.free)
    if len(every) != len(live) + len(span.free) or len(every) != cls.slots_per_span:
        raise KVStoreError(f"arena invariant: slab span at byte {span.start} lost or shared a slot")
    for offset in every:
        if (offset - span.start) % cls.stride or not span.start <= offset < span.end:
            raise KVStoreError(f"arena invariant: misplaced slot at byte {offset}")
    if span.used != len(live) or not live:
        raise KVStoreError(f"arena invariant: slab span at byte {span.start} has a bad count")


def _check_tiling(pieces: list[tuple[int, int, str]], n_pages: int) -> None:
    pieces.sort()
    pos, prev = 0, ""
    for page, npages, kind in pieces:
        if page != pos:
            raise KVStoreError(f"arena invariant: pages overlap or leak at page {page} ({kind})")
        if kind == "free" and prev == "free":
            raise KVStoreError(f"arena invariant: uncoalesced free pages at page {page}")
        pos, prev = page + npages, kind
    if pos != n_pages:
        raise KVStoreError(f"arena invariant: pages cover {pos} of {n_pages}")


def _allocate(
    nbytes: int, device: str | torch.device, pin_memory: bool | None, huge_pages: bool
) -> tuple[torch.Tensor, bool]:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(f"bad device {device!r}: {exc}") from exc
    if pin_memory is None:
        pin_memory = dev.type == "cpu" and torch.cuda.is_available()
    try:
        if dev.type == "cpu" and not pin_memory:
            return host_memory(nbytes, huge_pages=huge_pages)
        t = torch.empty(nbytes, dtype=torch.uint8, device=dev, pin_memory=pin_memory)
        return t, False
    except torch.OutOfMemoryError as exc:
        raise CapacityError(f"cannot allocate {nbytes} bytes on {dev}: {exc}") from exc
    except (RuntimeError, AssertionError) as exc:
        raise InvalidArgument(f"cannot allocate an arena on {dev}: {exc}") from exc


def host_memory(nbytes: int, *, huge_pages: bool = True) -> tuple[torch.Tensor, bool]:
    """A ``uint8`` tensor of ``nbytes`` of anonymous host memory, mapped on its own and
    starting on a :data:`HUGE_PAGE` boundary, and advised ``MADV_HUGEPAGE`` with
    ``huge_pages``, else ``MADV_NOHUGEPAGE`` (4 KiB pages even where the kernel's mode is
    ``always``): (the tensor, whether huge pages were advised and the kernel took it).
    Pages are mapped as they are first written (:func:`populate` maps them at once); where
    the kernel has transparent huge pages, advised memory gets a 2 MiB page each time one
    is free. Unadvised pages of the mapping stay on both sides of the tensor, so the kernel
    never merges its range with a neighbouring advised mapping (whose huge pages
    :func:`huge_page_bytes` would then count). Where ``mmap`` cannot map privately (not a
    POSIX system), torch's allocator gives the memory, unadvised. Raises
    :class:`InvalidArgument` for ``nbytes`` < 1, :class:`CapacityError` when the mapping
    fails.

    Why: a one-sided WRITE or READ between two processes of one host (UCX's CMA copy) pins
    each page of the other process's memory as it goes. ``python bench/huge_pages.py`` on
    this project's AMD VM: 8 x 512 KiB written into another process's 4 KiB pages in 506 µs
    p50, into its huge pages in 316; read out of them in 453 and 249 (a loopback receive and
    send, and the scrub's hashing, within 10%). torch's own allocator advises nothing by default
    (docs/decisions.md, "Host memory on huge pages")."""
    if type(nbytes) is not int or nbytes < 1:
        raise InvalidArgument(f"host memory of {nbytes!r} bytes: must be a positive int")
    if not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(nbytes, dtype=torch.uint8), False
    try:
        m = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, ValueError) as exc:
        raise CapacityError(f"cannot map {nbytes} bytes of host memory: {exc}") from exc
    base = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
    skip = HUGE_PAGE - base % HUGE_PAGE  # (1 to 2 MiB below, at least 2 MiB - skip above)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    advised = False
    if advice is not None:
        try:
            m.madvise(advice, skip, nbytes)
            advised = huge_pages
        except OSError:  # (a kernel built without transparent huge pages)
            pass
    # The tensor keeps the mapping alive; the mapping ends with the last view of it.
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=skip), advised


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the host memory under ``t`` that huge pages back now: the ``AnonHugePages``
    of the mappings that lie inside ``t``'s bytes (as :func:`host_memory` makes them: the
    advised range is a mapping of its own), from ``/proc/self/smaps``; 0 where there is no
    such file. Reads the whole file (milliseconds in a large process): for start-up
    reports, not for a request's path."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
            for line in f:
                head, _, rest = line.partition(" ")
                if "-" in head and not head.endswith(":"):
                    lo, _, hi = head.partition("-")
                    inside = start <= int(lo, 16) and int(hi, 16) <= end
                elif inside and head == "AnonHugePages:":
                    total += int(rest.split()[0]) * KiB
    except (OSError, ValueError):
        return 0
    return total


MADV_POPULATE_WRITE = 23
"""``madvise`` advice (Linux 5.14+): map the range's pages writable now, keeping the bytes
of those already mapped."""
POPULATE_STEP = 32 * 2**20
"""Bytes mapped per ``madvise`` call (a stop request is seen between calls, and the process's
memory map lock is let go: other threads' page faults and mappings wait at most one step)."""


def populate(
    t: torch.Tensor,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Blocking (run it on a thread of its own): map every page of the CPU tensor ``t``
    now, ``POPULATE_STEP`` bytes at a time, until done or ``stop`` is set; the bytes
    mapped. Pages already mapped keep their bytes, so it may run while the memory is in use.
    0 where the kernel cannot (not Linux, or older than 5.14). ``progress(done)``, if
    given, is called with the bytes mapped so far after each step.

    Why: a page of host memory first written by a receive costs its page fault there, on the
    put's path. ``bench/first_fill.py`` on this project's AMD VM: a fresh node of 3 GiB took
    its first 2 GiB of puts (8 x 512 KiB) at 0.10 GB/s, p50 47 ms and 8.7 s of node CPU per
    GB, against 1.02 GB/s, 4.0 ms and 0.76 s/GB with its memory mapped at start (about 0.4 s
    of one core per GiB, on the node's own thread)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or t.numel() == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = PAGE_ALIGN
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    done = 0
    for at in range(start, end, POPULATE_STEP):
        if stop is not None and stop.is_set():
            break
        size = min(POPULATE_STEP, end - at)
        if libc.madvise(at, size, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) and done == 0:
                return 0  # (an older kernel: pages are mapped as they are first written)
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {errno.errorcode.get(err, err)}")
        done += size
        if progress is not None:
            progress(done)
    return done

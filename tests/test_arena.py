"""Arena: size parsing, slab geometry, the extent heap and the page/slab/extent carving."""

from __future__ import annotations

import mmap
import sys
import threading
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from kvstore.core.arena import (
    HUGE_PAGE,
    POPULATE_STEP,
    SLOT_ALIGN,
    Arena,
    ExtentHeap,
    default_page_bytes,
    host_memory,
    huge_page_bytes,
    parse_size,
    populate,
    slab_geometry,
)
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError
from tests import thp

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# ---- parse_size ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MiB),
        ("4GiB", 4 * GiB),
        ("1G", GiB),
        ("1g", GiB),
        ("100MB", 100 * 10**6),
        ("4096", 4096),
        ("4096B", 4096),
        ("1.5GiB", 3 * GiB // 2),
        (" 2 KiB ", 2048),
        ("0.5KiB", 512),
        ("3Ki", 3 * KiB),
        ("1TB", 10**12),
        ("0", 0),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "MiB", "-1", "1.5", "1.2B", "12XB", "4 GiB extra", "1e9", "0x100", "nan", "∞", True, -5],
)
def test_parse_size_rejects_garbage(text: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_size(text)  # type: ignore[arg-type]


def test_parse_size_rejects_non_strings() -> None:
    with pytest.raises(InvalidArgument):
        parse_size(4.0)  # type: ignore[arg-type]


# ---- geometry --------------------------------------------------------------------------


@given(stride=st.integers(1, 64 * MiB // SLOT_ALIGN).map(lambda n: n * SLOT_ALIGN))
@settings(max_examples=200, deadline=None)
def test_slab_geometry_bounds_waste(stride: int) -> None:
    page = 256 * KiB
    slots, pages = slab_geometry(stride, page)
    span = pages * page
    assert slots >= 1 and slots * stride <= span
    assert span - slots * stride < stride  # as many slots as fit
    assert span <= max(-(-stride // page) * page, 16 * MiB)
    # Waste is 1/32 of the span at most, except where no span size allowed better.
    if Fraction(span - slots * stride, span) > Fraction(1, 32):
        assert stride > page


def test_realistic_slot_waste_is_small() -> None:
    # 32 layers x (256 tok x 8 heads x 128 dim x 2 (K, V) int8 + ~4 KiB header/scales)
    slot = 32 * (256 * 8 * 128 * 2 + 4096)
    slots, pages = slab_geometry(slot, 256 * KiB)
    assert slots == 1 and (pages * 256 * KiB - slot) / (pages * 256 * KiB) < 0.02


def test_slab_geometry_refuses_slot_bigger_than_arena() -> None:
    with pytest.raises(CapacityError):
        slab_geometry(8 * KiB + SLOT_ALIGN, 4 * KiB, max_pages=2)


def test_default_page_bytes() -> None:
    assert default_page_bytes(64 * GiB) == 256 * KiB
    assert default_page_bytes(512 * MiB) == 256 * KiB
    assert default_page_bytes(1 * MiB) == 16 * KiB
    assert default_page_bytes(5000) == 4 * KiB


# ---- extent heap -----------------------------------------------------------------------


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 10**6)), max_size=80))
@settings(max_examples=150, deadline=None)
def test_extent_heap_against_a_bitmap(ops: list[tuple[bool, int, int]]) -> None:
    size = 256
    heap = ExtentHeap()
    heap.add(0, size)
    used = [False] * size
    live: dict[int, int] = {}
    for is_alloc, length, pick in ops:
        if is_alloc or not live:
            start = heap.alloc(length)
            if start is None:
                # Every free run is shorter than `length` only if no gap is long enough...
                # segregated fit may skip a fit in its own bin only after 16 candidates.
                runs = _free_runs(used)
                assert all(n < length for n in runs) or len(heap) > 16
                continue
            assert not any(used[start : start + length]) and start + length <= size
            used[start : start + length] = [True] * length
            live[start] = length
        else:
            start = sorted(live)[pick % len(live)]
            length = live.pop(start)
            used[start : start + length] = [False] * length
            heap.free(start, length, 0, size)
        heap.check()
        assert sorted(heap.extents()) == _free_extents(used)
    for start, length in live.items():
        heap.free(start, length, 0, size)
    assert list(heap.extents()) == [(0, size)]


def _free_runs(used: list[bool]) -> list[int]:
    return [n for _, n in _free_extents(used)]


def _free_extents(used: list[bool]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, u in enumerate([*used, True]):
        if not u and start is None:
            start = i
        elif u and start is not None:
            out.append((start, i - start))
            start = None
    return out


def test_extent_heap_never_merges_across_region_bounds() -> None:
    heap = ExtentHeap()
    heap.add(0, 10)
    heap.add(10, 10)  # a second region, adjacent in memory
    a = heap.alloc(10)
    assert a is not None
    heap.free(a, 10, lo=a, hi=a + 10)
    assert sorted(heap.extents()) == [(0, 10), (10, 10)]
    heap.check()
    with pytest.raises(InvalidArgument):
        heap.add(30, 0)


# ---- arena -----------------------------------------------------------------------------


def test_arena_construction_and_views() -> None:
    arena = Arena("1MiB", page_bytes="16KiB")
    assert arena.capacity_bytes == MiB and arena.n_pages == 64
    assert arena.tensor.dtype == torch.uint8 and arena.tensor.numel() == MiB
    assert not arena.pinned  # no CUDA here, so pin_memory=None means unpinned
    assert arena.stats().free_bytes == MiB
    view = arena.view(100, 10)
    view.fill_(9)
    assert int(arena.tensor[100:110].sum()) == 90
    with pytest.raises(InvalidArgument):
        arena.view(MiB - 4, 8)
    # capacity rounds down to whole pages
    assert Arena(MiB + 5000, page_bytes=16 * KiB).capacity_bytes == MiB


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"capacity_bytes": "lots"}, InvalidArgument),
        ({"capacity_bytes": 1000}, InvalidArgument),
        ({"capacity_bytes": MiB, "page_bytes": 5000}, InvalidArgument),
        ({"capacity_bytes": MiB, "device": "nonsense"}, InvalidArgument),
    ],
)
def test_arena_rejects_bad_config(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        Arena(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_arena_on_missing_cuda_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument):
        Arena(MiB, device="cuda")


def test_slot_that_never_fits_raises_capacity() -> None:
    arena = Arena(64 * KiB, page_bytes=4 * KiB)
    with pytest.raises(CapacityError):
        arena.alloc_slot(65 * KiB)
    with pytest.raises(CapacityError):
        arena.alloc_extent(65 * KiB)
    with pytest.raises(InvalidArgument):
        arena.alloc_slot(0)
    with pytest.raises(InvalidArgument):
        arena.free_slot(12345)
    with pytest.raises(InvalidArgument):
        arena.free_extent(12345)


def test_slots_fill_the_arena_and_come_back() -> None:
    arena = Arena(64 * KiB, page_bytes=4 * KiB)
    offsets = []
    while (off := arena.alloc_slot(1000)) is not None:
        offsets.append(off)
    assert len(offsets) == 64  # 1024-byte stride, no waste
    assert len(set(offsets)) == 64 and all(o % SLOT_ALIGN == 0 for o in offsets)
    assert arena.stats().free_bytes == 0 and arena.alloc_extent(1) is None
    arena.validate()
    for off in offsets:
        arena.free_slot(off)
    arena.validate()
    stats = arena.stats()
    assert stats.free_page_bytes == stats.capacity_bytes and stats.slab_spans == 0


def test_empty_spans_go_back_to_other_classes() -> None:
    arena = Arena(64 * KiB, page_bytes=4 * KiB)
    small = [arena.alloc_slot(4096) or 0 for _ in range(16)]
    assert sorted(small) == [i * 4096 for i in range(16)] and arena.alloc_slot(16 * KiB) is None
    for off in small[4:8]:
        arena.free_slot(off)  # four adjacent pages come back and coalesce
    big = arena.alloc_slot(16 * KiB)
    assert big == small[4]
    arena.validate()


def test_big_object_span_remainder_serves_small_objects() -> None:
    arena = Arena(MiB, page_bytes=16 * KiB)
    big = arena.alloc_extent(20 * KiB)  # takes a whole object span
    small = arena.alloc_extent(100)
    assert big is not None and small is not None
    assert arena.stats().object_spans == 1
    arena.free_extent(big)
    arena.free_extent(small)
    arena.validate()
    assert arena.stats().free_page_bytes == MiB


class ArenaMachine(RuleBasedStateMachine):
    """Random slot and extent alloc/free; contents prove nothing overlaps."""

    slots = Bundle("slots")
    extents = Bundle("extents")

    def __init__(self) -> None:
        super().__init__()
        self.arena = Arena(96 * KiB, page_bytes=4 * KiB)
        self.tag = 0
        self.live: dict[tuple[str, int], tuple[int, int]] = {}  # (kind, offset) -> (size, tag)

    def _fill(self, kind: str, offset: int, size: int) -> tuple[str, int]:
        self.tag = self.tag % 250 + 1
        self.arena.view(offset, size).fill_(self.tag)
        self.live[(kind, offset)] = (size, self.tag)
        return kind, offset

    @rule(target=slots, size=st.sampled_from([200, 1000, 3000, 4096, 9000, 20000]))
    def alloc_slot(self, size: int) -> object:
        offset = self.arena.alloc_slot(size)
        return multiple() if offset is None else self._fill("slot", offset, size)

    @rule(target=extents, size=st.integers(0, 12000))
    def alloc_extent(self, size: int) -> object:
        offset = self.arena.alloc_extent(size)
        return multiple() if offset is None else self._fill("extent", offset, size)

    @rule(handle=consumes(slots))
    def free_slot(self, handle: tuple[str, int]) -> None:
        del self.live[handle]
        self.arena.free_slot(handle[1])

    @rule(handle=consumes(extents))
    def free_extent(self, handle: tuple[str, int]) -> None:
        del self.live[handle]
        self.arena.free_extent(handle[1])

    @invariant()
    def consistent(self) -> None:
        self.arena.validate()
        stats = self.arena.stats()
        assert stats.used_bytes + stats.free_bytes == stats.capacity_bytes
        assert stats.slot_bytes + stats.object_bytes <= stats.used_bytes
        for (_, offset), (size, tag) in self.live.items():
            view = self.arena.view(offset, size)
            assert bool((view == tag).all()), f"bytes at {offset} were overwritten"

    def teardown(self) -> None:
        for kind, offset in list(self.live):
            (self.arena.free_slot if kind == "slot" else self.arena.free_extent)(offset)
        self.arena.validate()
        stats = self.arena.stats()
        assert stats.free_page_bytes == stats.capacity_bytes == stats.free_bytes


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_validate_catches_corruption() -> None:
    arena = Arena(64 * KiB, page_bytes=4 * KiB)
    offset = arena.alloc_slot(1000)
    assert offset is not None
    arena._slot_bytes += 1  # simulate a bookkeeping bug
    with pytest.raises(KVStoreError):
        arena.validate()


def test_slot_room_counts_the_slots_an_allocation_could_take_without_evicting() -> None:
    """Free bytes overstate room for big slots: a 4 MiB arena of 64 KiB pages holds one
    33-page span of eight 256 KiB + 144 B slots and 31 pages no such span fits in."""
    arena = Arena(4 * MiB, device="cpu")
    size = 256 * KiB + 144
    assert arena.slot_room(size) == (8, 8)
    offsets = [arena.alloc_slot(size) for _ in range(8)]
    assert None not in offsets and arena.alloc_slot(size) is None
    assert arena.slot_room(size) == (0, 8) and arena.stats().free_bytes == 31 * 64 * KiB
    for offset in offsets[:3]:
        arena.free_slot(offset)
    assert arena.slot_room(size) == (3, 8)
    small_free, small_total = arena.slot_room(4 * KiB)  # the free pages, in small spans
    assert small_free > 0 and small_total >= small_free
    with pytest.raises(CapacityError):
        arena.slot_room(8 * MiB)  # never fits


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise: Linux")
def test_populate_maps_a_host_arena_now_and_keeps_what_it_holds() -> None:
    arena = Arena(64 * 2**20)
    view = arena.view(3 * 2**20, 4096)
    view[:] = 7  # a page in use: populating keeps its bytes
    before = _resident_bytes()
    steps: list[int] = []
    done = arena.populate(progress=steps.append)
    if done == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert done >= 64 * 2**20 - 4096
    assert steps == sorted(set(steps)) and steps[-1] == done  # each step reported, in order
    assert len(steps) == -(-done // POPULATE_STEP)
    assert _resident_bytes() - before >= 60 * 2**20
    assert (view == 7).all()
    stop = threading.Event()
    stop.set()
    assert populate(Arena(8 * 2**20).tensor, stop) == 0  # (stopped before its first step)


@pytest.mark.skipif(not thp.usable(), reason="no transparent huge pages for this process")
def test_host_arena_memory_is_on_huge_pages_and_outlives_its_mapping_object() -> None:
    """A host arena starts on a 2 MiB boundary in a mapping of its own advised for huge
    pages (torch's allocator advises nothing: not eligible where the kernel's mode is
    ``madvise``), and once written its 2 MiB pages are huge pages, unless the kernel had
    none free; ``huge_pages=False`` advises against them (4 KiB pages in every mode)."""
    arena = Arena(16 * MiB)
    t = arena.tensor
    assert arena.huge_pages and t.data_ptr() % HUGE_PAGE == 0
    eligible = thp.smaps_field(t, "THPeligible")
    if eligible is None:
        pytest.skip("this kernel does not report THPeligible (Linux 5.0+)")
    assert eligible == 1
    before = thp.fallbacks()
    t.fill_(5)  # (the tensor alone keeps the mapping: nothing else refers to it)
    assert int(t[::4096].sum()) == 5 * (16 * MiB // 4096)
    huge = arena.huge_page_bytes()
    assert huge == huge_page_bytes(t) == (thp.smaps_field(t, "AnonHugePages") or 0) * KiB
    assert 0 <= huge <= 16 * MiB and huge % HUGE_PAGE == 0
    if huge == 0 and thp.fallbacks() > before:
        pytest.skip("the kernel had no free 2 MiB page for this test (thp_fault_fallback)")
    assert huge > 0
    plain = Arena(16 * MiB, huge_pages=False)
    plain.tensor.fill_(5)
    assert not plain.huge_pages and thp.smaps_field(plain.tensor, "THPeligible") == 0
    assert plain.huge_page_bytes() == 0


def test_host_memory_is_zeroed_aligned_and_sized() -> None:
    """What :func:`host_memory` hands out: ``nbytes`` of zeros from a 2 MiB boundary, and
    the advice's outcome (False when not asked); a size below one byte is refused."""
    t, advised = host_memory(3 * MiB + 4096, huge_pages=False)
    assert not advised and t.numel() == 3 * MiB + 4096 and t.dtype == torch.uint8
    assert t.data_ptr() % HUGE_PAGE == 0 and int(t.count_nonzero()) == 0
    for bad in (0, -1, 1.5):
        with pytest.raises(InvalidArgument):
            host_memory(bad)  # type: ignore[arg-type]


@pytest.mark.skipif(not thp.usable(), reason="no transparent huge pages for this process")
def test_huge_page_bytes_counts_only_the_arena_beside_an_advised_neighbour() -> None:
    """Mappings advised for huge pages that the kernel places right below an arena do not
    merge with its range (unadvised pages of the arena's own mapping lie between): their
    huge pages are not counted as the arena's."""
    t, _ = host_memory(16 * MiB)
    neighbours = []
    try:
        for _ in range(3):  # (mmap places each below the last, where it has room)
            m = mmap.mmap(-1, 8 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            neighbours.append(m)
            m.madvise(mmap.MADV_HUGEPAGE)
            m.write(b"\x01" * (8 * MiB))
        t.fill_(1)
        assert 0 <= huge_page_bytes(t) <= 16 * MiB
    finally:
        for m in neighbours:
            m.close()

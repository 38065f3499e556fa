"""Moves between a node's tiers (``kvstore.node.tiers.Tiers``), on a GPU tier of CPU tensors:
a block being read stays where it is, a prefix chain moves up parent first and new
blocks never start above their parent, a promotion never costs a demotion, and the
GPU tier's room is counted in runs its slots fit (``Arena.slot_room``)."""

from __future__ import annotations

import math

from kvstore.core.slots import Slot
from kvstore.node.tiers import FREE_SHARE, Tiers

NS = b"m" * 16
SLOT = 64 * 1024


def tiers(gpu_mem: int = 2 * 2**20) -> Tiers:
    return Tiers(8 * 2**20, gpu_mem, gpu="cpu")


def chain(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def store(t: Tiers, keys: list[bytes], tier: str = "host", parents: bool = True) -> list[Slot]:
    """Landed slots for ``keys`` (a chain when ``parents``) in ``tier``, bytes = their index."""
    where = t.host if tier == "host" else t[0]
    slots = []
    for i, key in enumerate(keys):
        parent = keys[i - 1] if parents and i else None
        slot = where.table.allocate((NS, key), SLOT, SLOT, 1, parent).slot
        where.table.slot_view(slot).fill_(i % 251)
        where.table.mark_landed(slot, 0)
        slots.append(slot)
    return slots


def where(t: Tiers, keys: list[bytes]) -> list[str | None]:
    found = []
    for key in keys:
        names = [tier.name for tier in t if tier.table.find((NS, key)) is not None]
        assert len(names) <= 1, f"{key.hex()} in {names}"
        found.append(names[0] if names else None)
    return found


def settle(t: Tiers, steps: int = 200) -> int:
    """Run the mover until it has nothing to do (bounded); the moves it made."""
    for moved in range(steps):
        if not t.move_one():
            return moved
    raise AssertionError("the mover never ran out of work")


def test_a_chain_moves_up_parent_first_and_never_above_its_parent() -> None:
    t = tiers()
    keys = chain(6)
    store(t, keys)
    t.hit([(NS, k) for k in keys])  # a read of the whole prefix
    for _ in range(20):  # bounded: one move per step
        moved = t.move_one()
        w = where(t, keys)
        for i in range(1, len(keys)):
            assert not (w[i] == "gpu" and w[i - 1] == "host"), w  # a child above its parent
        if not moved:
            break
    assert where(t, keys) == ["gpu"] * 6
    for i, key in enumerate(keys):  # every byte came along
        slot = t[0].table.get((NS, key))
        assert slot is not None and slot.landed_mask == 1
        assert bool((t[0].table.slot_view(slot) == i % 251).all())
    t[0].table.validate()
    t.host.table.validate()


def test_a_block_being_read_or_scrubbed_moves_only_after() -> None:
    t = tiers()
    keys = chain(2, tag=1)
    slots = store(t, keys, parents=False)
    lease = t.host.table.pin(slots[0])
    scrubbing = {slots[1]}
    t.movable = lambda slot: slot not in scrubbing
    t.hit([(NS, k) for k in keys])
    assert settle(t) == 0 and where(t, keys) == ["host", "host"]
    lease.release()
    scrubbing.clear()
    assert settle(t) == 2 and where(t, keys) == ["gpu", "gpu"]


def test_a_new_block_starts_where_its_parent_is() -> None:
    t = tiers()
    [parent] = chain(1, tag=2)
    store(t, [parent])
    assert t.start_tier(NS, parent) is t.host
    assert t.start_tier(NS, None) is t[0]
    assert t.start_tier(NS, b"z" * 16) is t[0]  # a parent held nowhere


def test_promotions_fill_only_the_room_beyond_the_free_share() -> None:
    """Reads of more host blocks than the GPU tier has room for: they move up until the
    tier's free share is left, and none is demoted again (a promotion that took the tier
    below its share would be undone by the mover at once)."""
    t = tiers(gpu_mem=4 * 2**20)
    t.allocated(SLOT)  # the slot size puts take
    free, total = t[0].arena.slot_room(SLOT)
    keep = max(1, math.ceil(total * FREE_SHARE))
    assert free == total > keep
    keys = chain(free + 10, tag=3)
    store(t, keys, parents=False)
    t.hit([(NS, k) for k in keys])
    settle(t)
    moves = t.metrics.registry.get_sample_value
    assert moves("kvstore_tier_moves_total", {"to": "gpu"}) == free - keep
    assert moves("kvstore_tier_moves_total", {"to": "host"}) is None  # nothing came back
    assert not t.short_of_room()


def test_slot_room_counts_only_runs_a_span_fits() -> None:
    """Pages freed between other sizes' spans are free bytes but no room for a big slot."""
    t = tiers(gpu_mem=2 * 2**20)
    arena = t[0].arena
    small = 16 * 1024
    offsets = []
    while (off := arena.alloc_slot(small)) is not None:
        offsets.append(off)
    page = arena.page_bytes
    for off in offsets:  # the slots of every other page freed: free pages, one by one
        if off // page % 2 == 0:
            arena.free_slot(off)
    big = 512 * 1024
    free, _ = arena.slot_room(big)
    fits = 0
    taken = []
    while (off := arena.alloc_slot(big)) is not None:  # what an allocation really gets
        taken.append(off)
        fits += 1
    assert free == fits
    assert arena.stats().free_bytes >= arena.capacity_bytes // 3  # bytes, but no room


def test_a_draining_node_promotes_nothing() -> None:
    t = tiers()
    keys = chain(2, tag=4)
    store(t, keys, parents=False)
    t.promoting = False  # what a drain sets
    t.hit([(NS, k) for k in keys])
    assert settle(t) == 0 and where(t, keys) == ["host", "host"]
    t.promoting = True  # the drain was called off: the reads still count
    assert settle(t) == 2 and where(t, keys) == ["gpu", "gpu"]

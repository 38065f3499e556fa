"""SlotTable and ObjectStore: leases, LRU with tail-first chains, quarantine, objects."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.core.arena import Arena
from kvstore.core.slots import Lease, ObjectStore, ObjectWrite, Slot, SlotKey, SlotTable
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, Miss

KiB = 1 << 10
NS = b"n" * 16
OTHER_NS = b"o" * 16


def key(i: int, ns: bytes = NS) -> SlotKey:
    return ns, i.to_bytes(16, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def small_table(capacity: int = 64 * KiB) -> tuple[SlotTable, Clock]:
    clock = Clock()
    return SlotTable(Arena(capacity, page_bytes=4 * KiB), clock=clock), clock


def chain(table: SlotTable, ids: list[int], slot_bytes: int = 4096) -> list[SlotKey]:
    """Allocate blocks ``ids`` as one prefix chain; returns their keys in prefix order."""
    keys, parent = [], None
    for i in ids:
        result = table.allocate(key(i), slot_bytes, slot_bytes // 4, 4, parent=parent)
        assert result.created and result.evicted == []
        keys.append(result.slot.key)
        parent = result.slot.block_hash
    return keys


# ---- unit tests ------------------------------------------------------------------------


def test_allocate_views_and_landing() -> None:
    table, _ = small_table()
    slot = table.allocate(key(1), 4000, 1000, 4).slot
    assert table.get(key(1)) is slot and table.get(key(2)) is None
    for i in range(4):
        table.chunk_view(slot, i).fill_(i + 1)
    whole = table.slot_view(slot)
    assert whole.numel() == 4000
    assert [int(whole[i * 1000 : (i + 1) * 1000].float().mean()) for i in range(4)] == [1, 2, 3, 4]
    assert table.landed(slot) == 0 and not slot.complete
    assert table.mark_landed(slot, 2) and not table.mark_landed(slot, 2)
    assert table.landed(slot) == 0b100
    for i in (0, 1, 3):
        table.mark_landed(slot, i)
    assert slot.complete
    with pytest.raises(InvalidArgument):
        table.chunk_view(slot, 4)
    with pytest.raises(InvalidArgument):
        table.mark_landed(slot, -1)
    table.validate()


def test_allocate_existing_key_is_first_writer_wins() -> None:
    table, _ = small_table()
    first = table.allocate(key(1), 4000, 1000, 4)
    again = table.allocate(key(1), 4000, 1000, 4)
    assert again.slot is first.slot and not again.created and first.created
    with pytest.raises(InvalidArgument):
        table.allocate(key(1), 8000, 2000, 4)


@pytest.mark.parametrize(
    "args",
    [
        ((NS,), 4000, 1000, 4, None),
        (("ns", b"h"), 4000, 1000, 4, None),
        (key(1), 0, 1000, 4, None),
        (key(1), 4000, 1000, 5, None),
        (key(1), 4000, 1000, True, None),
        (key(1), 4000, 1000, 4, key(1)[1]),
        (key(1), 4000, 1000, 4, "parent"),
    ],
)
def test_allocate_rejects_bad_requests(args: tuple) -> None:  # type: ignore[type-arg]
    table, _ = small_table()
    with pytest.raises(InvalidArgument):
        table.allocate(*args)
    table.validate()


def test_capacity_error_when_everything_is_pinned() -> None:
    table, _ = small_table()
    leases = [table.pin(table.allocate(key(i), 4096, 1024, 4).slot) for i in range(16)]
    with pytest.raises(CapacityError):
        table.allocate(key(99), 4096, 1024, 4)
    assert table.take_evictions() == [] and len(table) == 16
    leases[5].release()
    result = table.allocate(key(99), 4096, 1024, 4)
    assert result.evicted == [key(5)]
    with pytest.raises(CapacityError):
        table.allocate(key(100), 128 * KiB, 1024, 4)  # can never fit
    table.validate()


def test_a_slot_that_eviction_cannot_make_room_for_evicts_nothing() -> None:
    """When even evicting every unpinned slot would not free a slot's size, the allocation
    fails before it evicts: a request that cannot be met does not empty the cache."""
    table, _ = small_table()
    leases = [table.pin(table.allocate(key(i), 4096, 1024, 4).slot) for i in range(12)]
    for i in range(12, 16):
        table.allocate(key(i), 4096, 1024, 4)  # 16 KiB unpinned, nothing free
    with pytest.raises(CapacityError, match="evicted nothing"):
        table.allocate(key(99), 32 * KiB, 8 * KiB, 4)
    assert table.take_evictions() == [] and len(table) == 16
    for lease in leases[8:]:
        lease.release()  # 32 KiB unpinned, side by side: room, by evicting all of it
    result = table.allocate(key(99), 32 * KiB, 8 * KiB, 4)
    assert sorted(result.evicted) == [*map(key, range(8, 16))]
    table.validate()


def test_release_is_idempotent_and_leases_nest() -> None:
    table, _ = small_table()
    slot = table.allocate(key(1), 4096, 1024, 4).slot
    a, b = table.pin(slot), table.pin(slot)
    assert slot.pins == 2 and table.stats().pinned_bytes == 4096
    a.release()
    a.release()
    assert a.released and not b.released and slot.pins == 1
    assert not table.evict(key(1))
    with b:
        pass
    b.release()
    assert slot.pins == 0 and table.stats().pinned_bytes == 0
    assert table.lease(a.id) is None
    table.validate()
    assert table.evict(key(1)) and not table.evict(key(1))
    with pytest.raises(Miss):
        table.pin(slot)
    with pytest.raises(Miss):
        table.chunk_view(slot, 0)
    table.validate()


def test_pinned_context_manager() -> None:
    table, _ = small_table()
    slot = table.allocate(key(1), 4000, 1000, 4).slot
    with table.pinned(slot) as view:
        assert view.numel() == 4000 and slot.pins == 1
        view.fill_(3)
    assert slot.pins == 0 and int(table.chunk_view(slot, 3)[0]) == 3
    with pytest.raises(RuntimeError), table.pinned(slot):
        raise RuntimeError("boom")
    assert slot.pins == 0
    table.validate()


def test_lease_expiry() -> None:
    table, clock = small_table()
    slot = table.allocate(key(1), 4096, 1024, 4).slot
    short = table.pin(slot, ttl_s=1.0)
    explicit = table.pin(slot, ttl_s=5.0, now=200.0)
    forever = table.pin(slot)
    assert short.expires_at == 101.0 and explicit.expires_at == 205.0
    assert table.expire_leases() == []
    clock.now = 101.0
    assert table.expire_leases() == [short] and short.released
    short.release()  # a late release by the dead client is harmless
    assert table.lease(explicit.id) is explicit
    assert table.expire_leases(now=300.0) == [explicit]
    assert slot.pins == 1 and not forever.released
    forever.release()
    table.validate()
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument):
            table.pin(slot, ttl_s=bad)
    table.validate()


def test_many_expired_leases_keep_the_heap_bounded() -> None:
    table, _ = small_table()
    slot = table.allocate(key(1), 4096, 1024, 4).slot
    for _ in range(5000):
        table.pin(slot, ttl_s=10.0).release()
    assert len(table._leases._expiry) < 3000
    table.validate()


def test_tail_first_eviction_along_a_chain() -> None:
    table, _ = small_table()
    a = chain(table, [1, 2, 3, 4])  # 4 KiB slots, 16 fit
    b = chain(table, [11, 12, 13, 14])
    others = chain(table, list(range(21, 29)))
    table.touch(others)
    table.touch(a)  # a is now the most recent chain, b the least
    evicted = []
    for i in range(6):
        evicted += table.allocate(key(100 + i), 4096, 1024, 4).evicted
    assert evicted == [b[3], b[2], b[1], b[0], others[7], others[6]]
    table.validate()


def test_an_owner_over_its_quota_loses_its_own_blocks_first() -> None:
    table, _ = small_table()  # 16 slots of 4 KiB
    table.set_quotas({"flood": 4 * 4096, "calm": 8 * 4096})
    calm = [table.allocate(key(i), 4096, 1024, 4, owner="calm").slot.key for i in range(6)]
    # The flood uses the free memory beyond its quota (a quota is no hard cap)...
    flood = [table.allocate(key(100 + i), 4096, 1024, 4, owner="flood").slot.key
             for i in range(10)]  # fmt: skip
    assert table.owner_bytes() == {"calm": 6 * 4096, "flood": 10 * 4096}
    # ...but once memory is short its own oldest blocks go, never calm's, though calm's
    # are older: calm is within its quota.
    gone = []
    for i in range(20):
        gone += table.allocate(key(200 + i), 4096, 1024, 4, owner="flood").evicted
    assert gone[:10] == flood and set(gone).isdisjoint(calm)
    assert table.owner_bytes()["calm"] == 6 * 4096 and table.owner_evictions == {"flood": 20}
    # Calm's own puts, within its quota, also take the flood's blocks first.
    more = table.allocate(key(300), 4096, 1024, 4, owner="calm")
    assert more.evicted and not set(more.evicted) & set(calm)
    table.validate()
    # With no one over quota the order is plain LRU again.
    table.set_quotas({})
    assert table.allocate(key(400), 4096, 1024, 4, owner="flood").evicted == [calm[0]]
    table.validate()


def test_an_owner_reaching_its_quota_evicts_its_own_before_an_unlimited_one() -> None:
    table, _ = small_table()
    table.set_quotas({"a": 4 * 4096})
    old = [table.allocate(key(i), 4096, 1024, 4).slot.key for i in range(12)]  # no owner
    mine = [table.allocate(key(50 + i), 4096, 1024, 4, owner="a").slot.key for i in range(4)]
    # "a" is at its quota: its next block would put it over, so its own oldest goes,
    # though the unowned blocks are older.
    assert table.allocate(key(99), 4096, 1024, 4, owner="a").evicted == [mine[0]]
    assert table.allocate(key(98), 4096, 1024, 4).evicted == [old[0]]
    table.validate()


def test_an_owner_with_no_quota_evicts_its_own_not_one_within_its_quota() -> None:
    """Found by trying the product: a tenant without a quota flooded the pool and evicted
    a tenant within its quota (no one was "over", so the plain LRU chose). Blocks of an
    owner without a quota (no tenant's among them) now go before those of one within its
    quota, and after those of one over its quota."""
    table, _ = small_table()  # 16 slots of 4 KiB
    table.set_quotas({"a": 8 * 4096, "b": 2 * 4096})
    mine = [table.allocate(key(i), 4096, 1024, 4, owner="a").slot.key for i in range(6)]
    over = [table.allocate(key(50 + i), 4096, 1024, 4, owner="b").slot.key for i in range(3)]
    flood = [table.allocate(key(100 + i), 4096, 1024, 4, owner="c").slot.key
             for i in range(7)]  # fmt: skip
    gone = []
    for i in range(12):
        gone += table.allocate(key(200 + i), 4096, 1024, 4, owner="c").evicted
    assert gone[:1] == over[:1]  # "b" is over its quota: its oldest first
    assert set(gone).isdisjoint(mine) and set(flood) <= set(gone)
    assert table.owner_bytes()["a"] == 6 * 4096
    table.validate()


def test_an_over_quota_owner_with_nothing_evictable_lets_the_plain_lru_choose() -> None:
    # The over-quota owner's slots are all pinned (landing): its heap empties while the
    # victim is sought, and the oldest of everyone else's goes. Found by review: this
    # raised KeyError and leaked the parent's child count.
    table, _ = small_table()
    table.set_quotas({"a": 4096})
    pins = [table.pin(table.allocate(key(i), 4096, 1024, 4, owner="a").slot) for i in range(2)]
    others = [table.allocate(key(100 + i), 4096, 1024, 4).slot.key for i in range(14)]
    result = table.allocate(key(200), 4096, 1024, 4, parent=others[-1][1], owner="b")
    assert result.evicted == [others[0]]  # (the parent of the new slot stays)
    table.validate()
    for lease in pins:
        lease.release()
    table.validate()


def test_a_quota_counts_the_owners_bytes_in_every_table_that_shares_it() -> None:
    # A node's tiers share one quota per tenant (tcp:// puts land in host memory only): a
    # tenant within its node quota is not over it because one tier holds most of it.
    table, _ = small_table()
    elsewhere = {"a": 0}
    table.set_quotas({"a": 8 * 4096}, used=lambda o: table.owned_bytes(o) + elsewhere.get(o, 0))
    older = [table.allocate(key(100 + i), 4096, 1024, 4).slot.key for i in range(10)]
    mine = [table.allocate(key(i), 4096, 1024, 4, owner="a").slot.key for i in range(6)]
    assert table.allocate(key(200), 4096, 1024, 4).evicted == [older[0]]  # a within: LRU
    elsewhere["a"] = 3 * 4096  # 6 + 3 slots of "a" now count against its 8: over
    assert table.allocate(key(201), 4096, 1024, 4).evicted == [mine[0]]
    table.validate()


def test_touch_makes_the_tail_older_without_parent_links() -> None:
    # With HRW placement a node mostly holds blocks whose parents live elsewhere: only the
    # touch order then puts the tail first.
    table, _ = small_table()
    keys = [table.allocate(key(i), 4096, 1024, 4).slot.key for i in range(16)]
    request = keys[4:8]
    table.touch(request)
    table.touch(keys[8:])
    table.touch(keys[:4])
    assert [table.evict_lru() for _ in range(4)] == request[::-1]
    table.validate()


def test_parent_with_pinned_child_is_kept() -> None:
    table, _ = small_table()
    head, tail = chain(table, [1, 2])
    lease = table.pin(table.get(tail))  # type: ignore[arg-type]
    fill = chain(table, list(range(10, 24)))  # arena now full (16 slots)
    table.touch(fill)
    result = table.allocate(key(99), 4096, 1024, 4)
    assert head not in result.evicted and result.evicted == [fill[-1]]
    lease.release()
    assert table.evict_lru() == tail and table.evict_lru() == head
    table.validate()


def test_parent_is_not_evicted_for_its_own_child() -> None:
    table, _ = small_table()
    (head,) = chain(table, [1])
    chain(table, list(range(10, 25)))  # 15 more: full, head is the oldest
    result = table.allocate(key(2), 4096, 1024, 4, parent=head[1])
    assert head not in result.evicted and len(result.evicted) == 1
    assert table.get(head) is not None
    table.validate()


def test_failed_allocation_still_reports_its_evictions() -> None:
    table, _ = small_table()
    small = [table.allocate(key(i), 4096, 1024, 4).slot for i in range(16)]
    leases = [table.pin(s) for s in small[::2]]  # every other page pinned: no 8 KiB run
    with pytest.raises(CapacityError):
        table.allocate(key(99), 8192, 2048, 4)
    evicted = table.take_evictions()
    assert sorted(evicted) == sorted(s.key for s in small[1::2])
    assert table.take_evictions() == []
    for lease in leases:
        lease.release()
    result = table.allocate(key(99), 8192, 2048, 4)
    assert result.evicted == [key(0)]  # page 1 is already free: one eviction makes the run
    table.validate()


def test_demote_hook_sees_every_lru_victim_and_keeps_demoted_keys_off_the_journal() -> None:
    offered: list[SlotKey] = []

    def demote(victim: Slot) -> bool:
        offered.append(victim.key)
        assert victim.alive and table.get(victim.key) is victim  # still readable here
        return victim.key[1][-1] % 2 == 0  # even blocks find a home elsewhere

    table = SlotTable(Arena(64 * KiB, page_bytes=4 * KiB), demote=demote)
    keys = [table.allocate(key(i), 4096, 1024, 4).slot.key for i in range(16)]
    evicted = [*table.allocate(key(16), 4096, 1024, 4).evicted,
               *table.allocate(key(17), 4096, 1024, 4).evicted]  # fmt: skip
    assert table.evict_lru() == keys[2]
    assert offered == keys[:3]
    assert evicted == [keys[1]] and table.take_evictions() == []  # keys 0 and 2: demoted
    assert table.evict(keys[3]) and offered == keys[:3], "an explicit eviction is not offered"
    table.validate()


def test_quarantine() -> None:
    table, _ = small_table()
    slot = table.allocate(key(1), 4096, 1024, 4).slot
    lease = table.pin(slot)
    table.quarantine(slot)
    table.quarantine(slot)
    assert table.get(key(1)) is None and table.quarantined() == [slot]
    for call in (lambda: table.pin(slot), lambda: table.chunk_view(slot, 0)):
        with pytest.raises(Miss):
            call()
    with pytest.raises(CapacityError):
        table.allocate(key(1), 4096, 1024, 4)
    lease.release()  # leases stay valid through quarantine
    assert not table.evict(key(1)) and table.evict_lru() is None
    stats = table.stats()
    assert stats.quarantined_slots == 1 and stats.slot_bytes == 4096 and stats.evictable_slots == 0
    assert table.drop_namespace(NS) == []
    table.validate()
    table.unquarantine(slot)
    table.unquarantine(slot)
    assert table.get(key(1)) is slot and table.evict(key(1))
    with pytest.raises(Miss):
        table.quarantine(slot)
    table.validate()


def test_drop_namespace_keeps_pinned_slots() -> None:
    table, _ = small_table()
    mine = [table.allocate(key(i), 4096, 1024, 4).slot for i in range(3)]
    theirs = table.allocate(key(1, OTHER_NS), 4096, 1024, 4).slot
    lease = table.pin(mine[0])
    assert sorted(table.drop_namespace(NS)) == [key(1), key(2)]
    assert table.get(key(0)) is mine[0] and table.get(theirs.key) is theirs
    lease.release()
    assert table.drop_namespace(NS) == [key(0)]
    table.validate()


def test_stats_add_up() -> None:
    table, _ = small_table()
    slot = table.allocate(key(1), 3000, 1000, 3).slot
    table.pin(slot)
    stats = table.stats()
    assert stats.used_bytes + stats.free_bytes == stats.capacity_bytes == 64 * KiB
    assert stats.slots == 1 and stats.pinned_slots == 1 and stats.leases == 1
    assert stats.pinned_bytes == slot.stride == 3072 and stats.device == "cpu"


def test_validate_catches_a_broken_pin_count() -> None:
    table, _ = small_table()
    slot = table.allocate(key(1), 4096, 1024, 4).slot
    slot.pins = 1  # as if someone counted a reference by hand
    with pytest.raises(KVStoreError):
        table.validate()


# ---- objects ---------------------------------------------------------------------------


def test_objects_put_commit_get_remove() -> None:
    arena = Arena(64 * KiB, page_bytes=4 * KiB)
    store = ObjectStore(arena, max_object_bytes=8 * KiB, max_total_bytes=32 * KiB)
    write = store.put("cfg", 5)
    write.view.copy_(torch.frombuffer(bytearray(b"hello"), dtype=torch.uint8))
    assert store.get("cfg") is None  # invisible until committed
    write.commit()
    write.commit()
    got = store.get("cfg")
    assert got is not None and bytes(got.numpy()) == b"hello" and "cfg" in store
    with store.put("cfg", 0) as empty:
        empty.commit()
    got = store.get("cfg")
    assert got is not None and got.numel() == 0 and len(store) == 1
    assert store.remove("cfg") and not store.remove("cfg") and store.get("cfg") is None
    store.validate()
    arena.validate()
    assert arena.stats().free_page_bytes == arena.capacity_bytes and store.used_bytes == 0


def test_an_objects_newer_version_stands_whatever_comes_after_it() -> None:
    """Two writes of one key keep the newer version, in whichever order they commit: an
    older one committed after it is dropped (its bytes freed) and says so."""
    arena = Arena(64 * KiB, page_bytes=4 * KiB)
    store = ObjectStore(arena, max_object_bytes=8 * KiB, max_total_bytes=32 * KiB)

    def put(value: bytes, version: int) -> bool:
        with store.put("cfg", len(value), version) as write:
            write.view.copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
            published = write.commit()
            assert write.commit() is published  # (idempotent)
        return published

    assert put(b"new", 20) and not put(b"old", 10)
    got = store.get("cfg")
    assert got is not None and bytes(got.numpy()) == b"new"
    assert store.version("cfg") == 20 and store.items() == [("cfg", 3, 20)]
    assert put(b"newer", 30) and put(b"again", 30)  # (a version as new replaces)
    assert store.version("cfg") == 30 and store.version("none") is None
    store.validate()
    assert store.remove("cfg")
    assert arena.stats().free_page_bytes == arena.capacity_bytes and store.used_bytes == 0


def test_object_write_aborts_on_exit_and_limits_hold() -> None:
    arena = Arena(64 * KiB, page_bytes=4 * KiB)
    store = ObjectStore(arena, max_object_bytes=8 * KiB, max_total_bytes=16 * KiB)
    with store.put("x", 100):
        pass
    assert "x" not in store and store.used_bytes == 0
    write = store.put("y", 10)
    write.abort()
    with pytest.raises(InvalidArgument):
        write.commit()
    with pytest.raises(CapacityError):
        store.put("big", 8 * KiB + 1)
    writes = [store.put(f"k{i}", 8 * KiB) for i in range(2)]
    with pytest.raises(CapacityError):
        store.put("over", 1)  # quota: pending writes count
    for w in writes:
        w.commit()
    for bad_key in ("", 5, "x" * 5000):
        with pytest.raises(InvalidArgument):
            store.put(bad_key, 1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        store.put("neg", -1)
    store.validate()


def test_replacing_a_pinned_object_frees_it_on_release() -> None:
    arena = Arena(64 * KiB, page_bytes=4 * KiB)
    store = ObjectStore(arena, max_total_bytes=32 * KiB)
    with store.put("k", 1000) as w:
        w.view.fill_(1)
        w.commit()
    with store.pinned("k") as old:
        assert old is not None
        with store.put("k", 1000) as w:
            w.view.fill_(2)
            w.commit()
        assert int(old[0]) == 1 and store.used_bytes == 2048  # old bytes intact while pinned
        store.validate()
    assert store.used_bytes == 1024
    with store.pinned("missing") as none:
        assert none is None
    lease = store.pin("k", ttl_s=1.0, now=0.0)
    assert lease is not None and store.remove("k") and store.used_bytes == 1024
    assert store.expire_leases(now=1.0) == [lease]
    assert store.used_bytes == 0
    store.validate()
    arena.validate()


def test_objects_evict_lru_slots_to_make_room() -> None:
    table, _ = small_table()
    store = ObjectStore(table.arena, make_room=table.evict_lru, max_total_bytes=64 * KiB)
    keys = chain(table, list(range(16)))
    with store.put("obj", 6000) as w:
        w.commit()
    assert table.take_evictions() == [keys[15], keys[14]]  # tail first, two pages
    lease = table.pin(table.get(keys[0]))  # type: ignore[arg-type]
    for i in range(1, 14):
        table.pin(table.get(keys[i]))  # type: ignore[arg-type]
    with pytest.raises(CapacityError):
        store.put("obj2", 4096)
    lease.release()
    table.validate()
    store.validate()


# ---- the state machine -----------------------------------------------------------------

CLASSES = [(1000, 250, 4), (3000, 1000, 3), (4096, 1024, 4), (9000, 4500, 2)]


@dataclass
class Model:
    """What the table should hold, computed without its data structures."""

    geometry: dict[SlotKey, tuple[int, int, int]] = field(default_factory=dict)
    parent: dict[SlotKey, SlotKey | None] = field(default_factory=dict)
    recency: dict[SlotKey, int] = field(default_factory=dict)
    tag: dict[SlotKey, int] = field(default_factory=dict)
    quarantined: set[SlotKey] = field(default_factory=set)
    leases: list[Lease[Slot]] = field(default_factory=list)
    tick: int = 0

    def pins(self, k: SlotKey) -> int:
        return sum(1 for lease in self.leases if not lease.released and lease.target.key == k)

    def has_child(self, k: SlotKey) -> bool:
        return any(p == k for p in self.parent.values())

    def evictable(self, protected: SlotKey | None = None) -> list[SlotKey]:
        return [
            k
            for k in self.geometry
            if k not in self.quarantined
            and not self.pins(k)
            and not self.has_child(k)
            and k != protected
        ]

    def forget(self, k: SlotKey) -> None:
        for table in (self.geometry, self.parent, self.recency, self.tag):
            del table[k]  # type: ignore[attr-defined]

    def check_lru_victims(self, victims: list[SlotKey], protected: SlotKey | None) -> None:
        for victim in victims:
            candidates = self.evictable(protected)
            assert candidates, f"{victim} evicted while nothing was evictable"
            expected = min(candidates, key=self.recency.__getitem__)
            assert victim == expected, "eviction broke LRU / tail-first order"
            self.forget(victim)


class SlotMachine(RuleBasedStateMachine):
    """Random allocate/land/touch/pin/release/expire/quarantine/evict/objects."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        # 8 pages: every slot class and the object heap compete for them
        self.arena = Arena(32 * KiB, page_bytes=4 * KiB)
        self.table = SlotTable(self.arena, clock=self.clock)
        self.store = ObjectStore(
            self.arena,
            max_object_bytes=6 * KiB,
            max_total_bytes=12 * KiB,
            make_room=self.table.evict_lru,
            clock=self.clock,
        )
        self.model = Model()
        self.paths: list[tuple[bytes, list[bytes]]] = [(NS, []), (OTHER_NS, [])]
        self.next_block = 0
        self.next_tag = 0
        self.objects: dict[str, tuple[int, int]] = {}  # key -> (nbytes, tag)
        self.pending: list[tuple[ObjectWrite, int]] = []
        self.object_leases: list[Lease] = []  # type: ignore[type-arg]

    def _tag(self) -> int:
        self.next_tag = self.next_tag % 250 + 1
        return self.next_tag

    def _present(self, pick: int) -> SlotKey | None:
        keys = sorted(self.model.geometry)
        return keys[pick % len(keys)] if keys else None

    @rule(
        path=st.integers(0, 100),
        cut=st.integers(0, 8),
        cls=st.sampled_from(CLASSES),
        count=st.integers(1, 3),
    )
    def allocate(self, path: int, cut: int, cls: tuple[int, int, int], count: int) -> None:
        """Extend a prefix (a cut of a known path, so chains branch) by ``count`` blocks."""
        ns, blocks = self.paths[path % len(self.paths)]
        blocks = blocks[: cut % (len(blocks) + 1)]
        for _ in range(count):
            if not self._allocate_one(ns, blocks, cls):
                return
            blocks = self.paths[-1][1]
            if len(self.paths) > 12:
                del self.paths[2]

    def _allocate_one(self, ns: bytes, blocks: list[bytes], cls: tuple[int, int, int]) -> bool:
        parent = blocks[-1] if blocks else None
        self.next_block += 1
        k = (ns, self.next_block.to_bytes(16, "big"))
        pkey = (ns, parent) if parent is not None else None
        try:
            # (two owners, no quotas: the per-owner heaps must give the one LRU order)
            owner = "a" if ns == NS else "b"
            result = self.table.allocate(k, *cls, parent=parent, owner=owner)
        except CapacityError:
            evicted = self.table.take_evictions()
            self.model.check_lru_victims(evicted, pkey)
            if self.model.evictable(pkey):
                # Given up with something evictable: only where evicting every unpinned
                # slot could not free the slot's size, and then having evicted nothing.
                arena, m = self.table.arena, self.model
                unpinned = sum(arena.slot_stride(m.geometry[k][0]) for k in m.geometry
                               if not m.pins(k))  # fmt: skip
                room = arena.free_bytes + unpinned
                assert evicted == [] and room < arena.slot_stride(cls[0]), (
                    "gave up while something was evictable"
                )
            return False
        self.model.check_lru_victims(result.evicted, pkey)
        assert result.created and result.slot.key == k
        tag = self._tag()
        for i in range(cls[2]):
            self.table.chunk_view(result.slot, i).fill_(tag)
        self.model.tick += 1
        self.model.geometry[k], self.model.parent[k] = cls, pkey
        self.model.recency[k], self.model.tag[k] = self.model.tick, tag
        self.paths.append((ns, [*blocks, k[1]]))
        return True

    @rule(pick=st.integers(0, 1000))
    def allocate_existing(self, pick: int) -> None:
        k = self._present(pick)
        if k is None:
            return
        if k in self.model.quarantined:
            with pytest.raises(CapacityError):
                self.table.allocate(k, *self.model.geometry[k])
        else:
            result = self.table.allocate(k, *self.model.geometry[k])
            assert not result.created and result.evicted == []

    @rule(path=st.integers(0, 100))
    def touch(self, path: int) -> None:
        ns, blocks = self.paths[path % len(self.paths)]
        keys = [(ns, b) for b in blocks]
        self.table.touch(keys)
        for k in reversed(keys):
            if k in self.model.recency:
                self.model.tick += 1
                self.model.recency[k] = self.model.tick

    @rule(pick=st.integers(0, 1000), index=st.integers(0, 3))
    def land(self, pick: int, index: int) -> None:
        k = self._present(pick)
        if k is None or k in self.model.quarantined:
            return
        slot = self.table.get(k)
        assert slot is not None
        index %= slot.num_chunks
        before = self.table.landed(slot)
        assert self.table.mark_landed(slot, index) == (not before >> index & 1)

    @rule(pick=st.integers(0, 1000), ttl=st.sampled_from([None, 1.0, 5.0]))
    def pin(self, pick: int, ttl: float | None) -> None:
        k = self._present(pick)
        if k is None:
            return
        slot = self.table._slots[k]
        if k in self.model.quarantined:
            with pytest.raises(Miss):
                self.table.pin(slot, ttl)
            return
        self.model.leases.append(self.table.pin(slot, ttl))

    @precondition(lambda self: self.model.leases)
    @rule(pick=st.integers(0, 1000))
    def release(self, pick: int) -> None:
        lease = self.model.leases[pick % len(self.model.leases)]
        lease.release()  # maybe a second time: idempotent
        if pick % 3 == 0:
            self.model.leases.remove(lease)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def expire(self, dt: float) -> None:
        self.clock.now += dt
        expected = [
            lease
            for lease in self.model.leases + self.object_leases
            if not lease.released
            and lease.expires_at is not None
            and lease.expires_at <= self.clock.now
        ]
        got = self.table.expire_leases() + self.store.expire_leases()
        assert sorted(map(id, got)) == sorted(map(id, expected))
        assert all(lease.released for lease in got)

    @rule(pick=st.integers(0, 1000))
    def quarantine(self, pick: int) -> None:
        k = self._present(pick)
        if k is None:
            return
        slot = self.table._slots[k]
        if k in self.model.quarantined:
            self.table.unquarantine(slot)
            self.model.quarantined.discard(k)
        else:
            self.table.quarantine(slot)
            self.model.quarantined.add(k)

    @rule(pick=st.integers(0, 1000))
    def evict(self, pick: int) -> None:
        k = self._present(pick)
        if k is None:
            return
        allowed = k not in self.model.quarantined and not self.model.pins(k)
        assert self.table.evict(k) == allowed
        if allowed:
            self.model.forget(k)

    @rule(ns=st.sampled_from([NS, OTHER_NS]))
    def drop_namespace(self, ns: bytes) -> None:
        expected = {
            k
            for k in self.model.geometry
            if k[0] == ns and k not in self.model.quarantined and not self.model.pins(k)
        }
        assert set(self.table.drop_namespace(ns)) == expected
        for k in expected:
            self.model.forget(k)

    @rule(
        name=st.sampled_from(["a", "b", "c", "d"]),
        nbytes=st.integers(0, 6 * KiB),
        commit=st.booleans(),
    )
    def put_object(self, name: str, nbytes: int, commit: bool) -> None:
        try:
            write = self.store.put(name, nbytes)
        except CapacityError:
            self.model.check_lru_victims(self.table.take_evictions(), None)
            return
        self.model.check_lru_victims(self.table.take_evictions(), None)
        tag = self._tag()
        write.view.fill_(tag)
        if commit:
            write.commit()
            self.objects[name] = (nbytes, tag)
        else:
            self.pending.append((write, tag))

    @precondition(lambda self: self.pending)
    @rule(commit=st.booleans())
    def finish_pending(self, commit: bool) -> None:
        write, tag = self.pending.pop(0)
        if commit:
            write.commit()
            self.objects[write.key] = (write.view.numel(), tag)
        else:
            write.abort()

    @rule(name=st.sampled_from(["a", "b", "c", "d"]), ttl=st.sampled_from([None, 1.0]))
    def pin_object(self, name: str, ttl: float | None) -> None:
        lease = self.store.pin(name, ttl)
        assert (lease is None) == (name not in self.objects)
        if lease is not None:
            self.object_leases.append(lease)

    @precondition(lambda self: self.object_leases)
    @rule()
    def release_object(self) -> None:
        self.object_leases.pop(0).release()

    @rule(name=st.sampled_from(["a", "b", "c", "d"]))
    def remove_object(self, name: str) -> None:
        assert self.store.remove(name) == (self.objects.pop(name, None) is not None)

    @invariant()
    def consistent(self) -> None:
        self.table.validate()
        self.store.validate()
        stats = self.table.stats()
        assert stats.used_bytes + stats.free_bytes == stats.capacity_bytes
        assert stats.slots == len(self.model.geometry)
        assert set(self.table._slots) == set(self.model.geometry)
        for k, tag in self.model.tag.items():
            slot = self.table._slots[k]
            assert slot.pins == self.model.pins(k)
            assert slot.quarantined == (k in self.model.quarantined)
            view = self.arena.view(slot.offset, slot.num_chunks * slot.chunk_bytes)
            assert bool((view == tag).all()), "a live slot's bytes were overwritten"
        for name, (nbytes, tag) in self.objects.items():
            got = self.store.get(name)
            assert got is not None and got.numel() == nbytes and bool((got == tag).all())
        for write, tag in self.pending:
            assert bool((write.view == tag).all()), "a pending object was overwritten"

    def teardown(self) -> None:
        for lease in self.model.leases + self.object_leases:
            lease.release()
        for write, _ in self.pending:
            write.abort()
        for slot in self.table.quarantined():
            self.table.unquarantine(slot)
        while self.table.evict_lru() is not None:
            pass
        for name in list(self.objects):
            self.store.remove(name)
        assert len(self.table) == 0 and len(self.store) == 0
        self.table.validate()
        self.store.validate()
        stats = self.arena.stats()
        assert stats.free_page_bytes == stats.free_bytes == stats.capacity_bytes, "leak"


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_a_slot_allocated_cold_is_the_next_victim_until_touched() -> None:
    """A block staged up for one read (``cold=True``) goes before every warm slot, the
    newest cold one first; a touch makes it warm like any other."""
    table, _ = small_table(16 * KiB)  # four 4 KiB slots
    warm = [table.allocate(key(i), 4096, 1024, 4).slot for i in range(2)]
    cold = [table.allocate(key(10 + i), 4096, 1024, 4, cold=True).slot for i in range(2)]
    table.validate()
    assert table.allocate(key(20), 4096, 1024, 4).evicted == [cold[1].key]
    table.touch([cold[0].key])  # read again: warm now, and the most recently used
    table.validate()
    assert table.allocate(key(21), 4096, 1024, 4).evicted == [warm[0].key]
    assert table.get(cold[0].key) is cold[0]

"""The disk tier: its segment store on a real file system (records written, read back
verified, adopted again by a new store on the same directory, torn tails dropped, a disk of
another node or pool refused), and a node with a host memory far smaller than what it is
given, in this process against a real master and in real processes killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import struct
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import lz4.block
import pytest
import torch

import kvclient
from kvclient.ucx import nixl_available
from kvstore.control.client import MasterClient
from kvstore.core.codec import ChunkKey, encode_chunk
from kvstore.core.kvgen import realistic_kv
from kvstore.core.slots import SlotKey
from kvstore.dataplane import NodeClient
from kvstore.dataplane.location import tier_of
from kvstore.errors import ChecksumError, InvalidArgument
from kvstore.master import MasterConfig, MasterServer
from kvstore.node.disk import ALIGN, READ_PIECE, DiskStore, Record
from kvstore.node.disk_lz4 import LEARN_BYTES, LZ4, RELEARN, Lz4Policy, unpack_chunks
from kvstore.node.disk_tier import DiskTier
from kvstore.node.server import NodeConfig, StorageNode
from kvstore.transport import connect
from tests.cluster import start_server
from tests.test_node import NS, TIMEOUT, Rig, blocks, chunks, get, put, running

# ---- the store ------------------------------------------------------------------------------


def _images(n: int, size: int = 5000, per: int = 3) -> list[tuple[Record, list[bytes]]]:
    """``n`` slots of ``per`` random chunks of ``size`` bytes, with and without parents and
    owners, and their chunks."""
    out = []
    for i, key in enumerate(blocks(n)):
        payloads = [os.urandom(size) for _ in range(per)]
        parent = None if i == 0 else b"p" * 16
        owner = "tenant-a" if i % 2 else ""
        img = Record.of((b"n" * 16, key), parent, owner, size * per + 64, size, per, 2**per - 1)
        out.append((img, payloads))
    return out


def _write(store: DiskStore, items: list[tuple[Record, list[bytes]]]) -> list[Record]:
    """Write ``items`` batch after batch, as the tier's writer does; the records indexed."""
    todo = list(items)
    written: list[Record] = []
    while todo:
        plan, _ = store.plan_batch([img for img, _ in todo])
        assert plan is not None
        n = len(plan.records)
        store.write_batch(plan, [[memoryview(p) for p in payloads] for _, payloads in todo[:n]])
        store.commit(plan)
        written += plan.records
        todo = todo[n:]
    return written


def _payload(store: DiskStore, key: SlotKey) -> bytes:
    rec = store.get(key)
    assert rec is not None
    view = store.read(rec)
    try:
        return bytes(view)
    finally:
        store.give_back(view)


def test_records_read_back_verified_and_are_adopted_by_the_next_store(tmp_path: Path) -> None:
    store = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1", segment_bytes=64 * 2**10)
    items = _images(40)
    _write(store, items)
    assert store.segments > 1  # 40 records of ~16 KiB over 64 KiB segments
    for img, payloads in items:
        assert _payload(store, img.key) == b"".join(payloads)
    store.close()
    again = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1", segment_bytes=64 * 2**10)
    assert len(again) == 40 and again.dropped_tail_bytes == 0
    for img, payloads in items:
        rec = again.get(img.key)
        assert rec is not None
        assert (rec.parent, rec.owner, rec.mask, rec.num_chunks) == (
            img.parent,
            img.owner,
            img.mask,
            img.num_chunks,
        )
        assert _payload(again, img.key) == b"".join(payloads)
    again.close()


def test_a_disk_larger_than_its_new_size_is_refused_not_emptied(tmp_path: Path) -> None:
    """Reopened with a smaller size than it holds (a mistyped --disk-size), the disk is
    refused with the size it needs, and kept whole: it dropped its oldest segments, here
    every one of them, without a word."""
    store = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1", segment_bytes=64 * 2**10)
    items = _images(40)
    _write(store, items)
    held = store.used_bytes
    store.close()
    with pytest.raises(InvalidArgument, match=r"more than --disk-size 256KiB: start the node "
                       r"with --disk-size 1MiB or more"):  # fmt: skip
        DiskStore.open(tmp_path, 256 * 2**10, node_id="n1", segment_bytes=64 * 2**10)
    again = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1", segment_bytes=64 * 2**10)
    assert len(again) == 40 and again.used_bytes == held
    again.close()


def test_a_torn_tail_is_dropped_and_what_came_before_it_is_kept(tmp_path: Path) -> None:
    store = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1")
    items = _images(6)
    records = _write(store, items)
    store.close()
    last = records[-1]
    seg = tmp_path / f"seg-{last.segment:08d}.kvd"
    # The crash came mid-way through the last record's payload.
    os.truncate(seg, last.offset + last.span - ALIGN)
    with open(seg, "ab") as f:
        f.write(b"\x00" * ALIGN)  # (the file's length is no proof of anything)
    again = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1")
    assert len(again) == 5 and last.key not in again
    assert again.dropped_tail_bytes == last.span
    for img, payloads in items[:5]:
        assert _payload(again, img.key) == b"".join(payloads)
    # Appends go on after the last intact record.
    _write(again, items[5:])
    again.close()
    third = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1")
    assert len(third) == 6 and third.dropped_tail_bytes == 0
    third.close()


def test_a_flipped_payload_byte_is_never_served(tmp_path: Path) -> None:
    store = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1", segment_bytes=32 * 2**10)
    items = _images(8)
    records = _write(store, items)
    store.close()
    first = records[0]  # in the oldest segment: adopted on its header, checked on its read
    seg = tmp_path / f"seg-{first.segment:08d}.kvd"
    with open(seg, "r+b") as f:
        f.seek(first.offset + first.payload_at + 1234)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    again = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1", segment_bytes=32 * 2**10)
    rec = again.get(first.key)
    assert rec is not None
    with pytest.raises(ChecksumError):
        again.read(rec)
    assert _payload(again, records[1].key) == b"".join(items[1][1])
    again.close()


def test_the_oldest_segments_make_room_and_dead_records_stay_dead(tmp_path: Path) -> None:
    store = DiskStore.open(tmp_path, 256 * 2**10, node_id="n1", segment_bytes=64 * 2**10)
    items = _images(40)  # ~640 KiB of records into 256 KiB
    dropped: list[Record] = []
    for img, payloads in items:
        plan, gone = store.plan_batch([img])
        assert plan is not None
        dropped += gone
        store.write_batch(plan, [[memoryview(p) for p in payloads]])
        store.commit(plan)
    assert store.used_bytes <= 256 * 2**10
    kept = [img.key for img, _ in items if img.key in store]
    assert kept == [img.key for img, _ in items][-len(kept) :]  # the newest are kept
    assert {r.key for r in dropped} == {img.key for img, _ in items} - set(kept)
    victim = store.forget(kept[-1])
    assert victim is not None
    store.kill(victim)
    store.close()
    again = DiskStore.open(tmp_path, 256 * 2**10, node_id="n1", segment_bytes=64 * 2**10)
    assert set(again) == set(kept[:-1])
    again.close()


def test_a_record_larger_than_a_read_piece_is_read_in_pieces_and_checked_whole(
    tmp_path: Path,
) -> None:
    """Records of 9 MiB are read in two pieces at once: they read back whole,
    and a flipped byte in any piece, or a record cut short, is never served."""
    store = DiskStore.open(tmp_path, 64 * 2**20, node_id="n1")
    items = _images(2, size=3 * 2**20, per=3)
    records = _write(store, items)
    assert records[0].span > 2 * READ_PIECE
    for img, payloads in items:
        assert _payload(store, img.key) == b"".join(payloads)
    first, second = records
    seg = tmp_path / f"seg-{first.segment:08d}.kvd"
    with open(seg, "r+b") as f:  # a byte of the first record's last piece
        f.seek(first.offset + first.span - READ_PIECE // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ChecksumError, match="checksum"):
        store.read(first)
    os.truncate(seg, second.offset + second.span - 2 * ALIGN)  # the last piece cut short
    with pytest.raises(ChecksumError, match="short read"):
        store.read(second)
    store.close()


def _kv_images(quant: str, n: int, first: int = 0) -> list[tuple[Record, list[bytes]]]:
    """``n`` slots of 3 realistic chunks (64 tokens, 8 heads of 64, bfloat16) coded with
    ``quant``, to be packed."""
    out = []
    for i, key in enumerate(blocks(first + n)[first:]):
        payloads = [
            bytes(encode_chunk(realistic_kv(64, 8, 64, torch.bfloat16, seed=first + i * 3 + j),
                               quant, ChunkKey(key, j, 0)).numpy())
            for j in range(3)
        ]  # fmt: skip
        size = len(payloads[0])
        img = Record.of((b"n" * 16, key), None, "", 3 * size, size, 3, 0b111, packed=True)
        out.append((img, payloads))
    return out


def test_packed_records_read_back_exact_take_less_room_and_are_adopted(tmp_path: Path) -> None:
    """Raw bfloat16 chunks are packed (byte planes + lz4) and take less room; INT8 chunks,
    which lz4 cannot shrink, are stored as they are though packing was asked; what packing
    saved is the next record's room; a new store reads both back byte for byte."""
    store = DiskStore.open(tmp_path, 64 * 2**20, node_id="n1")  # (one segment)
    raw, int8 = _kv_images("none", 6), _kv_images("int8", 4, first=6)
    records = _write(store, raw + int8)
    assert all(r.packed and r.payload_bytes < 0.95 * r.raw_bytes for r in records[:6])
    assert not any(r.packed or r.payload_bytes != r.raw_bytes for r in records[6:])
    assert store.used_bytes == sum(r.span for r in records)  # nothing left between records
    assert [r.offset for r in records[1:]] == [r.offset + r.span for r in records[:-1]]
    for img, payloads in raw + int8:
        assert _payload(store, img.key) == b"".join(payloads)
    store.close()
    again = DiskStore.open(tmp_path, 64 * 2**20, node_id="n1")
    assert len(again) == 10 and again.dropped_tail_bytes == 0
    assert [again.index[r.key].packed for r in records] == [True] * 6 + [False] * 4
    for img, payloads in raw + int8:
        assert _payload(again, img.key) == b"".join(payloads)
    again.close()


def test_a_flipped_byte_of_a_packed_record_is_never_served(tmp_path: Path) -> None:
    store = DiskStore.open(tmp_path, 8 * 2**20, node_id="n1")
    (rec,) = _write(store, _kv_images("none", 1))
    assert rec.packed
    with open(tmp_path / f"seg-{rec.segment:08d}.kvd", "r+b") as f:
        f.seek(rec.offset + rec.payload_at + rec.payload_bytes // 2)  # inside an lz4 stream
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ChecksumError):
        store.read(rec)
    store.close()
    again = DiskStore.open(tmp_path, 8 * 2**20, node_id="n1")
    assert again.dropped_tail_bytes == rec.span  # (the newest segment is checked whole)
    assert rec.key not in again
    again.close()


def test_lz4_auto_packs_where_the_disk_reads_slower_than_packing_gains() -> None:
    # A disk as fast as unpacking: no ratio would pay, nothing is tried.
    assert not Lz4Policy("auto", disk_gbps=2.0, decompress_gbps=2.0).wants(b"a" * 16)
    assert not Lz4Policy("auto").wants(b"a" * 16)  # unmeasured: nothing
    assert Lz4Policy("lz4").wants(b"a" * 16) and not Lz4Policy("off").wants(b"a" * 16)
    slow = Lz4Policy("auto", disk_gbps=0.2, decompress_gbps=2.0)
    assert slow.ratio_needed() == pytest.approx(1 / 0.9)
    int8, bf16 = b"8" * 16, b"b" * 16
    step = 2**20
    for _ in range(LEARN_BYTES // step):
        assert slow.wants(int8) and slow.wants(bf16)  # learning
        slow.learn(int8, step, step)  # INT8: stored as it is
        slow.learn(bf16, step, int(step / 1.16))
    asked = [slow.wants(int8) for _ in range(4 * RELEARN)]
    assert asked.count(True) == 4  # one in RELEARN, to notice a change
    assert all(slow.wants(bf16) for _ in range(100))
    # The same ratio on a faster disk does not pay: needs more than 1.25.
    fast = Lz4Policy("auto", disk_gbps=0.4, decompress_gbps=2.0)
    for _ in range(LEARN_BYTES // step):
        fast.learn(bf16, step, int(step / 1.16))
    assert fast.ratio_needed() == pytest.approx(1.25)
    assert [fast.wants(bf16) for _ in range(RELEARN)].count(True) == 1


def test_a_disk_of_another_node_or_pool_or_holding_strangers_is_refused(tmp_path: Path) -> None:
    DiskStore.open(tmp_path / "a", 2**20, node_id="n1", secret="s1").close()
    with pytest.raises(InvalidArgument, match="belongs to node 'n1'"):
        DiskStore.open(tmp_path / "a", 2**20, node_id="n2", secret="s1")
    with pytest.raises(InvalidArgument, match=r"another cluster secret \(a cluster secret; "
                       "this node has a different one"):  # fmt: skip
        DiskStore.open(tmp_path / "a", 2**20, node_id="n1", secret="s2")
    with pytest.raises(InvalidArgument, match="this node has none"):  # (it said "a different")
        DiskStore.open(tmp_path / "a", 2**20, node_id="n1")
    assert DiskStore.owner_of(tmp_path / "a") == "n1"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgument, match=r"notes\.txt"):
        DiskStore.open(tmp_path / "b", 2**20, node_id="n1")
    assert "s1" not in (tmp_path / "a" / "kvstore-disk.json").read_text()


def test_a_failed_write_gives_its_room_back(tmp_path: Path) -> None:
    store = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1")
    items = _images(3)
    _write(store, items[:1])
    plan, _ = store.plan_batch([items[1][0]])
    assert plan is not None
    store.abandon(plan)  # (what the tier does when write_batch raised)
    _write(store, items[2:])
    store.close()
    again = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1")
    assert set(again) == {items[0][0].key, items[2][0].key}
    again.close()


# ---- a node with a disk tier, in this process -------------------------------------------------

SLOT_ROWS = 2  # NS has two layers


async def _put_all(rig: Rig, keys: list[bytes]) -> dict[tuple[bytes, int], torch.Tensor]:
    """Both layers of ``keys``, 4 blocks a put, the disk tier's writer caught up after each
    (so nothing leaves host memory unwritten); what was put, by (block, layer)."""
    sent: dict[tuple[bytes, int], torch.Tensor] = {}
    conn = await connect(rig.node.data_uri, timeout=TIMEOUT)
    try:
        for i in range(0, len(keys), 4):
            part = keys[i : i + 4]
            for layer in range(SLOT_ROWS):
                rows = chunks(part, layer)
                ack = await put(conn, rig.node, part, rows, layer=layer)
                assert (ack.stored, ack.failed) == (len(part), ())
                sent.update({(k, layer): rows[j] for j, k in enumerate(part)})
            if rig.node.disk is not None:  # (False while writes are paused by a fault)
                await rig.node.disk.flush(TIMEOUT)
    finally:
        await conn.close()
    return sent


async def _tiers(rig: Rig, keys: list[bytes]) -> list[str]:
    """The tier the index says holds each block (its one holder)."""
    found = await MasterClient.in_process(rig.master.service).lookup(NS.id, keys, 2)
    return [tier_of(holders[0].location) if holders else "" for holders in found]


async def _read_all(rig: Rig, keys: list[bytes]) -> dict[tuple[bytes, int], torch.Tensor]:
    got: dict[tuple[bytes, int], torch.Tensor] = {}
    conn = await connect(rig.node.data_uri, timeout=TIMEOUT)
    try:
        for i in range(0, len(keys), 8):
            part = keys[i : i + 8]
            for layer in range(SLOT_ROWS):
                found, bufs = await get(conn, part, layer)
                kept = [k for k, f in zip(part, found, strict=True) if f]
                got.update({(k, layer): b for k, b in zip(kept, bufs, strict=True)})
    finally:
        await conn.close()
    return got


@asynccontextmanager
async def disk_node(
    disk: Path, disk_size: int = 64 * 2**20, **more: Any
) -> AsyncIterator[tuple[Rig, DiskTier]]:
    """:func:`tests.test_node.running` over ``tcp://``: a node of 4 MiB of host memory with
    a disk tier of ``disk_size`` bytes at ``disk`` (``more``: NodeConfig fields), and that
    tier."""
    options = {"host_mem": 4 * 2**20, "disk_path": str(disk), "disk_size": disk_size, **more}
    async with running("tcp", **options) as rig:
        assert rig.node.disk is not None
        yield rig, rig.node.disk


async def test_a_node_holds_and_serves_many_times_its_memory_from_disk(tmp_path: Path) -> None:
    """4 MiB of host memory, 60 blocks of 256 KiB: every block is read back byte for byte,
    most of them from disk, and the master's index holds every one of them."""
    async with disk_node(tmp_path / "disk") as (rig, disk_tier):
        keys = blocks(60)
        sent: dict[tuple[bytes, int], torch.Tensor] = {}
        for i in range(0, 60, 8):  # give the writer time to keep up (it is behind the puts)
            sent |= await _put_all(rig, keys[i : i + 8])
            assert await disk_tier.flush(TIMEOUT)
        assert await rig.holders(keys) == [2] * 60
        await rig.node.link.commit([])  # (what the writer learnt reaches the index)
        tiers = await _tiers(rig, keys)
        assert set(tiers) == {"disk", "host+disk"} and tiers.count("host+disk") >= 4
        assert all((tier == "disk") == (rig.node.tiers.lookup((NS.id, k)) is None)
                   for k, tier in zip(keys, tiers, strict=True))  # fmt: skip
        stats = await NodeClient(rig.node.data_uri, timeout_s=TIMEOUT).stats()
        (disk_stats,) = [t for t in stats["tiers"] if t["name"] == "disk"]
        assert disk_stats["slots"] == 60 and disk_stats["unwritten_evictions"] == 0
        got = await _read_all(rig, keys)
        assert set(got) == set(sent)
        assert all(torch.equal(got[k], sent[k]) for k in sent)
        assert disk_tier.counters["read"] >= 50
        # A scan of disk blocks read once displaces nothing warm: staged cold, they are the
        # next victims, and a second read stages warm.
        assert disk_tier.counters["staged_cold"] >= 50
        warm = disk_tier.counters["staged_warm"]
        await _read_all(rig, keys[:2])
        assert disk_tier.counters["staged_warm"] > warm
        # A block staged warm is in host memory and still on disk: the index says both
        # (it said "host", which tells an operator a restart would lose it).
        await rig.node.link.commit([])
        staged = [k for k in keys[:2] if rig.node.tiers.lookup((NS.id, k)) is not None]
        assert staged and set(await _tiers(rig, staged)) == {"host+disk"}


async def test_a_block_in_use_keeps_a_disk_copy_when_its_segment_goes(tmp_path: Path) -> None:
    """A block read again and again stays in host memory while the disk drops the
    segment it was written to: it is written again, so when host memory lets it go at
    last it stays on the node, on disk."""
    async with disk_node(tmp_path / "disk", 8 * 2**20) as (rig, tier):
        hot = blocks(1)
        sent = await _put_all(rig, hot)
        for _ in range(10):  # 10 MiB through an 8 MiB disk, the hot block read each time
            await _put_all(rig, blocks(4))
            assert await tier.flush(TIMEOUT)
            assert (await _read_all(rig, hot)).keys() == sent.keys()
        assert tier.counters["written"] > 41  # the hot block was written again
        for _ in range(4):  # host memory lets the hot block go (4 MiB: the disk keeps it)
            await _put_all(rig, blocks(4))
            assert await tier.flush(TIMEOUT)
        assert rig.node.tiers.lookup((NS.id, hot[0])) is None
        got = await _read_all(rig, hot)
        assert got.keys() == sent.keys() and all(torch.equal(got[k], sent[k]) for k in sent)
        assert tier.counters["unwritten_evictions"] == 0


async def test_reads_of_one_block_at_once_read_it_from_disk_once(tmp_path: Path) -> None:
    """An engine reads a prompt's layers in several calls at once: each block only on
    disk is read up once, and those reads are one use (it stays cold: the next victim)."""
    async with disk_node(tmp_path / "disk") as (rig, tier):
        keys = blocks(24)
        sent = await _put_all(rig, keys)
        part = [k for k in keys if rig.node.tiers.lookup((NS.id, k)) is None][:6]
        assert len(part) == 6
        before = tier.counters["read"]
        conns = [await connect(rig.node.data_uri, timeout=TIMEOUT) for _ in range(2)]
        try:
            got = await asyncio.gather(*(get(c, part, layer) for layer, c in enumerate(conns)))
        finally:
            for c in conns:
                await c.close()
        for layer, (found, bufs) in enumerate(got):
            assert found == [1] * 6
            assert all(torch.equal(b, sent[(k, layer)]) for k, b in zip(part, bufs, strict=True))
        assert tier.counters["read"] - before == 6
        host = rig.node.tiers.host.table
        assert all(host.get((NS.id, k)).stamp < 0 for k in part)  # type: ignore[union-attr]


async def test_a_put_of_a_block_held_on_disk_is_answered_stored(tmp_path: Path) -> None:
    """The first writer wins on disk as in memory: a block only on disk is not sent
    again (nor read up for it), and reads keep getting the bytes first stored."""
    async with disk_node(tmp_path / "disk") as (rig, tier):
        keys = blocks(24)
        sent = await _put_all(rig, keys)
        part = [k for k in keys if rig.node.tiers.lookup((NS.id, k)) is None][:4]
        reads = tier.counters["read"]
        conn = await connect(rig.node.data_uri, timeout=TIMEOUT)
        try:
            ack = await put(conn, rig.node, part, chunks(part, 1), layer=1)  # other bytes
        finally:
            await conn.close()
        assert (ack.stored, ack.skipped, ack.failed) == (0, 4, ())  # (as for a block in memory)
        assert tier.counters["read"] == reads
        assert all(rig.node.tiers.lookup((NS.id, k)) is None for k in part)
        got = await _read_all(rig, part)
        assert all(torch.equal(got[k, 1], sent[k, 1]) for k in part)


@pytest.mark.parametrize("compress", ["off", "lz4"])
async def test_a_node_restarted_on_its_disk_serves_what_it_wrote(
    tmp_path: Path, compress: str
) -> None:
    """Also with every block packed (lz4): the bytes read back are the bytes put."""
    async with disk_node(tmp_path / "disk", disk_compress=compress) as (rig, tier):
        keys = blocks(24)
        sent = await _put_all(rig, keys)
        assert await tier.flush(TIMEOUT)
        first_id = rig.node.node_id
        lz4 = tier.stats()["lz4"]
        if compress == "lz4":  # bfloat16 randn: its byte planes compress
            assert lz4["raw_bytes"] == 24 * 2 * chunks(keys[:1]).shape[1]
            assert 0 < lz4["stored_bytes"] < lz4["raw_bytes"]
            assert tier.store.live_bytes < lz4["raw_bytes"]
            assert all(tier.store.index[NS.id, k].packed for k in keys)
        else:
            assert lz4["raw_bytes"] == 0
            assert not any(tier.store.index[NS.id, k].packed for k in keys)
        got = await _read_all(rig, keys)  # (partly from disk: 6 MiB in 4 MiB of memory)
        assert set(got) == set(sent) and all(torch.equal(got[k], sent[k]) for k in sent)
    async with disk_node(tmp_path / "disk") as (rig, _):  # a new master: an empty index
        assert rig.node.node_id == first_id  # the id the disk was written by
        assert await rig.holders(keys) == [2] * 24
        assert await _tiers(rig, keys) == ["disk"] * 24
        got = await _read_all(rig, keys)
        assert set(got) == set(sent) and all(torch.equal(got[k], sent[k]) for k in sent)


async def test_an_operator_eviction_removes_the_disk_copy_for_good(tmp_path: Path) -> None:
    async with disk_node(tmp_path / "disk") as (rig, tier):
        keys = blocks(16)
        await _put_all(rig, keys)
        assert await tier.flush(TIMEOUT)
        gone = await NodeClient(rig.node.data_uri, timeout_s=TIMEOUT).evict(NS.id, keys[:10])
        assert gone.evicted == 10
        assert await rig.holders(keys) == [0] * 10 + [2] * 6
        await asyncio.to_thread(tier._writer.submit(lambda: None).result, TIMEOUT)
    async with disk_node(tmp_path / "disk") as (rig, _):
        assert await rig.holders(keys) == [0] * 10 + [2] * 6


# ---- real processes, SIGKILL; ucx:// ----------------------------------------------------------

KV_NS = kvclient.Namespace(model="disk-test", revision="1", num_layers=4, num_kv_heads=4,
                           head_dim=64, dtype=torch.bfloat16, block_tokens=64,
                           quant="int8")  # fmt: skip


def _node(master: str, disk: Path, *extra: str) -> list[str]:
    return ["node", "--master", master, "--data-port", "0", "--metrics-port", "0",
            "--host-mem", "4MiB", "--disk-path", str(disk), "--disk-size", "256MiB",
            *extra]  # fmt: skip


async def test_blocks_on_disk_survive_a_sigkill_of_their_node(tmp_path: Path) -> None:
    """A node process holding 40 prompts' blocks, most on disk, is killed with SIGKILL;
    restarted on the same disk it re-registers them and every one reads back the same."""
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--node-lease-s", "2")  # fmt: skip
    node = start_server(*_node(master.grpc, tmp_path / "disk"))
    try:
        async with await kvclient.KVClient.connect(master.grpc, KV_NS, timeout_s=TIMEOUT) as c:
            prompts, _ = await _put_prompts(c, node.data)
            before = [await c.get_layer(t, 0) for t in prompts]
            assert all(b.shape[1] == 256 for b in before)
        node.proc.send_signal(signal.SIGKILL)
        node.kill()
        node = start_server(*_node(master.grpc, tmp_path / "disk"), timeout=90)
        async with await kvclient.KVClient.connect(master.grpc, KV_NS, timeout_s=TIMEOUT) as c:
            for p, tokens in enumerate(prompts):
                assert await c.match_prefix(tokens) == 256
                for layer in (0, 3):
                    after = await c.get_layer(tokens, layer)
                    assert after.shape[1] == 256
                    if layer == 0:
                        assert torch.equal(after, before[p])
    finally:
        node.stop()
        master.stop()


@asynccontextmanager
async def _one_master() -> AsyncIterator[tuple[MasterServer, MasterClient, list[StorageNode]]]:
    """A master in this process, its in-process client, and a list for the test's nodes:
    each stopped, then the master, however the test ends."""
    master = MasterServer(MasterConfig(grpc_port=0))
    await master.start()
    nodes: list[StorageNode] = []
    try:
        yield master, MasterClient.in_process(master.service), nodes
    finally:
        for node in nodes:
            await node.stop(grace=1.0)
        await master.stop(grace=0.5)


async def test_a_drain_copies_the_blocks_held_only_on_disk(tmp_path: Path) -> None:
    """A node restarted on its disk (its namespaces read back from it, none put since)
    drains: every block, nearly all of them on disk only, is copied to the other node."""
    async with _one_master() as (master, in_process, nodes):
        base = NodeConfig(master=master.address, data_port=0, host_mem=4 * 2**20, sweep_s=0.1,
                          disk_path=str(tmp_path / "disk"), disk_size=64 * 2**20)  # fmt: skip
        first = StorageNode(base, master=in_process)
        await first.start()
        keys = blocks(24)
        sent = await _put_all(Rig(master, first), keys)
        assert first.disk is not None and await first.disk.flush(TIMEOUT)
        await first.stop(grace=1.0)
        nodes.append(again := StorageNode(base, master=in_process))
        nodes.append(other := StorageNode(replace(base, host_mem=32 * 2**20, disk_path="",
                                                  disk_size=0), master=in_process))  # fmt: skip
        for node in nodes:
            await node.start()
        assert again.disk is not None and len(again.disk.store) == 24
        done = await again.drain_and_wait(30.0)
        assert done["drain_state"] == "done" and done["drain_left"] == 0, done
        assert done["drain_moved_chunks"] == 48 and done["drain_failed"] == 0, done
        got = await _read_all(Rig(master, other), keys)
        assert set(got) == set(sent) and all(torch.equal(got[k], sent[k]) for k in sent)
    for node in nodes:
        assert node.pinned_slots == 0


async def test_a_drain_puts_its_copies_where_there_is_room_not_over_anothers_blocks(
    tmp_path: Path,
) -> None:
    """Found by trying the product: a drain weighed targets by free memory, so a node
    restarted on a full disk (its memory empty, its blocks on disk only) took most copies,
    wrote them to its disk, and its own oldest blocks went, while a third node had room for
    all of them. Weighed by room (a disk node's free disk), the copies go to the node with
    room, and no block of the pool is lost; each block is copied once, and passes after
    done copy nothing."""
    async with _one_master() as (master, in_process, nodes):
        base = NodeConfig(master=master.address, data_port=0, host_mem=16 * 2**20,
                          sweep_s=0.1, disk_path=str(tmp_path / "full"),
                          disk_size=8 * 2**20)  # fmt: skip
        full = StorageNode(base, master=in_process)
        await full.start()
        theirs = blocks(28)  # ~7 of its 8 MiB of disk
        kept = await _put_all(Rig(master, full), theirs)
        assert full.disk is not None and await full.disk.flush(TIMEOUT)
        await full.stop(grace=1.0)
        nodes.append(full := StorageNode(base, master=in_process))  # (on disk only now)
        nodes.append(
            roomy := StorageNode(
                replace(
                    base,
                    host_mem=4 * 2**20,
                    disk_path=str(tmp_path / "roomy"),
                    disk_size=64 * 2**20,
                ),
                master=in_process,
            )
        )
        nodes.append(leaving := StorageNode(replace(base, disk_path="", disk_size=0),
                                            master=in_process))  # fmt: skip
        for node in nodes:
            await node.start()
        assert full.disk is not None and len(full.disk.store) == 28
        keys = blocks(24)
        sent = await _put_all(Rig(master, leaving), keys)
        done = await leaving.drain_and_wait(30.0)
        assert done["drain_state"] == "done" and done["drain_moved_chunks"] == 48, done
        for _ in range(3):  # (passes go on while the mark is set)
            await leaving.migration.one_pass()
        assert leaving.migration.counters()["drain_moved_chunks"] == 48
        for node in (full, roomy):
            assert node.disk is not None and await node.disk.flush(TIMEOUT)
        assert len(full.disk.store) == 28  # nothing of its own dropped for the copies
        got = await _read_all(Rig(master, full), theirs)
        assert set(got) == set(kept) and all(torch.equal(got[k], kept[k]) for k in kept)
        ours = await _read_all(Rig(master, roomy), keys)
        assert set(ours) == set(sent) and all(torch.equal(ours[k], sent[k]) for k in sent)


@pytest.mark.skipif(not nixl_available(), reason="nixl-cu12 not installed")
async def test_ucx_readers_of_disk_blocks_get_them_staged_and_leased(tmp_path: Path) -> None:
    """A ``ucx://`` node's blocks held only on disk: a reader's one-sided READ has no
    location to go to (the index says ``disk``), so it leases them; the node reads them
    up into registered host memory first. Every byte comes back as put."""
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--transport", "ucx", "--host-mem", "4MiB", "--disk-path",
                       str(tmp_path / "disk"), "--disk-size", "256MiB")  # fmt: skip
    try:
        async with await kvclient.KVClient.connect(srv.grpc, KV_NS, timeout_s=TIMEOUT) as c:
            prompts, _ = await _put_prompts(c, srv.data)
            before = [await c.get_layer(t, 1) for t in prompts]
            reads = (await _disk_stats(srv.data))["read"]
            for p, tokens in enumerate(prompts):
                assert torch.equal(await c.get_layer(tokens, 1), before[p])
            assert (await _disk_stats(srv.data))["read"] > reads + 50
        url = f"http://{srv.addresses['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        leased = re.search(
            r'^kvstore_transfer_bytes_total\{op="get",transport="ucx"\} (\S+)$', text, re.M
        )
        assert leased is not None and float(leased.group(1)) > 0  # (read one-sidedly)
    finally:
        srv.stop()


async def _disk_stats(data_uri: str) -> dict[str, Any]:
    stats = await NodeClient(data_uri, timeout_s=TIMEOUT).stats()
    (d,) = [t for t in stats["tiers"] if t["name"] == "disk"]
    return d


async def _put_prompts(
    c: kvclient.KVClient, data_uri: str, n: int = 40
) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """Put ``n`` prompts of 256 tokens, every layer, and wait until the node's disk tier
    wrote all their blocks; the prompts and their KV."""
    prompts = [[(p * 7919 + t) % 30000 for t in range(256)] for p in range(n)]
    kv = {p: torch.randn(4, 2, 256, 4, 64).bfloat16() for p in range(n)}
    for p, tokens in enumerate(prompts):
        for layer in range(4):
            assert await c.put_layer(tokens, layer, kv[p][layer]) == 256
        for _ in range(250):  # the writer is behind the puts: let it catch up (4 MiB of
            d = await _disk_stats(data_uri)  # host memory must not evict unwritten blocks)
            if d["queued"] == 0 and d["slots"] == 4 * (p + 1):
                break
            await asyncio.sleep(0.02)
        assert d["slots"] == 4 * (p + 1), d
    return prompts, kv


def test_a_format_1_disk_is_adopted_and_marked_2_and_an_unknown_format_refused(
    tmp_path: Path,
) -> None:
    """Format 2 may hold packed records: a disk of format 1 is read as it is and marked 2,
    so a binary knowing only format 1 refuses it rather than cut packed records off; a
    format this binary does not know is refused."""
    store = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1")
    items = _images(3)
    _write(store, items)
    store.close()
    ident = tmp_path / "kvstore-disk.json"
    meta = json.loads(ident.read_text())
    assert meta["format"] == 2
    ident.write_text(json.dumps(meta | {"format": 1}))
    again = DiskStore.open(tmp_path, 4 * 2**20, node_id="n1")
    assert len(again) == 3 and _payload(again, items[0][0].key) == b"".join(items[0][1])
    again.close()
    assert json.loads(ident.read_text())["format"] == 2
    ident.write_text(json.dumps(meta | {"format": 3}))
    with pytest.raises(InvalidArgument, match="format 1 or 2"):
        DiskStore.open(tmp_path, 4 * 2**20, node_id="n1")


def test_a_packed_chunk_that_unpacks_short_is_a_checksum_error() -> None:
    """lz4 returns a short block without a word when a stream ends early: the unpacking
    says so (the stored bytes' checksum passed, so only a writer's bug could make one)."""
    raw = os.urandom(4096)
    stream = lz4.block.compress(raw[:1000] * 2, store_size=False)  # 2,000 bytes, not 4,096
    table = struct.pack("<II", len(stream) | LZ4, 0)
    out = bytearray(4096)
    with pytest.raises(ChecksumError, match="unpacks to 2000 bytes"):
        unpack_chunks(memoryview(table + stream), memoryview(out), 1, 4096)

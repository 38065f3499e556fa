"""Whether lz4 pays on the pool's chunks, against this machine's disk: the measurement the
disk tier's compression decision rests on.

    python bench/lz4_chunks.py [--chunks 32] [--dir PATH] [--disk-mib 256] [--records 64]
                               [--plot lz4.png]

Encodes ``--chunks`` realistic chunks (``kvstore.core.kvgen``: outlier channels, rotary
structure; 256 tokens, 8 KV heads, head dim 128, bfloat16) per scheme (``int8``,
``int4``, ``none``) and compresses each whole chunk with lz4 (block API, fast levels:
acceleration 1 and 8, and the high-compression mode at level 3; for ``none``, also after
splitting the 16-bit values into byte planes, which puts bfloat16's sign and exponent
bytes together). Reports the ratio and
compress and decompress GB/s (of uncompressed bytes, one thread), and the disk bandwidth
below which compression makes a chunk's read faster: reading ``n`` bytes compressed costs
``n/(ratio*disk) + n/decompress``, which beats ``n/disk`` only while ``disk <
decompress*(1 - 1/ratio)``. Beside it, in the same run, this file system's own sequential
O_DIRECT write and read GB/s (4 MiB units, ``--disk-mib`` in all; buffered where O_DIRECT
is refused, as on tmpfs, which the table says).

Then such chunks through the disk tier's store (``kvstore.node.disk.DiskStore``, on
``--dir``, ``O_DIRECT`` where the store takes it): ``--records`` records of 4 raw
bfloat16 chunks (about 1 MiB each, each from a seed of its own), written batch after batch
as the node's writer writes them (then the segments fsynced), once plain and once packed
(byte planes + lz4, ``kvstore/node/disk_lz4.py``), each into a fresh store directory, then
every record read back with ``DiskStore.read`` on one thread and on the tier's 4 reader
threads (either way, the store reads a record of several times 4 MiB in pieces on threads
of its own, which the table says). Per side: stored bytes / raw bytes, write and read GB/s of
raw bytes and read CPU s/GB (``time.process_time``: every thread), each the best of 3
rounds, the sides alternating. Every record read back is compared (by xxh3_128) with what
was written; a mismatch fails the run. Beside it, what the tier's ``auto`` policy decides
on this machine (``Lz4Policy`` on ``DiskStore.measure_read`` and ``measure_decompress``,
measured as a node measures them when its tier opens) and its model of a packed read's
time against a plain one's, ``1/ratio + disk/unpack``, next to the measured quotients.
Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import lz4.block
import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BarPanel,
    BenchError,
    Table,
    best_of,
    expect,
    explain,
    open_direct,
    print_report,
    progress,
    save_bar_plot,
)

from kvstore.core.codec import ChunkKey, encode_chunk
from kvstore.core.kvgen import realistic_kv
from kvstore.node.disk import READ_PIECE, DiskStore, Record, read_pieces
from kvstore.node.disk_lz4 import LEARN_BYTES, PROBE_BYTES, Lz4Policy, measure_decompress
from kvstore.node.disk_tier import READ_THREADS

T, H, D = 256, 8, 128
LEVELS = (("fast, accel 1", {"mode": "fast", "acceleration": 1}),
          ("fast, accel 8", {"mode": "fast", "acceleration": 8}),
          ("high, level 3", {"mode": "high_compression", "compression": 3}))  # fmt: skip
UNIT = 4 << 20
PER_RECORD = 4
"""Chunks per record in the store section (one slot's record)."""
ROUNDS = 3
NS = bytes(16)
"""The store section's namespace id (every record's)."""


def byte_planes(buf: bytes, itemsize: int = 2) -> bytes:
    """``buf``'s ``itemsize``-byte values as byte planes: every value's byte 0, then byte 1."""
    return np.frombuffer(buf, np.uint8).reshape(-1, itemsize).T.tobytes()


def chunks(quant: str, n: int) -> list[bytes]:
    out = []
    for seed in range(n):
        kv = realistic_kv(T, H, D, torch.bfloat16, seed=seed)
        buf = encode_chunk(kv, quant, ChunkKey(bytes([seed % 256] * 16), seed % 32, 0))
        out.append(bytes(buf.numpy()))
    return out


def disk_gbps(directory: str, total: int) -> tuple[float, float, str]:
    """Sequential write and read GB/s of a file in ``directory``, O_DIRECT where taken."""
    path = os.path.join(directory, "kvstore-lz4-bench.tmp")
    buf = mmap.mmap(-1, UNIT)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(UNIT))
    fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    how = "O_DIRECT" if direct else "buffered (O_DIRECT refused)"
    try:
        t0 = time.perf_counter()
        for _ in range(total // UNIT):
            os.write(fd, buf)
        os.fsync(fd)
        write = total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) == UNIT:
            pass
        read = total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)
    return write, read, how


def block_hash(i: int) -> bytes:
    """Record ``i``'s block hash in the store section."""
    return (1 << 64 | i).to_bytes(16, "big")


def store_chunks(n: int) -> list[list[bytes]]:
    """``n`` records' chunks: :data:`PER_RECORD` raw (``none``) bfloat16 chunks each, each
    drawn from a seed of its own."""
    out = []
    for i in range(n):
        seeds = range(1000 + i * PER_RECORD, 1000 + (i + 1) * PER_RECORD)  # (not the above's)
        kvs = [realistic_kv(T, H, D, torch.bfloat16, seed=seed) for seed in seeds]
        out.append([bytes(encode_chunk(kv, "none", ChunkKey(block_hash(i), j, 0)).numpy())
                    for j, kv in enumerate(kvs)])  # fmt: skip
    return out


def digest(chunks: list[bytes]) -> tuple[int, int]:
    """What a record must read back as: its bytes' count and xxh3_128."""
    h = xxhash.xxh3_128()
    for c in chunks:
        h.update(c)
    return sum(len(c) for c in chunks), h.intdigest()


def read_digest(store: DiskStore, rec: Record) -> tuple[int, int]:
    """``rec`` read back as the tier reads it (:meth:`DiskStore.read`: header and stored
    payload checked, a packed one unpacked): the count and xxh3_128 of the bytes served."""
    view = store.read(rec)
    try:
        return len(view), xxhash.xxh3_128_intdigest(view)
    finally:
        store.give_back(view)


@dataclass
class Side:
    """One side of the store section (plain or packed records): the best of its rounds,
    each figure on its own."""

    packed: bool
    write_s: float = float("inf")
    read_s: dict[int, float] = field(default_factory=dict)
    """Seconds to read every record back, by reader threads."""
    read_cpu: dict[int, float] = field(default_factory=dict)
    """CPU seconds this process (every thread) spent meanwhile, by reader threads."""
    direct: bool = True
    payloads: list[tuple[int, int]] = field(default_factory=list)
    """Each record's raw bytes and payload bytes as stored (the last round's)."""
    on_disk: int = 0
    """Bytes of segments the records took (headers and alignment included)."""
    span: int = 0
    """The largest record's bytes on disk (what one read reads)."""
    packed_records: int = 0

    @property
    def name(self) -> str:
        return "packed" if self.packed else "plain"


def _fold(best: dict[int, float], threads: int, value: float) -> None:
    best[threads] = min(best.get(threads, float("inf")), value)


def store_round(where: str | None, side: Side, data: list[list[bytes]],
                sums: list[tuple[int, int]], pool: ThreadPoolExecutor) -> None:  # fmt: skip
    """Write ``data`` into a fresh store in ``where`` (its records plain or packed, as
    ``side`` says) batch after batch as the node's writer does, and fsync the segments
    (without ``O_DIRECT``, also ask the kernel to drop them from the page cache); then read
    every record back on one thread and on :data:`READ_THREADS`, each checked against
    ``sums``. Folds the figures into ``side``; :class:`BenchError` when a record reads back
    other bytes than were written."""
    size = len(data[0][0])
    raw = sum(n for n, _ in sums)
    with tempfile.TemporaryDirectory(dir=where, prefix="kvstore-lz4-store-") as d:
        store = DiskStore.open(d, 2 * raw + (64 << 20), node_id="n1")
        try:
            todo = [(Record.of((NS, block_hash(i)), None, "", PER_RECORD * size, size,
                               PER_RECORD, 2**PER_RECORD - 1, packed=side.packed), chunks)
                    for i, chunks in enumerate(data)]  # fmt: skip
            records: list[Record] = []
            t0 = time.perf_counter()
            while todo:
                plan, dropped = store.plan_batch([rec for rec, _ in todo])
                if plan is None or dropped:
                    raise BenchError("the store dropped records to make room: capacity too small")
                n = len(plan.records)
                store.write_batch(plan, [[memoryview(c) for c in chunks] for _, chunks in todo[:n]])
                store.commit(plan)
                records += plan.records
                todo = todo[n:]
            for seg in sorted(Path(d).glob("seg-*.kvd")):
                fd = os.open(seg, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    if not store.direct:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            side.write_s = min(side.write_s, time.perf_counter() - t0)
            expect(len(store) == len(data), f"{len(store)} of {len(data)} records indexed")
            side.direct = store.direct
            side.payloads = [(r.raw_bytes, r.payload_bytes) for r in records]
            side.on_disk = store.used_bytes
            side.span = max(r.span for r in records)
            side.packed_records = sum(r.packed for r in records)
            for threads in (1, READ_THREADS):
                c0, t0 = time.process_time(), time.perf_counter()
                if threads == 1:
                    got = [read_digest(store, rec) for rec in records]
                else:
                    got = list(pool.map(partial(read_digest, store), records))
                _fold(side.read_s, threads, time.perf_counter() - t0)
                _fold(side.read_cpu, threads, time.process_time() - c0)
                bad = [i for i, (g, w) in enumerate(zip(got, sums, strict=True)) if g != w]
                on = "one thread" if threads == 1 else f"{threads} threads"
                expect(not bad, f"{side.name} records {bad[:8]} read back other bytes than "
                                f"were written (read on {on})")  # fmt: skip
        finally:
            store.close()


def store_section(where: str | None, n: int, advance: Callable[[], object]) -> list[Table]:
    """The store section's tables: :func:`store_round` for both sides, :data:`ROUNDS` times
    alternating, then what the ``auto`` policy decides here and its model beside what the
    rounds measured. ``advance`` is called after each step (``2 * ROUNDS + 2`` steps)."""
    data = store_chunks(n)
    c0 = time.process_time()
    sums = [digest(chunks) for chunks in data]
    raw = sum(size for size, _ in sums)
    check_cpu = (time.process_time() - c0) / (raw / 1e9)
    advance()
    sides = (Side(packed=False), Side(packed=True))
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="bench-disk-read") as pool:
        list(pool.map(time.sleep, [0.05] * READ_THREADS))  # every reader thread started
        for _ in range(ROUNDS):
            for side in sides:
                store_round(where, side, data, sums, pool)
                advance()
    with tempfile.TemporaryDirectory(dir=where, prefix="kvstore-lz4-probe-") as d:
        probe = DiskStore.open(d, 256 << 20, node_id="n1")
        try:
            disk_read = probe.measure_read(PROBE_BYTES)  # as a node measures its disk
        finally:
            probe.close()
    policy = Lz4Policy("auto", disk_gbps=disk_read, decompress_gbps=measure_decompress())
    advance()
    plain, packed = sides
    for raw_bytes, stored in packed.payloads:  # as the tier learns from the blocks it packs
        policy.learn(NS, raw_bytes, stored)
    ratio = raw / sum(stored for _, stored in packed.payloads)
    needed = policy.ratio_needed()
    decides = policy.wants(NS)

    def gbps(seconds: float) -> str:
        return f"{raw / seconds / 1e9:.2f}"

    def cpu(seconds: float) -> str:
        return f"{seconds / (raw / 1e9):.3f}"

    many = READ_THREADS
    io = {True: "O_DIRECT", False: "buffered (O_DIRECT refused)"}
    table = Table(
        f"Through the disk tier's store ({n} records of {PER_RECORD} raw bfloat16 chunks, "
        f"{raw / 2**20:.0f} MiB per side; best of {ROUNDS} rounds)",
        [
            "records",
            "I/O",
            "records packed",
            "stored ÷ raw",
            "on disk ÷ raw",
            "write GB/s",
            "read GB/s, 1 thread",
            f"read GB/s, {many} threads",
            "read CPU s/GB, 1 thread",
            f"read CPU s/GB, {many} threads",
        ],
    )
    for side in sides:
        table.add(side.name, io[side.direct], f"{side.packed_records}/{n}",
                  f"{sum(s for _, s in side.payloads) / raw:.3f}", f"{side.on_disk / raw:.3f}",
                  gbps(side.write_s), gbps(side.read_s[1]), gbps(side.read_s[many]),
                  cpu(side.read_cpu[1]), cpu(side.read_cpu[many]))  # fmt: skip
    table.notes += [
        f"on {where or tempfile.gettempdir()}, each side and round in a fresh store directory, "
        "the sides alternating (plain, packed, plain, ...); every figure is its own best of "
        f"the {ROUNDS} rounds; GB/s and s/GB of raw (unpacked) bytes",
        "write: plan_batch, write_batch, commit of every record, batch after batch, on one "
        "thread (packing included), then an fsync of each segment",
        "read: DiskStore.read of every record (header and stored payload's xxh3_64 checked, "
        "packed ones unpacked) and give_back, on one thread or on a pool of "
        f"{many} threads; CPU: time.process_time of the whole process over the pass",
        "every record read back is compared, by xxh3_128, with what was written (a mismatch "
        f"fails the run); that hash costs {check_cpu:.3f} CPU s/GB here, included in the "
        "read figures",
        "stored ÷ raw: payload bytes as stored; on disk ÷ raw: the segments' bytes (headers, "
        "4 KiB alignment)",
        f"the store reads a record of several times {READ_PIECE >> 20} MiB in as many "
        "pieces at once, on threads of its own, whatever the caller's threads: here "
        + ", ".join(
            f"a {side.name} record is {side.span / 2**20:.2f} MiB on disk, "
            f"{len(read_pieces(side.span))} read"
            for side in sides
        ),
    ]
    if not all(side.direct for side in sides):
        table.notes.append(
            "O_DIRECT refused: the segments are fsynced and fadvise(DONTNEED)ed after writing, "
            "which drops them from the page cache on a disk file system but not on tmpfs; "
            "the reads may come from memory"
        )
    verdict = ("never packs: the disk reads faster than lz4 unpacks" if needed == float("inf")
               else f"{'packs' if decides else 'does not pack'} these chunks")  # fmt: skip
    if needed != float("inf") and raw < LEARN_BYTES:
        verdict += f" (still learning: under {LEARN_BYTES >> 20} MiB seen)"
    policy_table = Table(
        "What the tier's lz4 policy decides on this machine",
        [
            "disk read GB/s (probe)",
            "lz4 unpack GB/s",
            "ratio needed",
            "ratio of these chunks",
            "auto decides",
        ],
        [
            (
                f"{policy.disk_gbps:.2f}",
                f"{policy.decompress_gbps:.2f}",
                "inf" if needed == float("inf") else f"{needed:.3f}",
                f"{ratio:.3f}",
                verdict,
            )
        ],
        [
            f'Lz4Policy("auto", disk_gbps=store.measure_read({PROBE_BYTES >> 20} MiB), '
            "decompress_gbps=measure_decompress()), as a node measures them when its tier opens "
            "(one probe each, in the same directory); it then learns the ratio of every record "
            "packed above",
            "ratio needed = 1 / (1 - disk/unpack); ratio of these chunks = raw bytes ÷ the "
            "packed records' payload bytes",
        ],
    )
    model = 1 / ratio + policy.disk_gbps / policy.decompress_gbps
    plain_disk = raw / plain.read_s[1] / 1e9
    model_plain = 1 / ratio + plain_disk / policy.decompress_gbps
    measured = [packed.read_s[t] / plain.read_s[t] for t in (1, many)]
    quotients = Table(
        "Packed against plain reads: the model and the store",
        [
            "packed ÷ plain",
            "model, probe's disk",
            "model, plain 1-thread read as disk",
            "measured, 1 thread",
            f"measured, {many} threads",
        ],
        [
            ("read time", f"{model:.3f}", f"{model_plain:.3f}", *(f"{m:.3f}" for m in measured)),
            (
                "read GB/s",
                f"{1 / model:.3f}",
                f"{1 / model_plain:.3f}",
                *(f"{1 / m:.3f}" for m in measured),
            ),
        ],
        [
            "model: a packed read takes 1/ratio + disk/unpack of a plain one's time (the "
            "policy's rule; unpacking not overlapped with I/O), with the ratio above and disk "
            f"= the probe's {policy.disk_gbps:.2f} GB/s or this section's plain one-thread read "
            f"{plain_disk:.2f} GB/s, unpack = {policy.decompress_gbps:.2f} GB/s",
            "below 1 in the read time row (above 1 in the GB/s row): packed reads are faster",
        ],
    )
    return [table, policy_table, quotients]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--dir", default=None, help="where to measure the disk (default: a temp dir)")
    p.add_argument("--disk-mib", type=int, default=256)
    p.add_argument("--records", type=int, default=64, help="records per side through the store")
    p.add_argument("--plot", default=None)
    args = explain(p, __doc__).parse_args(argv)
    if args.records < 1:
        p.error("--records must be at least 1")
    torch.set_num_threads(1)
    table = Table(
        f"lz4 on whole chunks ({T} tokens, H={H}, D={D}, bfloat16 KV; {args.chunks} per scheme)",
        ["scheme", "lz4", "ratio", "compress GB/s", "decompress GB/s", "pays below disk GB/s"],
    )
    labels: list[str] = []
    ratios: list[float] = []
    with progress() as bar:
        task = bar.add_task("schemes", total=4 * len(LEVELS) + 1)
        for quant in ("int8", "int4", "none", "none, byte planes"):
            data = chunks(quant.split(",")[0], args.chunks)
            if quant.endswith("planes"):
                data = [byte_planes(c) for c in data]
            raw = sum(len(c) for c in data)
            for name, kwargs in LEVELS:
                packed = [lz4.block.compress(c, store_size=False, **kwargs) for c in data]
                ratio = raw / sum(len(c) for c in packed)
                comp = best_of(lambda d=data, k=kwargs: [  # type: ignore[misc]
                    lz4.block.compress(c, store_size=False, **k) for c in d], 3)  # fmt: skip
                pairs = list(zip(packed, data, strict=True))
                dec = best_of(lambda p=pairs: [lz4.block.decompress(c, uncompressed_size=len(r))  # type: ignore[misc]
                                             for c, r in p], 3)  # fmt: skip
                dec_gbps = raw / dec / 1e9
                table.add(quant, name, f"{ratio:.3f}", f"{raw / comp / 1e9:.2f}",
                          f"{dec_gbps:.2f}", f"{dec_gbps * (1 - 1 / ratio):.2f}")  # fmt: skip
                labels.append(f"{quant}/{name}")
                ratios.append(ratio)
                bar.advance(task)
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            write, read, how = disk_gbps(d, args.disk_mib << 20)
        bar.advance(task)
        store_task = bar.add_task("through the store", total=2 * ROUNDS + 2)
        store_tables = store_section(args.dir, args.records, lambda: bar.advance(store_task))
    disk = Table(
        "This file system, same run",
        ["where", "I/O", "write GB/s", "read GB/s"],
        [(args.dir or tempfile.gettempdir(), how, f"{write:.2f}", f"{read:.2f}")],
        [f"{args.disk_mib} MiB in {UNIT >> 20} MiB units, one thread, fsync after writing"],
    )
    table.notes.append(
        "pays below disk GB/s = decompress GB/s x (1 - 1/ratio): compressing makes a read "
        "faster only on a disk slower than this (decompression not overlapped with I/O)"
    )
    print_report("lz4 on the pool's chunks", "bench/lz4_chunks.py", argv,
                 [table, disk, *store_tables])  # fmt: skip
    if args.plot:
        save_bar_plot(args.plot, [BarPanel("lz4 ratio per chunk", "ratio", labels,
                                           {"ratio": ratios})])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

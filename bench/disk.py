"""The disk tier's store (``kvstore.node.disk.DiskStore``) against raw ``O_DIRECT`` I/O of
the same sizes on the same file system, in the same run.

    python bench/disk.py [--sizes "256 KiB,1 MiB,4 MiB,16 MiB"] [--total 512MiB] [--chunks 4]
                         [--threads 1,4] [--reps 3] [--dir PATH] [--plot disk.png]

Per slot size, ``--total`` bytes of slots of ``--chunks`` random chunks each:

- Writes: the store as the tier's writer drives it (``plan_batch``, ``write_batch``,
  ``commit``, batch after batch, then an ``fsync`` of the segments written, which the
  table shows apart), beside ``pwrite`` of the same batch sizes (each batch's aligned
  bytes, header pages included) from a page-aligned buffer into one plain file, then its
  ``fsync``. Both append to files they grow.
- Reads: ``read`` + ``give_back`` of every record in one random order, on 1 and 4 threads
  (``--threads``; a ``ThreadPoolExecutor``), beside ``preadv`` of the same aligned ranges
  (a record's header page and payload) in the same order and threads from the plain file.
- The store's CPU work per byte on one thread (what it does beside the I/O): the copy of
  the chunks into its aligned write buffer, and xxh3_64 over the payload.

GB/s are of slot payload bytes on both sides (both move the same aligned ranges, so
store ÷ raw is the ratio of their times). Both sides use ``O_DIRECT`` where the file system
takes it (the table says which). Store and raw alternate round by round (which goes first
alternates too; a first round is a warm-up), and each side's fastest of ``--reps`` rounds
is kept, so a noisy neighbour hits both alike. The target: store reads ≥ 0.8 of raw.
Data goes to a temporary directory in ``--dir`` (default: the current directory; not a
tmpfs, where ``O_DIRECT`` is refused), deleted at exit. Markdown on stdout, progress on
stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import mmap
import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BarPanel, Table, best_of, open_direct, print_report, progress, save_bar_plot

from kvstore.core.sizes import format_size, parse_size
from kvstore.errors import InvalidArgument
from kvstore.node.disk import ALIGN, SEGMENT_BYTES, DiskStore, Record

T = TypeVar("T")
NS = b"disk-bench-ns-00"
POOL_BYTES = 64 << 20
"""Random bytes the chunks are cut from (larger than a CPU cache)."""
MAX_UNIT = 16 << 20
"""Raw writes go from a page-aligned buffer this large (or one record's span if larger)."""


@dataclass
class Side:
    """One side's rounds: wall and CPU seconds (this process, every thread) of each."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    fsync: list[float] = field(default_factory=list)

    def best(self) -> int:
        return min(range(len(self.wall)), key=self.wall.__getitem__)

    def gbps(self, nbytes: int) -> float:
        return nbytes / self.wall[self.best()] / 1e9

    def cpu_per_gb(self, nbytes: int) -> float:
        return self.cpu[self.best()] / (nbytes / 1e9)


def timed(side: Side, fn: Callable[[], float]) -> None:
    """Run ``fn`` (which returns the seconds of its fsync, 0 if none) into ``side``."""
    c0, t0 = time.process_time(), time.perf_counter()
    side.fsync.append(fn())
    side.wall.append(time.perf_counter() - t0)
    side.cpu.append(time.process_time() - c0)


def rounds(pair: Sequence[tuple[Side, Callable[[], float]]], reps: int, tick: Callable[[], None],
           warm: bool = True) -> None:  # fmt: skip
    """``reps`` rounds of both sides, alternating which goes first, after a warm-up round
    (``warm``) that is not kept."""
    for r in range(reps + warm):
        order = pair if r % 2 == 0 else pair[::-1]
        for side, fn in order:
            timed(side, fn)
            if warm and r == 0:
                for lst in (side.wall, side.cpu, side.fsync):
                    lst.pop()
        tick()


class Run:
    """One slot size: a store and a plain file in ``root``, written round after round."""

    def __init__(self, root: Path, size: int, chunks: int, total: int, pool: memoryview,
                 rounds_: int) -> None:  # fmt: skip
        self.size, self.chunks, self.n = size, chunks, max(1, total // size)
        self.chunk = size // chunks
        self.pool = pool
        probe = Record.of((NS, bytes(16)), None, "", size, self.chunk, chunks, 2**chunks - 1)
        self.span = probe.span
        capacity = (rounds_ + 1) * self.n * self.span + 4 * SEGMENT_BYTES
        self.store = DiskStore.open(root / "store", capacity, node_id="bench-disk")
        self.raw_path = root / "raw.bin"
        self.raw_fd, self.raw_direct = open_direct(self.raw_path, os.O_RDWR | os.O_CREAT)
        self.raw_end = 0
        self.turn = 0
        self.records: list[Record] = []
        self.batches: list[int] = []
        """The store's batch sizes (bytes) of its last round: raw writes the same."""
        self.raw_at: list[int] = []
        """Raw offset of each of ``records`` in the plain file (its last round)."""
        self.views = [
            [pool[o : o + self.chunk] for o in self._offsets(i)] for i in range(self.n)
        ]  # fmt: skip
        self.write_buf = mmap.mmap(-1, _up(max(MAX_UNIT, self.span)))
        self.write_buf.write(bytes(pool[: len(self.write_buf)]))
        self._local = threading.local()

    def _offsets(self, i: int) -> list[int]:
        room = len(self.pool) - self.chunk
        return [(i * self.chunks + c) * self.chunk % room // 64 * 64 for c in range(self.chunks)]

    def close(self) -> None:
        self.store.close()
        os.close(self.raw_fd)
        self.write_buf.close()

    @property
    def payload(self) -> int:
        return self.n * self.size

    # ---- writes

    def store_write(self) -> float:
        """Write every slot through the store, as the tier's writer does; fsync seconds."""
        self.turn += 1
        store, full = self.store, 2**self.chunks - 1
        recs = [
            Record.of((NS, struct.pack("<QQ", self.turn, i)), None if i == 0 else
                      struct.pack("<QQ", self.turn, i - 1), "", self.size, self.chunk,
                      self.chunks, full)
            for i in range(self.n)
        ]  # fmt: skip
        batches: list[int] = []
        done = 0
        while done < self.n:
            plan, dropped = store.plan_batch(itertools.islice(recs, done, None))
            if plan is None or dropped:
                raise RuntimeError("the store dropped records: its capacity is too small")
            k = len(plan.records)
            store.write_batch(plan, self.views[done : done + k])
            store.commit(plan)
            batches.append(plan.nbytes)
            done += k
        t0 = time.perf_counter()
        for number in sorted({r.segment for r in recs}):
            fd = os.open(store.path / f"seg-{number:08d}.kvd", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.records, self.batches = recs, batches
        return time.perf_counter() - t0

    def raw_write(self) -> float:
        """``pwrite`` the store's batch sizes from an aligned buffer; fsync seconds."""
        at, base, view = self.raw_end, self.raw_end, memoryview(self.write_buf)
        for nbytes in self.batches or [self.span] * self.n:
            for off in range(0, nbytes, len(view)):  # (a batch larger than the buffer)
                part = min(len(view), nbytes - off)
                if os.pwrite(self.raw_fd, view[:part], at) != part:
                    raise OSError("short write")
                at += part
        self.raw_end = at
        self.raw_at = [base + i * self.span for i in range(self.n)]
        t0 = time.perf_counter()
        os.fsync(self.raw_fd)
        return time.perf_counter() - t0

    # ---- reads

    def store_read(self, rec: Record) -> None:
        view = self.store.read(rec)
        self.store.give_back(view)

    def raw_read(self, at: int) -> None:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, _up(self.span))
        if os.preadv(self.raw_fd, [memoryview(buf)[: self.span]], at) != self.span:
            raise OSError("short read")

    def reads(self, order: list[int], pool: ThreadPoolExecutor | None) -> tuple[
            Callable[[], float], Callable[[], float]]:  # fmt: skip
        """The store's and the plain file's read rounds, ``order`` of the last round's
        records, on ``pool`` (None: this thread)."""
        recs = [self.records[i] for i in order]
        ats = [self.raw_at[i] for i in order]

        def store() -> float:
            _each(self.store_read, recs, pool)
            return 0.0

        def raw() -> float:
            _each(self.raw_read, ats, pool)
            return 0.0

        return store, raw


def _each(fn: Callable[[T], None], items: Sequence[T], pool: ThreadPoolExecutor | None) -> None:
    if pool is None:
        for item in items:
            fn(item)
    else:
        for _ in pool.map(fn, items):
            pass


def _up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def cpu_parts(size: int, chunks: int, pool: memoryview, reps: int) -> tuple[float, float]:
    """One thread, GB/s: the copy of a slot's chunks into an aligned buffer, xxh3_64 of it."""
    chunk = size // chunks
    views = [pool[c * chunk : (c + 1) * chunk] for c in range(chunks)]
    buf = mmap.mmap(-1, _up(size))
    buf.write(bytes(size))  # (touched: the store's write buffer is reused)

    def copy() -> None:
        at = 0
        for v in views:
            buf[at : at + chunk] = v
            at += chunk

    payload = memoryview(buf)[:size]
    copy_s = best_of(copy, reps)
    hash_s = best_of(lambda: xxhash.xxh3_64_intdigest(payload), reps)
    payload.release()
    buf.close()
    return size / copy_s / 1e9, size / hash_s / 1e9


@dataclass
class Result:
    """One slot size: its run (records, batches, where) and each side's rounds."""

    size: int
    n: int
    batch_mib: float
    how: str
    write: tuple[Side, Side]
    read: dict[int, tuple[Side, Side]]


def bench_size(root: Path, size: int, args: argparse.Namespace, pool: memoryview,
               tick: Callable[[], None]) -> Result:  # fmt: skip
    """Write then read ``args.total`` bytes of ``size`` slots, store and raw alternating."""
    run = Run(root, size, args.chunks, parse_size(args.total), pool, args.reps + 1)
    try:
        how = (f"store {'O_DIRECT' if run.store.direct else 'buffered'}, "
               f"raw {'O_DIRECT' if run.raw_direct else 'buffered'}")  # fmt: skip
        ws, wr = Side(), Side()
        rounds([(ws, run.store_write), (wr, run.raw_write)], args.reps, tick)
        order = list(range(run.n))
        random.Random(args.seed).shuffle(order)
        read: dict[int, tuple[Side, Side]] = {}
        for t in args.thread_counts:
            with contextlib.ExitStack() as stack:
                ex = None if t == 1 else stack.enter_context(ThreadPoolExecutor(t))
                fs, fr = run.reads(order, ex)
                read[t] = (Side(), Side())
                rounds([(read[t][0], fs), (read[t][1], fr)], args.reps, tick)
        batch_mib = sum(run.batches) / len(run.batches) / 2**20
        return Result(size, run.n, batch_mib, how, (ws, wr), read)
    finally:
        run.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256 KiB,1 MiB,4 MiB,16 MiB", help="slot sizes")
    p.add_argument("--total", default="512MiB", help="bytes of slots per size")
    p.add_argument("--chunks", type=int, default=4, help="chunks per slot")
    p.add_argument("--threads", default="1,4", help="reader thread counts")
    p.add_argument("--reps", type=int, default=3, help="rounds kept per side (best is shown)")
    p.add_argument("--seed", type=int, default=0, help="of the read order")
    p.add_argument("--dir", default=".", help="where the data goes (a temp dir in it)")
    p.add_argument("--plot", default=None, help="write a PNG of the GB/s here")
    args = p.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        total = parse_size(args.total)
        args.thread_counts = [int(t) for t in args.threads.split(",")]
    except (InvalidArgument, ValueError) as exc:
        p.error(str(exc))
    if min(args.thread_counts) < 1 or args.reps < 1 or args.chunks < 1 or total < 1:
        p.error("--threads, --reps, --chunks and --total must be at least 1")
    if any(s % (args.chunks * ALIGN) for s in sizes):
        p.error(f"every size must be a multiple of {args.chunks} x {ALIGN} bytes")
    pool = memoryview(bytearray(os.urandom(POOL_BYTES)))
    results: list[Result] = []
    cpu = Table(
        "The store's CPU work per byte, one thread (beside the I/O)",
        ["slot", "copy into aligned buffer GB/s", "xxh3_64 GB/s",
         "write: copy + hash GB/s", "read: hash GB/s"],
        notes=["write: copy + hash in series (what write_batch does per byte before its "
               "pwrite); read: the xxh3_64 read does after its preadv; one thread, no I/O"],
    )  # fmt: skip
    with progress() as bar, tempfile.TemporaryDirectory(prefix="kvstore-disk-bench-",
                                                        dir=args.dir) as d:  # fmt: skip
        total_rounds = len(sizes) * (1 + len(args.thread_counts)) * (args.reps + 1)
        task = bar.add_task("disk rounds", total=total_rounds)
        for size in sizes:
            root = Path(d) / f"s{size}"
            root.mkdir()
            try:
                results.append(bench_size(root, size, args, pool, lambda: bar.advance(task)))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            copy_gbps, hash_gbps = cpu_parts(size, args.chunks, pool, args.reps)
            cpu.add(format_size(size), f"{copy_gbps:.2f}", f"{hash_gbps:.2f}",
                    f"{1 / (1 / copy_gbps + 1 / hash_gbps):.2f}", f"{hash_gbps:.2f}")  # fmt: skip
    where = os.path.abspath(args.dir)
    writes, reads = tables(results, args, total, where)
    print_report("The disk tier's store vs raw O_DIRECT I/O", "bench/disk.py", argv,
                 [writes, reads, cpu])  # fmt: skip
    if args.plot:
        labels = [format_size(r.size) for r in results]
        read_labels = [f"{format_size(r.size)} x{t}" for r in results for t in r.read]
        gb = [r.n * r.size for r in results]
        save_bar_plot(args.plot, [
            BarPanel("write GB/s (fsync included)", "GB/s", labels, {
                "store": [r.write[0].gbps(b) for r, b in zip(results, gb, strict=True)],
                "raw": [r.write[1].gbps(b) for r, b in zip(results, gb, strict=True)]}),
            BarPanel("read GB/s, random order (slot x threads)", "GB/s", read_labels, {
                "store": [s.gbps(b) for r, b in zip(results, gb, strict=True)
                          for s, _ in r.read.values()],
                "raw": [w.gbps(b) for r, b in zip(results, gb, strict=True)
                        for _, w in r.read.values()]}),
        ], suptitle=f"disk tier store vs raw O_DIRECT I/O, {where}")  # fmt: skip
    return 0


def tables(results: list[Result], args: argparse.Namespace, total: int,
           where: str) -> tuple[Table, Table]:  # fmt: skip
    """The write and read tables of ``results``."""
    writes = Table(
        f"Writes: store (plan_batch, write_batch, commit) vs raw pwrite, {format_size(total)} "
        f"per size, {args.chunks} chunks per slot",
        ["slot", "records", "batch MiB", "store GB/s", "store fsync ms", "raw GB/s",
         "raw fsync ms", "store ÷ raw", "store CPU s/GB", "raw CPU s/GB"],
    )  # fmt: skip
    reads = Table(
        f"Reads: store read + give_back vs raw preadv, random order, {format_size(total)} "
        "per size (target: store ÷ raw ≥ 0.8)",
        ["slot", "threads", "store GB/s", "raw GB/s", "store ÷ raw", "store CPU s/GB",
         "raw CPU s/GB"],
    )  # fmt: skip
    for r in results:
        b, (ws, wr) = r.n * r.size, r.write
        writes.add(format_size(r.size), r.n, f"{r.batch_mib:.1f}", f"{ws.gbps(b):.2f}",
                   f"{ws.fsync[ws.best()] * 1e3:.1f}", f"{wr.gbps(b):.2f}",
                   f"{wr.fsync[wr.best()] * 1e3:.1f}", f"{ws.gbps(b) / wr.gbps(b):.2f}",
                   f"{ws.cpu_per_gb(b):.3f}", f"{wr.cpu_per_gb(b):.3f}")  # fmt: skip
        for t, (rs, rr) in r.read.items():
            reads.add(format_size(r.size), t, f"{rs.gbps(b):.2f}", f"{rr.gbps(b):.2f}",
                      f"{rs.gbps(b) / rr.gbps(b):.2f}", f"{rs.cpu_per_gb(b):.3f}",
                      f"{rr.cpu_per_gb(b):.3f}")  # fmt: skip
    hows = sorted({r.how for r in results})
    writes.notes += [
        f"in {where} ({'; '.join(hows)}); store: DiskStore.direct, whether its segments "
        "bypass the page cache",
        "GB/s of slot payload; each side's includes its fsync (ms shown apart: the store's "
        "of every segment it wrote); batch MiB: the store's mean batch (records of "
        f"{args.chunks} chunks + a header page each), raw writes the same sizes",
        "CPU s/GB: this process's CPU seconds (every thread) per GB of payload; "
        f"best of {args.reps} rounds per side, store and raw alternating",
    ]
    reads.notes += [
        "both sides read the same aligned ranges (a record's header page and payload) in "
        "the same random order; the store also verifies the header and the payload's "
        "xxh3_64; threads > 1: a ThreadPoolExecutor",
    ]
    return writes, reads


if __name__ == "__main__":
    sys.exit(main())

"""A node's host memory on 4 KiB pages beside huge pages: what each copy into it costs.

    python bench/huge_pages.py [--rounds 6] [--per 100] [--sizes "512 KiB,4 MiB"]
                               [--batch 8] [--plot PNG]

A node's host memory is one arena that every put copies into and every get copies out of.
Since ``huge-pages`` (on by default) it is mapped on its own and advised for transparent
huge pages (``kvstore.core.arena.host_memory``); before, it was ``torch.empty``, which
advises nothing. This measures, against a second process that holds 1 GiB of each kind
of memory (written once, so no page faults while timed), p50 microseconds of one exchange
of ``--batch`` chunks of each size at rotating offsets:

- **WRITE (CMA)**: ``process_vm_writev`` from this process into the holder's memory: what a
  ``ucx://`` put's one-sided WRITE does between two processes of one host (UCX's CMA
  transport; the kernel pins each target page);
- **READ (CMA)**: ``process_vm_readv`` out of it (a ``ucx://`` get);
- **receive (TCP)**: the holder receives the chunks from a loopback socket into its
  memory (``recv_into``) and acks one byte (a ``tcp://`` put's receive);
- **send (TCP)**: the holder sends the chunks out of its memory (``sendall``) to this
  process, which receives them into its own (a ``tcp://`` get's send);
- **scrub (xxh3)**: this process hashes chunks of its own memory of each kind (a node's
  scrub of landed chunks).

Source memory (this process's) is plain ``torch`` memory rotating over 512 MiB. Rounds
alternate the two kinds; the table gives the median of the rounds' p50s, their range (the
loopback receive moves 2x between rounds on a shared VM) and the ratio of the medians.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import xxhash
from _common import BarPanel, Table, expect, node_memory, print_report, progress, save_bar_plot

from kvstore.core.arena import huge_page_bytes
from kvstore.core.sizes import parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TARGET = 1 * GiB
"""Memory the holder process keeps of each kind."""
SOURCE = 512 * MiB
"""This process's memory the chunks come from, rotating."""
KINDS = ("4 KiB pages", "huge pages")
OPS = ("WRITE (CMA)", "READ (CMA)", "receive (TCP)", "send (TCP)", "scrub (xxh3)")
WARMUP = 10


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _memory(nbytes: int, huge: bool) -> torch.Tensor:
    """``nbytes`` written once: 4 KiB pages as torch's allocator gives them, or a node's."""
    t = node_memory(nbytes) if huge else torch.ones(nbytes, dtype=torch.uint8)
    if huge:
        off = "off (/sys/kernel/mm/transparent_hugepage/enabled) or none was free"
        expect(huge_page_bytes(t) > 0, f"no huge pages: the kernel's are {off}")
    return t


def hold(pipe: Pipe, huge: bool) -> None:
    """Holder process: 1 GiB of one kind; sends (pid, address, huge-page bytes, port),
    then serves ``(op, offset, nbytes)`` exchanges on its socket until the pipe closes: op
    ``P`` receives that many bytes into its memory at ``offset`` and acks a byte, ``G``
    sends them from there."""
    mem = _memory(TARGET, huge)
    view = memoryview(mem.numpy())
    listener = socket.create_server(("127.0.0.1", 0))
    pipe.send((os.getpid(), mem.data_ptr(), huge_page_bytes(mem), listener.getsockname()[1]))
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(17)
    with sock:
        while True:
            if not _recv_exactly(sock, memoryview(head)):
                return
            offset, nbytes = int.from_bytes(head[1:9], "little"), int.from_bytes(head[9:], "little")
            if head[:1] == b"G":
                sock.sendall(view[offset : offset + nbytes])
                continue
            if not _recv_exactly(sock, view[offset : offset + nbytes]):
                return
            sock.sendall(b"k")


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class Holder:
    """One holder process and the ways to reach its memory."""

    def __init__(self, huge: bool) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=hold, args=(child, huge), daemon=True)
        self.proc.start()
        self.pid, self.addr, self.huge_bytes, port = self.pipe.recv()
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def _cma(op: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_writev if op.startswith("WRITE") else libc.process_vm_readv
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    fn.restype = ctypes.c_ssize_t
    return fn


def _offsets(i: int, batch: int, size: int, region: int) -> list[int]:
    """Chunk offsets of exchange ``i``: successive chunks, wrapping inside ``region``."""
    per = region // (batch * size)
    return [((i % per) * batch + k) * size for k in range(batch)]


def time_op(op: str, holder: Holder, local: torch.Tensor, src: torch.Tensor, size: int,
            batch: int, per: int) -> float:  # fmt: skip
    """p50 seconds of ``per`` exchanges of ``batch`` chunks of ``size`` (after warm-up)."""
    times = []
    src_view = memoryview(src.numpy())
    call = _cma(op) if "CMA" in op else None
    for i in range(WARMUP + per):
        there = _offsets(i, batch, size, TARGET)
        here = _offsets(i * 7, batch, size, SOURCE)
        t0 = time.perf_counter()
        if call is not None:
            liov = (_Iovec * batch)(*[_Iovec(src.data_ptr() + o, size) for o in here])
            riov = (_Iovec * batch)(*[_Iovec(holder.addr + o, size) for o in there])
            t0 = time.perf_counter()
            moved = call(holder.pid, liov, batch, riov, batch, 0)
            expect(moved == batch * size, f"{op} moved {moved}: errno {ctypes.get_errno()}")
        elif op.startswith(("receive", "send")):
            code = b"P" if op.startswith("receive") else b"G"
            nbytes = batch * size
            holder.sock.sendall(
                code + there[0].to_bytes(8, "little") + nbytes.to_bytes(8, "little")
            )
            if code == b"G":  # (into this process's memory, as a reader's buffer)
                expect(_recv_exactly(holder.sock, src_view[here[0] : here[0] + nbytes]), "closed")
            else:
                for o in here:
                    holder.sock.sendall(src_view[o : o + size])
                expect(holder.sock.recv(1) == b"k", "the holder did not ack")
        else:
            mine = memoryview(local.numpy())
            for o in there:
                xxhash.xxh3_64_intdigest(mine[o : o + size])
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per kind and case")
    parser.add_argument("--per", type=int, default=100, help="timed exchanges per round")
    parser.add_argument("--sizes", default="512 KiB,4 MiB", help="chunk sizes, comma-separated")
    parser.add_argument("--batch", type=int, default=8, help="chunks per exchange")
    parser.add_argument("--plot", metavar="PNG", help="also write a bar chart here")
    args = parser.parse_args(argv)
    sizes = [parse_size(s.strip().replace(" ", "")) for s in args.sizes.split(",")]
    expect(all(s > 0 and s * args.batch <= SOURCE // 2 for s in sizes), "sizes out of range")
    torch.set_num_threads(1)
    src = _memory(SOURCE, huge=False)
    holders = {kind: Holder(huge=kind == KINDS[1]) for kind in KINDS}
    local = {kind: _memory(TARGET, huge=kind == KINDS[1]) for kind in KINDS}
    results: dict[tuple[str, int, str], list[float]] = {}
    try:
        cases = [(op, size) for size in sizes for op in OPS]
        with progress() as bar:
            task = bar.add_task("rounds", total=args.rounds * len(cases) * len(KINDS))
            for _ in range(args.rounds):
                for op, size in cases:
                    for kind in KINDS:
                        p50 = time_op(op, holders[kind], local[kind], src, size, args.batch,
                                      args.per)  # fmt: skip
                        results.setdefault((op, size, kind), []).append(p50)
                        bar.advance(task)
        huge_held = holders[KINDS[1]].huge_bytes
    finally:
        for holder in holders.values():
            holder.close()
    table = Table(
        f"p50 µs of one exchange of {args.batch} chunks, memory of each kind (median of "
        f"{args.rounds} rounds of {args.per})",
        ["operation", "chunk", *(f"{k} µs (rounds' range)" for k in KINDS), "huge ÷ 4 KiB"],
    )
    panels: dict[int, BarPanel] = {}
    for op, size in cases:
        med = {k: statistics.median(results[op, size, k]) * 1e6 for k in KINDS}
        label = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
        spread = {k: (min(results[op, size, k]) * 1e6, max(results[op, size, k]) * 1e6)
                  for k in KINDS}  # fmt: skip
        table.add(op, label, *(f"{med[k]:,.0f} ({spread[k][0]:,.0f}-{spread[k][1]:,.0f})"
                               for k in KINDS),
                  f"{med[KINDS[1]] / med[KINDS[0]]:.2f}")  # fmt: skip
        title = f"{args.batch} x {label}: p50 per exchange"
        panel = panels.setdefault(size, BarPanel(title, "µs", [], {k: [] for k in KINDS}))
        panel.labels.append(op)
        for k in KINDS:
            panel.series[k].append(med[k])
    table.notes = [
        f"The holder's huge-page memory: {huge_held / GiB:.2f} of {TARGET / GiB:.0f} GiB on "
        "huge pages once written (AnonHugePages); its 4 KiB memory is torch.empty's.",
        "WRITE and READ: one process_vm_writev / process_vm_readv of the exchange's chunks "
        "(UCX's CMA copy). receive: the holder's recv_into of the chunks sent over loopback "
        "TCP, until its 1-byte ack; send: this process's recv_into of the chunks the holder "
        "sends from its memory. scrub: xxh3_64 of each chunk in this process's memory.",
    ]
    print_report("A node's host memory: 4 KiB pages beside huge pages", "bench/huge_pages.py",
                 argv, [table])  # fmt: skip
    if args.plot:
        save_bar_plot(args.plot, list(panels.values()), "4 KiB pages beside huge pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whether lz4 pays on the pool's chunks, against this machine's disk: the measurement the
disk tier's compression decision rests on.

    python bench/lz4_chunks.py [--chunks 32] [--dir PATH] [--disk-mib 256] [--plot lz4.png]

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
is refused, as on tmpfs, which the table says). Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import lz4.block
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BarPanel, Table, best_of, print_report, progress, save_bar_plot

from kvstore.core.codec import ChunkKey, encode_chunk
from kvstore.core.kvgen import realistic_kv

T, H, D = 256, 8, 128
LEVELS = (("fast, accel 1", {"mode": "fast", "acceleration": 1}),
          ("fast, accel 8", {"mode": "fast", "acceleration": 8}),
          ("high, level 3", {"mode": "high_compression", "compression": 3}))  # fmt: skip
UNIT = 4 << 20


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
    how = "O_DIRECT"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        how = "buffered (O_DIRECT refused)"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(total // UNIT):
            os.write(fd, buf)
        os.fsync(fd)
        write = total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
    flags = os.O_RDONLY | (os.O_DIRECT if how == "O_DIRECT" else 0)
    fd = os.open(path, flags)
    try:
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) == UNIT:
            pass
        read = total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)
    return write, read, how


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--dir", default=None, help="where to measure the disk (default: a temp dir)")
    p.add_argument("--disk-mib", type=int, default=256)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
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
                dec = best_of(lambda p=pairs: [lz4.block.decompress(c, uncompressed_size=len(r))
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
    print_report("lz4 on the pool's chunks", "bench/lz4_chunks.py", argv, [table, disk])
    if args.plot:
        save_bar_plot(args.plot, [BarPanel("lz4 ratio per chunk", "ratio", labels,
                                           {"ratio": ratios})])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

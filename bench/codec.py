"""The core's speed and accuracy, side by side with what the machine can do.

    python bench/codec.py [--quick] [--plot codec.png] [--fused-only] [--warm-cache]

Prints Markdown: the INT8 schemes' attention-output error on realistic KV, codec GB/s next
to a plain ``torch`` copy of the same bytes, the eager and the fused (torch.compile)
codec side by side on a trace-like layer and a big one with their first-call (compile)
times, prefix-hashing time for a 128k-token prompt, and slot-allocator operations per
second. Progress goes to stderr. Compile times are cold (Inductor's on-disk caches
in a fresh directory) unless ``--warm-cache``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BarPanel, Table, machine_markdown, progress, save_bar_plot

from kvstore.core import codec, fused
from kvstore.core.arena import Arena
from kvstore.core.hashing import Namespace, block_hashes
from kvstore.core.kvgen import compare_schemes, measure_speed, realistic_kv
from kvstore.core.slots import SlotTable


def per_op_us(fn: Callable[[], object], n: int, repeats: int = 5) -> float:
    """Median microseconds per call of ``fn`` over ``repeats`` batches of ``n`` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def hashing_table(quick: bool) -> Table:
    ns = Namespace(model="m", revision="r", num_layers=32, num_kv_heads=8, head_dim=128)
    table = Table("Prefix hashing (xxh3-128 chain, 256-token blocks)", ["prompt", "µs", "blocks"])
    for n in (8192, 131072):
        tokens = np.random.default_rng(0).integers(0, 150_000, n)
        us = per_op_us(lambda t=tokens: block_hashes(ns, t), 5 if quick else 20)
        table.add(f"{n // 1024}k tokens (numpy)", f"{us:.0f}", n // 256)
    as_list = np.random.default_rng(0).integers(0, 150_000, 131072).tolist()
    us = per_op_us(lambda: block_hashes(ns, as_list), 3 if quick else 10)
    table.add("128k tokens (Python list)", f"{us:.0f}", 512)
    table.notes.append("a list pays for its conversion to a u32 array; engines hold numpy/torch")
    return table


def allocator_table(quick: bool) -> Table:
    slot = 16 * 2**20 + 32 * 1024  # an 8B-model block: 32 layers x ~0.5 MiB chunks
    arena = Arena(64 * slot + 4 * 2**20, device="cpu")
    table_ = SlotTable(arena)
    n = 2000 if quick else 20000
    counter = iter(range(10**9))

    def alloc_evicting() -> None:
        i = next(counter)
        table_.allocate((b"n" * 16, i.to_bytes(16, "big")), slot, slot // 32, 32)

    for _ in range(64):
        alloc_evicting()  # fill the arena: every later allocation evicts the LRU slot
    result = Table("Slot allocator (one thread)", ["operation", "µs/op", "ops/s"])

    def row(name: str, fn: Callable[[], object], count: int) -> None:
        us = per_op_us(fn, count)
        result.add(name, f"{us:.2f}", f"{1e6 / us:,.0f}")

    row("allocate with LRU eviction (16 MiB slots)", alloc_evicting, n)
    slot0 = table_.slots()[0]
    row("pin + release (lease)", lambda: table_.pin(slot0).release(), n * 5)
    keys = [s.key for s in table_.slots()]
    row("touch 64 blocks tail-first", lambda: table_.touch(keys), n // 10)
    table_.validate()
    return result


FUSED_SHAPES = [  # (name, block tokens, blocks): H=8, D=128, bfloat16, the default int8
    ("trace: 24 blocks x 16 tokens", 16, 24),
    ("big: 2048 tokens, 256-token blocks", 256, 8),
]


def _timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (a first call: compile included)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _decode_layer(rows: torch.Tensor, dst: torch.Tensor, block: int) -> None:
    for i in range(rows.shape[0]):
        codec.decode_chunk(rows[i], out=dst[:, i * block : (i + 1) * block])


def _encode_layer(layer: torch.Tensor, block: int, keys: list[Any], rows: torch.Tensor) -> None:
    codec.encode_blocks(layer, block, keys, out=rows)


def _in_mode(mode: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        fused.set_mode(mode)
        return fn()

    return run


def _fused_shape(name: str, block: int, n: int, calls: int, speed: Table, first: Table) -> None:
    """Add one layer shape's rows to the two tables of :func:`fused_tables`."""
    layer = realistic_kv(n * block, 8, 128, torch.bfloat16, seed=1)
    keys = [codec.ChunkKey(bytes([i % 256]) * 16, 0, 0) for i in range(n)]
    nbytes = codec.chunk_nbytes(block, 8, 128, torch.bfloat16, "int8")
    rows = {m: torch.empty(n, nbytes, dtype=torch.uint8) for m in ("eager", "fused")}
    dst = {m: torch.empty_like(layer) for m in ("eager", "fused")}
    copy_dst = torch.empty_like(layer)
    copy = partial(copy_dst.copy_, layer)
    if n > 3:  # a smaller layer first: the block count is dynamic, no recompile after
        few = _timed(
            _in_mode("fused", partial(_encode_layer, layer, block, keys[:3], rows["fused"][:3]))
        )
        first.add(name, "encode_blocks x3 (compiles)", "-", f"{few:.2f}")
    jobs = {
        "encode_blocks": {m: partial(_encode_layer, layer, block, keys, rows[m]) for m in rows},
        f"decode_chunk x{n}": {m: partial(_decode_layer, rows["eager"], dst[m], block)
                               for m in rows},
    }  # fmt: skip
    for what, job in jobs.items():
        starts = {m: _timed(_in_mode(m, job[m])) for m in ("eager", "fused")}
        first.add(name, what, f"{starts['eager'] * 1e3:.2f}", f"{starts['fused']:.2f}")
        best = {"eager": float("inf"), "fused": float("inf"), "copy": float("inf")}
        for _ in range(3):  # alternate, keep each one's best median
            for m in ("eager", "fused"):
                best[m] = min(best[m], per_op_us(_in_mode(m, job[m]), calls) / 1e3)
            best["copy"] = min(best["copy"], per_op_us(copy, 50) / 1e3)
        wrote = rows if what == "encode_blocks" else dst
        same = torch.equal(wrote["eager"].view(torch.uint8), wrote["fused"].view(torch.uint8))
        e, f, c = best["eager"], best["fused"], best["copy"]
        speed.add(name, what, f"{e:.3f}", f"{f:.3f}", f"{c:.3f}", f"{c / e:.2f}x",
                  f"{c / f:.2f}x", f"{e / f:.2f}x", "yes" if same else "NO")  # fmt: skip


def fused_tables(quick: bool) -> list[Table]:
    """Eager vs fused vs ``copy_`` on each of :data:`FUSED_SHAPES`, in one run, the two
    codecs measured in alternation (this VM is shared); and the first-call times."""
    speed = Table(
        "Eager vs fused codec vs torch copy_ (one thread, bf16 H=8 D=128, default int8)",
        ["layer", "operation", "eager ms", "fused ms", "copy_ ms", "eager / copy_",
         "fused / copy_", "fused speedup", "bytes identical"],
    )  # fmt: skip
    first = Table("First calls (compile included; later calls: the table above)",
                  ["layer", "call", "eager ms", "fused first-call s"])  # fmt: skip
    for name, block, n in FUSED_SHAPES:
        _fused_shape(name, block, n, 5 if quick else 15, speed, first)
    fused.set_mode(None)
    speed.notes.append("x / copy_: the codec's speed as a fraction of copy_'s on the same KV bytes")
    speed.notes.append("decode: each chunk into its slice of a layer (what get_layer does)")
    first.notes.append("fused graphs compiled: " + "; ".join(
        f"{r.what} {r.seconds:.1f} s{'' if r.ok else ' FAILED'}" for r in fused.compile_log()
    ))  # fmt: skip
    return [speed, first]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples (CI smoke run)")
    parser.add_argument("--plot", help="write a PNG of the codec speeds here")
    parser.add_argument("--fused-only", action="store_true", help="only eager vs fused")
    parser.add_argument("--warm-cache", action="store_true", help="keep Inductor's disk cache")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.warm_cache:  # every first call compiles from scratch, C++ included
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvstore-bench-")
    if args.fused_only:
        print(machine_markdown())
        for table in fused_tables(args.quick):
            print(table.to_markdown())
        return 0
    sections = []
    with progress() as bar:
        task = bar.add_task("codec bench", total=5)
        sections += fused_tables(args.quick)
        bar.advance(task)
        acc = Table(
            "INT8 schemes: attention-output error on realistic KV (T=256, H=8, D=128, fp16)",
            ["scheme", "median rel. error", "p99 rel. error", "mean cosine", "size / fp16"],
        )
        for row in compare_schemes(
            chunks=4 if args.quick else 16, queries=64 if args.quick else 256
        ):
            acc.add(
                row.scheme,
                f"{row.median_rel_err:.3%}",
                f"{row.p99_rel_err:.2%}",
                f"{row.mean_cosine:.6f}",
                f"{row.size_ratio:.4f}",
            )
        acc.notes.append("size / fp16 counts header, scales and checksum")
        sections.append(acc)
        bar.advance(task)
        speed = Table(
            "Codec speed vs torch copy (one thread, GB/s of fp16 KV; 2048-token layer, 8 blocks)",
            ["operation", "GB/s", "ms/call", "vs copy_"],
        )
        rows = measure_speed(tokens=2048)
        copy_chunk = next(g for w, g, _ in rows if w == "copy_ chunk")
        copy_layer = next(g for w, g, _ in rows if w == "copy_ layer")
        for what, gbs, ms in rows:
            base = copy_layer if "layer" in what else copy_chunk
            speed.add(what, f"{gbs:.2f}", f"{ms:.3f}", f"{gbs / base:.2f}x")
        sections.append(speed)
        bar.advance(task)
        sections.append(hashing_table(args.quick))
        bar.advance(task)
        sections.append(allocator_table(args.quick))
        bar.advance(task)
    print(machine_markdown())
    for table in sections:
        print(table.to_markdown())
    if args.plot:
        chosen = [r for r in rows if "layer" in r[0]]
        save_bar_plot(
            args.plot,
            [
                BarPanel(
                    "codec vs copy (2048-token layer)",
                    "GB/s",
                    [r[0] for r in chosen],
                    {"GB/s": [r[1] for r in chosen]},
                )
            ],
            "kvstore core",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

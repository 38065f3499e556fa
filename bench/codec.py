"""The core's speed and accuracy, side by side with what the machine can do.

    python bench/codec.py [--quick] [--plot codec.png]

Prints Markdown: the INT8 schemes' attention-output error on realistic KV, codec GB/s next
to a plain ``torch`` copy of the same bytes, prefix-hashing time for a 128k-token prompt,
and slot-allocator operations per second. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BarPanel, Table, machine_markdown, progress, save_bar_plot

from kvstore.core.arena import Arena
from kvstore.core.hashing import Namespace, block_hashes
from kvstore.core.kvgen import compare_schemes, measure_speed
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples (CI smoke run)")
    parser.add_argument("--plot", help="write a PNG of the codec speeds here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = []
    with progress() as bar:
        task = bar.add_task("codec bench", total=4)
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

"""The core's speed and accuracy, side by side with what the machine can do.

    python bench/codec.py [--quick] [--plot codec.png] [--fused-only] [--warm-cache]
                          [--no-engine]

Prints Markdown: every scheme's size and attention-output error on realistic KV (INT8,
INT4, raw) and INT4's by group size, the reference engine's greedy tokens and logits
through a real ``kvstore serve`` with each ``quant`` beside one process's (skipped with
``--no-engine`` or without the ``engine`` extra), codec GB/s next to a plain ``torch``
copy of the same bytes, the eager, C and fused (torch.compile) codecs side by side on a
trace-like layer and a big one with their first-call (compile) times, prefix-hashing time
for a 128k-token prompt, and slot-allocator operations per second. Progress goes to
stderr. Compile times are cold (Inductor's on-disk caches in a fresh directory) unless
``--warm-cache``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BarPanel, Serve, Table, machine_markdown, progress, save_bar_plot

from kvstore.core import codec, fused, native
from kvstore.core.arena import Arena
from kvstore.core.hashing import Namespace, block_hashes
from kvstore.core.kvgen import (
    SchemeAccuracy,
    compare_int4_groups,
    compare_schemes,
    measure_speed,
    realistic_kv,
)
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
    """``fn`` run with the codec path ``mode`` (one of :data:`CODECS`)."""

    def run() -> object:
        fused.set_mode("native" if mode.startswith("native") else mode)
        if native.available():
            native.set_isa("avx2" if mode == "native-avx2" else "auto")
        return fn()

    return run


# kvstore.core.fused's modes, measured in turn; where the C kernels have AVX-512, also with
# them (encode and decode) held to AVX2 (side by side: what the wider rows bring)
CODECS = ("eager", "native", *(("native-avx2",) if native.isa() == "avx512" else ()), "fused")
_LABEL = {"eager": "eager", "native": "native", "native-avx2": "native avx2", "fused": "fused"}


def _fused_shape(name: str, block: int, n: int, calls: int, speed: Table, first: Table) -> None:
    """Add one layer shape's rows to the two tables of :func:`fused_tables`."""
    layer = realistic_kv(n * block, 8, 128, torch.bfloat16, seed=1)
    keys = [codec.ChunkKey(bytes([i % 256]) * 16, 0, 0) for i in range(n)]
    nbytes = codec.chunk_nbytes(block, 8, 128, torch.bfloat16, "int8")
    rows = {m: torch.empty(n, nbytes, dtype=torch.uint8) for m in CODECS}
    dst = {m: torch.empty_like(layer) for m in CODECS}
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
        starts = {m: _timed(_in_mode(m, job[m])) for m in CODECS}
        first.add(name, what, f"{starts['eager'] * 1e3:.2f}", f"{starts['fused']:.2f}")
        best = dict.fromkeys((*CODECS, "copy"), float("inf"))
        for _ in range(3):  # alternate, keep each one's best median
            for m in CODECS:
                best[m] = min(best[m], per_op_us(_in_mode(m, job[m]), calls) / 1e3)
            best["copy"] = min(best["copy"], per_op_us(copy, 50) / 1e3)
        wrote = rows if what == "encode_blocks" else dst
        same = all(torch.equal(wrote["eager"].view(torch.uint8), wrote[m].view(torch.uint8))
                   for m in CODECS)  # fmt: skip
        c = best["copy"]
        speed.add(name, what, *(f"{best[m]:.3f}" for m in CODECS), f"{c:.3f}",
                  *(f"{c / best[m]:.2f}x" for m in CODECS), "yes" if same else "NO")  # fmt: skip


def fused_tables(quick: bool) -> list[Table]:
    """Eager vs C vs fused vs ``copy_`` on each of :data:`FUSED_SHAPES`, in one run, the
    codecs measured in alternation (this VM is shared); and the first-call times."""
    speed = Table(
        "Eager vs C (native) vs fused codec vs torch copy_ (one thread, bf16 H=8 D=128, "
        "default int8)",
        ["layer", "operation", *(f"{_LABEL[m]} ms" for m in CODECS), "copy_ ms",
         *(f"{_LABEL[m]} / copy_" for m in CODECS), "bytes identical"],
    )  # fmt: skip
    first = Table("First calls (compile included; later calls: the table above)",
                  ["layer", "call", "eager ms", "fused first-call s"])  # fmt: skip
    if not native.available():
        speed.notes.append("the C kernels are not built here: the native column ran eager")
    for name, block, n in FUSED_SHAPES:
        _fused_shape(name, block, n, 5 if quick else 15, speed, first)
    fused.set_mode(None)
    if native.available():
        native.set_isa("auto")
    if "native-avx2" in CODECS:
        speed.notes.append("native: encode and decode in AVX-512 rows (this CPU has AVX-512 "
                           "BF16); native avx2: the same kernels held to AVX2")  # fmt: skip
    speed.notes.append("x / copy_: the codec's speed as a fraction of copy_'s on the same KV bytes")
    speed.notes.append("decode: each chunk into its slice of a layer (what get_layer does)")
    first.notes.append("fused graphs compiled: " + "; ".join(
        f"{r.what} {r.seconds:.1f} s{'' if r.ok else ' FAILED'}" for r in fused.compile_log()
    ))  # fmt: skip
    return [speed, first]


def accuracy_tables(quick: bool) -> list[Table]:
    """Every scheme's attention error and size on realistic KV, and INT4's by group size."""
    cols = ["scheme", "median rel. error", "p99 rel. error", "mean cosine", "size / fp16"]
    shape = "realistic KV (T=256, H=8, D=128, fp16)"
    acc = Table(f"Schemes: attention-output error on {shape}", cols)
    groups = Table(f"INT4 by group size G: attention-output error on {shape}", cols)
    study = {"chunks": 4 if quick else 16, "queries": 64 if quick else 256}
    schemes = (*(s for s in codec.SCHEMES if s != "raw"), "none")

    def add(table: Table, rows: list[SchemeAccuracy]) -> None:
        for row in rows:
            table.add(row.scheme, f"{row.median_rel_err:.3%}", f"{row.p99_rel_err:.2%}",
                      f"{row.mean_cosine:.6f}", f"{row.size_ratio:.4f}")  # fmt: skip

    add(acc, compare_schemes(schemes=schemes, **study))
    add(groups, compare_int4_groups(**study))
    acc.notes.append(
        f"quant='int8' is {codec.DEFAULT_INT8}, quant='int4' is {codec.DEFAULT_INT4}; size / "
        "fp16 counts header, scales and checksum"
    )
    groups.notes.append(
        "K per channel over groups of G tokens, V per token over groups of G channels "
        "(int4-g32 is G=32, int4-g128 G=128), through the codec's kernels"
    )
    return [acc, groups]


def engine_table(quick: bool) -> Table | None:
    """The reference engine (transformers' Llama, random weights) prefilling prompts into a
    real ``kvstore serve`` and decoding them from it, per ``quant``, against one process
    with no pool: top-1 agreement over greedy steps and how far the logits moved."""
    try:
        from examples.reference_engine import Engine, build_model, namespace, reference_generate
    except ImportError:
        return None
    import kvclient

    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(40, 100))]
               for _ in range(4 if quick else 16)]  # fmt: skip
    steps = 8 if quick else 16
    refs = [reference_generate("llama", p, steps) for p in prompts]
    table = Table(
        "Reference engine through the pool: greedy tokens and logits against one process",
        ["quant", "top-1 agreement", "prompts identical", "max abs logit diff",
         "mean abs logit diff / logit std"],
    )  # fmt: skip
    model = build_model("llama")
    with Serve.start("--host-mem", "256MiB") as serve:
        for quant in ("none", "int8", "int4"):
            with kvclient.SyncKVClient.connect(
                serve.addresses["grpc"], namespace("llama", quant)
            ) as kv:
                for p in prompts:
                    Engine(model, kv, load=False, save=True).generate(p, 1)
                outs = [
                    Engine(model, kv, load=True, save=False).generate(p, steps) for p in prompts
                ]
            pairs = list(zip(outs, refs, strict=True))
            same = sum(x == y for o, r in pairs for x, y in zip(o.tokens, r.tokens, strict=True))
            moved = [(torch.as_tensor(g) - w, w) for o, r in pairs
                      for g, w in zip(o.logits, r.logits, strict=True)]  # fmt: skip
            worst = max(float(d.abs().max()) for d, _ in moved)
            spread = statistics.mean(float(d.abs().mean() / w.std()) for d, w in moved)
            identical = sum(o.tokens == r.tokens for o, r in pairs)
            assert all(o.loaded_tokens > 0 for o in outs), "the decode loaded nothing"
            table.add(quant, f"{same}/{steps * len(prompts)}", f"{identical}/{len(prompts)}",
                      f"{worst:.4f}", f"{spread:.5f}")  # fmt: skip
    table.notes.append(
        f"{len(prompts)} prompts of 40-99 tokens, {steps} greedy steps each; the decode engine "
        "loads every whole block of the prompt from the pool and computes the rest; "
        "agreement is position by position against the same model in one process"
    )
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples (CI smoke run)")
    parser.add_argument("--plot", help="write a PNG of the codec speeds here")
    parser.add_argument("--fused-only", action="store_true", help="only eager vs fused")
    parser.add_argument("--warm-cache", action="store_true", help="keep Inductor's disk cache")
    parser.add_argument("--no-engine", action="store_true", help="skip the reference engine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.warm_cache:  # every first call compiles from scratch, C++ included
        cache = tempfile.mkdtemp(prefix="kvstore-bench-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)  # (not left in /tmp)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    if args.fused_only:
        print(machine_markdown())
        for table in fused_tables(args.quick):
            print(table.to_markdown())
        return 0
    sections = []
    with progress() as bar:
        task = bar.add_task("codec bench", total=6)
        sections += fused_tables(args.quick)
        bar.advance(task)
        sections += accuracy_tables(args.quick)
        bar.advance(task)
        engine = None if args.no_engine else engine_table(args.quick)
        sections += [engine] if engine else []
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
        speed.notes.append(
            "verify_chunk rows count the encoded chunk's bytes (what it reads), not fp16 KV "
            "bytes: their GB/s and their ratio to copy_ are of those bytes (an int8 chunk is "
            "about half its fp16 KV)."
        )
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

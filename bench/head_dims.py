"""The INT8 codec at every head dim: each D beside the nearest multiple of 16, same run.

    python bench/head_dims.py [--dims 30,50,72,100,120,136,200,250] [--tokens 9216]
                              [--reps 5] [--plot head_dims.png]

Encodes a layer of ``--tokens`` tokens (8 KV heads, bfloat16, ``int8`` scheme, blocks of
512 tokens, ``encode_blocks``) and decodes its chunks into a layer (``decode_chunk`` with
``out``), one thread, for each ``--dims`` D and for the multiple of 16 nearest to it
(ties: the one above). The C kernels take any D from 8 on, a row's last vector overlapping
the one before it where the vector width does not divide D (``kvstore/core/native.py``).
Reports the best of ``--reps`` calls per D and direction, and D's time over its
neighbour's (the target: ≤ 2). Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BarPanel, Table, best_of, explain, print_report, progress, save_bar_plot

from kvstore.core import native
from kvstore.core.codec import ChunkKey, decode_chunk, encode_blocks

H, BLOCK = 8, 512


def nearest16(d: int) -> int:
    """The multiple of 16 nearest ``d`` (ties: the one above), at least 16."""
    return max(16, (d + 8) // 16 * 16)


def timings(d: int, tokens: int, reps: int) -> tuple[float, float]:
    """Best seconds to encode and to decode a layer of ``tokens`` at head dim ``d``."""
    kv = torch.randn(2, tokens, H, d).bfloat16()
    keys = [ChunkKey(i.to_bytes(16, "big"), 0, 0) for i in range(tokens // BLOCK)]
    rows = encode_blocks(kv, BLOCK, keys, "int8")
    out = torch.empty_like(kv)

    def decode() -> None:
        for i, row in enumerate(rows):
            decode_chunk(row, out=out[:, i * BLOCK : (i + 1) * BLOCK])

    enc = best_of(lambda: encode_blocks(kv, BLOCK, keys, "int8"), reps)
    dec = best_of(decode, reps)
    n = len(keys) * BLOCK
    if not torch.allclose(out[:, :n].float(), kv[:, :n].float(), atol=0.1, rtol=0.05):
        raise SystemExit(f"D={d}: the decoded layer is not the encoded one")
    return enc, dec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="30,50,72,100,120,136,200,250")
    p.add_argument("--tokens", type=int, default=9216)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--plot", default=None)
    args = explain(p, __doc__).parse_args(argv)
    torch.set_num_threads(1)
    dims = [int(x) for x in args.dims.split(",")]
    table = Table(
        f"INT8 encode and decode of a layer ({args.tokens} tokens, H={H}, bfloat16, blocks "
        f"of {BLOCK}), ms, one thread; C kernels: {native.available()}",
        [
            "D",
            "encode ms",
            "decode ms",
            "nearest multiple of 16",
            "its encode ms",
            "its decode ms",
            "encode ÷",
            "decode ÷",
        ],
    )
    ratios: dict[str, list[float]] = {"encode": [], "decode": []}
    with progress() as bar:
        task = bar.add_task("head dims", total=2 * len(dims))
        for d in dims:
            near = nearest16(d)
            enc, dec = timings(d, args.tokens, args.reps)
            bar.advance(task)
            nenc, ndec = timings(near, args.tokens, args.reps)
            bar.advance(task)
            ratios["encode"].append(enc / nenc)
            ratios["decode"].append(dec / ndec)
            table.rows.append([d, f"{enc * 1e3:.2f}", f"{dec * 1e3:.2f}", near,
                               f"{nenc * 1e3:.2f}", f"{ndec * 1e3:.2f}",
                               f"{enc / nenc:.2f}", f"{dec / ndec:.2f}"])  # fmt: skip
    table.notes.append(
        "best of --reps calls each; ÷: D's time over its nearest multiple of 16's (target ≤ 2); "
        "decode: every chunk of the layer decoded into a slice of it (decode_chunk, out=)"
    )
    print_report("The codec at every head dim", "bench/head_dims.py", argv, [table])
    if args.plot:
        save_bar_plot(args.plot, [BarPanel("time ÷ nearest multiple of 16", "ratio",
                                           [str(d) for d in dims], ratios)])  # fmt: skip
        print(f"Plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

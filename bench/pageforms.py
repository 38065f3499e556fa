"""What an engine's page form costs the codec, side by side with the codec's best case.

    python bench/pageforms.py [--tokens 4096] [--heads 8] [--head-dim 128] [--reps 5]
                              [--plot pageforms.png]

One layer of ``--tokens`` tokens (bfloat16) in each page form ``kvclient.layouts`` maps —
vLLM 0.32's GPU ``[B, H, N, 2D]`` pages in NHD and HND order, its CPU pages (``cpu_dn``: K
transposed) and AMX tiles (``cpu_amx``), and the legacy ``kv_first`` — at engine pages of
16 and 32 tokens (chunks gathered) and of 256 (a chunk inside one page: read in place
where the form's channels are adjacent), encoded into INT8 chunks of 256 tokens and
decoded back through ``PagedCache``. Beside each, in the same run: the same chunks
encoded from and decoded into a contiguous ``[2, T, H, D]`` tensor (the codec's best
case). Prints Markdown (GB/s of KV and the ratio to the best case); progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BarPanel, Table, best_of, explain, print_report, progress, save_bar_plot

from kvclient.layouts import halves
from kvclient.paged import PagedCache, chunk_views, decode_into, encode_paged
from kvstore.core.codec import ChunkKey, decode_chunk, encode_blocks
from tests import pageforms

B = 256
FORMS = ("bhnc_nhd", "bhnc_hnd", "cpu_dn", "cpu_amx", "kv_first")
PAGES = (16, 32, 256)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--plot", default=None, help="write a PNG of the ratios here")
    args = explain(p, __doc__).parse_args(argv)
    T, H, D = args.tokens - args.tokens % B, args.heads, args.head_dim
    n = T // B
    dtype = torch.bfloat16
    kv = (torch.randn(2, T, H, D) * 2).to(dtype)
    keys = [ChunkKey(bytes([j + 1] * 16), 0, 0) for j in range(n)]
    gb = kv.numel() * kv.element_size() / 1e9

    bufs = encode_blocks(kv, B, keys, "int8")
    out = torch.empty_like(kv)
    base_enc = best_of(lambda: encode_blocks(kv, B, keys, "int8"), args.reps)

    def decode_all() -> None:
        for j, buf in enumerate(bufs):
            decode_chunk(buf, out=out[:, j * B : (j + 1) * B], expect_key=keys[j])

    base_dec = best_of(decode_all, args.reps)
    table = Table(
        f"INT8, one layer of {T} tokens, H={H}, D={D}, bfloat16, chunks of {B}",
        ["page form", "page", "encode GB/s", "÷ contiguous", "decode GB/s", "÷ contiguous"],
    )
    table.add("contiguous [2, T, H, D]", "-", f"{gb / base_enc:.2f}", "1.00",
              f"{gb / base_dec:.2f}", "1.00")  # fmt: skip
    labels: list[str] = []
    enc_ratio: list[float] = []
    dec_ratio: list[float] = []
    with progress() as bar:
        task = bar.add_task("page forms", total=len(FORMS) * len(PAGES))
        for form in FORMS:
            for N in PAGES:
                nblk = T // N + 2
                cache = pageforms.new(form, nblk, N, H, D, dtype)
                f = "bhnc" if form.startswith("bhnc") else form
                paged = PagedCache(halves(cache, f, D), "kv_pair")
                ids = list(range(nblk - 1, nblk - 1 - T // N, -1))  # a block table out of order
                views = chunk_views(paged, ids, B, n)
                wviews = chunk_views(paged, ids, B, n, writable=True)
                enc = best_of(lambda v=views: encode_paged(v, keys, "int8"), args.reps)

                def decode_paged(w: list = wviews) -> None:  # type: ignore[type-arg]
                    for j, buf in enumerate(bufs):
                        decode_into(buf, w[j], expect_key=keys[j])

                dec = best_of(decode_paged, args.reps)
                table.add(form, N, f"{gb / enc:.2f}", f"{base_enc / enc:.2f}",
                          f"{gb / dec:.2f}", f"{base_dec / dec:.2f}")  # fmt: skip
                labels.append(f"{form}/{N}")
                enc_ratio.append(base_enc / enc)
                dec_ratio.append(base_dec / dec)
                bar.advance(task)
    table.notes.append(
        "÷ contiguous: the contiguous tensor's time over the page form's, in this run "
        "(1.00: as fast as the codec's best case). Pages of 16 and 32 tokens are gathered "
        "(scattered) one chunk at a time; pages of 256 hold a chunk each, read in place "
        "where K's and V's channels are adjacent (not the CPU pages' transposed K nor "
        "the AMX tiles: those are always staged)."
    )
    print_report("Page forms: the codec through an engine's pages", "bench/pageforms.py",
                 argv, [table])  # fmt: skip
    if args.plot:
        panel = BarPanel("÷ contiguous (higher is better)", "ratio", labels,
                         {"encode": enc_ratio, "decode": dec_ratio})  # fmt: skip
        save_bar_plot(args.plot, [panel], "INT8 through each page form")
    return 0


if __name__ == "__main__":
    sys.exit(main())

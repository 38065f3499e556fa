"""A prefill engine's side: compute (here: generate) a prompt's KV and push it layer by layer.

python examples/prefill.py MASTER [--tokens 2048] [--layers 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

import kvclient
from kvstore.core.kvgen import realistic_kv


def namespace(layers: int) -> kvclient.Namespace:
    """The model geometry both example processes agree on (an 8B-class GQA model)."""
    return kvclient.Namespace(
        model="example-8b", revision="v1", num_layers=layers, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, block_tokens=256, quant="int8",
    )  # fmt: skip


def prompt(n: int) -> list[int]:
    """A deterministic example prompt."""
    return [(i * 7919 + 13) % 128_000 for i in range(n)]


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("master")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    tokens = prompt(args.tokens)
    async with await kvclient.KVClient.connect(args.master, namespace(args.layers)) as kv:
        t0 = time.perf_counter()
        for layer in range(args.layers):
            kv_layer = realistic_kv(args.tokens, 8, 128, torch.bfloat16, seed=layer)
            stored = await kv.put_layer(tokens, layer, kv_layer)
            await asyncio.sleep(0.01)  # stands in for the next layer's forward pass
        dt = time.perf_counter() - t0
        print(f"prefill: stored {stored} tokens x {args.layers} layers in {dt:.2f} s")
        print(f"prefill: match_prefix -> {await kv.match_prefix(tokens)} tokens cached")


if __name__ == "__main__":
    asyncio.run(main())

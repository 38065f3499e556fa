"""A prefill writer or a decode reader in its own OS process, for integration tests.

    python tests/kvproc.py writer MASTER --tokens N --layers L [--seed S] [--pause-s P]
    python tests/kvproc.py reader MASTER --tokens N --layers L [--seed S] [--timeout T]

Both derive the same prompt and KV from the seed. Each prints one JSON line per event
with a wall-clock timestamp: the writer ``{"put": layer, "t": ..., "stored": n}`` before
and after each layer, the reader ``{"got": layer, "t": ..., "err": median attention
error}``. Exit 0 on success; a KVStoreError prints ``{"error": type, "message": ...}`` and
exits 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

import kvclient
from kvstore.core.kvgen import attention_error, realistic_kv

HEADS, HEAD_DIM = 8, 128


def namespace(layers: int) -> kvclient.Namespace:
    """The namespace every test process agrees on."""
    return kvclient.Namespace(
        model="itest-model",
        revision="r1",
        num_layers=layers,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        block_tokens=256,
        quant="int8",
    )


def prompt(n: int, seed: int) -> list[int]:
    """Deterministic token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=g).tolist()


def layer_kv(n: int, layer: int, seed: int) -> torch.Tensor:
    """The KV the writer puts for ``layer`` (and the reader expects)."""
    return realistic_kv(n, HEADS, HEAD_DIM, torch.bfloat16, seed=seed * 1000 + layer)


def emit(**fields: object) -> None:
    """One JSON event line, flushed."""
    print(json.dumps({**fields, "t": time.time()}), flush=True)


async def writer(args: argparse.Namespace) -> None:
    tokens = prompt(args.tokens, args.seed)
    async with await kvclient.KVClient.connect(args.master, namespace(args.layers)) as kv:
        for layer in range(args.layers):
            t = layer_kv(args.tokens, layer, args.seed)
            emit(put=layer, phase="start")
            stored = await kv.put_layer(tokens, layer, t)
            emit(put=layer, phase="done", stored=stored)
            if args.pause_s:
                await asyncio.sleep(args.pause_s)


async def reader(args: argparse.Namespace) -> None:
    tokens = prompt(args.tokens, args.seed)
    queries = torch.randn(64, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    async with await kvclient.KVClient.connect(args.master, namespace(args.layers)) as kv:
        emit(ready=True)
        async for layer, t in kv.stream_layers(tokens, timeout=args.timeout):
            full = (args.tokens // 256) * 256
            ref = layer_kv(args.tokens, layer, args.seed)[:, :full]
            rel, _ = attention_error(ref.float(), t.float(), queries)
            emit(got=layer, tokens=t.shape[1], err=float(rel.median()))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["writer", "reader"])
    parser.add_argument("master")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    try:
        asyncio.run(writer(args) if args.role == "writer" else reader(args))
    except kvclient.KVStoreError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A decode engine's side: stream a prompt's KV layer by layer as the prefill writes it.

    python examples/decode.py MASTER [--tokens 2048] [--layers 32]

Start it before (or while) ``prefill.py`` runs: ``stream_layers`` waits for blocks that do
not exist yet and yields each layer as soon as every block of it has landed.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from prefill import namespace, prompt  # type: ignore[import-not-found]

import kvclient
from kvstore.core.kvgen import attention_error, realistic_kv


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("master")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    import torch

    tokens = prompt(args.tokens)
    queries = torch.randn(32, 8, 128)
    async with await kvclient.KVClient.connect(args.master, namespace(args.layers)) as kv:
        print("decode: waiting for the prompt's KV ...", flush=True)
        t0 = time.perf_counter()
        worst = 0.0
        async for layer, t in kv.stream_layers(tokens, timeout=60):
            ref = realistic_kv(args.tokens, 8, 128, torch.bfloat16, seed=layer)[:, : t.shape[1]]
            rel, _ = attention_error(ref.float(), t.float(), queries)
            worst = max(worst, float(rel.median()))
            if layer in (0, args.layers - 1):
                print(f"decode: layer {layer:2d} arrived after {time.perf_counter() - t0:.2f} s")
        print(f"decode: all {args.layers} layers, {t.shape[1]} tokens each; "
              f"worst median attention error {worst:.3%} (int8)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

"""A prefill writer or a decode reader in its own OS process, for integration tests.

    python tests/kvproc.py writer MASTER --tokens N --layers L [--seed S] [--pause-s P]
    python tests/kvproc.py reader MASTER --tokens N --layers L [--seed S] [--timeout T]
    python tests/kvproc.py stall|partial|crafted MASTER --tokens N --layers L --layer I

All derive the same prompt and KV from the seed. Each prints one JSON line per event
with a wall-clock timestamp: the writer ``{"put": layer, "t": ..., "stored": n}`` before
and after each layer, the reader ``{"got": layer, "t": ..., "err": median attention
error, "digest": xxh3 of the tensor's bytes}``. Hostile or broken writers of layer
``--layer`` write put frames by hand: ``stall`` sends a put's prefix and then nothing
(``{"claimed": n}``, then sleeps), ``partial`` sends half of the first chunk and waits to
be killed (``{"partial": n}``), ``crafted`` puts chunks with the right keys
encoded from float16 KV into the bfloat16 namespace (``{"crafted": ack}``). Exit 0 on
success; a KVStoreError prints ``{"error": type, "message": ...}`` and exits 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch
import xxhash

import kvclient
from kvstore.control.client import MasterClient
from kvstore.core.codec import ChunkKey, chunk_nbytes, encode_blocks
from kvstore.core.kvgen import attention_error, realistic_kv
from kvstore.dataplane import NodeClient, PutChunk
from kvstore.dataplane.messages import Put
from kvstore.transport.framing import encode_prefix

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
            emit(got=layer, tokens=t.shape[1], err=float(rel.median()), digest=digest(t))


def digest(t: torch.Tensor) -> str:
    """xxh3 of a tensor's bytes (to compare what a reader got with what it should get)."""
    return xxhash.xxh3_64_hexdigest(t.contiguous().view(torch.uint8).numpy().tobytes())


def encoded(args: argparse.Namespace, dtype: torch.dtype) -> tuple[list[bytes], list[torch.Tensor]]:
    """The block hashes of the prompt and chunks of ``--layer`` encoded from ``dtype``."""
    ns = namespace(args.layers)
    tokens = prompt(args.tokens, args.seed)
    hashes = kvclient.block_hashes(ns, tokens)
    full = len(hashes) * ns.block_tokens
    t = layer_kv(args.tokens, args.layer, args.seed)[:, :full].to(dtype)
    keys = [ChunkKey(h, args.layer, 0) for h in hashes]
    return hashes, encode_blocks(t, ns.block_tokens, keys, ns.quant)


async def data_uri(args: argparse.Namespace) -> str:
    """The data URI of the pool's one live node."""
    master = MasterClient(args.master)
    try:
        [node] = [n for n in await master.nodes() if n.alive]
    finally:
        await master.close()
    return node.data_uri


def put_request(args: argparse.Namespace, hashes: list[bytes]) -> Put:
    """A put of ``--layer``'s chunks of ``hashes``."""
    ns = namespace(args.layers)
    nbytes = chunk_nbytes(ns.block_tokens, ns.num_kv_heads, ns.head_dim, ns.dtype, ns.quant)
    spec = tuple(PutChunk(h, hashes[i - 1] if i else None, args.layer, nbytes)
                 for i, h in enumerate(hashes))  # fmt: skip
    return Put(ns.canonical_bytes(), spec)


async def open_raw(args: argparse.Namespace) -> asyncio.StreamWriter:
    """A plain socket to the node's data port (for frames written by hand)."""
    host, port = (await data_uri(args)).removeprefix("tcp://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    return writer


async def stall(args: argparse.Namespace) -> None:
    """The put frame's prefix announces every chunk, and nothing follows."""
    hashes, chunks = encoded(args, torch.bfloat16)
    writer = await open_raw(args)
    writer.write(encode_prefix(put_request(args, hashes).header(), [c.numel() for c in chunks]))
    await writer.drain()
    await asyncio.sleep(0.5)  # (the node reads the prefix and claims the chunks)
    emit(claimed=len(hashes))
    await asyncio.sleep(args.timeout)


async def partial(args: argparse.Namespace) -> None:
    """The put frame announces every chunk, and only half of the first one follows."""
    hashes, chunks = encoded(args, torch.bfloat16)
    writer = await open_raw(args)
    writer.write(encode_prefix(put_request(args, hashes).header(), [c.numel() for c in chunks]))
    writer.write(chunks[0].numpy()[: chunks[0].numel() // 2].tobytes())
    await writer.drain()
    emit(partial=len(hashes))
    await asyncio.sleep(args.timeout)


async def crafted(args: argparse.Namespace) -> None:
    hashes, chunks = encoded(args, torch.float16)
    ack = await NodeClient(await data_uri(args)).put(
        namespace(args.layers).canonical_bytes(), put_request(args, hashes).chunks, chunks
    )
    emit(crafted={"stored": ack.stored, "failed": list(ack.failed)})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["writer", "reader", "stall", "partial", "crafted"])
    parser.add_argument("master")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--layer", type=int, default=0)
    args = parser.parse_args()
    roles = {"writer": writer, "reader": reader, "stall": stall, "partial": partial,
             "crafted": crafted}  # fmt: skip
    try:
        asyncio.run(roles[args.role](args))
    except kvclient.KVStoreError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

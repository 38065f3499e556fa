"""Puts into a fresh node: host memory mapped when the node starts, beside mapped as the
puts first write it, in the same run.

    python bench/first_fill.py [--host-mem 3GiB] [--fill 2GiB] [--chunk "512 KiB"]
                               [--transport tcp|ucx] [--plot out.png]

Starts two ``kvstore serve --host-mem H`` nodes at once, one as shipped (``prefault-memory``
on: a thread maps the host arena's pages when the node starts) and one with
``--prefault-memory false``, and puts ``--fill`` bytes of fresh keys into each, 8 chunks
(``quant="none"``) an exchange, the two nodes taking turns exchange by exchange, as soon as
both are ready (a user's first puts):

- ``tcp``: over one kept ``tcp://`` connection, ``NodeClient.put`` of pre-encoded chunks;
- ``ucx``: ``--transport ucx`` nodes, ``KVClient(ucx=True).put_layer`` of 8 fresh blocks a
  call (the engine's path: encode into registered staging, one-sided WRITE, ``landed``).
  Over shared memory or TCP UCX copies with ``process_vm_writev``, which faults the node's
  unmapped pages in on the writer's CPU, so the writer's CPU is reported too.

Reports per node: put GB/s, p50/p99 per exchange, the node's CPU seconds and minor page
faults over the fill (``/proc``), the writer's CPU per GB (this process's thread time
around each exchange). Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BarPanel,
    KeptConnection,
    Serve,
    Table,
    expect,
    explain,
    latency_stats,
    print_report,
    proc_stat,
    progress,
    save_bar_plot,
)

from kvstore.core.codec import ChunkKey, chunk_nbytes, encode_blocks
from kvstore.core.hashing import Namespace
from kvstore.core.sizes import parse_size
from kvstore.dataplane import NodeClient
from kvstore.dataplane.messages import PutChunk
from kvstore.transport import connect

PER_EXCHANGE = 8
H, D = 8, 128


def ns_chunk_bytes(tokens: int) -> int:
    return chunk_nbytes(tokens, H, D, torch.bfloat16, "none")


def namespace(tokens: int) -> Namespace:
    return Namespace(model="first-fill", revision="1", num_layers=1, num_kv_heads=H,
                     head_dim=D, block_tokens=tokens, quant="none")  # fmt: skip


async def fill(
    nodes: dict[str, Serve], fill_bytes: int, chunk_bytes: int, transport: str = "tcp"
) -> dict[str, dict]:
    """Put ``fill_bytes`` of fresh keys into each node, taking turns; per node its
    latencies, bytes, writer CPU, and the node's CPU seconds and minor faults over the
    fill."""
    tokens = chunk_bytes // (2 * H * D * 2)
    ns = namespace(tokens)
    kv = torch.randn(2, tokens * PER_EXCHANGE, H, D).bfloat16()
    per_exchange = PER_EXCHANGE * ns_chunk_bytes(tokens)
    n = max(1, fill_bytes // per_exchange)
    if transport == "ucx":
        return await _fill_ucx(nodes, ns, kv, n, per_exchange)
    exchanges = []  # encoded beforehand: the timing is the put alone
    for i in range(n):
        keys = [(i * PER_EXCHANGE + j + 1).to_bytes(16, "big") for j in range(PER_EXCHANGE)]
        rows = encode_blocks(kv, tokens, [ChunkKey(k, 0, 0) for k in keys], "none")
        spec = tuple(PutChunk(k, None, 0, r.numel()) for k, r in zip(keys, rows, strict=True))
        exchanges.append((spec, [r.numpy() for r in rows]))
    clients, conns = {}, []
    for name, serve in nodes.items():
        conn = await connect(serve.addresses["data"], timeout=30.0)
        conns.append(conn)
        clients[name] = NodeClient(serve.addresses["data"], KeptConnection(conn), timeout_s=30.0)

    async def put(name: str, i: int) -> None:
        ack = await clients[name].put(ns.canonical_bytes(), *exchanges[i])
        expect(ack.stored == PER_EXCHANGE, f"{name}: {ack}")

    try:
        return await _take_turns(nodes, n, per_exchange, put)
    finally:
        for conn in conns:
            await conn.close()


async def _fill_ucx(
    nodes: dict[str, Serve], ns: Namespace, kv: torch.Tensor, n: int, per_exchange: int
) -> dict[str, dict]:
    """:func:`fill` over ``ucx://``: ``KVClient(ucx=True).put_layer`` of 8 fresh blocks a
    call into each node (one client per node, both in this process)."""
    from kvclient import KVClient

    clients = {name: await KVClient.connect(serve.addresses["grpc"], ns, timeout_s=30.0,
                                            ucx=True)
               for name, serve in nodes.items()}  # fmt: skip
    tokens = kv.shape[1]

    async def put(name: str, i: int) -> None:
        prompt = [i * tokens + j for j in range(tokens)]  # (fresh blocks each time)
        stored = await clients[name].put_layer(prompt, 0, kv)
        expect(stored == tokens, f"{name}: stored {stored} of {tokens} tokens")

    try:
        block = ns.block_tokens  # untimed: one block each, so that the client's NIXL agent,
        for client in clients.values():  # its staging and its link to the node are set up
            await client.put_layer(list(range(1 << 30, (1 << 30) + block)), 0, kv[:, :block])
        return await _take_turns(nodes, n, per_exchange, put)
    finally:
        for client in clients.values():
            await client.close()


async def _take_turns(
    nodes: dict[str, Serve],
    n: int,
    per_exchange: int,
    put: Callable[[str, int], Awaitable[None]],
) -> dict[str, dict]:
    """``put(node, i)`` for ``i`` in ``range(n)``, the nodes taking turns; per node its
    latencies, writer CPU (this thread's time around each put), bytes, and its process's
    ``/proc`` figures before and after."""
    out: dict[str, dict] = {name: {"lat": [], "writer_s": 0.0} for name in nodes}
    for name, serve in nodes.items():
        out[name]["before"] = proc_stat(serve.proc.pid)
    with progress() as bar:
        task = bar.add_task("exchanges", total=n * len(nodes))
        for i in range(n):
            for name in nodes:
                t0, c0 = time.perf_counter(), time.thread_time()
                await put(name, i)
                out[name]["writer_s"] += time.thread_time() - c0
                out[name]["lat"].append(time.perf_counter() - t0)
                bar.advance(task)
    for name, serve in nodes.items():
        out[name]["after"] = proc_stat(serve.proc.pid)
        out[name]["bytes"] = n * per_exchange
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host-mem", default="3GiB")
    p.add_argument("--fill", default="2GiB")
    p.add_argument("--chunk", default="512 KiB")
    p.add_argument("--transport", choices=("tcp", "ucx"), default="tcp")
    p.add_argument("--plot", default=None)
    args = explain(p, __doc__).parse_args(argv)
    flags = {"mapped at start": (), "mapped as first written": ("--prefault-memory", "false")}
    ucx = ("--transport", "ucx") if args.transport == "ucx" else ()
    nodes = {
        name: Serve.start("--host-mem", args.host_mem, *ucx, *extra)
        for name, extra in flags.items()
    }
    try:
        got = asyncio.run(
            fill(nodes, parse_size(args.fill), parse_size(args.chunk), args.transport)
        )
    finally:
        for serve in nodes.values():
            serve.stop()
    how = ("ucx://, KVClient.put_layer" if args.transport == "ucx"
           else "tcp://, one kept connection")  # fmt: skip
    table = Table(
        f"A fresh node's first {args.fill} of puts (host memory {args.host_mem}, "
        f"{PER_EXCHANGE} x {args.chunk} an exchange, {how})",
        [
            "host memory",
            "GB/s",
            "p50 ms",
            "p99 ms",
            "node CPU s",
            "node CPU s/GB",
            "minor faults",
            "writer CPU s/GB",
        ],
    )
    for name, r in got.items():
        stats = latency_stats(r["lat"])
        used = r["after"] - r["before"]
        gb = r["bytes"] / 1e9
        table.rows.append([name, f"{gb / sum(r['lat']):.2f}", f"{stats['p50'] * 1e3:.2f}",
                           f"{stats['p99'] * 1e3:.2f}", f"{used.cpu_s:.2f}",
                           f"{used.cpu_s / gb:.3f}", used.minor_faults,
                           f"{r['writer_s'] / gb:.3f}"])  # fmt: skip
    table.notes.append(
        "the two nodes run at once and take turns exchange by exchange; the fill starts once "
        "both are ready and its exchanges are encoded (tcp://) or the client's NIXL agent "
        "has put one block into each node (ucx://): seconds, in which the first node's "
        "mapping thread (~0.4 s of a core per GiB here) has mostly run; it is not counted; "
        "GB/s: bytes over the sum of the exchanges' times; CPU and faults: /proc of each "
        "node over the fill; writer CPU: this process's thread time around each exchange "
        "(over ucx:// it holds the copy into the node's memory, and the faults of pages the "
        "node did not map; not the codec thread's encode)"
    )
    print_report("Puts into a fresh node", "bench/first_fill.py", argv, [table])
    if args.plot:
        rates = {"GB/s": [float(str(r[1])) for r in table.rows]}
        save_bar_plot(args.plot, [BarPanel("put GB/s into a fresh node", "GB/s", list(got), rates)])
        print(f"Plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure a running ``kvstore serve`` end to end, beside the baselines it should match.

    python bench/service.py [--reps 5] [--warmup 1] [--eager] [--plot out.png]

One run starts its own ``kvstore serve`` (loopback, port 0), two client processes (a
*writer* and a *reader*, neither of them the server), a plain asyncio TCP server and a bare
``grpc.aio`` echo server, each in its own process, and stops them all at the end. It prints
Markdown on stdout (progress goes to stderr):

1. put and get of one prompt (default 2048 tokens x 32 layers, H=8, D=128, bf16, 256-token
   blocks, int8) through ``KVClient.put_layer`` / ``get_layer``, split into codec time
   (``encode_blocks`` / ``decode_chunk`` alone, same process) and transport time (the same
   chunks moved with the node's data-plane protocol over ``kvstore.transport.connect``,
   master commit included, no codec); GB/s as bf16 input bytes and as int8 wire bytes.
2. the same chunk bytes over plain asyncio streams (``readexactly``; one layer's chunks per
   round trip, one ack per layer) between two processes.
3. ``match_prefix`` latency on a 128-block prompt (a small 2-layer namespace: the cost
   depends on the block count, not the chunk size) beside a bare ``grpc.aio`` unary echo
   of the same request and response sizes and the generated stub's ``MatchPrefix``.
4. CPU seconds of the server process (``/proc``, each thread's schedstat) and of the client
   per GB moved.

Every prompt uses fresh tokens (first writer wins, so a re-put would move nothing); the
first ``--warmup`` prompts open connections and warm caches and are not reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import statistics
import struct
import sys
from collections.abc import Awaitable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

import grpc
import torch
from _common import (
    BarPanel,
    KeptConnection,
    Serve,
    SpawnedServer,
    Table,
    expect,
    explain,
    meter,
    print_report,
    progress,
    save_bar_plot,
    time_calls,
    time_calls_async,
)

from kvclient import KVClient
from kvstore.core import fused, native
from kvstore.core.arena import parse_size
from kvstore.core.codec import ChunkKey, chunk_nbytes, decode_chunk, encode_blocks
from kvstore.core.hashing import Namespace, block_hashes
from kvstore.core.kvgen import realistic_kv
from kvstore.dataplane import ChunkRef, NodeClient, PutChunk
from kvstore.transport import as_byte_view, connect
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

HEADS, HEAD_DIM, BLOCK = 8, 128, 256
MATCH_LAYERS, MATCH_HEADS, MATCH_HEAD_DIM = 2, 1, 16
IO_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 600.0
RAW_HEAD = struct.Struct("<cII")  # op (b"P" put, b"G" get), chunk count, chunk bytes
RAW_MAX_CHUNK = 64 * 2**20
RAW_MAX_COUNT = 4096
TRANSPORT_SEED_OFFSET = 1_000_003  # the transport-only prompt of seed s uses s + this
EAGER_SEED_OFFSET = 2_000_003  # --eager: the eager codec's prompt of rep s uses s + this
FILL_SEED = 2_000_003  # pool-filling prompts use FILL_SEED + k
Stats = dict[str, float]


# ----------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Setup:
    """Where everything runs and what to move; sent to the worker processes."""

    master: str
    data_uri: str
    server_pid: int
    raw_addr: tuple[str, int]
    raw_pid: int
    echo_addr: str
    tokens: int
    layers: int
    match_blocks: int
    match_calls: int

    @property
    def full_tokens(self) -> int:
        return self.tokens // BLOCK * BLOCK

    @property
    def chunk_bytes(self) -> int:
        return chunk_nbytes(BLOCK, HEADS, HEAD_DIM, torch.bfloat16, "int8")

    @property
    def input_bytes(self) -> int:
        """bf16 KV bytes of the prompt's full blocks, every layer."""
        return self.layers * 2 * self.full_tokens * HEADS * HEAD_DIM * 2

    @property
    def wire_bytes(self) -> int:
        """int8 chunk bytes of the prompt's full blocks, every layer."""
        return self.layers * (self.tokens // BLOCK) * self.chunk_bytes


def big_namespace(layers: int) -> Namespace:
    """The namespace of section 1: a 32-layer, 8-KV-head model shard."""
    return Namespace(
        model="bench-service",
        revision="r1",
        num_layers=layers,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        block_tokens=BLOCK,
        quant="int8",
    )


def match_namespace() -> Namespace:
    """A small namespace for ``match_prefix``: 128 blocks of it fit in any pool."""
    return Namespace(
        model="bench-match",
        revision="r1",
        num_layers=MATCH_LAYERS,
        num_kv_heads=MATCH_HEADS,
        head_dim=MATCH_HEAD_DIM,
        dtype=torch.bfloat16,
        block_tokens=BLOCK,
        quant="int8",
    )


def prompt(n: int, seed: int) -> list[int]:
    """Deterministic token ids; different seeds give different block hashes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=g).tolist()  # type: ignore[no-any-return]


def layer_kv(n: int, layer: int, seed: int) -> torch.Tensor:
    """Realistic bf16 KV ``[2, n, H, D]`` of one layer."""
    return realistic_kv(n, HEADS, HEAD_DIM, torch.bfloat16, seed=seed * 1000 + layer)


# ----------------------------------------------------------------------- worker processes

_STATE: dict[str, Any] = {}
"""Per worker process: its event loop, clients and connections, kept across jobs."""


def _run(coro: Awaitable[Any]) -> Any:
    loop = _STATE.get("loop")
    if loop is None:
        loop = _STATE["loop"] = asyncio.new_event_loop()
    return loop.run_until_complete(coro)


async def _client(master: str, ns: Namespace) -> KVClient:
    clients: dict[bytes, KVClient] = _STATE.setdefault("clients", {})
    if ns.id not in clients:
        clients[ns.id] = await KVClient.connect(master, ns, timeout_s=IO_TIMEOUT_S)
    return clients[ns.id]


async def _node(uri: str) -> NodeClient:
    """The node's data port over this worker's one kept connection (dialled once)."""
    if "data" not in _STATE:
        _STATE["data"] = await connect(uri, timeout=IO_TIMEOUT_S)
        _STATE["node"] = NodeClient(uri, KeptConnection(_STATE["data"]), timeout_s=IO_TIMEOUT_S)
    return _STATE["node"]  # type: ignore[no-any-return]


async def _raw_conn(addr: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if "raw" not in _STATE:
        _STATE["raw"] = await asyncio.wait_for(asyncio.open_connection(*addr), IO_TIMEOUT_S)
    return _STATE["raw"]  # type: ignore[no-any-return]


def job_close() -> None:
    """Close this worker's clients and connections (the last job of each worker)."""

    async def close() -> None:
        for kv in _STATE.pop("clients", {}).values():
            await kv.close()
        _STATE.pop("node", None)
        if "data" in _STATE:
            await _STATE.pop("data").close()
        if "raw" in _STATE:
            _, writer = _STATE.pop("raw")
            writer.close()

    if "loop" in _STATE:
        _run(close())
        _STATE.pop("loop").close()


async def protocol_put(
    node: NodeClient, ns: Namespace, hashes: list[bytes], layer: int, chunks: list[torch.Tensor]
) -> None:
    """Put one layer's pre-encoded chunks with the node's data-plane exchange (``put`` →
    ``ready`` → ``data`` → ``ack``, the ack coming after the node's master commit); every
    chunk must be sent and stored (fresh tokens: none is on the node yet)."""
    spec = [
        PutChunk(h, hashes[i - 1] if i else None, layer * ns.tp_size, chunks[i].numel())
        for i, h in enumerate(hashes)
    ]
    ack = await node.put(ns.canonical_bytes(), spec, [c.numpy() for c in chunks])
    expect(ack.stored == len(hashes), f"node stored {ack} of {len(hashes)} chunks, layer {layer}")


async def protocol_get(
    node: NodeClient, ns: Namespace, hashes: list[bytes], layer: int, rows: torch.Tensor
) -> None:
    """Get one layer's chunks with the node's ``get`` exchange straight into ``rows``."""

    def into(found: list[int]) -> list[Any]:
        expect(len(found) == len(hashes), f"node misses chunks of layer {layer}")
        return [rows[i].numpy() for i in found]

    await node.get(ns.id, [ChunkRef(h, layer * ns.tp_size) for h in hashes], into)


async def raw_put(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bufs: list[Any]
) -> None:
    """Send one layer's chunks over plain asyncio streams and wait for the 1-byte ack."""
    writer.write(RAW_HEAD.pack(b"P", len(bufs), len(bufs[0])))
    for b in bufs:
        writer.write(b)
    await writer.drain()
    await asyncio.wait_for(reader.readexactly(1), IO_TIMEOUT_S)


async def raw_get(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: int, size: int
) -> None:
    """Ask for ``count`` chunks of ``size`` bytes and read them with ``readexactly``."""
    writer.write(RAW_HEAD.pack(b"G", count, size))
    await writer.drain()
    async with asyncio.timeout(IO_TIMEOUT_S):
        for _ in range(count):
            await reader.readexactly(size)


def _rows(setup: Setup, blocks: int) -> torch.Tensor:
    """This worker's ``[layers, blocks, chunk_bytes]`` chunk buffer, zeroed once so that
    first-touch page faults stay out of the codec and transport timings."""
    rows = _STATE.get("rows")
    if rows is None:
        shape = (setup.layers, blocks, setup.chunk_bytes)
        rows = _STATE["rows"] = torch.zeros(shape, dtype=torch.uint8)
    return rows  # type: ignore[no-any-return]


def job_fill(setup: Setup, seed: int) -> Stats:
    """Writer process: put one prompt's chunks over tcp:// to fill the pool (the first
    touch of its memory), timed like a transport-only put."""
    return _run(_fill(setup, seed))  # type: ignore[no-any-return]


async def _fill(setup: Setup, seed: int) -> Stats:
    ns = big_namespace(setup.layers)
    kv = _STATE.get("fill_kv")
    if kv is None:
        kv = _STATE["fill_kv"] = layer_kv(setup.tokens, 0, FILL_SEED)
    hashes = block_hashes(ns, prompt(setup.tokens, seed))
    rows = _rows(setup, len(hashes))
    chunks = [
        encode_blocks(kv, BLOCK, [ChunkKey(h, i, 0) for h in hashes], ns.quant, out=rows[i])
        for i in range(setup.layers)
    ]
    node = await _node(setup.data_uri)
    with meter(setup.server_pid) as rec:
        for i, layer_chunks in enumerate(chunks):
            await protocol_put(node, ns, hashes, i, layer_chunks)
    return rec


def job_node_stats(setup: Setup) -> dict[str, Any]:
    """The node's ``stats`` answer (slots, used and capacity bytes)."""

    async def ask() -> dict[str, Any]:
        return await (await _node(setup.data_uri)).stats()

    return _run(ask())  # type: ignore[no-any-return]


def job_write(setup: Setup, seed: int, codec: str | None = None) -> dict[str, Stats]:
    """Writer process, one prompt: put_layer x L, encode alone, protocol put, raw put;
    ``codec``: the codec path (kvstore.core.fused's modes; None: the default)."""
    fused.set_mode(codec)
    return _run(_write(setup, seed))  # type: ignore[no-any-return]


async def _write(setup: Setup, seed: int) -> dict[str, Stats]:
    ns = big_namespace(setup.layers)
    kv = await _client(setup.master, ns)
    layers = [layer_kv(setup.tokens, i, seed) for i in range(setup.layers)]
    tokens = prompt(setup.tokens, seed)
    res: dict[str, Stats] = {}
    with meter(setup.server_pid) as res["put"]:
        for i, t in enumerate(layers):
            stored = await kv.put_layer(tokens, i, t)
            expect(stored == setup.full_tokens, f"put_layer stored {stored} tokens")
    hashes = block_hashes(ns, prompt(setup.tokens, seed + TRANSPORT_SEED_OFFSET))
    rows = _rows(setup, len(hashes))
    with meter(setup.server_pid) as res["encode"]:
        chunks = [
            encode_blocks(t, BLOCK, [ChunkKey(h, i, 0) for h in hashes], ns.quant, out=rows[i])
            for i, t in enumerate(layers)
        ]
    node = await _node(setup.data_uri)
    with meter(setup.server_pid) as res["put_transport"]:
        for i, layer_chunks in enumerate(chunks):
            await protocol_put(node, ns, hashes, i, layer_chunks)
    reader, writer = await _raw_conn(setup.raw_addr)
    with meter(setup.raw_pid) as res["raw_put"]:
        for layer_chunks in chunks:
            await raw_put(reader, writer, [as_byte_view(c) for c in layer_chunks])
    return res


def job_read(setup: Setup, seed: int, codec: str | None = None) -> dict[str, Stats]:
    """Reader process, one prompt: get_layer x L, protocol get, decode alone, raw get;
    ``codec`` as for :func:`job_write`."""
    fused.set_mode(codec)
    return _run(_read(setup, seed))  # type: ignore[no-any-return]


async def _read(setup: Setup, seed: int) -> dict[str, Stats]:
    ns = big_namespace(setup.layers)
    kv = await _client(setup.master, ns)
    tokens, n = prompt(setup.tokens, seed), setup.full_tokens
    out = _STATE.get("out")
    if out is None:
        out = _STATE["out"] = torch.zeros(2, setup.tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    res: dict[str, Stats] = {}
    with meter(setup.server_pid) as res["get"]:
        for i in range(setup.layers):
            got = await kv.get_layer(tokens, i, out=out)
            expect(got.shape[1] == n, f"get_layer returned {got.shape[1]} of {n} tokens")
    ref = layer_kv(setup.tokens, setup.layers - 1, seed)[:, :n].float()
    res["quality"] = {"rel_error": float((out[:, :n].float() - ref).norm() / ref.norm())}
    hashes = block_hashes(ns, prompt(setup.tokens, seed + TRANSPORT_SEED_OFFSET))
    rows = _rows(setup, len(hashes))
    node = await _node(setup.data_uri)
    with meter(setup.server_pid) as res["get_transport"]:
        for i in range(setup.layers):
            await protocol_get(node, ns, hashes, i, rows[i])
    with meter(setup.server_pid) as res["decode"]:
        for i in range(setup.layers):
            for b, h in enumerate(hashes):
                span = out[:, b * BLOCK : (b + 1) * BLOCK]
                decode_chunk(rows[i, b], out=span, expect_key=ChunkKey(h, i, 0))
    reader, writer = await _raw_conn(setup.raw_addr)
    with meter(setup.raw_pid) as res["raw_get"]:
        for _ in range(setup.layers):
            await raw_get(reader, writer, len(hashes), setup.chunk_bytes)
    return res


def job_match(setup: Setup) -> dict[str, Stats]:
    """Put a 128-block prompt (small namespace), then time match_prefix beside the echo."""
    return _run(_match(setup))  # type: ignore[no-any-return]


async def _match(setup: Setup) -> dict[str, Stats]:
    ns = match_namespace()
    kv = await _client(setup.master, ns)
    n = setup.match_blocks * BLOCK
    tokens = prompt(n, 4242)
    for layer in range(ns.num_layers):
        t = realistic_kv(n, MATCH_HEADS, MATCH_HEAD_DIM, torch.bfloat16, seed=layer)
        expect(await kv.put_layer(tokens, layer, t) == n, "match prompt was not stored")
    expect(await kv.match_prefix(tokens) == n, "match_prefix does not see the whole prompt")
    hashes = kv.block_hashes(tokens)
    req = pb.MatchPrefixRequest(
        ns_id=ns.id, block_hashes=hashes, chunks_per_block=ns.num_layers, block_tokens=BLOCK
    )
    res: dict[str, Stats] = {}
    async with grpc.aio.insecure_channel(setup.master) as channel:
        stub = pb_grpc.MasterStub(channel)
        resp = await stub.MatchPrefix(req, timeout=IO_TIMEOUT_S)
        expect(resp.blocks == setup.match_blocks, f"MatchPrefix matched {resp.blocks} blocks")
        res["stub"] = await time_calls_async(
            lambda: stub.MatchPrefix(req, timeout=IO_TIMEOUT_S), setup.match_calls
        )
    sizes = {"req_bytes": float(req.ByteSize()), "resp_bytes": float(resp.ByteSize())}
    res["stub"].update(sizes)
    payload = struct.pack("<I", resp.ByteSize()) + req.SerializeToString()[4:]
    async with grpc.aio.insecure_channel(setup.echo_addr) as channel:
        echo = channel.unary_unary("/bench.Echo/Echo")
        reply = await echo(payload, timeout=IO_TIMEOUT_S)
        expect(len(reply) == resp.ByteSize(), "echo answered the wrong size")
        res["echo"] = await time_calls_async(
            lambda: echo(payload, timeout=IO_TIMEOUT_S), setup.match_calls
        )
    res["echo"].update(sizes)
    res["client"] = await time_calls_async(lambda: kv.match_prefix(tokens), setup.match_calls)
    res["client"].update(sizes)
    res["hashes"] = time_calls(lambda: kv.block_hashes(tokens), setup.match_calls)
    return res


# ----------------------------------------------------------------------- baseline servers


def serve_raw_tcp(pipe: Pipe) -> None:
    """Process target: a plain asyncio TCP server (streams, ``readexactly``); sends its
    ``(host, port)`` through ``pipe`` and serves until terminated."""
    asyncio.run(_raw_server(pipe))


async def _raw_server(pipe: Pipe) -> None:
    blobs: dict[int, bytes] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                op, count, size = RAW_HEAD.unpack(await reader.readexactly(RAW_HEAD.size))
                if count > RAW_MAX_COUNT or size > RAW_MAX_CHUNK or op not in (b"P", b"G"):
                    return
                if op == b"P":
                    for _ in range(count):
                        await reader.readexactly(size)
                    writer.write(b"k")
                else:
                    blob = blobs.setdefault(size, bytes(size))
                    for _ in range(count):
                        writer.write(blob)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    pipe.send(server.sockets[0].getsockname()[:2])
    await server.serve_forever()


def serve_grpc_echo(pipe: Pipe) -> None:
    """Process target: a bare ``grpc.aio`` server with one unary bytes method,
    ``/bench.Echo/Echo``, answering ``size`` zero bytes to a request that starts with
    ``size`` (u32 LE); sends its address through ``pipe`` and serves until terminated."""
    asyncio.run(_echo_server(pipe))


async def _echo_server(pipe: Pipe) -> None:
    replies: dict[int, bytes] = {}

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        size = min(struct.unpack_from("<I", request)[0], 2**20)
        return replies.setdefault(size, bytes(size))

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pipe.send(f"127.0.0.1:{port}")
    await server.wait_for_termination()


# ----------------------------------------------------------------------- orchestration


@dataclass
class Results:
    """What one run measured: the pool-filling puts, per reported prompt the spans of both
    workers, the match_prefix latencies, and the node's stats after the fill."""

    setup: Setup
    fill: list[Stats]
    prompts: list[dict[str, Stats]]
    match: dict[str, Stats]
    pool: dict[str, Any]
    eager: list[dict[str, Stats]]  # --eager: the same prompts' shape with the eager codec


def run(args: argparse.Namespace) -> Results:
    """Start everything, fill the pool, measure, stop everything (also on failure)."""
    with contextlib.ExitStack() as stack, progress() as bar:
        task = bar.add_task("starting kvstore serve", total=None)
        # (mapped: the node maps its memory on a thread after its ready line; the fill and
        # --no-fill puts must neither race that thread nor be billed for it)
        serve = stack.enter_context(Serve.start("--host-mem", args.host_mem, mapped=True))
        bar.update(task, description="starting baseline servers")
        raw, echo = SpawnedServer.start(serve_raw_tcp), SpawnedServer.start(serve_grpc_echo)
        stack.callback(raw.stop)
        stack.callback(echo.stop)
        setup = Setup(
            master=serve.addresses["grpc"],
            data_uri=serve.addresses["data"],
            server_pid=serve.proc.pid,
            raw_addr=tuple(raw.address),
            raw_pid=raw.pid,
            echo_addr=echo.address,
            tokens=args.tokens,
            layers=args.layers,
            match_blocks=args.match_blocks,
            match_calls=args.match_calls,
        )
        fills = -(-parse_size(args.host_mem) // setup.wire_bytes) + 1 if args.fill else 0
        bar.update(task, total=fills + 2 * (1 + args.eager) * (args.warmup + args.reps) + 2)
        bar.update(task, description="starting writer and reader processes")
        writer, reader = _worker(stack), _worker(stack)
        fill = []
        for k in range(fills):
            bar.update(task, advance=1, description=f"filling the pool: prompt {k + 1}/{fills}")
            fill.append(writer.submit(job_fill, setup, FILL_SEED + k).result(JOB_TIMEOUT_S))
        pool = writer.submit(job_node_stats, setup).result(JOB_TIMEOUT_S)
        prompts = []
        eager: list[dict[str, Stats]] = []
        codecs = [(None, prompts, 0), ("eager", eager, EAGER_SEED_OFFSET)][: 1 + args.eager]
        for rep in range(args.warmup + args.reps):
            tag = "warm-up" if rep < args.warmup else f"prompt {rep - args.warmup + 1}"
            for codec, into, offset in codecs:  # alternating: the VM is shared
                what = f"{tag}{' (eager codec)' if codec else ''}"
                bar.update(task, advance=1, description=f"{what}: writer puts {args.layers} layers")
                w = writer.submit(job_write, setup, rep + 1 + offset, codec).result(JOB_TIMEOUT_S)
                bar.update(task, advance=1, description=f"{what}: reader gets {args.layers} layers")
                r = reader.submit(job_read, setup, rep + 1 + offset, codec).result(JOB_TIMEOUT_S)
                if rep >= args.warmup:
                    into.append({**w, **r})
        bar.update(task, advance=1, description=f"match_prefix x {args.match_calls}")
        match = reader.submit(job_match, setup).result(JOB_TIMEOUT_S)
        bar.update(task, advance=1, description="stopping")
    return Results(setup, fill, prompts, match, pool, eager)


def _worker(stack: contextlib.ExitStack) -> ProcessPoolExecutor:
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))

    def close() -> None:
        with contextlib.suppress(Exception):
            pool.submit(job_close).result(30)
        pool.shutdown(wait=True, cancel_futures=True)

    stack.callback(close)
    return pool


# ----------------------------------------------------------------------- report


def _col(prompts: list[dict[str, Stats]], span: str, field: str = "s") -> list[float]:
    return [p[span][field] for p in prompts]


def _minus(prompts: list[dict[str, Stats]], total: str, part: str) -> list[float]:
    return [p[total]["s"] - p[part]["s"] for p in prompts]


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "n/a"


def throughput_table(res: Results) -> Table:
    """Section 1: put/get end to end, codec alone, transport alone, total - codec."""
    s, p = res.setup, res.prompts
    table = Table(
        f"1. put / get of one {s.tokens}-token, {s.layers}-layer prompt "
        f"(H={HEADS}, D={HEAD_DIM}, bf16, {BLOCK}-token blocks, int8), "
        f"{len(p)} prompts",
        ["step", "ms median", "ms best", "bf16 GB/s median", "bf16 GB/s best",
         "wire GB/s median", "wire GB/s best"],
    )  # fmt: skip
    rows = [
        (f"put: put_layer x {s.layers}, end to end (writer process)", _col(p, "put")),
        (f"put: encode_blocks x {s.layers} alone (codec)", _col(p, "encode")),
        ("put: over tcp:// alone (node protocol, pre-encoded)", _col(p, "put_transport")),
        ("put: end to end minus encode", _minus(p, "put", "encode")),
        (f"get: get_layer x {s.layers}, end to end (reader process)", _col(p, "get")),
        (f"get: decode_chunk x {s.layers * (s.tokens // BLOCK)} alone (codec)", _col(p, "decode")),
        ("get: over tcp:// alone (node protocol, into buffers)", _col(p, "get_transport")),
        ("get: end to end minus decode", _minus(p, "get", "decode")),
    ]
    for label, secs in rows:
        med, best = statistics.median(secs), min(secs)
        table.add(
            label, f"{med * 1e3:.1f}", f"{best * 1e3:.1f}",
            _gbps(s.input_bytes, med), _gbps(s.input_bytes, best),
            _gbps(s.wire_bytes, med), _gbps(s.wire_bytes, best),
        )  # fmt: skip
    errs = [x["quality"]["rel_error"] for x in p]
    table.notes += [
        f"bf16 bytes: {s.input_bytes:,} (the prompt's KV, every layer); wire bytes: "
        f"{s.wire_bytes:,} ({s.layers * (s.tokens // BLOCK)} chunks x {s.chunk_bytes:,} B).",
        "Writer and reader are separate processes, neither the server; median and best "
        "over the prompts (different seeds, fresh tokens each).",
        _pool_note(res),
        "'alone' rows run in the same process right after the end-to-end pass, on "
        "preallocated chunk buffers; the transport rows move the same chunk bytes (another "
        "prompt's keys) with the node's put/get exchange over kvstore.transport.connect — "
        "the put includes the node's checksum pass and master commit.",
        f"Read-back check: relative L2 error of the last layer vs the bf16 original, "
        f"median {statistics.median(errs):.4f}.",
    ]
    return table


def codec_table(res: Results) -> Table:
    """--eager: put_layer / get_layer x L with the default codec beside the eager one."""
    s, p, e = res.setup, res.prompts, res.eager
    table = Table(
        f"1b. The default codec ({'C kernels' if native.available() else 'eager: no C kernels'}) "
        f"vs the eager codec, end to end, {len(p)} prompts each, alternating",
        ["step", "default ms median", "eager ms median", "eager / default"],
    )  # fmt: skip
    chunks = s.layers * (s.tokens // BLOCK)
    spans = {
        f"put_layer x {s.layers}": "put",
        f"get_layer x {s.layers}": "get",
        f"encode_blocks x {s.layers}": "encode",
        f"decode_chunk x {chunks}": "decode",
    }
    for label, span in spans.items():
        fast, slow = statistics.median(_col(p, span)), statistics.median(_col(e, span))
        table.add(label, f"{fast * 1e3:.1f}", f"{slow * 1e3:.1f}", f"{slow / fast:.2f}x")
    return table


def _pool_note(res: Results) -> str:
    pool = res.pool
    used, cap = int(pool.get("used_bytes", 0)), int(pool.get("capacity_bytes", 0))
    if not res.fill:
        return f"Pool: {cap:,} B, fresh (--no-fill): puts pay first-touch page faults."
    return (
        f"Pool: {cap:,} B, filled first by {len(res.fill)} prompts ({used:,} B used, "
        f"{pool.get('slots')} slots), so every measured put evicts LRU slots and lands in "
        "pages touched before — the steady state of a full cache."
    )


def raw_table(res: Results) -> Table:
    """Section 2: the same bytes over plain asyncio streams, beside our tcp://."""
    s, p = res.setup, res.prompts
    table = Table(
        "2. the same chunk bytes over plain asyncio TCP (streams, readexactly)",
        ["path", "ms median", "ms best", "wire GB/s median", "wire GB/s best",
         "tcp:// ÷ raw (median GB/s)"],
    )  # fmt: skip
    raw_put, raw_get = _col(p, "raw_put"), _col(p, "raw_get")
    tput, tget = _col(p, "put_transport"), _col(p, "get_transport")
    for label, secs, base in [
        ("raw asyncio, client → server, ack per layer", raw_put, raw_put),
        ("tcp:// put (node protocol + commit)", tput, raw_put),
        ("raw asyncio, server → client, request per layer", raw_get, raw_get),
        ("tcp:// get (node protocol)", tget, raw_get),
    ]:
        med, best = statistics.median(secs), min(secs)
        table.add(
            label, f"{med * 1e3:.1f}", f"{best * 1e3:.1f}",
            _gbps(s.wire_bytes, med), _gbps(s.wire_bytes, best),
            f"{statistics.median(base) / med:.2f}",
        )  # fmt: skip
    table.notes.append(
        f"{s.layers} round trips of {s.tokens // BLOCK} x {s.chunk_bytes:,} B, loopback, "
        "raw server in its own process; receive side uses readexactly (one copy per chunk)."
    )
    return table


def match_table(res: Results) -> Table:
    """Section 3: match_prefix latency beside a bare grpc.aio echo."""
    s, m = res.setup, res.match
    table = Table(
        f"3. match_prefix of a {s.match_blocks}-block prompt, {s.match_calls} sequential calls",
        ["call", "request B", "response B", "p50 µs", "p99 µs", "mean µs", "calls/s",
         "p50 ÷ echo p50"],
    )  # fmt: skip
    echo = m["echo"]["p50"]
    for label, key in [
        ("bare grpc.aio unary echo (own process)", "echo"),
        ("MasterStub.MatchPrefix (generated stub, pre-hashed)", "stub"),
        ("KVClient.match_prefix (hash + RPC)", "client"),
        ("kv.block_hashes alone (no I/O)", "hashes"),
    ]:
        st = m[key]
        table.add(
            label,
            f"{int(st['req_bytes']):,}" if "req_bytes" in st else "-",
            f"{int(st['resp_bytes']):,}" if "resp_bytes" in st else "-",
            f"{st['p50'] * 1e6:.0f}", f"{st['p99'] * 1e6:.0f}", f"{st['mean'] * 1e6:.0f}",
            f"{1 / st['mean']:.0f}", f"{st['p50'] / echo:.2f}",
        )  # fmt: skip
    table.notes.append(
        f"Namespace with {MATCH_LAYERS} layers, H={MATCH_HEADS}, D={MATCH_HEAD_DIM}, all "
        f"{s.match_blocks} blocks present; 50 warm-up calls each. The echo answers as many "
        "bytes as MatchPrefix does, to a request of MatchPrefix's size."
    )
    return table


def cpu_table(res: Results) -> Table:
    """Section 4: server and client CPU seconds per GB moved."""
    s, p = res.setup, res.prompts
    gb = s.wire_bytes / 1e9
    table = Table(
        "4. CPU time per GB moved (wire bytes)",
        ["phase", "server process", "server CPU s", "server CPU s/GB", "server minor faults",
         "client CPU s/GB", "client minor faults"],
    )  # fmt: skip
    if res.fill:
        fill = [{"fill": f} for f in res.fill]
        cpu = statistics.median(_col(fill, "fill", "server_cpu"))
        table.add(
            "put over tcp://, pool memory never touched (filling it)", "kvstore serve",
            f"{cpu:.3f}", f"{cpu / gb:.2f}",
            f"{statistics.median(_col(fill, 'fill', 'server_faults')):,.0f}",
            f"{statistics.median(_col(fill, 'fill', 'client_cpu')) / gb:.2f}",
            f"{statistics.median(_col(fill, 'fill', 'client_faults')):,.0f}",
        )  # fmt: skip
    for label, span, who in [
        ("put_layer end to end", "put", "kvstore serve"),
        ("put over tcp:// alone", "put_transport", "kvstore serve"),
        ("get_layer end to end", "get", "kvstore serve"),
        ("get over tcp:// alone", "get_transport", "kvstore serve"),
        ("raw asyncio, client → server", "raw_put", "raw asyncio server"),
        ("raw asyncio, server → client", "raw_get", "raw asyncio server"),
    ]:
        cpu = statistics.median(_col(p, span, "server_cpu"))
        table.add(
            label, who, f"{cpu:.3f}", f"{cpu / gb:.2f}",
            f"{statistics.median(_col(p, span, 'server_faults')):,.0f}",
            f"{statistics.median(_col(p, span, 'client_cpu')) / gb:.2f}",
            f"{statistics.median(_col(p, span, 'client_faults')):,.0f}",
        )  # fmt: skip
    table.notes += [
        f"{gb:.3f} GB per phase; medians over the prompts. Server CPU: every thread's time "
        "on a CPU, from /proc/<pid>/task/*/schedstat (to the microsecond); kvstore serve is "
        "master + node in one process, so its put CPU includes the commit RPC it serves.",
        "Client CPU: getrusage of the writer/reader process (codec thread included).",
        "Minor faults: first touches of fresh memory. "
        + (
            f"The first row is the pool-filling puts ({len(res.fill)} prompts into "
            "never-touched slot pages, median); every other put lands in reused pages and "
            "evicts LRU slots."
            if res.fill
            else "No fill (--no-fill): every put lands in never-touched slot pages."
        ),
    ]
    return table


def plot(res: Results, path: str) -> None:
    """Wire GB/s per path and match_prefix latency, as a PNG."""
    s, p = res.setup, res.prompts
    spans = ["put", "put_transport", "raw_put", "get", "get_transport", "raw_get"]
    labels = ["put e2e", "put tcp://", "put raw asyncio", "get e2e", "get tcp://",
              "get raw asyncio"]  # fmt: skip
    gbs = {
        "median": [s.wire_bytes / statistics.median(_col(p, k)) / 1e9 for k in spans],
        "best": [s.wire_bytes / min(_col(p, k)) / 1e9 for k in spans],
    }
    keys = ["echo", "stub", "client"]
    lat = {q: [res.match[k][q] * 1e6 for k in keys] for q in ("p50", "p99")}
    save_bar_plot(
        path,
        [
            BarPanel(f"wire GB/s, one {s.layers}-layer prompt", "GB/s", labels, gbs),
            BarPanel(
                f"{s.match_blocks}-block match_prefix",
                "µs",
                ["grpc.aio echo", "MatchPrefix stub", "KVClient.match_prefix"],
                lat,
            ),
        ],
        suptitle="bench/service.py",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="prompts reported (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="prompts not reported")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--match-blocks", type=int, default=128)
    parser.add_argument("--match-calls", type=int, default=1000)
    parser.add_argument("--host-mem", default="1GiB", help="pool size (default 1GiB)")
    parser.add_argument(
        "--no-fill",
        dest="fill",
        action="store_false",
        help="measure into a fresh pool instead of filling it first (first-touch costs)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="also run every prompt with the eager codec (KVSTORE_CODEC=eager), alternating",
    )
    parser.add_argument("--plot", metavar="PNG", help="also write a bar chart here")
    args = explain(parser, __doc__).parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.tokens < BLOCK or args.layers < 1:
        parser.error("need --reps >= 1, --warmup >= 0, --tokens >= 256, --layers >= 1")
    if args.match_blocks < 1 or args.match_calls < 1:
        parser.error("need --match-blocks >= 1 and --match-calls >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print Markdown; 0 on success."""
    args = parse_args(argv)
    res = run(args)
    tables = (throughput_table(res), raw_table(res), match_table(res), cpu_table(res))
    if args.eager:
        tables = (tables[0], codec_table(res), *tables[1:])
    print_report("kvstore serve, end to end", "bench/service.py", argv, tables)
    if args.plot:
        plot(res, args.plot)
        print(f"Plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The data plane alone: kvstore ``tcp://`` and ``ucx://`` beside raw NIXL, raw sockets, memcpy.

    python bench/transfer.py [--quick] [--depth 1,4] [--gpu-mem 8GiB] [--plot out.png]
                             [--master-apart]

Starts a ``kvstore serve --transport ucx`` (loopback; its node serves ``tcp://`` and
``ucx://``; with ``--master-apart`` a ``kvstore master`` and a ``kvstore node`` instead,
each a process of its own, so that every put's ack waits for a commit over gRPC, as in a
cluster; the node's CPU figures are then the node process's alone), a raw NIXL target, a
raw asyncio socket server and two client processes, a *writer* and a *reader*; Markdown
goes to stdout, progress to stderr. It measures:
1. kvstore's own exchanges on **pre-encoded chunks** (``quant="none"``), so no codec time
   hides the transport: ``put → ready → data → ack`` (``tcp://``), ``reserve → spans → NIXL
   WRITE → landed → ack`` (``ucx://``), ``get → data``, ``lease → spans → NIXL READ →
   release``, per chunk size x chunks per exchange x **depth** (exchanges in flight, one
   connection each, as an engine keeps several layers in flight): GB/s, p50/p99, phases;
2. the same bytes over raw NIXL (the binding, spinning; target registered like a node; at
   depth D, D requests posted and polled from one thread), raw asyncio sockets
   (``sock_sendall`` / ``sock_recv_into``, D sockets) and a one-thread ``copy_`` (depth 1);
3. the node's CPU per GB, and (3b) the node's and client's CPU per exchange with what a
   100 or 400 Gb/s RDMA link would leave of an exchange, (3c) the client's CPU per GB
   beside the raw NIXL writer's and the raw socket client's; 4. kvstore ÷ baseline at the same
   depth, and one prompt end to end through ``KVClient.put_layer`` / ``get_layer`` (codec
   included); 5. the node's idle CPU.
Puts use fresh keys; the pool is filled first (puts evict and land in touched memory, as in
a full cache); client memory rotates over 512 MiB and caches are flushed after encoding.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import itertools
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from typing import Any, TypeVar

import nixl_raw
import torch
import xxhash
from _common import (
    KeptConnection,
    SpawnedServer,
    WindowCpu,
    expect,
    explain,
    in_flight,
    meter,
    node_memory,
    print_report,
    progress,
    raw_socket_connect,
    raw_socket_get,
    raw_socket_put,
    serve_raw_sockets,
    spawn_worker,
    start_pool,
    time_calls_async,
    window_cpu,
)
from _transfer_report import (
    EMPTY_PROBE,
    RAW_PROBE,
    STATS_PROBE,
    baseline_table,
    client_cpu_table,
    cpu_table,
    e2e_table,
    exchange_table,
    idle_table,
    kv_table,
    plot,
    probe_table,
    ratio_table,
)
from service import BLOCK, HEAD_DIM, HEADS, big_namespace, layer_kv, prompt

from kvclient import KVClient
from kvclient.ucx import Grants
from kvstore.control.client import MasterClient
from kvstore.core.arena import parse_size
from kvstore.core.codec import (
    ChunkKey,
    ChunkSpec,
    chunk_nbytes,
    encode_blocks,
    verify_chunk,
)
from kvstore.core.hashing import Namespace
from kvstore.core.headers import HeaderChecks
from kvstore.dataplane import SEND, ChunkRef, NodeClient, PutChunk
from kvstore.dataplane.location import SlotLocation
from kvstore.dataplane.messages import Ack, Message, Put, Ready
from kvstore.dataplane.messages import expect as answer_as
from kvstore.transport import Connection, as_byte_view, connect
from kvstore.transport.nixl import ALONE_INLINE_BYTES, NixlAgent, Span

KiB, MiB = 1 << 10, 1 << 20
H, D = 8, 128
"""Heads and head dim of the benchmark chunks (bf16: 4096 payload bytes per token)."""
SIZES = {"64 KiB": 64 * KiB, "512 KiB": 512 * KiB, "4 MiB": 4 * MiB, "16 MiB": 16 * MiB}
MAX_EXCHANGE = 256 * MiB + 64 * KiB
"""Largest exchange measured (64 x 4 MiB chunks with their headers)."""
REGION = 2 * MAX_EXCHANGE
"""Registered memory each client process rotates over (and the raw targets' too)."""
FLUSH = 64 * MiB
"""Bytes written after encoding to push the encoded chunks out of the CPU caches."""
WARMUP = 2
"""Untimed exchanges before each point."""
PROBES = 500
"""Small round trips per fixed-cost probe."""
IO_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 600.0
DEPTHS = "1,4"
"""Exchanges in flight measured by default (``--depth``)."""
E2E_SEED = 7_000_001


# ----------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Point:
    """One (chunk size, chunks per exchange) combination."""

    label: str
    payload: int
    batch: int

    @property
    def tokens(self) -> int:
        """Block tokens that make a ``payload``-byte bf16 ``[2, T, H, D]`` chunk."""
        return self.payload // (2 * H * D * 2)

    @property
    def chunk_bytes(self) -> int:
        return chunk_nbytes(self.tokens, H, D, torch.bfloat16, "none")

    @property
    def exchange_bytes(self) -> int:
        return self.batch * self.chunk_bytes

    @property
    def name(self) -> str:
        return f"{self.label} x {self.batch}"

    def namespace(self, layers: int = 1) -> Namespace:
        """A namespace of ``layers`` layers whose chunks are exactly this point's chunks."""
        rev = self.label.replace(" ", "")
        return Namespace(model="bench-transfer", revision=rev, num_layers=layers,
                         num_kv_heads=H, head_dim=D, dtype=torch.bfloat16,
                         block_tokens=self.tokens, quant="none")  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """Where everything runs and how much to move; sent to the worker processes."""

    master: str
    data_uri: str
    server_pid: int
    node_metadata: bytes
    raw_addr: tuple[str, int]
    raw_nixl_metadata: bytes
    raw_nixl_addr: int
    pool_bytes: int
    budget: int
    min_n: int
    max_n: int
    e2e_tokens: int
    e2e_layers: int
    depths: tuple[int, ...]
    gpu_bytes: int = 0
    """The node's GPU tier (0: none)."""
    master_apart: bool = False
    """The master runs in a process of its own (else in the node's: ``kvstore serve``)."""

    def exchanges(self, point: Point, depth: int) -> int:
        """Exchanges of a point at ``depth``, warm-ups included (timed: about ``budget``
        bytes whatever the depth, at least two per lane)."""
        n = min(self.max_n, self.budget // point.exchange_bytes)
        timed = max(self.min_n, 2 * depth, n)
        return _warmups(depth) + timed


def _warmups(depth: int) -> int:
    """Untimed exchanges first: :data:`WARMUP`, and at least one per connection in use."""
    return max(WARMUP, depth)


def fits(point: Point, depth: int) -> bool:
    """Whether ``depth`` exchanges of ``point`` in flight fit the region on distinct rows."""
    return depth * point.exchange_bytes <= REGION


@dataclass
class Measured:
    """Latencies of one point's timed exchanges at one depth, their phases, the wall time
    they took together and the CPU they cost."""

    nbytes: int
    depth: int
    seconds: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    wall: float = 0.0
    node_cpu: float = 0.0
    node_loop_cpu: float = 0.0
    """The part of ``node_cpu`` on the node's main thread (its event loop)."""
    client_cpu: float = 0.0
    scrub_us: float | None = None
    """The node's scrub CPU per exchange (``ucx://`` puts; :func:`scrubbed`)."""

    @property
    def gbps(self) -> float:
        """Throughput: bytes of the timed exchanges / the wall time they took (at depth 1
        about bytes per exchange / mean latency)."""
        return self.nbytes * len(self.seconds) / self.wall / 1e9

    @property
    def moved_gb(self) -> float:
        return self.nbytes * len(self.seconds) / 1e9

    def add(self, seconds: float, phases: dict[str, float] | None) -> None:
        self.seconds.append(seconds)
        for name, value in (phases or {}).items():
            self.phases.setdefault(name, []).append(value)


def block_keys(tag: str, exchange: int, batch: int) -> list[bytes]:
    """The block hashes of one exchange (distinct for every tag and exchange)."""
    return [xxhash.xxh3_128_digest(f"{tag}/{exchange}/{j}".encode()) for j in range(batch)]


def points(sizes: list[str], batches: list[int]) -> list[Point]:
    """Every size x batch whose exchange is at most :data:`MAX_EXCHANGE`."""
    out = [Point(s, SIZES[s], b) for s in sizes for b in batches]
    return [p for p in out if p.exchange_bytes <= MAX_EXCHANGE]


# ----------------------------------------------------------------------- worker processes

_STATE: dict[str, Any] = {}
"""Per worker process: event loop, connections, NIXL agents and memory, kept across jobs."""


def _run(coro: Awaitable[Any]) -> Any:
    loop = _STATE.get("loop")
    if loop is None:
        loop = _STATE["loop"] = asyncio.new_event_loop()
    return loop.run_until_complete(coro)


def job_init(setup: Setup, role: str) -> None:
    """Open one connection to the node (with a :class:`NodeClient` on it: a lane) and one to
    the raw socket server per exchange in flight (the largest depth), start a NIXL agent
    with a registered :data:`REGION` and, for the writer, a raw NIXL binding agent on the
    same memory."""
    os.environ.update(nixl_raw.LOOPBACK)
    _run(_init(setup, role))
    if role == "writer":
        from kvstore.transport.nixl_binding import import_bindings

        nixl = import_bindings()

        agent = nixl.nixlAgent(f"bench-raw-{uuid.uuid4().hex[:8]}", nixl.nixlAgentConfig())
        agent.createBackend("UCX", {})
        addr = _STATE["region"].data_ptr()
        agent.registerMem(nixl.nixlRegDList(nixl.DRAM_SEG, [(addr, REGION, 0, "")]))
        peer = agent.loadRemoteMD(setup.raw_nixl_metadata).decode()
        _STATE.update(nixl=nixl, raw_agent=agent, raw_peer=peer)


async def _init(setup: Setup, role: str) -> None:
    region = torch.zeros(REGION, dtype=torch.uint8)  # touched: no page faults while timed
    name = f"bench-{role}-{uuid.uuid4().hex[:8]}"  # (set up as kvclient sets up its agent)
    agent = await NixlAgent(name, alone_inline_bytes=ALONE_INLINE_BYTES).start()
    await agent.register(region)
    lanes = range(max(setup.depths))
    raws = [raw_socket_connect(setup.raw_addr, IO_TIMEOUT_S) for _ in lanes]
    conns = [await connect(setup.data_uri, timeout=IO_TIMEOUT_S) for _ in lanes]
    nodes = [NodeClient(setup.data_uri, KeptConnection(c), timeout_s=IO_TIMEOUT_S) for c in conns]
    _STATE.update(region=region, scratch=torch.zeros(MAX_EXCHANGE, dtype=torch.uint8),
                  agent=agent, peer=await agent.add_peer(setup.node_metadata), raws=raws,
                  conns=conns, nodes=nodes)  # fmt: skip


def job_close() -> None:
    """Close this worker's clients, connections and agents (its last job)."""

    async def close() -> None:
        for kv in _STATE.pop("clients", {}).values():
            await kv.close()
        _STATE.pop("nodes", None)
        for conn in _STATE.pop("conns", []):
            await conn.close()
        if "agent" in _STATE:
            await _STATE.pop("agent").close()

    if "loop" in _STATE:
        _run(close())
        _STATE.pop("loop").close()
    for sock in _STATE.pop("raws", []):
        sock.close()
    _STATE.pop("raw_agent", None)


def _slots(point: Point) -> int:
    return max(1, REGION // point.exchange_bytes)


def _rows(point: Point, i: int) -> torch.Tensor:
    """``[batch, chunk_bytes]`` rows of the registered region for exchange ``i`` (rotating)."""
    offset = (i % _slots(point)) * point.exchange_bytes
    rows = _STATE["region"][offset : offset + point.exchange_bytes]
    return rows.view(point.batch, point.chunk_bytes)  # type: ignore[no-any-return]


def _flush_caches() -> None:
    _STATE["scratch"][:FLUSH].add_(1)


def _encode(point: Point, tag: str, i: int, layer: int = 0, row: int | None = None) -> list[bytes]:
    """Encode exchange ``i``'s chunks (fresh keys; layer ``layer``) into the rows of
    exchange ``row`` (default ``i``); their block hashes."""
    src = _STATE.get("source")
    if src is None or src.shape[1] < point.batch * point.tokens:
        # One bf16 tensor serves every exchange: under quant "none" the content is moot.
        src = _STATE["source"] = torch.randn(2, point.batch * point.tokens, H, D).bfloat16()
    keys = block_keys(tag, i, point.batch)
    out = _rows(point, i if row is None else row)
    encode_blocks(src, point.tokens, [ChunkKey(k, layer, 0) for k in keys], "none", out=out)
    return keys


Rows = torch.Tensor
Phases = dict[str, float]
Sample = tuple[float, Phases | None]
Exchange = Callable[[int, int], Awaitable[Phases | None]]
"""One exchange, ``(exchange index, lane)`` → its phases; lane k owns connection k."""
Segment = Callable[[range], Awaitable[list[Sample]]]
"""Runs a stretch of exchanges, the depth in flight; (seconds, phases) of each."""


def in_lanes(exchange: Exchange, depth: int) -> Segment:
    """:func:`in_flight` of ``exchange``: ``depth`` lanes, lane k on connection k."""
    return functools.partial(in_flight, exchange, depth=depth)


async def _walled(stretch: Awaitable[list[Sample]]) -> tuple[float, list[Sample]]:
    t0 = time.perf_counter()
    samples = await stretch
    return time.perf_counter() - t0, samples


def _measure(setup: Setup, point: Point, depth: int, segment: Segment,
             prepare: Callable[[int], None] | None = None) -> Measured:  # fmt: skip
    """Run a point's exchanges with ``depth`` in flight, in stretches: the warm-ups, then
    the rest of each round over the region (so exchanges in flight never share rows).
    Between stretches nothing is in flight: ``prepare(i)`` runs for each exchange of the
    next one and, when it starts a round over the region, the caches are flushed (untimed).
    Timed: each exchange, and each stretch's wall time and node / client CPU."""
    total, slots, warm = setup.exchanges(point, depth), _slots(point), _warmups(depth)
    res = Measured(point.exchange_bytes, depth)
    for a, b in itertools.pairwise(sorted({0, warm, total, *range(slots, total, slots)})):
        if prepare is not None:
            for i in range(a, b):
                prepare(i)
        if a % slots == 0:  # a new round over the region: evict it from the caches
            _flush_caches()
        with meter(setup.server_pid) as cpu:
            wall, samples = _run(_walled(segment(range(a, b))))
        if a >= warm:
            res.wall += wall
            res.node_cpu += cpu["server_cpu"]
            res.node_loop_cpu += cpu["server_main_cpu"]
            res.client_cpu += cpu["client_cpu"]
            for seconds, phases in samples:
                res.add(seconds, phases)
    return res


# ---- kvstore's exchanges, one in flight per connection (a lane)
#
# Lane k owns ``_STATE["conns"][k]`` and the NodeClient on it, ``_STATE["nodes"][k]``. Headers
# are built and parsed only by kvstore.dataplane.messages; where a NodeClient method hides a
# phase boundary (put: ready → data), the exchange is driven here step by step.


A = TypeVar("A", bound=Message)


async def _answer(conn: Connection, cls: type[A], *ops: str) -> A:
    """The node's next answer, parsed as ``cls`` (raising what an error answer says)."""
    return answer_as((await conn.recv_header(IO_TIMEOUT_S)).header, cls, *ops)


async def _ask(conn: Connection, request: Message, cls: type[A], *ops: str) -> A:
    """Send ``request`` (no payload); the node's answer, parsed as ``cls``."""
    await conn.send(request.header(), timeout=IO_TIMEOUT_S)
    return await _answer(conn, cls, *ops)


def _put_chunks(keys: list[bytes], rows: Rows) -> tuple[PutChunk, ...]:
    return tuple(PutChunk(k, None, 0, rows.shape[1]) for k in keys)


def _refs(keys: list[bytes]) -> list[ChunkRef]:
    return [ChunkRef(k, 0) for k in keys]


def _sends_all(ready: Ready, n: int) -> None:
    expect(ready.accept == (SEND,) * n, f"node did not take every chunk: {list(ready.accept)}")


def _timed_write(t: list[float], n: int, rows: Rows) -> Callable[[Ready], Awaitable[None]]:
    """The ``write`` callback of a reserve: WRITE ``rows`` into the spans the node answered
    (all ``n`` chunks must be SEND), appending the times before and after to ``t``."""

    async def write(ready: Ready) -> None:
        _sends_all(ready, n)
        spans = [Span.from_wire(s) for s in ready.spans or ()]
        t.append(time.perf_counter())
        await _STATE["agent"].write(_STATE["peer"], spans, list(rows.unbind(0)),
                                    timeout=IO_TIMEOUT_S)  # fmt: skip
        t.append(time.perf_counter())

    return write


def layers_for(setup: Setup, point: Point) -> int:
    """Layers per prompt of the layered put (``ucx layers``): 32, or fewer where two
    prompts' slots would not fit half the pool."""
    return max(2, min(32, setup.pool_bytes // 4 // point.exchange_bytes))


async def put_ucx_layers(lane: int, ns: bytes, keys: list[bytes], rows: Rows, layer: int,
                         last: int) -> Phases:  # fmt: skip
    """An engine's per-layer put: layer ``layer`` of the same blocks as the layers before
    it. Layer 0: ``reserve → reserved → WRITE → landed → ack``; every later layer: WRITE at
    the locations the previous ack granted, then ``write → ack`` (one round trip). Each ack
    grants the next layer (none after ``last``)."""
    grants: Grants = _STATE.setdefault("grants", Grants())
    t = [time.perf_counter()]
    chunks = tuple(PutChunk(k, None, layer, rows.shape[1]) for k in keys)
    ask = (layer + 1,) if layer < last else ()
    node = _STATE["nodes"][lane]
    spans = grants.take("node", keys, layer, rows.shape[1])
    if spans is not None:
        t.append(t[0])
        await _STATE["agent"].write(_STATE["peer"], [Span.from_wire(w) for w in spans],
                                    list(rows.unbind(0)), timeout=IO_TIMEOUT_S)  # fmt: skip
        t.append(time.perf_counter())
        ack = await node.write(ns, chunks, _STATE["writer"], ask)
    else:
        write = _timed_write(t, len(keys), rows)
        ack = await node.reserve(ns, chunks, write, writer=_STATE["writer"], grant=ask)
    _stored_all(ack, len(keys))
    grants.keep("node", keys, ack.grants, ack.grant_s)
    t0, t1, t2 = t
    return {"control": t1 - t0, "move": t2 - t1, "after": time.perf_counter() - t2}


def _stored_all(ack: Ack, n: int) -> None:
    expect(ack.stored == n, f"node refused chunks: {ack}")


def _found_all(found: list[int], n: int) -> None:
    expect(len(found) == n, f"node misses chunks: found {found} of {n}")


async def put_tcp(lane: int, ns: bytes, keys: list[bytes], rows: Rows) -> Phases:
    """``put + chunks → ack`` in one round trip (the ack follows the node's checks and
    master commit): the frame is sent (move), then the ack awaited (after)."""
    conn = _STATE["conns"][lane]
    t0 = time.perf_counter()
    request = Put(ns, _put_chunks(keys, rows))
    await conn.send(request.header(), [r.numpy() for r in rows], timeout=IO_TIMEOUT_S)
    t1 = time.perf_counter()
    _stored_all(await _answer(conn, Ack), len(keys))
    return {"move": t1 - t0, "after": time.perf_counter() - t1}


async def put_ucx(lane: int, ns: bytes, keys: list[bytes], rows: Rows) -> Phases:
    """``reserve → reserved {spans} → NIXL WRITE → landed → ack`` (``NodeClient.reserve``;
    its ``write`` callback marks the phase boundaries)."""
    t = [time.perf_counter()]
    write = _timed_write(t, len(keys), rows)
    _stored_all(await _STATE["nodes"][lane].reserve(ns, _put_chunks(keys, rows), write), len(keys))
    t0, t1, t2 = t
    return {"control": t1 - t0, "move": t2 - t1, "after": time.perf_counter() - t2}


async def get_tcp(lane: int, ns_id: bytes, keys: list[bytes], rows: Rows) -> Phases:
    """``get → data`` straight into ``rows`` (``NodeClient.get``; its ``into`` callback runs
    between the answer's header and its payload)."""
    t = [time.perf_counter()]

    def into(found: list[int]) -> list[Any]:
        _found_all(found, len(keys))
        t.append(time.perf_counter())
        return [r.numpy() for r in rows]

    await _STATE["nodes"][lane].get(ns_id, _refs(keys), into)
    t0, t1 = t
    return {"control": t1 - t0, "move": time.perf_counter() - t1}


async def get_ucx(lane: int, ns_id: bytes, keys: list[bytes], rows: Rows) -> Phases:
    """What a ``ucx://`` reader does now: NIXL READ of each committed slot at the location
    its lookup gave (looked up before the timing, as a get's one lookup is), then the check
    of each chunk's header (key and spec) that tells a reused slot; no node exchange."""
    t0 = time.perf_counter()
    spans = [Span.from_wire(_STATE["locs"][k].span(0, rows.shape[1])) for k in keys]
    t1 = time.perf_counter()
    await _STATE["agent"].read(_STATE["peer"], spans, list(rows.unbind(0)), timeout=IO_TIMEOUT_S)
    t2 = time.perf_counter()
    check = _STATE["headers"].check  # (as a reader checks them: kvclient.reads)
    for k, row in zip(keys, rows, strict=True):
        check(row, ChunkKey(k, 0, 0))
    return {"control": t1 - t0, "move": t2 - t1, "after": time.perf_counter() - t2}


async def get_ucx_leased(lane: int, ns_id: bytes, keys: list[bytes], rows: Rows) -> Phases:
    """``lease → leased {spans} → NIXL READ → release`` (``NodeClient.lease``; the node
    answers no release): a reader's fallback when a location is stale."""
    t0 = time.perf_counter()
    async with _STATE["nodes"][lane].lease(ns_id, _refs(keys), IO_TIMEOUT_S) as (found, leased):
        _found_all(found, len(keys))
        spans = [Span.from_wire(s) for s in leased.spans]
        t1 = time.perf_counter()
        await _STATE["agent"].read(_STATE["peer"], spans, list(rows.unbind(0)),
                                   timeout=IO_TIMEOUT_S)  # fmt: skip
        t2 = time.perf_counter()
    return {"control": t1 - t0, "move": t2 - t1, "after": time.perf_counter() - t2}


KV = {("tcp", "put"): put_tcp, ("ucx", "put"): put_ucx, ("tcp", "get"): get_tcp,
      ("ucx", "get"): get_ucx, ("ucx leased", "get"): get_ucx_leased}  # fmt: skip


# ---- jobs


def job_fill(setup: Setup) -> float:
    """Writer: put 1.1 x the pool over ``tcp://`` (4 MiB chunks, 16 per exchange) so every
    page of the node's arena is touched before anything is measured; seconds taken."""
    point, start = Point("4 MiB", SIZES["4 MiB"], 16), time.perf_counter()
    ns = point.namespace().canonical_bytes()
    for i in range(-(-setup.pool_bytes * 11 // 10 // point.exchange_bytes)):
        _run(put_tcp(0, ns, _encode(point, "fill", i), _rows(point, i)))
    return time.perf_counter() - start


def _put_tag(transport: str, point: Point, depth: int) -> str:
    """What a put job's keys are made of (the get jobs rebuild them from it)."""
    return f"{transport}/{point.name}/depth {depth}"


def job_put(setup: Setup, point: Point, transport: str, depth: int) -> Measured:
    """Writer: put exchanges of fresh pre-encoded chunks, ``depth`` in flight, encoded
    (untimed) one round over the region at a time."""
    ns, tag = point.namespace().canonical_bytes(), _put_tag(transport, point, depth)
    total, keys = setup.exchanges(point, depth), {}

    def prepare(i: int) -> None:
        if i % _slots(point) == 0:
            keys.update({j: _encode(point, tag, j) for j in range(i, i + _slots(point))
                         if j < total})  # fmt: skip

    async def put(i: int, lane: int) -> Phases:
        return await KV[(transport, "put")](lane, ns, keys.pop(i), _rows(point, i))

    def measure() -> Measured:
        return _measure(setup, point, depth, in_lanes(put, depth), prepare)

    return scrubbed(point, measure) if transport == "ucx" else measure()


def job_put_layers(setup: Setup, point: Point, depth: int) -> Measured:
    """Writer: an engine's per-layer puts (:func:`put_ucx_layers`): exchange ``i`` is layer
    ``i % L`` of prompt ``i // L`` (``L`` = :func:`layers_for`), one exchange in flight."""
    layers = layers_for(setup, point)
    ns = point.namespace(layers).canonical_bytes()
    tag, total, keys = f"layers/{point.name}", setup.exchanges(point, depth), {}
    _STATE.setdefault("writer", uuid.uuid4().hex)

    def prepare(i: int) -> None:
        if i % _slots(point) == 0:
            for j in range(i, min(total, i + _slots(point))):
                keys[j] = _encode(point, tag, j // layers, layer=j % layers, row=j)

    async def put(i: int, lane: int) -> Phases:
        return await put_ucx_layers(lane, ns, keys.pop(i), _rows(point, i), i % layers,
                                    layers - 1)  # fmt: skip

    return scrubbed(point, lambda: _measure(setup, point, depth, in_lanes(put, depth), prepare))


def scrubbed(point: Point, job: Callable[[], Measured]) -> Measured:
    """``job()`` (``ucx://`` puts), with the node's scrub CPU per exchange: from its
    counters before the job and once its scrub has checked every chunk after it (untimed;
    waits up to :data:`IO_TIMEOUT_S`)."""
    node = _STATE["nodes"][0]
    before = _run(node.stats())
    res = job()

    async def settled() -> dict[str, Any]:
        deadline = time.monotonic() + IO_TIMEOUT_S
        while (stats := await node.stats())["scrub_pending"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return stats

    after = _run(settled())
    chunks = after["scrubbed"] - before["scrubbed"]
    if chunks > 0:
        res.scrub_us = (after["scrub_cpu_us"] - before["scrub_cpu_us"]) / chunks * point.batch
    return res


def job_get(setup: Setup, point: Point, transport: str, depth: int) -> Measured:
    """Reader: gets, ``depth`` in flight, cycling over the last ``ucx://`` put exchanges of
    the same point and depth that fit half the pool, into rotating rows; the last chunk is
    then verified (untimed)."""
    ns_id, tag = point.namespace().id, _put_tag("ucx", point, depth)
    total = setup.exchanges(point, depth)
    ring = max(1, min(total, setup.pool_bytes // 2 // point.exchange_bytes))

    def keys(i: int) -> list[bytes]:
        return block_keys(tag, total - ring + i % ring, point.batch)

    if transport == "ucx":
        _run(_locate(setup, point, [k for i in range(ring) for k in keys(i)]))

    async def get(i: int, lane: int) -> Phases:
        return await KV[(transport, "get")](lane, ns_id, keys(i), _rows(point, i))

    res = _measure(setup, point, depth, in_lanes(get, depth))
    verify_chunk(_rows(point, total - 1)[-1], expect_key=ChunkKey(keys(total - 1)[-1], 0, 0))
    return res


async def _locate(setup: Setup, point: Point, hashes: list[bytes]) -> None:
    """The slot location of each block (the master's lookup, as a reader's get asks it)."""
    ns = point.namespace()
    locs: dict[bytes, SlotLocation] = {}
    async with MasterClient(setup.master, timeout_s=IO_TIMEOUT_S) as mc:
        for at in range(0, len(hashes), 4096):
            part = hashes[at : at + 4096]
            for h, block in zip(part, await mc.lookup(ns.id, part, 1), strict=True):
                loc = SlotLocation.unpack(block[0].location) if block else None
                expect(loc is not None, "a block put over ucx:// has no slot location")
                locs[h] = loc  # type: ignore[assignment]
    _STATE.update(locs=locs, headers=HeaderChecks(ChunkSpec.of(ns)))


def job_raw(setup: Setup, point: Point, op: str, depth: int) -> Measured:
    """Writer (``put``) or reader (``get``): the same bytes over the raw socket server,
    ``depth`` in flight, one socket each."""
    move = raw_socket_put if op == "put" else raw_socket_get

    async def exchange(i: int, lane: int) -> None:
        views = [as_byte_view(r, writable=True) for r in _rows(point, i)]
        await move(_STATE["raws"][lane], views)

    return _measure(setup, point, depth, in_lanes(exchange, depth))


def _raw_nixl_once(code: Any, local: Any, remote: Any) -> None:
    """One raw NIXL transfer: create, post, spin on the status, release."""
    nixl, agent = _STATE["nixl"], _STATE["raw_agent"]
    handle = agent.createXferReq(code, local, remote, _STATE["raw_peer"])
    status = agent.postXferReq(handle)
    while status == nixl.NIXL_IN_PROG:
        status = agent.getXferStatus(handle)
    agent.releaseXferReq(handle)
    expect(status == nixl.NIXL_SUCCESS, f"raw NIXL transfer failed: {status}")


def _raw_nixl_posted(code: Any, lists: dict[int, tuple[Any, Any]], depth: int) -> Segment:
    """Raw NIXL requests, ``depth`` in flight, all on the calling thread: post up to
    ``depth``, then poll them in turn (spinning), releasing each as it completes and
    posting the next. Each one's time: create → completed and released."""
    nixl, agent, peer = _STATE["nixl"], _STATE["raw_agent"], _STATE["raw_peer"]

    async def segment(indices: range) -> list[Sample]:
        todo, flight = iter(indices), collections.deque[tuple[Any, float, Any]]()
        out: list[Sample] = []

        def post() -> None:
            if (i := next(todo, None)) is not None:
                t0 = time.perf_counter()
                handle = agent.createXferReq(code, *lists.pop(i), peer)
                flight.append((handle, t0, agent.postXferReq(handle)))

        for _ in range(depth):
            post()
        while flight:
            handle, t0, status = flight.popleft()
            if status == nixl.NIXL_IN_PROG:
                status = agent.getXferStatus(handle)
            if status == nixl.NIXL_IN_PROG:
                flight.append((handle, t0, status))
                continue
            agent.releaseXferReq(handle)
            expect(status == nixl.NIXL_SUCCESS, f"raw NIXL transfer failed: {status}")
            out.append((time.perf_counter() - t0, None))
            post()
        return out

    return segment


def job_raw_nixl(setup: Setup, point: Point, op: str, depth: int) -> Measured:
    """Writer: raw NIXL ``op`` (READ or WRITE) of one exchange's spans per request,
    ``depth`` requests in flight (the binding spinning on their status: the ceiling, as
    ``bench/nixl_raw.py``'s raw path)."""
    nixl, cb, lists = _STATE["nixl"], point.chunk_bytes, {}
    code = nixl.NIXL_READ if op == "READ" else nixl.NIXL_WRITE

    def prepare(i: int) -> None:  # descriptor lists are built outside the timing
        local = _rows(point, i).data_ptr()
        bases = (local, setup.raw_nixl_addr + local - _STATE["region"].data_ptr())
        lists[i] = tuple(nixl.nixlXferDList(nixl.DRAM_SEG, [(b + k * cb, cb, 0)
                         for k in range(point.batch)]) for b in bases)  # fmt: skip

    return _measure(setup, point, depth, _raw_nixl_posted(code, lists, depth), prepare)


def job_memcpy(setup: Setup, point: Point) -> Measured:
    """Writer: one-thread ``copy_`` of one exchange's chunks per step, region → scratch
    (depth 1 only: a ceiling, one thread)."""
    threads, scratch, cb = torch.get_num_threads(), _STATE["scratch"], point.chunk_bytes

    async def exchange(i: int, lane: int) -> None:
        for k, row in enumerate(_rows(point, i)):
            scratch[k * cb : (k + 1) * cb].copy_(row)

    torch.set_num_threads(1)
    try:
        return _measure(setup, point, 1, in_lanes(exchange, 1))
    finally:
        torch.set_num_threads(threads)


def job_probes(setup: Setup) -> dict[str, dict[str, float]]:
    """Writer: :data:`PROBES` small round trips of each kind (fixed costs), in seconds."""
    return _run(_probes(setup))  # type: ignore[no-any-return]


async def _probes(setup: Setup) -> dict[str, dict[str, float]]:
    nixl, agent, node = _STATE["nixl"], _STATE["agent"], _STATE["nodes"][0]
    peer = await agent.add_peer(setup.raw_nixl_metadata)
    tiny, remote = _STATE["region"][:64], setup.raw_nixl_addr
    ldl, rdl = (nixl.nixlXferDList(nixl.DRAM_SEG, [(a, 64, 0)]) for a in (tiny.data_ptr(), remote))

    async def stats() -> None:
        await node.stats()

    async def raw_nixl() -> None:
        _raw_nixl_once(nixl.NIXL_WRITE, ldl, rdl)

    view = as_byte_view(tiny, writable=True)
    calls = {
        RAW_PROBE: lambda: raw_socket_get(_STATE["raws"][0], [view]),
        EMPTY_PROBE: lambda: node.unhold("no-such-hold"),
        STATS_PROBE: stats,
        "raw NIXL WRITE of 64 B (binding, spinning)": raw_nixl,
        "NixlAgent.write of 64 B (kvstore's layer)": lambda: agent.write(
            peer, [(remote, 64)], [tiny]
        ),
    }
    out = {name: await time_calls_async(call, PROBES, WARMUP) for name, call in calls.items()}
    await agent.remove_peer(peer)
    return out


async def _client(setup: Setup, ucx: bool) -> KVClient:
    clients: dict[bool, KVClient] = _STATE.setdefault("clients", {})
    if ucx not in clients:
        ns = big_namespace(setup.e2e_layers)
        clients[ucx] = await KVClient.connect(setup.master, ns, timeout_s=IO_TIMEOUT_S, ucx=ucx)
    return clients[ucx]


def job_e2e(setup: Setup, op: str, transport: str, seed: int) -> float:
    """Writer (``put``): ``put_layer`` x layers of one prompt, KV generated beforehand.
    Reader (``get``): ``get_layer`` x layers of that prompt into one ``out``. Seconds."""

    async def run() -> float:
        kv = await _client(setup, transport == "ucx")
        tokens, n = prompt(setup.e2e_tokens, seed), setup.e2e_tokens // BLOCK * BLOCK
        layers = [
            layer_kv(setup.e2e_tokens, i, seed) for i in range(setup.e2e_layers * (op == "put"))
        ]
        out = torch.empty(2, setup.e2e_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        for i in range(setup.e2e_layers):
            if op == "put":
                got = await kv.put_layer(tokens, i, layers[i])
            else:
                got = (await kv.get_layer(tokens, i, out=out)).shape[1]
            expect(got == n, f"{op}_layer moved {got} of {n} tokens")
        return time.perf_counter() - t0

    return _run(run())  # type: ignore[no-any-return]


# ----------------------------------------------------------------------- orchestration


def serve_raw_nixl(pipe: Pipe) -> None:
    """Process target (:class:`SpawnedServer`): a NIXL target as in ``bench/nixl_raw.py``
    (a NixlAgent with the progress thread, like a node) registering :data:`REGION` bytes;
    sends ``(metadata, buffer address)`` and serves until terminated."""
    os.environ.update(nixl_raw.LOOPBACK)
    asyncio.run(_raw_nixl_target(pipe))


async def _raw_nixl_target(pipe: Pipe) -> None:
    buf = node_memory(REGION)  # touched: no page faults while timed
    async with NixlAgent(f"bench-target-{uuid.uuid4().hex[:8]}", progress_thread=True) as agent:
        reg = await agent.register(buf)
        pipe.send((await agent.metadata(), reg.addr))
        await asyncio.Event().wait()


async def _node_metadata(master: str) -> bytes:
    async with MasterClient(master, timeout_s=IO_TIMEOUT_S) as mc:
        nodes = await mc.nodes()
    expect(len(nodes) == 1 and bool(nodes[0].nixl_metadata), "expected one node serving ucx")
    return nodes[0].nixl_metadata


@dataclass
class Results:
    """Everything one run measured; ``by`` is keyed by (point name, path, depth)."""

    setup: Setup
    points: list[Point]
    by: dict[tuple[str, str, int], Measured] = field(default_factory=dict)
    e2e: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    probes: dict[str, dict[str, float]] = field(default_factory=dict)
    idle: list[tuple[str, WindowCpu]] = field(default_factory=list)
    fill_s: float = 0.0
    mapping_s: float = 0.0
    """How long the fresh node took to map its host memory (after its ready line)."""


Job = tuple[str, int, str, Callable[..., Any], tuple[Any, ...]]


def _point_jobs(setup: Setup, point: Point) -> list[Job]:
    """(path, depth, worker, job, args) of one point: memcpy, then per depth that fits each
    kvstore path right before its baseline, puts before gets (gets read the ucx puts), the
    layered puts last (their baseline: the raw NIXL WRITE of the same point)."""
    jobs: list[Job] = [("memcpy", 1, "writer", job_memcpy, (setup, point))]
    for d in (d for d in setup.depths if fits(point, d)):
        layers = ("kv ucx layers put", d, "writer", job_put_layers, (setup, point, d))
        layered = [layers] if d == 1 else []  # (an engine's per-layer puts: depth 1)
        jobs += [
            ("kv tcp put", d, "writer", job_put, (setup, point, "tcp", d)),
            ("raw asyncio put", d, "writer", job_raw, (setup, point, "put", d)),
            ("kv ucx put", d, "writer", job_put, (setup, point, "ucx", d)),
            ("raw NIXL WRITE", d, "writer", job_raw_nixl, (setup, point, "WRITE", d)),
            ("kv tcp get", d, "reader", job_get, (setup, point, "tcp", d)),
            ("raw asyncio get", d, "reader", job_raw, (setup, point, "get", d)),
            ("kv ucx get", d, "reader", job_get, (setup, point, "ucx", d)),
            ("kv ucx leased get", d, "reader", job_get, (setup, point, "ucx leased", d)),
            ("raw NIXL READ", d, "writer", job_raw_nixl, (setup, point, "READ", d)),
            *layered,  # (after the gets, which read back the ucx puts it would evict)
        ]
    return jobs


def run(args: argparse.Namespace) -> Results:
    """Start everything, measure, stop everything (also on failure)."""
    pts = points(args.sizes, args.batches)
    with contextlib.ExitStack() as stack, progress() as bar:
        jobs = sum(1 + sum((9 + (d == 1)) * fits(p, d) for d in args.depth) for p in pts)
        total = 7 + jobs + 4 * (args.e2e_reps + 1) + args.idle_after
        task = bar.add_task("starting kvstore --transport ucx", total=total)

        def step(what: str) -> None:
            bar.update(task, advance=1, description=what)

        gpu = ["--gpu-mem", args.gpu_mem] if args.gpu_mem else []
        node_flags = ["--transport", "ucx", "--host-mem", args.host_mem, *gpu]
        serve, _ = start_pool(stack, *node_flags, apart=args.master_apart)
        master = serve.addresses["grpc"]
        pid = serve.proc.pid
        step("the node maps its host memory")
        t0 = time.monotonic()
        serve.wait_mapped()  # (a one-off at start, on a nice-19 thread: not idle work)
        mapping_s = time.monotonic() - t0
        step(f"idle node, {args.idle_s:.0f} s")
        idle = [("fresh node, memory mapped, nothing connected", window_cpu(pid, args.idle_s))]
        step("starting the raw baselines")
        raw = SpawnedServer.start(functools.partial(serve_raw_sockets, region_bytes=REGION))
        stack.callback(raw.stop)
        target = SpawnedServer.start(serve_raw_nixl)
        stack.callback(target.stop)
        raw_md, raw_addr = target.address
        setup = Setup(master, serve.addresses["data"], pid,
                      asyncio.run(_node_metadata(master)), tuple(raw.address),
                      raw_md, raw_addr, parse_size(args.host_mem), args.budget, args.min_n,
                      args.max_n, args.e2e_tokens, args.e2e_layers, args.depth,
                      parse_size(args.gpu_mem or 0), args.master_apart)  # fmt: skip
        res = Results(setup, pts, idle=idle, mapping_s=mapping_s)
        step("starting writer and reader processes")
        workers = {r: spawn_worker(stack, job_close) for r in ("writer", "reader")}
        for f in [w.submit(job_init, setup, r) for r, w in workers.items()]:
            f.result(JOB_TIMEOUT_S)
        step("filling the pool")
        res.fill_s = workers["writer"].submit(job_fill, setup).result(JOB_TIMEOUT_S)
        step("fixed costs: small round trips")
        res.probes = workers["writer"].submit(job_probes, setup).result(JOB_TIMEOUT_S)
        for point in pts:
            for path, depth, role, job, job_args in _point_jobs(setup, point):
                step(f"{point.name}: {path}, depth {depth}")
                m = workers[role].submit(job, *job_args).result(JOB_TIMEOUT_S)
                res.by[(point.name, path, depth)] = m
        _measure_e2e(workers, res, args.e2e_reps, step)
        for w in workers.values():
            w.submit(job_close).result(60)
        if args.idle_after:
            step(f"idle node after the run, {args.idle_s:.0f} s")
            res.idle.append(("after the run, clients gone", window_cpu(pid, args.idle_s)))
        step("stopping")
    return res


def _measure_e2e(workers: dict[str, ProcessPoolExecutor], res: Results, reps: int,
                 step: Callable[[str], None]) -> None:  # fmt: skip
    """put_layer / get_layer of one fresh prompt per rep and transport (rep 0: warm-up)."""
    s = res.setup
    for rep in range(reps + 1):
        for transport in ("tcp", "ucx"):
            seed = E2E_SEED + 10 * rep + (transport == "ucx")
            for op, role in (("put", "writer"), ("get", "reader")):
                step(f"end to end over {transport}://: {op}_layer x {s.e2e_layers}")
                job = workers[role].submit(job_e2e, s, op, transport, seed)
                seconds = job.result(JOB_TIMEOUT_S)
                if rep:
                    res.e2e.setdefault((transport, op), []).append(seconds)


# ----------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` shrinks every knob not given explicitly."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about a minute: fewer points")
    parser.add_argument("--sizes", help=f"comma-separated, of: {', '.join(SIZES)}")
    parser.add_argument("--batches", help="chunks per exchange, comma-separated (1,8,64)")
    parser.add_argument("--depth", default=DEPTHS,
                        help=f"exchanges in flight, comma-separated ({DEPTHS})")  # fmt: skip
    parser.add_argument("--budget", type=parse_size, help="bytes per point and depth (512MiB)")
    parser.add_argument("--min-n", type=int, help="fewest timed exchanges per point (8)")
    parser.add_argument("--max-n", type=int, default=300, help="most timed exchanges per point")
    parser.add_argument("--host-mem", default="1GiB", help="node pool (default 1GiB)")
    parser.add_argument("--gpu-mem", help="also a GPU tier of this size on the node (needs "
                        "CUDA): ucx:// puts land in device memory")  # fmt: skip
    parser.add_argument("--e2e-reps", type=int, help="end-to-end prompts per transport (3)")
    parser.add_argument("--e2e-tokens", type=int, default=2048)
    parser.add_argument("--e2e-layers", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle window (5 s)")
    parser.add_argument("--plot", metavar="PNG", help="also write a bar chart here")
    parser.add_argument("--master-apart", action="store_true",
                        help="a kvstore master and a kvstore node, each a process of its own "
                             "(a cluster's shape), instead of one kvstore serve")  # fmt: skip
    args = explain(parser, __doc__).parse_args(argv)
    quick = args.quick
    sizes = args.sizes or ("512 KiB,4 MiB" if quick else ",".join(SIZES))
    args.sizes = [s.strip() for s in sizes.split(",")]
    if any(s not in SIZES for s in args.sizes):
        parser.error(f"--sizes takes {', '.join(SIZES)}")
    args.batches = [int(b) for b in (args.batches or "1,8,64").split(",")]
    args.depth = tuple(sorted({int(d) for d in args.depth.split(",")}))
    args.budget = args.budget or (64 * MiB if quick else 512 * MiB)
    args.min_n = args.min_n or (3 if quick else 8)
    args.e2e_reps = args.e2e_reps if args.e2e_reps is not None else (1 if quick else 3)
    args.idle_after = not quick
    if min(args.batches) < 1 or min(args.depth) < 1 or args.min_n < 1 or args.max_n < args.min_n:
        parser.error("need batches >= 1, depths >= 1, 1 <= --min-n <= --max-n")
    if args.e2e_reps < 1:
        parser.error("need --e2e-reps >= 1")
    if not points(args.sizes, args.batches):
        parser.error(f"every size x batch exceeds {MAX_EXCHANGE // MiB} MiB per exchange")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print Markdown; 0 on success."""
    args = parse_args(argv)
    res = run(args)
    tables = (kv_table(res, WARMUP, REGION), probe_table(res, PROBES), baseline_table(res),
              cpu_table(res), exchange_table(res), client_cpu_table(res), ratio_table(res),
              e2e_table(res),
              idle_table(res))  # fmt: skip
    print_report("Data plane: kvstore tcp:// and ucx:// beside their baselines",
                 "bench/transfer.py", argv, tables)  # fmt: skip
    if args.plot:
        plot(res, args.plot)
        print(f"Plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

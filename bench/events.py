"""A router's view of the pool: the cluster event stream's snapshot and live events,
beside a bare gRPC stream of the same messages.

    python bench/events.py [--blocks 200000] [--nodes 2] [--reps 3] [--live 300]
                           [--redis URL] [--plot events.png]

A router (``kvclient.PoolIndex``) starts from a snapshot of the master's index and
rebuilds from one whenever its stream cannot resume (another master, a restart), so the
time a snapshot takes is how long a router routes blind. This starts a ``kvstore master``
(with ``--redis URL``: on that Redis database, which the bench empties before and after:
give it one of its own, e.g. ``redis://127.0.0.1:6379/15``),
registers ``--nodes`` nodes from this process and commits ``--blocks`` blocks to each
(batches of 512, every block held by every node: a snapshot then sends ``blocks x
nodes`` events), then measures, in ``--reps`` alternating rounds:

1. **snapshot**: ``Events(snapshot=True)`` read until ``SNAPSHOT_DONE`` and folded into a
   ``PoolIndex`` (what a router does), wall time, events per second, this process's CPU
   and the master's (``/proc``, each thread's schedstat);
2. **bare stream**: a ``grpc.aio`` server in a process of its own streaming the same
   number of ``EventsResponse`` messages of the same events (pre-built), read with the
   generated stub and not decoded further: the floor any snapshot over gRPC stands on.

Then **live**: ``--live`` commits of one block, one at a time, each timed from the
``Commit`` call to the moment the follower's stream delivers its ``STORED`` event, beside
the ``Commit`` call's own round trip. Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from _common import (
    BarPanel,
    Serve,
    SpawnedServer,
    Table,
    expect,
    explain,
    print_report,
    proc_stat,
    progress,
    save_bar_plot,
)

from kvclient import PoolIndex
from kvstore.control import wire
from kvstore.control.client import MasterClient
from kvstore.control.records import BlockAdd, ClusterEvent, ClusterEventKind, CommitBatch
from kvstore.dataplane.location import SlotLocation
from kvstore.v1 import kvstore_pb2 as pb

NS = bytes(range(16))
BATCH = 512
"""Blocks per commit while filling."""
CHUNKS = tuple(range(64))
"""Chunks each block's holder holds (32 layers x 2 shards)."""
LOCATION = SlotLocation(1 << 30, 4 << 20, 2).pack()
IO_TIMEOUT_S = 120.0


def block_hash(node: int, i: int) -> bytes:
    """Block ``i`` (every node holds every block)."""
    del node
    return i.to_bytes(16, "big")


async def fill(client: MasterClient, nodes: int, blocks: int, bar: object, task: object) -> list:
    """Register ``nodes`` nodes and commit ``blocks`` blocks to each; (node id, epoch,
    next seq) of each."""
    out = []
    for n in range(nodes):
        client.session = os.urandom(32)
        node_id = f"bench-events-{n}"
        reg = await client.register(node_id, f"tcp://127.0.0.1:{7000 + n}")
        seq = 0
        for start in range(0, blocks, BATCH):
            seq += 1
            adds = tuple(BlockAdd(NS, block_hash(n, i), CHUNKS, LOCATION)
                         for i in range(start, min(blocks, start + BATCH)))  # fmt: skip
            applied = await client.commit(CommitBatch(node_id, reg.epoch, seq, adds))
            expect(applied == seq, f"commit {seq} of {node_id} not applied")
            bar.advance(task, len(adds))  # type: ignore[attr-defined]
        out.append((node_id, reg.epoch, seq + 1, client.session))
    return out


async def snapshot_round(address: str, master_pid: int, expected: int) -> dict[str, float]:
    """One snapshot read into a PoolIndex: seconds, events, client and master CPU s."""
    index = PoolIndex()
    async with MasterClient(address, timeout_s=IO_TIMEOUT_S) as client:
        cpu0, master0, t0 = time.process_time(), proc_stat(master_pid), time.perf_counter()
        events = 0
        stream = client.events(b"", snapshot=True, timeout=IO_TIMEOUT_S)
        async for log_id, batch in stream:
            index.apply(log_id, batch)
            events += len(batch)
            if batch and batch[-1].kind is ClusterEventKind.SNAPSHOT_DONE:
                break
        await stream.aclose()
        wall = time.perf_counter() - t0
        cpu, master = time.process_time() - cpu0, (proc_stat(master_pid) - master0).cpu_s
    expect(events == expected + 2, f"snapshot sent {events} events, expected {expected + 2}")
    expect(len(index.blocks) * 0 + sum(map(len, index.blocks.values())) == expected,
           "the index did not take every holder")  # fmt: skip
    return {"s": wall, "events": events, "cpu": cpu, "master": master}


def _snapshot_messages(blocks: int, nodes: int) -> list[bytes]:
    """The EventsResponse messages of a snapshot of ``blocks`` x ``nodes`` holders, as the
    master batches them (serialized: the bare server only sends them)."""
    events = [wire.cluster_event_to_pb(ClusterEvent(1, ClusterEventKind.CLEARED))]
    for i in range(blocks):
        for n in range(nodes):
            events.append(wire.cluster_event_to_pb(ClusterEvent(
                1, ClusterEventKind.STORED, NS, block_hash(n, i), f"bench-events-{n}",
                1_700_000_000_000 + n, CHUNKS, "host")))  # fmt: skip
    events.append(wire.cluster_event_to_pb(ClusterEvent(1, ClusterEventKind.SNAPSHOT_DONE)))
    out, size = [], 1024
    for k in range(0, len(events), size):
        out.append(pb.EventsResponse(log_id="x" * 16, events=events[k : k + size]))
    return [m.SerializeToString() for m in out]


def serve_bare_stream(pipe: Pipe, blocks: int, nodes: int) -> None:
    """A grpc.aio server streaming the snapshot's messages on every call (run in a process
    of its own: :class:`SpawnedServer`)."""
    asyncio.run(_bare_server(pipe, _snapshot_messages(blocks, nodes)))


async def _bare_server(pipe: Pipe, messages: list[bytes]) -> None:
    async def stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        for m in messages:
            yield m

    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Bare", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}),))  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pipe.send(f"127.0.0.1:{port}")
    await server.wait_for_termination()


async def bare_round(address: str, pid: int, expected: int) -> dict[str, float]:
    """One read of the bare stream (messages parsed as EventsResponse, nothing more)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(
            "/bench.Bare/Stream", response_deserializer=pb.EventsResponse.FromString
        )
        cpu0, srv0, t0 = time.process_time(), proc_stat(pid), time.perf_counter()
        events = 0
        async for msg in call(b"", timeout=IO_TIMEOUT_S):
            events += len(msg.events)
        wall = time.perf_counter() - t0
        cpu, srv = time.process_time() - cpu0, (proc_stat(pid) - srv0).cpu_s
    expect(events == expected + 2, f"bare stream sent {events} events")
    return {"s": wall, "events": events, "cpu": cpu, "master": srv}


async def live(address: str, node: tuple, commits: int, start: int) -> dict[str, list[float]]:
    """``commits`` one-block commits: Commit's round trip, and Commit → STORED seen."""
    node_id, epoch, seq, session = node
    rtt, seen = [], []
    async with (
        MasterClient(address, timeout_s=IO_TIMEOUT_S) as writer,
        MasterClient(address, timeout_s=IO_TIMEOUT_S) as reader,
    ):
        writer.session = session
        stream = reader.events(b"", timeout=IO_TIMEOUT_S)
        await anext(stream)  # (open: the log's id)
        for k in range(commits):
            h = block_hash(0, start + k)
            t0 = time.perf_counter()
            await writer.commit(CommitBatch(node_id, epoch, seq + k, (BlockAdd(NS, h, (0,)),)))
            t1 = time.perf_counter()
            while True:
                _, batch = await asyncio.wait_for(anext(stream), 10)
                if any(e.block_hash == h for e in batch):
                    break
            t2 = time.perf_counter()
            rtt.append(t1 - t0)
            seen.append(t2 - t0)
        await stream.aclose()
    return {"commit": rtt, "event": seen}


async def run(args: argparse.Namespace) -> list[Table]:
    # (the bench's nodes send no heartbeats: their leases must outlast the run)
    flags = ["--grpc-port", "0", "--metrics-port", "0", "--commit-port", "off",
             "--node-lease-s", "3600"]  # fmt: skip
    flags += ["--redis", args.redis] if args.redis else []
    expected = args.blocks * args.nodes
    _empty(args.redis)
    try:
        return await _run(args, flags, expected)
    finally:
        _empty(args.redis)


def _empty(url: str) -> None:
    """FLUSHDB the bench's own Redis database (nothing without one)."""
    if url:
        import redis

        with redis.Redis.from_url(url, socket_timeout=10) as r:
            r.flushdb()


async def _run(args: argparse.Namespace, flags: list[str], expected: int) -> list[Table]:
    with progress() as bar, Serve.start(*flags, command="master") as master:
        address = master.addresses["grpc"]
        task = bar.add_task("filling the index", total=expected)
        async with MasterClient(address, timeout_s=IO_TIMEOUT_S) as client:
            nodes = await fill(client, args.nodes, args.blocks, bar, task)
        bare = SpawnedServer.start(_BareTarget(args.blocks, args.nodes))
        try:
            rounds: dict[str, list[dict[str, float]]] = {"snapshot": [], "bare stream": []}
            task = bar.add_task("snapshot, bare stream", total=2 * args.reps)
            for r in range(args.reps):
                order = ("snapshot", "bare stream") if r % 2 == 0 else ("bare stream", "snapshot")
                for what in order:
                    if what == "snapshot":
                        res = await snapshot_round(address, master.proc.pid, expected)
                    else:
                        res = await bare_round(bare.address, bare.pid, expected)
                    rounds[what].append(res)
                    bar.advance(task)
        finally:
            bare.stop()
        bar.add_task(f"live: {args.live} commits", total=None)
        lat = await live(address, nodes[0], args.live, args.blocks)
    return _tables(args, rounds, lat, expected)


class _BareTarget:
    """A picklable ``serve_bare_stream`` with its sizes (SpawnedServer runs it)."""

    def __init__(self, blocks: int, nodes: int) -> None:
        self.blocks, self.nodes = blocks, nodes

    def __call__(self, pipe: Pipe) -> None:
        serve_bare_stream(pipe, self.blocks, self.nodes)


def _tables(args: argparse.Namespace, rounds: dict, lat: dict, expected: int) -> list[Table]:
    snap = Table(
        f"1. A snapshot of {args.blocks:,} blocks x {args.nodes} nodes ({expected:,} STORED "
        f"events), median of {args.reps} rounds",
        ["stream", "s", "events/s", "client CPU s", "server CPU s", "÷ bare stream (s)"],
    )
    med = {w: {k: statistics.median(r[k] for r in rs) for k in ("s", "cpu", "master")}
           for w, rs in rounds.items()}  # fmt: skip
    for what in ("snapshot", "bare stream"):
        m = med[what]
        ratio = m["s"] / med["bare stream"]["s"]
        snap.add(what, f"{m['s']:.2f}", f"{(expected + 2) / m['s']:,.0f}", f"{m['cpu']:.2f}",
                 f"{m['master']:.2f}", f"{ratio:.2f}")  # fmt: skip
    snap.notes.append("snapshot: Events(snapshot=True) from a kvstore master"
              f"{' on Redis' if args.redis else ''}, read to SNAPSHOT_DONE and folded "
              "into a PoolIndex; bare stream: the same messages from a bare grpc.aio "
              "server, parsed and nothing more. Server CPU: the master's or the bare "
              "server's process.")  # fmt: skip
    ms = {k: sorted(v) for k, v in lat.items()}
    live_t = Table(f"2. Live: {args.live} one-block commits, one at a time",
                   ["from Commit to", "p50 µs", "p99 µs"])  # fmt: skip
    for k, label in (("commit", "its answer (the RPC)"), ("event", "the follower's STORED")):
        live_t.add(label, f"{ms[k][len(ms[k]) // 2] * 1e6:.0f}",
                   f"{ms[k][int(len(ms[k]) * 0.99)] * 1e6:.0f}")  # fmt: skip
    if args.plot:
        save_bar_plot(args.plot, [
            BarPanel("snapshot", "s", ["snapshot", "bare stream"],
                     {"s": [med["snapshot"]["s"], med["bare stream"]["s"]]}),
            BarPanel("live", "µs p50", ["commit", "event"],
                     {"p50": [ms["commit"][len(ms["commit"]) // 2] * 1e6,
                              ms["event"][len(ms["event"]) // 2] * 1e6]}),
        ], f"bench/events.py, {expected:,} holders")  # fmt: skip
    return [snap, live_t]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = explain(argparse.ArgumentParser(prog="bench/events.py"), __doc__)
    p.add_argument("--blocks", type=int, default=200_000, help="blocks per node")
    p.add_argument("--nodes", type=int, default=2, help="nodes, each holding every block")
    p.add_argument("--reps", type=int, default=3, help="rounds of each stream")
    p.add_argument("--live", type=int, default=300, help="one-block commits timed live")
    p.add_argument("--redis", default="", help="a Redis URL for the master's index")
    p.add_argument("--plot", default="", help="write a PNG here")
    args = p.parse_args(argv)
    if min(args.blocks, args.nodes, args.reps, args.live) < 1:
        p.error("--blocks, --nodes, --reps and --live must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tables = asyncio.run(run(args))
    print_report("The cluster event stream: snapshot and live", "bench/events.py",
                 argv if argv is not None else sys.argv[1:], tables)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

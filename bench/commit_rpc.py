"""A node's commit to a master in a process of its own: a unary ``Commit`` RPC, a message
of the node's ``CommitStream`` and a framed exchange on the master's commit port, side by
side in one run.

    python bench/commit_rpc.py [--rounds 6] [--commits 500] [--adds 8] [--load N]

Every put's ack waits for its node's commit, so on a cluster (a ``kvstore master`` apart
from its nodes) the commit's round trip is on every put's path; ``kvstore serve``'s own
node calls its master in-process and pays none of it (``bench/commit_path.py`` measures
that). This starts a ``kvstore master`` subprocess on loopback, registers two nodes with
it from this process and commits batches of ``--adds`` adds and as many evictions (a full
pool, as ``bench/commit_path.py`` builds them), in rounds that alternate between

- **unary Commit**: ``MasterStub.Commit``, one RPC per batch (what nodes sent before
  ``CommitStream``; what a node falls back to when its stream breaks);
- **CommitStream**: ``MasterClient.commit`` with ``use_commit_port=False``, one message on
  the node's long-lived stream (what a node sends while the commit port is out of reach);
- **commit port**: ``MasterClient.commit``, one framed exchange on the node's connection
  to the master's commit port (:mod:`kvstore.control.commit_port`; what a node sends).

Per path: the commit's p50 and p99 round trip, this process's CPU per commit (the
node's side) and the master process's (``/proc``, each thread's schedstat), each the median of
the rounds, and each ÷ CommitStream's. With ``--load N``, then N nodes commit at once,
back to back, on the stream and on the commit port in turn: the commits per second they
get through and the master's CPU per commit under that load. Markdown on stdout,
progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from _common import Serve, Table, expect, print_report, proc_stat, progress
from commit_path import NS, TIERS, block_hash, pool_batch

from kvstore.control import wire
from kvstore.control.client import MasterClient
from kvstore.control.records import CommitBatch
from kvstore.dataplane.location import tier_mark
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

POOL_BLOCKS = 4096
PATHS = ("unary Commit", "CommitStream", "commit port")


class Node:
    """One registered node of the bench: its master client and its next batches."""

    def __init__(self, client: MasterClient, node_id: str, adds: int) -> None:
        self.client = client
        self.node_id = node_id
        self.adds = adds
        self.epoch = 0
        self.seq = 0
        self.stub: pb_grpc.MasterStub | None = None
        """The unary path's stub (None for the stream's node)."""

    async def register(self) -> None:
        """Register (with a registration key, as a node's MasterLink does)."""
        self.client.session = os.urandom(32)
        reg = await self.client.register(self.node_id, "tcp://127.0.0.1:7000", tiers=TIERS)
        self.epoch = reg.epoch

    def batch(self) -> CommitBatch:
        """The next batch: ``adds`` new blocks, and the ones added a full pool ago evicted."""
        self.seq += 1
        window = max(1, POOL_BLOCKS // self.adds)
        return pool_batch(self.node_id, self.epoch, self.seq, self.adds, window, (0,),
                          tier_mark("host"), self.tag)  # fmt: skip

    @property
    def tag(self) -> bytes:
        """What starts this node's block hashes (two nodes commit into one master)."""
        return zlib.crc32(self.node_id.encode()).to_bytes(4, "big")


async def commit_unary(node: Node) -> int:
    """One unary ``Commit`` RPC on a channel of its own (the generated stub: what the
    client sent before ``CommitStream``)."""
    req = wire.commit_to_pb(node.batch())
    req.session = node.client.session
    expect(node.stub is not None, "no unary stub")
    resp = await node.stub.Commit(req, timeout=10)  # type: ignore[union-attr]
    return int(resp.applied_seq)


async def commit_by_client(node: Node) -> int:
    """``MasterClient.commit``: the commit port, or (``use_commit_port=False``) one message
    on the node's commit stream."""
    return await node.client.commit(node.batch())


async def measure(master_pid: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Alternate rounds of ``args.commits`` commits per path (a warm-up round first);
    per path and round: p50 and p99 µs, node-side and master CPU µs per commit."""
    out = {p: {"p50": [], "p99": [], "cpu": [], "master": []} for p in PATHS}
    calls = {"unary Commit": commit_unary, "CommitStream": commit_by_client,
             "commit port": commit_by_client}  # fmt: skip
    nodes = {}
    channel = grpc.aio.insecure_channel(args.master)
    for path in PATHS:
        client = MasterClient(args.master, timeout_s=10, use_commit_port=path == "commit port")
        nodes[path] = Node(client, f"bench-{path.split()[0].lower()}", args.adds)
        await nodes[path].register()
    nodes["unary Commit"].stub = pb_grpc.MasterStub(channel)
    try:
        with progress() as bar:
            task = bar.add_task("commits", total=(args.rounds + 1) * len(PATHS) * args.commits)
            for r in range(args.rounds + 1):
                for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                    node, call, lat = nodes[path], calls[path], []
                    cpu0, master0 = time.process_time(), proc_stat(master_pid)
                    for _ in range(args.commits):
                        t0 = time.perf_counter()
                        applied = await call(node)
                        lat.append(time.perf_counter() - t0)
                        expect(applied == node.seq, f"{path}: applied {applied}, sent {node.seq}")
                    bar.advance(task, args.commits)
                    if not r:
                        continue  # warm-up
                    cpu = time.process_time() - cpu0
                    master = (proc_stat(master_pid) - master0).cpu_s
                    lat.sort()
                    out[path]["p50"].append(lat[len(lat) // 2] * 1e6)
                    out[path]["p99"].append(lat[int(len(lat) * 0.99)] * 1e6)
                    out[path]["cpu"].append(cpu / args.commits * 1e6)
                    out[path]["master"].append(master / args.commits * 1e6)
        for path, node in nodes.items():  # every batch landed: the newest block is indexed
            [holders] = await node.client.lookup(NS, [block_hash(node.seq * node.adds, node.tag)])
            expect([h.node_id for h in holders] == [node.node_id], f"{path}: a commit is lost")
    finally:
        for node in nodes.values():
            await node.client.close()
        await channel.close()
    return out


LOAD_PATHS = ("CommitStream", "commit port")


async def load(master_pid: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """``args.load`` nodes committing at once, back to back, for ``args.load_s`` seconds a
    round, per path (alternating, ``args.rounds`` rounds after a warm-up): per round the
    commits per second all of them got through and the master's CPU per commit."""
    out: dict[str, dict[str, list[float]]] = {p: {"rate": [], "master": []} for p in LOAD_PATHS}
    nodes = {
        path: [Node(MasterClient(args.master, timeout_s=10, use_commit_port=path == "commit port"),
                    f"load-{i}-{path.split()[0].lower()}", args.adds)
               for i in range(args.load)]
        for path in LOAD_PATHS
    }  # fmt: skip
    for group in nodes.values():
        for node in group:
            await node.register()

    async def run(node: Node, until: float) -> int:
        done = 0
        while time.monotonic() < until:
            expect(await commit_by_client(node) == node.seq, f"{node.node_id}: a wrong seq")
            done += 1
        return done

    try:
        with progress() as bar:
            task = bar.add_task("load rounds", total=(args.rounds + 1) * len(LOAD_PATHS))
            for r in range(args.rounds + 1):
                for path in LOAD_PATHS if r % 2 == 0 else LOAD_PATHS[::-1]:
                    master0, began = proc_stat(master_pid), time.monotonic()
                    until = began + args.load_s
                    counts = await asyncio.gather(*(run(n, until) for n in nodes[path]))
                    took, commits = time.monotonic() - began, sum(counts)
                    master = (proc_stat(master_pid) - master0).cpu_s
                    bar.advance(task)
                    if r:  # (the first round warms up)
                        out[path]["rate"].append(commits / took)
                        out[path]["master"].append(master / commits * 1e6)
    finally:
        for group in nodes.values():
            for node in group:
                await node.client.close()
    return out


def load_table(got: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> Table:
    result = Table(
        f"{args.load} nodes committing at once, back to back ({args.rounds} rounds of "
        f"{args.load_s:g} s per path, alternating; medians of the rounds)",
        ["path", "commits/s", "master CPU µs/commit", "commits/s ÷ stream",
         "master CPU ÷ stream"],
    )  # fmt: skip
    med = {p: {k: statistics.median(v) for k, v in got[p].items()} for p in LOAD_PATHS}
    base = med["CommitStream"]
    for path in LOAD_PATHS:
        m = med[path]
        ratios = (m["rate"] / base["rate"], m["master"] / base["master"])
        result.add(path, f"{m['rate']:.0f}", f"{m['master']:.0f}", *(f"{r:.2f}" for r in ratios))
    result.notes.append(
        "The nodes are MasterClients in this process, sharing its loop and this machine's "
        "cores with the master: commits/s is what the two processes together reach here; "
        "the master's CPU per commit, under concurrent commits, is the figure to scale by."
    )
    return result


def table(got: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> Table:
    result = Table(
        f"A node's commit to a master in its own process ({args.adds} adds + {args.adds} "
        f"evictions a batch; {args.rounds} rounds of {args.commits} commits per path, "
        "alternating; medians of the rounds)",
        ["path", "p50 µs", "p99 µs", "node CPU µs/commit", "master CPU µs/commit",
         "p50 ÷ stream", "node CPU ÷ stream", "master CPU ÷ stream"],
    )  # fmt: skip
    med = {p: {k: statistics.median(v) for k, v in got[p].items()} for p in PATHS}
    base = med["CommitStream"]
    for path in PATHS:
        m = med[path]
        ratios = [m[k] / base[k] for k in ("p50", "cpu", "master")]
        result.add(path, f"{m['p50']:.0f}", f"{m['p99']:.0f}", f"{m['cpu']:.0f}",
                   f"{m['master']:.0f}", *(f"{r:.2f}" for r in ratios))  # fmt: skip
    result.notes += [
        "node CPU: this process (the node's side of the call: building the request, gRPC's "
        "client, the answer), process time over a round ÷ its commits; master CPU: the "
        "kvstore master process over the same round (/proc, every thread's schedstat).",
        "On loopback both processes share this machine's cores: each side's CPU is the "
        "figure to compare across machines, the round trip this machine's.",
    ]
    return result


def commit_links(metrics: str) -> float:
    """The master's ``kvstore_commit_links_total`` (its /metrics at ``host:port``)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as body:
        for line in body.read().decode().splitlines():
            if line.startswith("kvstore_commit_links_total "):
                return float(line.split()[1])
    return -1.0


def main(argv: list[str] | None = None) -> int:
    """Run both paths against one master subprocess and print Markdown; 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per path")
    p.add_argument("--commits", type=int, default=500, help="commits per round")
    p.add_argument("--adds", type=int, default=8, help="adds (and evictions) per batch")
    p.add_argument("--load", type=int, default=0,
                   help="then this many nodes committing at once (0: skip)")  # fmt: skip
    p.add_argument("--load-s", type=float, default=3.0, help="seconds per load round")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.commits < 1 or not 1 <= args.adds <= 4096:
        p.error("need --rounds >= 1, --commits >= 1, --adds in 1..4096")
    if not 0 <= args.load <= 256 or not args.load_s > 0:
        p.error("need --load in 0..256 and --load-s > 0")
    with Serve.start("--grpc-port", "0", "--metrics-port", "0", command="master") as master:
        args.master = master.addresses["grpc"]
        got = asyncio.run(measure(master.proc.pid, args))
        tables = [table(got, args)]
        if args.load:
            tables.append(load_table(asyncio.run(load(master.proc.pid, args)), args))
        links = commit_links(master.addresses["metrics"])
    # (one connection per node on the commit port, kept; the gRPC nodes opened none)
    expect(links == 1 + args.load, f"the commit port served {links} connections, not one a node")
    print_report("A node's commit to its master", "bench/commit_rpc.py", argv, tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())

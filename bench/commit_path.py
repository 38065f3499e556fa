"""The master's cost per commit: one node's batches of adds and evictions, in one process.

    python bench/commit_path.py [--rounds 7] [--commits 2000] [--chunks 1,32]
                                [--location mark|packed] [--pool-blocks 4096]

Every put's ack waits for its node's commit, so what the master spends on one is on the
put path. This measures, without sockets or threads, microseconds per commit of a batch
(8 adds + 8 evictions, and 64 + 64) through

- **in-process**: ``MasterService.commit_in_process``, what ``kvstore serve``'s own node
  calls (``wire.check_commit``, the session check, ``MemoryIndexStore.apply``,
  ``EventLog.commit``, the lease);
- **gRPC handler**: what a separate master does per ``Commit`` RPC once gRPC has the
  request's bytes: ``CommitRequest.FromString``, then the ``Commit`` handler
  (``wire.commit_from_pb`` and the same apply).

The master is built as the tests build one (a :class:`MemoryIndexStore`, a
:class:`Membership`, a node registered through an in-process :class:`MasterClient` with a
registration key) and holds a full pool: commit ``k`` adds ``adds`` new blocks and evicts
the ones added ``--pool-blocks / adds`` commits before, so every eviction drops an entry
the node holds (the index stays at ``--pool-blocks`` blocks). Batches are built before
each timed round (building them is the node's cost, not the master's). Rounds of the
cases alternate; the table gives the best and the median round. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from _common import BenchError, Table, expect, print_report, progress

from kvstore.control import wire
from kvstore.control.client import MasterClient
from kvstore.control.records import BlockAdd, BlockRef, CommitBatch, Tier
from kvstore.dataplane.location import SlotLocation, tier_mark
from kvstore.errors import InvalidArgument
from kvstore.master.index import MemoryIndexStore
from kvstore.master.membership import Membership
from kvstore.master.service import MasterService
from kvstore.v1 import kvstore_pb2 as pb

NODE = "bench-node"
NS = bytes(range(16))
LEASE_S = 3600.0  # (no sweep runs: the node never goes silent within a run)
TIERS = (Tier("host", 64 << 30, 48 << 30),)
PATHS = ("in-process", "gRPC handler")


class _Context:
    """What the ``Commit`` handler sees of its call (no token, no auth file)."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise InvalidArgument(f"Commit aborted: {code.name} {details}")


@dataclass
class Case:
    """One measured combination and the master it runs on, with its round times."""

    path: str
    adds: int
    chunks: int
    location: bytes
    pool_blocks: int
    master: MasterService | None = None
    epoch: int = 0
    session: bytes = b""
    seq: int = 0
    rounds_us: list[float] = field(default_factory=list)

    @property
    def service(self) -> MasterService:
        """The case's master (:func:`start` builds it)."""
        if self.master is None:
            raise BenchError(f"{self.path}: the case was not started")
        return self.master

    @property
    def window(self) -> int:
        """Commits between a block's add and its eviction (a full pool)."""
        return max(1, self.pool_blocks // self.adds)

    def batch(self) -> CommitBatch:
        """The node's next batch: ``adds`` new blocks, the oldest ``adds`` evicted."""
        self.seq += 1
        return pool_batch(NODE, self.epoch, self.seq, self.adds, self.window,
                          tuple(range(self.chunks)), self.location)  # fmt: skip


def pool_batch(
    node_id: str,
    epoch: int,
    seq: int,
    adds: int,
    window: int,
    chunks: tuple[int, ...],
    location: bytes,
    tag: bytes = b"",
) -> CommitBatch:
    """Commit ``seq`` of a node whose pool holds ``window`` commits' blocks: ``adds`` new
    blocks, and the ones added ``window`` commits before evicted (none before that)."""
    new = tuple(BlockAdd(NS, block_hash(seq * adds + i, tag), chunks, location)
                for i in range(adds))  # fmt: skip
    old = seq - window
    evicts = tuple(BlockRef(NS, block_hash(old * adds + i, tag)) for i in range(adds * (old > 0)))
    return CommitBatch(node_id, epoch, seq, new, evicts, tiers=TIERS)


def block_hash(i: int, tag: bytes = b"") -> bytes:
    """Block ``i``'s 16-byte hash, ``tag`` (a node's own, a few bytes) first."""
    return tag + i.to_bytes(16 - len(tag), "big")


async def start(case: Case) -> None:
    """Build the case's master, register its node and fill its pool (not timed)."""
    case.master = MasterService(MemoryIndexStore(), Membership(LEASE_S))
    client = MasterClient.in_process(case.master, timeout_s=5)
    client.session = os.urandom(32)  # as a node's MasterLink sets it
    reg = await client.register(NODE, "tcp://127.0.0.1:7000", tiers=TIERS)
    case.epoch, case.session = reg.epoch, client.session
    for _ in range(case.window + 1):
        await client.commit(case.batch())


async def measure(case: Case, commits: int) -> float:
    """One timed round of ``commits`` commits; microseconds per commit."""
    service = case.service
    batches = [case.batch() for _ in range(commits)]
    if case.path == "in-process":
        t0 = time.perf_counter()
        for batch in batches:
            await service.commit_in_process(batch, case.session)
        elapsed = time.perf_counter() - t0
    else:
        raw = []
        for batch in batches:
            req = wire.commit_to_pb(batch)
            req.session = case.session
            raw.append(req.SerializeToString())
        ctx = _Context()
        parse = pb.CommitRequest.FromString
        t0 = time.perf_counter()
        for data in raw:
            await service.Commit(parse(data), ctx)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - t0
    return elapsed / commits * 1e6


async def check(case: Case) -> None:
    """The master applied every batch (a resend of the last seq answers it), the newest
    blocks are held, the evicted ones are not, and the index is consistent."""
    service = case.service
    store = service.store
    expect(isinstance(store, MemoryIndexStore), "the master's store is not in memory")
    assert isinstance(store, MemoryIndexStore)  # (for mypy)
    resent = await service.commit_in_process(CommitBatch(NODE, case.epoch, case.seq))
    expect(resent == case.seq, f"{case.path}: applied seq {resent}, expected {case.seq}")
    newest = block_hash(case.seq * case.adds)
    evicted = block_hash((case.seq - case.window) * case.adds)
    held = await store.locate(NS, [newest, evicted])
    expect(list(held[0]) == [NODE] and not held[1], f"{case.path}: index lost a commit")
    store.validate()
    service.membership.validate()


async def run(args: argparse.Namespace) -> list[Case]:
    location = tier_mark("host") if args.location == "mark" else _packed()
    cases = [
        Case(path, adds, chunks, location, args.pool_blocks)
        for adds in (8, 64)
        for chunks in args.chunks
        for path in PATHS
    ]
    for case in cases:
        await start(case)
    with progress() as bar:
        task = bar.add_task("commit rounds", total=args.rounds * len(cases))
        for _ in range(args.rounds):
            for case in cases:
                commits = max(50, args.commits * 8 // case.adds)
                case.rounds_us.append(await measure(case, commits))
                bar.advance(task)
    for case in cases:
        await check(case)
    return cases


def _packed() -> bytes:
    """A ``ucx://`` node's host slot location (20 bytes)."""
    return SlotLocation(0x7F00_0000_0000, 512 << 10, 32).pack()


def table(cases: list[Case], args: argparse.Namespace) -> Table:
    result = Table(
        "Master commit path, µs per commit (one node, full pool)",
        ["path", "batch", "chunks/add", "best µs", "median µs", "commits/s (best)"],
    )
    for case in cases:
        best, median = min(case.rounds_us), statistics.median(case.rounds_us)
        result.add(
            case.path,
            f"{case.adds} adds + {case.adds} evicts",
            case.chunks,
            f"{best:.1f}",
            f"{median:.1f}",
            f"{1e6 / best:,.0f}",
        )
    result.notes += [
        f"{args.rounds} rounds of {args.commits} commits (8 + 8; 64 + 64: an eighth as many), "
        f"cases alternating; location: {args.location}; pool: {args.pool_blocks} blocks",
        "in-process: MasterService.commit_in_process (check_commit, session check, "
        "MemoryIndexStore.apply, EventLog.commit, lease)",
        "gRPC handler: CommitRequest.FromString + MasterService.Commit (commit_from_pb, the "
        "same apply); gRPC's own transport is not in it",
    ]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per case")
    parser.add_argument(
        "--commits", type=int, default=2000, help="commits of 8 + 8 per round (default 2000)"
    )
    parser.add_argument(
        "--chunks",
        default="1,32",
        help="chunks per add, comma-separated (default 1,32: one layer; a 32-layer block)",
    )
    parser.add_argument(
        "--location",
        choices=("mark", "packed"),
        default="mark",
        help="what each add carries: a tcp:// node's tier mark or a ucx:// slot location",
    )
    parser.add_argument("--pool-blocks", type=int, default=4096, help="blocks the node holds")
    args = parser.parse_args(argv)
    try:
        args.chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        parser.error("--chunks takes integers, e.g. 1,32")
    if args.rounds < 1 or args.commits < 1 or args.pool_blocks < 64:
        parser.error("need --rounds >= 1, --commits >= 1, --pool-blocks >= 64")
    if not all(1 <= c <= 1024 for c in args.chunks):
        parser.error("--chunks must lie in 1..1024")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print Markdown; 0 on success."""
    args = parse_args(argv)
    cases = asyncio.run(run(args))
    print_report("Master commit path", "bench/commit_path.py", argv, [table(cases, args)])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fixed cost of one ``NixlAgent.read/write`` call beside the raw NIXL binding.

    python bench/nixl_calls.py [--sizes 64,512K,4M] [--batches 1,8] [--rounds 5]

Two processes on loopback: a *target* (this script, spawned: a
:class:`~kvstore.transport.nixl.NixlAgent` with NIXL's progress thread that registers
:data:`REGION` bytes, as a storage node does) and the *initiator*, this process. For each
op x span size x spans per call the initiator times one call at a time, two ways:

- **raw**: the ``nixl_cu12._bindings`` agent driven directly on the calling thread,
  descriptor lists built once outside the timer: ``createXferReq`` → ``postXferReq`` →
  ``getXferStatus`` in a spin → ``releaseXferReq`` (the ceiling for one call);
- **agent**: ``await NixlAgent.read/write`` with the same spans (validation, descriptor
  lists, deadlines, polling, release: what kvstore pays per call).

The spans of one call are ``size`` apart plus a 4 KiB gap (so NIXL cannot merge them) and
the same on every call (cache-hot: this measures the cost per call, not memory). Each
point runs ``--rounds`` rounds, raw then agent (then agent then raw in the next round), so
drift on a shared machine lands on both; p50 and p99 are over all rounds' calls, and
agent ÷ raw is the ratio of the p50s. Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

import nixl_raw
import torch
from _common import SpawnedServer, Table, node_memory, percentile, print_report, progress

from kvstore.transport.nixl import NixlAgent

KiB, MiB = 1 << 10, 1 << 20
REGION = 64 * MiB
"""Bytes each side registers: room for 8 spans of 4 MiB with their gaps."""
GAP = 4 * KiB
WARMUP = 20
"""Untimed calls per path before each point (connection set-up, first touches)."""
BUDGET = 512 * MiB
"""Bytes moved per path per point, split over the rounds (between 100 and 2,000 calls)."""


def serve_target(pipe: Pipe) -> None:
    """Process target (:class:`SpawnedServer`): registers :data:`REGION` bytes with a
    progress-thread :class:`NixlAgent`, sends ``(metadata, address)``, serves until killed."""
    os.environ.update(nixl_raw.LOOPBACK)
    asyncio.run(_target(pipe))


async def _target(pipe: Pipe) -> None:
    buf = node_memory(REGION)  # touched: no page faults while timed (a node's kind)
    async with NixlAgent(f"calls-target-{os.getpid()}", progress_thread=True) as agent:
        reg = await agent.register(buf)
        pipe.send((await agent.metadata(), reg.addr))
        await asyncio.Event().wait()


@dataclass(frozen=True)
class Point:
    """One measured (op, size, batch): per-call seconds of each path."""

    op: str
    size: int
    batch: int
    raw: list[float]
    agent: list[float]


class Initiator:
    """The raw binding agent and a :class:`NixlAgent`, both on one local buffer."""

    def __init__(self, metadata: bytes, remote_addr: int) -> None:
        from kvstore.transport.nixl_binding import import_bindings

        nixl = import_bindings()

        self.nixl = nixl
        self.remote = remote_addr
        self.buf = torch.ones(REGION, dtype=torch.uint8)
        self.raw = nixl.nixlAgent(f"calls-raw-{os.getpid()}", nixl.nixlAgentConfig())
        self.raw.createBackend("UCX", {})
        region = [(self.buf.data_ptr(), REGION, 0, "")]
        self.raw.registerMem(nixl.nixlRegDList(nixl.DRAM_SEG, region))
        self.raw_peer = self.raw.loadRemoteMD(metadata).decode()
        self.metadata = metadata
        self.agent = NixlAgent(f"calls-agent-{os.getpid()}")
        self.peer = ""

    async def start(self) -> None:
        await self.agent.start()
        await self.agent.register(self.buf)
        self.peer = await self.agent.add_peer(self.metadata)

    async def close(self) -> None:
        await self.agent.close()

    def calls(self, op: str, size: int, batch: int) -> dict[str, Callable[[], Awaitable[Any]]]:
        """The two ways of making one call of ``batch`` spans of ``size`` bytes."""
        nixl, raw = self.nixl, self.raw
        offs = [i * (size + GAP) for i in range(batch)]
        local = [(self.buf.data_ptr() + o, size) for o in offs]
        remote = [(self.remote + o, size) for o in offs]
        views = [self.buf[o : o + size] for o in offs]
        ldl = nixl.nixlXferDList(nixl.DRAM_SEG, [(a, n, 0) for a, n in local])
        rdl = nixl.nixlXferDList(nixl.DRAM_SEG, [(a, n, 0) for a, n in remote])
        code = nixl.NIXL_READ if op == "READ" else nixl.NIXL_WRITE
        move = self.agent.read if op == "READ" else self.agent.write

        async def raw_call() -> None:
            handle = raw.createXferReq(code, ldl, rdl, self.raw_peer)
            status = raw.postXferReq(handle)
            while status == nixl.NIXL_IN_PROG:
                status = raw.getXferStatus(handle)
            raw.releaseXferReq(handle)
            if status != nixl.NIXL_SUCCESS:
                raise RuntimeError(f"raw {op} failed: {status}")

        async def agent_call() -> None:
            await move(self.peer, remote, views, timeout=30)

        return {"raw": raw_call, "agent": agent_call}


async def _timed(call: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def measure(ini: Initiator, op: str, size: int, batch: int, rounds: int) -> Point:
    """Warm both paths up, then ``rounds`` rounds of each, alternating which goes first."""
    calls = ini.calls(op, size, batch)
    n = max(100, min(2000, BUDGET // (size * batch))) // rounds
    got: dict[str, list[float]] = {"raw": [], "agent": []}
    for call in calls.values():
        await _timed(call, WARMUP)
    for r in range(rounds):
        for path in ("raw", "agent") if r % 2 == 0 else ("agent", "raw"):
            got[path] += await _timed(calls[path], n)
    return Point(op, size, batch, got["raw"], got["agent"])


async def run(args: argparse.Namespace) -> list[Point]:
    sizes = [nixl_raw.parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    server = SpawnedServer.start(serve_target)
    ini = Initiator(*server.address)
    points = []
    try:
        await ini.start()
        todo = [(op, s, b) for s in sizes for b in batches for op in nixl_raw.OPS]
        with progress() as bar:
            task = bar.add_task("NIXL calls", total=len(todo))
            for op, size, batch in todo:
                bar.update(task, description=f"{op} {fmt(size)} x {batch}")
                points.append(await measure(ini, op, size, batch, args.rounds))
                bar.advance(task)
    finally:
        await ini.close()
        server.stop()
    return points


def table(points: list[Point], rounds: int) -> Table:
    out = Table(
        "Per call: raw NIXL binding vs NixlAgent (one call in flight, µs)",
        ["op", "span", "spans", "calls", "raw p50", "raw p99", "agent p50", "agent p99",
         "agent ÷ raw p50"],
    )  # fmt: skip
    for p in points:
        raw = [percentile(p.raw, q) * 1e6 for q in (50, 99)]
        agent = [percentile(p.agent, q) * 1e6 for q in (50, 99)]
        out.add(p.op, fmt(p.size), p.batch, len(p.agent), f"{raw[0]:.1f}", f"{raw[1]:.1f}",
                f"{agent[0]:.1f}", f"{agent[1]:.1f}", f"{agent[0] / raw[0]:.2f}")  # fmt: skip
    out.notes += [
        "raw: binding on the calling thread, descriptor lists prebuilt, create → post → "
        "spin on getXferStatus → release; agent: `await NixlAgent.read/write` of the same spans",
        f"{rounds} rounds per point, alternating which path goes first; loopback "
        "(UCX_NET_DEVICES=lo), target with NIXL's progress thread; cache-hot spans",
    ]
    return out


def fmt(size: int) -> str:
    if size >= MiB:
        return f"{size // MiB} MiB"
    return f"{size // KiB} KiB" if size >= KiB else f"{size} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="64,512K,4M", help="bytes per span, comma-separated")
    parser.add_argument("--batches", default="1,8", help="spans per call, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per point")
    args = parser.parse_args(argv)
    os.environ.update(nixl_raw.LOOPBACK)  # the raw agent and the target, both on loopback
    points = asyncio.run(run(args))
    print_report("NixlAgent per-call overhead", "bench/nixl_calls.py", argv,
                 [table(points, args.rounds)])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

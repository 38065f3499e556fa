"""Raw NIXL READ/WRITE between two local processes, beside a single-thread memcpy.

For each UCX transport setting (UCX's own choice, then ``UCX_TLS=tcp`` — what two hosts
without RDMA get) a fresh pair of processes is spawned: a *target* that registers a buffer
with a :class:`~kvstore.transport.nixl.NixlAgent` running NIXL's progress thread (as a
storage node does), and an *initiator* that moves one request at a time and times it two
ways: **raw** — the NIXL binding called directly, spinning on ``getXferStatus`` (the
ceiling) — and **layer** — ``await NixlAgent.read/write`` (worker thread, backoff polling,
asyncio; what kvstore pays). The target's CPU seconds per GB moved are measured around each
point. ``memcpy`` is ``torch`` ``copy_`` of the same sizes on one thread, in this process.

By default every iteration uses the next slice of a 256 MiB buffer (cache-cold, like real
KV chunks); ``--hot`` reuses one slice. Usage::

    python bench/nixl_raw.py                       # Markdown table on stdout
    python bench/nixl_raw.py --sizes 512K,4M --plot nixl.png --ucx-log
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

KiB, MiB = 1 << 10, 1 << 20
REGION = 256 * MiB
TRANSPORTS: dict[str, dict[str, str]] = {"ucx": {}, "ucx tcp": {"UCX_TLS": "tcp"}}
LOOPBACK = {"UCX_NET_DEVICES": "lo"}
"""Both agents of the initiator on loopback (unrestricted, UCX stripes tcp over every NIC)."""
PATHS = ("raw", "layer")
OPS = ("READ", "WRITE")
WARMUP = 5
"""Untimed transfers before each point (connection set-up, first touches)."""


@dataclass(frozen=True)
class Timing:
    """Latencies of one (transport, op, path, size) point."""

    size: int
    seconds: list[float]

    @property
    def gbps(self) -> float:
        """Throughput with one request in flight: bytes / mean latency."""
        return self.size / statistics.fmean(self.seconds) / 1e9

    def pct_us(self, q: float) -> float:
        """The ``q`` quantile of the latencies, in µs."""
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


@dataclass(frozen=True)
class Row:
    transport: str
    op: str
    size: int
    raw: Timing
    layer: Timing
    target_cpu_s_per_gb: float
    memcpy_gbps: float


def iterations(size: int, budget: int) -> int:
    """Enough iterations to move about ``budget`` bytes, between 20 and 400."""
    return max(20, min(400, budget // size))


def offsets(size: int, n: int, hot: bool) -> Iterator[int]:
    """Where each iteration's bytes start inside the region (rotating unless ``hot``)."""
    slots = max(1, REGION // size)
    for i in range(n):
        yield 0 if hot else (i % slots) * size


# ---- target process ----------------------------------------------------------------------


def target_main(conn: Connection, env: dict[str, str]) -> None:
    """A storage-node stand-in: registers REGION bytes and reports its CPU time on demand."""
    os.environ.update(env)
    asyncio.run(_target(conn))


async def _target(conn: Connection) -> None:
    from _common import node_memory

    from kvstore.transport.nixl import NixlAgent

    buf = node_memory(REGION)  # touched: no page faults while timed (a node's kind)
    async with NixlAgent("bench-target", progress_thread=True) as agent:
        reg = await agent.register(buf)
        conn.send((await agent.metadata(), reg.span().to_wire()))
        while (cmd := conn.recv()) != "stop":  # the progress thread serves; we just wait
            conn.send(time.process_time() if cmd == "cpu" else None)


# ---- initiator process -------------------------------------------------------------------


def initiator_main(conn: Connection, env: dict[str, str], metadata: bytes, wire: list) -> None:
    """Times transfers on request: ``(op, path, size, n, hot)`` → list of seconds."""
    os.environ.update(env)
    asyncio.run(_initiator(conn, metadata, wire))


async def _initiator(conn: Connection, metadata: bytes, wire: list) -> None:
    from kvstore.transport.nixl_binding import import_bindings

    nixl = import_bindings()
    import torch

    from kvstore.transport.nixl import NixlAgent, Span

    remote = Span.from_wire(wire)
    buf = torch.ones(REGION, dtype=torch.uint8)
    raw = nixl.nixlAgent("bench-raw", nixl.nixlAgentConfig())
    raw.createBackend("UCX", {})
    raw.registerMem(nixl.nixlRegDList(nixl.DRAM_SEG, [(buf.data_ptr(), REGION, 0, "")]))
    raw_peer = raw.loadRemoteMD(metadata).decode()
    async with NixlAgent("bench-layer") as layer:
        await layer.register(buf)
        peer = await layer.add_peer(metadata)
        while (cmd := conn.recv()) != "stop":
            op, path, size, n, hot = cmd
            spots = list(offsets(size, n, hot))
            if path == "raw":
                conn.send(_time_raw(nixl, raw, raw_peer, op, buf.data_ptr(), remote, size, spots))
            else:
                conn.send(await _time_layer(layer, peer, op, buf, remote, size, spots))


def _time_raw(
    nixl: Any, agent: Any, peer: str, op: str, local: int, remote: Any, size: int, spots: list
) -> list[float]:
    code = nixl.NIXL_READ if op == "READ" else nixl.NIXL_WRITE
    seconds = []
    for off in spots:
        ldl = nixl.nixlXferDList(nixl.DRAM_SEG, [(local + off, size, 0)])
        rdl = nixl.nixlXferDList(nixl.DRAM_SEG, [(remote.addr + off, size, 0)])
        start = time.perf_counter()
        handle = agent.createXferReq(code, ldl, rdl, peer)
        status = agent.postXferReq(handle)
        while status == nixl.NIXL_IN_PROG:
            status = agent.getXferStatus(handle)
        seconds.append(time.perf_counter() - start)
        agent.releaseXferReq(handle)
        if status != nixl.NIXL_SUCCESS:
            raise RuntimeError(f"raw {op} failed: {status}")
    return seconds


async def _time_layer(
    agent: Any, peer: str, op: str, buf: Any, remote: Any, size: int, spots: list
) -> list[float]:
    move = agent.read if op == "READ" else agent.write
    seconds = []
    for off in spots:
        start = time.perf_counter()
        await move(peer, [(remote.addr + off, size)], [buf[off : off + size]], timeout=30)
        seconds.append(time.perf_counter() - start)
    return seconds


# ---- orchestration -----------------------------------------------------------------------


def memcpy_gbps(sizes: list[int], budget: int, hot: bool) -> dict[int, float]:
    """Single-thread ``torch`` copy of the same sizes and offsets."""
    import torch

    torch.set_num_threads(1)
    src = torch.ones(REGION, dtype=torch.uint8)
    dst = torch.ones(REGION, dtype=torch.uint8)
    out = {}
    for size in sizes:
        spots = list(offsets(size, iterations(size, budget), hot))
        start = time.perf_counter()
        for off in spots:
            dst[off : off + size].copy_(src[off : off + size])
        out[size] = size * len(spots) / (time.perf_counter() - start) / 1e9
    return out


class Pair:
    """A target and an initiator process for one transport setting."""

    def __init__(self, env: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.tconn, there = ctx.Pipe()
        self.target = ctx.Process(target=target_main, args=(there, env), daemon=True)
        self.target.start()
        metadata, wire = self.tconn.recv()
        self.iconn, there = ctx.Pipe()
        args = (there, env, metadata, wire)
        self.initiator = ctx.Process(target=initiator_main, args=args, daemon=True)
        self.initiator.start()

    def point(self, op: str, path: str, size: int, n: int, hot: bool) -> tuple[Timing, float]:
        """Warm up, then time ``n`` transfers; also the target's CPU seconds per GB."""
        self.iconn.send((op, path, size, WARMUP, hot))
        self.iconn.recv()
        self.tconn.send("cpu")
        before = self.tconn.recv()
        self.iconn.send((op, path, size, n, hot))
        seconds = self.iconn.recv()
        self.tconn.send("cpu")
        cpu = self.tconn.recv() - before
        return Timing(size, seconds), cpu / (size * n / 1e9)

    def close(self) -> None:
        for conn, proc in ((self.iconn, self.initiator), (self.tconn, self.target)):
            try:
                conn.send("stop")
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def run(args: argparse.Namespace) -> list[Row]:
    from rich.progress import Progress

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    copies = memcpy_gbps(sizes, args.budget, args.hot)
    transports = [t for t in TRANSPORTS if t in args.transports.split(",")]
    rows = []
    total = len(transports) * len(sizes) * len(OPS) * len(PATHS)
    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("NIXL points", total=total)
        for transport in transports:
            env = dict(TRANSPORTS[transport], **LOOPBACK)
            if args.ucx_log:
                env["UCX_LOG_LEVEL"] = "info"
            pair = Pair(env)
            try:
                for size in sizes:
                    n = iterations(size, args.budget)
                    for op in OPS:
                        got = {}
                        for path in PATHS:
                            progress.update(
                                task, description=f"{transport} {op} {fmt(size)} {path}"
                            )
                            got[path] = pair.point(op, path, size, n, args.hot)
                            progress.advance(task)
                        raw, cpu = got["raw"]
                        rows.append(
                            Row(transport, op, size, raw, got["layer"][0], cpu, copies[size])
                        )
            finally:
                pair.close()
    return rows


def table(rows: list[Row]) -> str:
    head = (
        "| transport | op | size | raw GB/s | raw p50 µs | raw p99 µs | layer GB/s "
        "| layer p50 µs | layer p99 µs | target CPU s/GB | memcpy GB/s |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        raw, layer = r.raw, r.layer
        lines.append(
            f"| {r.transport} | {r.op} | {fmt(r.size)} | {raw.gbps:.2f} | {raw.pct_us(0.5):.0f} "
            f"| {raw.pct_us(0.99):.0f} | {layer.gbps:.2f} | {layer.pct_us(0.5):.0f} "
            f"| {layer.pct_us(0.99):.0f} | {r.target_cpu_s_per_gb:.3f} | {r.memcpy_gbps:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for transport in dict.fromkeys(r.transport for r in rows):
        for op in OPS:
            pts = [r for r in rows if r.transport == transport and r.op == op]
            xs = [r.size for r in pts]
            ax.plot(xs, [r.raw.gbps for r in pts], marker="o", label=f"{transport} {op} raw")
            ax.plot(
                xs,
                [r.layer.gbps for r in pts],
                ls="--",
                marker="x",
                label=f"{transport} {op} layer",
            )
    memcpy = {r.size: r.memcpy_gbps for r in rows}
    ax.plot(list(memcpy), list(memcpy.values()), color="k", lw=2, label="memcpy (1 thread)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per request (one in flight)")
    ax.set_ylabel("GB/s")
    ax.set_title("NIXL READ/WRITE between two local processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": KiB, "M": MiB}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def fmt(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64K,512K,4M,16M", help="comma-separated sizes")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="ucx,ucx tcp")
    parser.add_argument("--budget", type=parse_size, default=256 * MiB, help="bytes per point")
    parser.add_argument("--hot", action="store_true", help="reuse one slice (cache-hot)")
    parser.add_argument("--plot", metavar="PNG", help="write a chart here")
    parser.add_argument("--ucx-log", action="store_true", help="UCX_LOG_LEVEL=info in children")
    args = parser.parse_args(argv)
    rows = run(args)
    cache = "cache-hot (one slice)" if args.hot else f"cache-cold (rotating over {fmt(REGION)})"
    print(f"NIXL between two processes on one host, one request in flight, {cache}\n")
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"\nchart: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

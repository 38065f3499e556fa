"""What TLS costs on the data port: ``tcp://`` beside ``tls://``, one run, one machine.

    python bench/tls_cost.py [--sizes "512 KiB,4 MiB"] [--batch 8] [--seconds 4]
                             [--plot bench/tls_cost.png] [--json PATH]

Two ``kvstore serve`` processes on loopback, one plain, one started with ``--data-tls``
(a CA and a certificate for 127.0.0.1 made here with ``openssl``, so the client verifies
the node as it would in a pool). For each chunk size this process puts exchanges of
``--batch`` fresh chunks (``quant="none"``, valid chunks the node checks) over one kept
connection for ``--seconds`` (at most 384 MiB), then reads them back the same way, first
from the plain node, then from the TLS one. Reported per path and direction: GB/s,
milliseconds per exchange (p50), CPU seconds per GB moved in this process and in the
node's (from
``/proc/<pid>/stat``), and the ratios TLS ÷ plain. The extra CPU per GB is the cost TLS
adds (AES-GCM and one copy each way, on each side). Markdown on stdout, progress on
stderr, a PNG with ``--plot``, every figure as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from _common import (
    BarPanel,
    BenchError,
    KeptConnection,
    Serve,
    Table,
    expect,
    explain,
    percentile,
    print_report,
    proc_stat,
    progress,
    save_bar_plot,
)

from kvstore.core.arena import parse_size
from kvstore.core.codec import ChunkKey, chunk_nbytes, encode_blocks
from kvstore.core.hashing import Namespace
from kvstore.dataplane import ChunkRef, NodeClient, PutChunk
from kvstore.transport import connect
from kvstore.transport.tls import client_context

H, D = 8, 128
IO_TIMEOUT_S = 30.0
PUT_BUDGET = 384 * 2**20
"""Bytes put per path and size at most (the 1 GiB pool keeps them all for the reads)."""


@dataclass
class Result:
    path: str
    size: str
    op: str
    exchanges: int
    bytes: int
    seconds: float
    p50_ms: float
    client_cpu_s: float
    node_cpu_s: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def client_cpu_per_gb(self) -> float:
        return self.client_cpu_s / (self.bytes / 1e9)

    @property
    def node_cpu_per_gb(self) -> float:
        return self.node_cpu_s / (self.bytes / 1e9)


def make_certs(d: Path) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 it signed (EC P-256), via ``openssl``."""
    if shutil.which("openssl") is None:
        raise BenchError("the openssl command is needed to make the test certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"),
        "-days", "2", "-subj", "/CN=kvstore bench CA")  # fmt: skip
    run("req", *ec, "-keyout", str(d / "node.key"), "-out", str(d / "node.csr"),
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(d / "node.csr"), "-CA", str(d / "ca.pem"), "-CAkey",
        str(d / "ca.key"), "-CAcreateserial", "-out", str(d / "node.pem"), "-days", "2",
        "-extfile", str(d / "ext"))  # fmt: skip
    (d / "node.key").chmod(0o600)
    return {"ca": str(d / "ca.pem"), "cert": str(d / "node.pem"), "key": str(d / "node.key")}


def namespace(tokens: int) -> Namespace:
    return Namespace(model="bench-tls", revision=str(tokens), num_layers=1,
                     num_kv_heads=H, head_dim=D, dtype=torch.bfloat16,
                     block_tokens=tokens, quant="none")  # fmt: skip


async def measure(
    node: Serve, path: str, size: str, batch: int, seconds: float, ca: str, tick: Any
) -> list[Result]:
    payload = parse_size(size)
    tokens = max(1, payload // (2 * H * D * 2))
    ns = namespace(tokens)
    cb = chunk_nbytes(tokens, H, D, torch.bfloat16, "none")
    uri = node.addresses["data"]
    if uri.startswith("tls://"):
        conn = await connect(uri, timeout=IO_TIMEOUT_S, ssl_context=client_context(ca))
    else:
        conn = await connect(uri, timeout=IO_TIMEOUT_S)
    client = NodeClient(uri, KeptConnection(conn), timeout_s=IO_TIMEOUT_S)
    # Every exchange's chunks encoded beforehand (fresh keys each), so that only the
    # transfer is timed: the encoding would cost both paths the same.
    src = torch.randn(2, batch * tokens, H, D).bfloat16()
    count = max(1, PUT_BUDGET // (batch * cb))
    rows = torch.empty(count, batch, cb, dtype=torch.uint8)
    all_keys = []
    for e in range(count):
        keys = [xxhash.xxh3_128_digest(f"{path}/{size}/{e}/{j}".encode()) for j in range(batch)]
        encode_blocks(src, tokens, [ChunkKey(k, 0, 0) for k in keys], "none", out=rows[e])
        all_keys.append(keys)
    out = torch.empty(batch, cb, dtype=torch.uint8)
    results, written = [], []
    try:
        for op in ("put", "get"):
            lat: list[float] = []
            moved = 0
            c0, n0, t0 = time.process_time(), proc_stat(node.proc.pid), time.perf_counter()
            i = 0
            while time.perf_counter() - t0 < seconds and (op == "get" or i < count):
                if op == "put":
                    keys = all_keys[i]
                    chunks = [PutChunk(k, None, 0, cb) for k in keys]
                    s = time.perf_counter()
                    ack = await client.put(ns.canonical_bytes(), chunks, list(rows[i]))
                    lat.append(time.perf_counter() - s)
                    expect(ack.stored + ack.skipped == batch, f"{path} put stored {ack.stored}")
                    written.append(keys)
                else:
                    keys = written[i % len(written)]
                    s = time.perf_counter()
                    found = await client.get(ns.id, [ChunkRef(k, 0) for k in keys],
                                             lambda f: [out[j] for j in f])  # fmt: skip
                    lat.append(time.perf_counter() - s)
                    expect(len(found) == batch, f"{path} get found {len(found)} of {batch}")
                moved += batch * cb
                i += 1
                tick()
            dt = time.perf_counter() - t0
            cpu = proc_stat(node.proc.pid) - n0
            results.append(Result(path, size, op, i, moved, dt, percentile(lat, 50) * 1e3,
                                  time.process_time() - c0, cpu.cpu_s))  # fmt: skip
    finally:
        await conn.close()
    return results


def tables(results: list[Result], args: argparse.Namespace) -> list[Table]:
    t = Table("Data port, plain and TLS", ["size x batch", "op", "path", "GB/s", "p50 ms",
              "client CPU s/GB", "node CPU s/GB"])  # fmt: skip
    ratio = Table("TLS ÷ plain (one run, side by side)", [
        "size x batch", "op", "throughput", "client CPU per GB", "node CPU per GB",
        "extra CPU s per GB (both sides)"])  # fmt: skip
    for r in results:
        t.add(f"{r.size} x {args.batch}", r.op, r.path, round(r.gbps, 2), round(r.p50_ms, 2),
              round(r.client_cpu_per_gb, 3), round(r.node_cpu_per_gb, 3))  # fmt: skip
    by = {(r.size, r.op, r.path): r for r in results}
    for size in args.sizes:
        for op in ("put", "get"):
            p, s = by[(size, op, "tcp://")], by[(size, op, "tls://")]
            extra = (s.client_cpu_per_gb + s.node_cpu_per_gb) - (
                p.client_cpu_per_gb + p.node_cpu_per_gb
            )
            ratio.add(f"{size} x {args.batch}", op, f"{s.gbps / p.gbps:.2f}",
                      f"{s.client_cpu_per_gb / p.client_cpu_per_gb:.2f}",
                      f"{s.node_cpu_per_gb / p.node_cpu_per_gb:.2f}", round(extra, 3))  # fmt: skip
    ratio.notes.append(
        "One connection, one exchange in flight, writer and node in separate processes on "
        "loopback; CPU from /proc (each thread's schedstat) and this process's process_time."
    )
    return [t, ratio]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="512 KiB,4 MiB")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--plot", default="")
    parser.add_argument("--json", default="")
    args = explain(parser, __doc__).parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if args.batch < 1 or args.seconds <= 0 or not args.sizes:
        parser.error("--batch >= 1, --seconds > 0, at least one size")
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp))
        pool = (
            f"{max(256, 4 * args.batch * max(parse_size(s) for s in args.sizes) // 2**20 * 8)}MiB"
        )
        plain = Serve.start("--host-mem", pool)
        tls = None
        try:
            tls = Serve.start("--host-mem", pool, "--data-tls", "--tls-cert", certs["cert"],
                              "--tls-key", certs["key"])  # fmt: skip
            expect(tls.addresses["data"].startswith("tls://"), "the TLS node serves tls://")
            with progress() as bar:
                task = bar.add_task("tls cost", total=None)
                for size in args.sizes:
                    for path, node in (("tcp://", plain), ("tls://", tls)):
                        bar.update(task, description=f"{path} {size}")
                        results += asyncio.run(measure(node, path, size, args.batch,
                                                       args.seconds, certs["ca"],
                                                       lambda: bar.advance(task)))  # fmt: skip
        finally:
            plain.stop()
            if tls is not None:
                tls.stop()
    print_report(
        "What TLS costs on the data port", "bench/tls_cost.py", argv, tables(results, args)
    )
    if args.plot:
        labels = [f"{r.size} {r.op}" for r in results if r.path == "tcp://"]
        series = {p: [r.gbps for r in results if r.path == p] for p in ("tcp://", "tls://")}
        cpu = {p: [r.client_cpu_per_gb + r.node_cpu_per_gb for r in results if r.path == p]
               for p in ("tcp://", "tls://")}  # fmt: skip
        panels = [BarPanel("throughput", "GB/s", labels, series),
                  BarPanel("CPU per GB, both sides", "s/GB", labels, cpu)]  # fmt: skip
        save_bar_plot(args.plot, panels)
        print(f"Plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

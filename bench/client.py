"""The engine-facing client's overheads, against a running ``kvstore serve`` it starts.

    python bench/client.py [--calls 300] [--reps 21] [--first-rounds 5]

Prints Markdown: per-call time of the sync twin next to the async client for the same
calls (so the difference is the cost of the loop-thread hop), how long the caller's
thread is blocked by ``start_put_layer`` for one 2048-token layer next to a blocking
``put_layer`` of the same layer, and a fresh client's first requests (a writer's first
and second ``put_layer``, a reader's first ``get_layer``, each client in a process of
its own, idle 1 s before its first request) without and after ``KVClient.warm_up``,
rounds of the two alternating, over ``tcp://`` and (where NIXL is installed) ``ucx://``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import Serve, Table, explain, machine_markdown, percentile, progress, seeded_tokens

import kvclient
from kvclient.ucx import nixl_available
from kvstore.core.kvgen import realistic_kv
from tests.cluster import start_server

NS = kvclient.Namespace(
    model="bench-client", revision="r", num_layers=2, num_kv_heads=8, head_dim=128,
    dtype=torch.bfloat16, block_tokens=256,
)  # fmt: skip


def _us(samples: list[float]) -> tuple[str, str]:
    return f"{percentile(samples, 50) * 1e6:.0f}", f"{percentile(samples, 99) * 1e6:.0f}"


async def async_calls(master: str, tokens: list[int], calls: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"match_prefix": [], "get_layer (512 tok)": []}
    async with await kvclient.KVClient.connect(master, NS) as kv:
        for _ in range(calls):
            t0 = time.perf_counter()
            await kv.match_prefix(tokens)
            t1 = time.perf_counter()
            await kv.get_layer(tokens, 0)
            t2 = time.perf_counter()
            out["match_prefix"].append(t1 - t0)
            out["get_layer (512 tok)"].append(t2 - t1)
    return out


def sync_calls(master: str, tokens: list[int], calls: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"match_prefix": [], "get_layer (512 tok)": []}
    with kvclient.SyncKVClient.connect(master, NS) as kv:
        for _ in range(calls):
            t0 = time.perf_counter()
            kv.match_prefix(tokens)
            t1 = time.perf_counter()
            kv.get_layer(tokens, 0)
            t2 = time.perf_counter()
            out["match_prefix"].append(t1 - t0)
            out["get_layer (512 tok)"].append(t2 - t1)
    return out


def blocked_time(master: str, reps: int) -> tuple[list[float], list[float], list[float]]:
    """Caller-thread time of start_put_layer, of the whole put via wait(), and of put_layer."""
    starts, totals, blocking = [], [], []
    with kvclient.SyncKVClient.connect(master, NS) as kv:
        for r in range(reps):
            tokens = [(r * 100_003 + i) % 150_000 for i in range(2048)]
            t = realistic_kv(2048, 8, 128, torch.bfloat16, seed=r)
            t0 = time.perf_counter()
            handle = kv.start_put_layer(tokens, 0, t)
            t1 = time.perf_counter()
            handle.wait(timeout=30)
            t2 = time.perf_counter()
            kv.put_layer(tokens, 1, t)
            t3 = time.perf_counter()
            if r:  # the first round warms caches and threads
                starts.append(t1 - t0)
                totals.append(t2 - t0)
                blocking.append(t3 - t2)
    return starts, totals, blocking


FIRST_TOKENS = 2048
IDLE_S = 1.0
"""How long a fresh client idles between connecting (and warming up) and its first request,
warm or cold alike: an engine compiles and captures its graphs in between, and a warm-up's
greeting needs the client's UCX progressed once (every 50 ms when idle) to take effect."""


async def first_requests(
    master: str, ucx: bool, warm: bool, seed: int, role: str
) -> dict[str, float]:
    """A fresh writer's first two ``put_layer`` calls, or a fresh reader's first
    ``get_layer`` of them (the client warmed up first when ``warm``; either way idle for
    :data:`IDLE_S` before its first request), in seconds."""
    tokens = seeded_tokens(seed, FIRST_TOKENS)  # (the writer's and the reader's processes)
    out: dict[str, float] = {}
    async with await kvclient.KVClient.connect(master, NS, ucx=ucx) as kv:
        t0 = time.perf_counter()
        if warm:
            await kv.warm_up()
        out[f"{role} warm_up"] = time.perf_counter() - t0
        await asyncio.sleep(IDLE_S)
        if role == "writer":
            for layer in (0, 1):
                t = realistic_kv(FIRST_TOKENS, 8, 128, torch.bfloat16, seed=seed + layer)
                t0 = time.perf_counter()
                await kv.put_layer(tokens, layer, t)
                out[("first", "second")[layer] + " put_layer"] = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            got = await kv.get_layer(tokens, 0)
            out["first get_layer"] = time.perf_counter() - t0
            assert got.shape[1] == FIRST_TOKENS, got.shape
    return out


def _first(master: str, transport: str, warm: bool, seed: int, role: str) -> dict[str, float]:
    torch.set_num_threads(1)
    return asyncio.run(first_requests(master, transport == "ucx", warm, seed, role))


def first_table(runs: dict[tuple[str, bool], list[dict[str, float]]], rounds: int) -> Table:
    table = Table(
        f"A fresh client's first requests, ms (2048-token layer, H=8, D=128, bf16; median "
        f"of {rounds} rounds, cold and warmed alternating; range in brackets)",
        ["transport", "client", "warm_up", "first put_layer", "second put_layer",
         "reader warm_up", "reader's first get_layer"],
    )  # fmt: skip
    keys = ("writer warm_up", "first put_layer", "second put_layer", "reader warm_up",
            "first get_layer")  # fmt: skip
    for (transport, warm), samples in runs.items():
        cells = []
        for key in keys:
            xs = [x[key] * 1e3 for x in samples]
            cells.append(f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})")
        table.add(transport, "warm_up() first" if warm else "cold", *cells)
    return table


def first_runs(
    transports: tuple[str, ...], rounds: int, bar: Any, task: Any
) -> dict[tuple[str, bool], list[dict[str, float]]]:
    """:func:`first_requests` of a writer, then a reader, on a node of each of
    ``transports``, each mapped; each round puts prompts of its own."""
    runs: dict[tuple[str, bool], list[dict[str, float]]] = {}
    ctx = multiprocessing.get_context("spawn")
    for transport in transports:
        with Serve.start("--host-mem", "1GiB", "--transport", transport, mapped=True) as srv:
            for r in range(rounds):
                for warm in (False, True) if r % 2 == 0 else (True, False):
                    got: dict[str, float] = {}
                    for role in ("writer", "reader"):  # (each a process of its own, as
                        # engines are: UCX's start is paid once per process)
                        with ctx.Pool(1) as pool:
                            call = (srv.addresses["grpc"], transport, warm, 2 * r + warm, role)
                            got.update(pool.apply(_first, call))
                    runs.setdefault((transport, warm), []).append(got)
                    bar.advance(task)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--first-rounds", type=int, default=5)
    args = explain(parser, __doc__).parse_args()
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--host-mem", "256MiB")  # fmt: skip
    try:
        with progress() as bar:
            task = bar.add_task("client bench", total=3)
            tokens = list(range(512))
            with kvclient.SyncKVClient.connect(srv.grpc, NS) as kv:
                kv.put_layer(tokens, 0, realistic_kv(512, 8, 128, torch.bfloat16))
            a = asyncio.run(async_calls(srv.grpc, tokens, args.calls))
            bar.advance(task)
            s = sync_calls(srv.grpc, tokens, args.calls)
            bar.advance(task)
            starts, totals, blocking = blocked_time(srv.grpc, args.reps)
            bar.advance(task)
    finally:
        srv.stop()
    with progress() as bar:
        transports = ("tcp", "ucx") if nixl_available() else ("tcp",)
        task = bar.add_task("first requests", total=2 * len(transports) * args.first_rounds)
        firsts = first_runs(transports, args.first_rounds, bar, task)
    table = Table(
        f"Sync twin vs async client, same calls ({args.calls} each, µs)",
        ["call", "async p50", "async p99", "sync p50", "sync p99", "sync overhead p50"],
    )
    for name in a:
        ap50, ap99 = _us(a[name])
        sp50, sp99 = _us(s[name])
        delta = (statistics.median(s[name]) - statistics.median(a[name])) * 1e6
        table.add(name, ap50, ap99, sp50, sp99, f"{delta:+.0f}")
    blocked = Table(
        "Caller thread blocked, one 2048-token layer (H=8, D=128, bf16 = 8 MiB), ms",
        ["what", "p50", "max"],
    )
    for name, xs in (
        ("start_put_layer returns", starts),
        ("start_put_layer → wait() done (whole put)", totals),
        ("put_layer (blocking)", blocking),
    ):
        blocked.add(name, f"{statistics.median(xs) * 1e3:.2f}", f"{max(xs) * 1e3:.2f}")
    print(machine_markdown())
    print(table.to_markdown())
    print(blocked.to_markdown())
    print(first_table(firsts, args.first_rounds).to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

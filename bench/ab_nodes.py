"""Two checkouts' nodes side by side: a node's CPU per put, and the put's latency, of this
working tree against a git commit, in one run.

    python bench/ab_nodes.py [--base HEAD~1] [--rounds 6] [--per 300] [--plot out.png]
                             [--master-apart]

Checks ``--base`` out into a temporary git worktree (its codec extension copied from this
tree when its C source is the same, else built there), starts one ``kvstore serve`` from
each tree at once, waits until both have mapped their host memory and gone idle, and puts
into them in turns: a round is ``--per`` puts into one node, then as many into the other, the order
swapped every round, after one warm-up round each. Two shapes, each its own series of
rounds:

- ``trace``: ``KVClient.put_layer`` of 24 fresh 16-token blocks of the trace replay's tiny
  namespace (1 layer, H=2, D=16, bf16, int8: chunks of 1,352 B), what an engine's per-layer
  put of a short prompt costs;
- ``512 KiB x 8``: ``NodeClient.put`` of 8 pre-encoded chunks of 512 KiB (``quant="none"``)
  over one kept ``tcp://`` connection, the pool emptied between rounds.

With ``--master-apart`` each tree runs a ``kvstore master`` and a ``kvstore node``, each a
process of its own, as a cluster does: every put's ack then waits for the node's commit to
cross gRPC, and the master's CPU per put is reported too.

This process is the client of both nodes, from this tree's code: only the node differs.
Per node and shape it reports the node's CPU per put (``/proc``, every thread's
schedstat: to the microsecond) and the put's p50, each the median over rounds
with the best round beside it, and this tree ÷ the base. Machines here are shared and
noisy: the rounds alternate so that both nodes meet the same minutes. Markdown on stdout,
progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import filecmp
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BarPanel,
    KeptConnection,
    Serve,
    Table,
    expect,
    explain,
    print_report,
    proc_stat,
    progress,
    save_bar_plot,
    start_pool,
    window_cpu,
)

from kvclient import KVClient
from kvstore.core.codec import ChunkKey, encode_blocks
from kvstore.core.hashing import Namespace
from kvstore.core.kvgen import realistic_kv
from kvstore.dataplane import NodeClient
from kvstore.dataplane.messages import PutChunk
from kvstore.transport import connect

ROOT = Path(__file__).resolve().parents[1]
NATIVE_C = Path("kvstore/core/_native.c")
IDLE_CORES = 0.05
TRACE_BLOCKS, TRACE_TOKENS = 24, 16
BIG_CHUNKS, BIG_H, BIG_D, BIG_TOKENS = 8, 8, 128, 256  # 512 KiB of bf16 K and V a chunk
SHAPES = ("trace", "512 KiB x 8")

Shape = tuple[Callable[[int], None], Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]
"""A shape's put into one node: ``prepare(i)`` (untimed: fresh keys for put ``i``), the put
itself (timed), and how to close it."""


def trace_namespace() -> Namespace:
    return Namespace(model="ab-trace", revision="r1", num_layers=1, num_kv_heads=2,
                     head_dim=16, dtype=torch.bfloat16, block_tokens=TRACE_TOKENS,
                     quant="int8")  # fmt: skip


def big_namespace() -> Namespace:
    return Namespace(model="ab-big", revision="r1", num_layers=1, num_kv_heads=BIG_H,
                     head_dim=BIG_D, dtype=torch.bfloat16, block_tokens=BIG_TOKENS,
                     quant="none")  # fmt: skip


@contextlib.contextmanager
def base_tree(ref: str) -> Iterator[Path]:
    """A worktree of ``ref`` in a temporary directory, with the codec's extension; removed
    on exit. Raises ``subprocess.CalledProcessError`` for an unknown ``ref``."""
    where = Path(tempfile.mkdtemp(prefix="kvstore-ab-")) / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where),
                    ref], check=True)  # fmt: skip
    try:
        built = sorted((ROOT / NATIVE_C.parent).glob("_native*.so"))
        if built and filecmp.cmp(ROOT / NATIVE_C, where / NATIVE_C, shallow=False):
            shutil.copy2(built[0], where / NATIVE_C.parent)
        else:  # (another C source: built there, as `pip install` would)
            subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                           cwd=where, check=True, capture_output=True)  # fmt: skip
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                       check=False, capture_output=True)  # fmt: skip
        shutil.rmtree(where.parent, ignore_errors=True)


def serve_from(stack: contextlib.ExitStack, tree: Path, host_mem: str,
               apart: bool) -> tuple[Serve, Serve | None]:  # fmt: skip
    """A pool (:func:`start_pool`: ``kvstore serve``, or with ``apart`` a master and a node)
    run from ``tree``'s code (its directory first on the path)."""
    prefix = ["env", f"PYTHONPATH={tree}", "sh", "-c", f'cd "{tree}" && exec "$@"', "_"]
    return start_pool(stack, "--host-mem", host_mem, apart=apart, prefix=prefix, mapped=True)


def wait_idle(serves: dict[str, Serve], timeout: float = 120.0) -> None:
    """Wait until each node spends under 5% of a core for a second: a base from before
    nodes said when their memory was mapped maps it still (the stats' wait cannot tell).
    Raises ``RuntimeError`` past ``timeout`` s."""
    deadline = time.monotonic() + timeout
    for name, serve in serves.items():
        while window_cpu(serve.proc.pid, 1.0).cores >= IDLE_CORES:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} node did not go idle within {timeout} s")


async def trace_put(serve: Serve) -> Shape:
    """``put_layer`` of 24 fresh tiny blocks into ``serve``."""
    kv = await KVClient.connect(serve.addresses["grpc"], trace_namespace(), timeout_s=30.0)
    layer = realistic_kv(TRACE_BLOCKS * TRACE_TOKENS, 2, 16, torch.bfloat16, seed=1)
    tag, tokens = uuid.uuid4().int % 100_000, [0]

    def prepare(i: int) -> None:
        tokens[:] = [tag, i, *range(TRACE_BLOCKS * TRACE_TOKENS - 2)]

    async def put() -> None:
        stored = await kv.put_layer(tokens, 0, layer)
        expect(stored == len(tokens), f"put_layer stored {stored} of {len(tokens)} tokens")

    return prepare, put, kv.close


async def big_put(serve: Serve) -> Shape:
    """A ``tcp://`` put of 8 fresh pre-encoded 512 KiB chunks into ``serve`` (a full pool
    evicts, as a cache in use does)."""
    ns = big_namespace()
    uri = serve.addresses["data"]
    conn = await connect(uri, timeout=30.0)
    node = NodeClient(uri, KeptConnection(conn), timeout_s=30.0)
    kv = torch.randn(2, BIG_CHUNKS * BIG_TOKENS, BIG_H, BIG_D).bfloat16()
    rows = torch.empty(BIG_CHUNKS, encode_blocks(kv[:, :BIG_TOKENS], BIG_TOKENS, [None],
                                                 "none")[0].numel(), dtype=torch.uint8)  # fmt: skip
    bufs, tag, spec = [r.numpy() for r in rows], uuid.uuid4().hex, [()]

    def prepare(i: int) -> None:  # a chunk's header names its key: fresh keys, fresh rows
        blocks = [xxhash.xxh3_128_digest(f"{tag}/{i}/{j}".encode()) for j in range(BIG_CHUNKS)]
        encode_blocks(kv, BIG_TOKENS, [ChunkKey(b, 0, 0) for b in blocks], "none", out=rows)
        spec[0] = tuple(PutChunk(b, None, 0, rows.shape[1]) for b in blocks)

    async def put() -> None:
        ack = await node.put(ns.canonical_bytes(), spec[0], bufs)
        expect(ack.stored == BIG_CHUNKS, f"put stored {ack.stored} of {BIG_CHUNKS} chunks")

    return prepare, put, conn.close


async def rounds(serves: dict[str, Serve], masters: dict[str, Serve | None], shape: str,
                 n_rounds: int, per: int,
                 tick: Callable[[], object]) -> dict[str, dict[str, list[float]]]:  # fmt: skip
    """Alternate rounds of ``per`` puts of ``shape`` between the nodes (the order swapped
    each round; the first round of each is a warm-up); per node, each round's node CPU per
    put (µs), its master's (when apart) and p50 (ms)."""
    make = trace_put if shape == "trace" else big_put
    shapes = {name: await make(serve) for name, serve in serves.items()}
    out: dict[str, dict[str, list[float]]] = {
        n: {"cpu": [], "master": [], "p50": []} for n in serves
    }
    count = 0
    try:
        for r in range(n_rounds + 1):
            order = list(serves) if r % 2 == 0 else list(serves)[::-1]
            for name in order:
                prepare, put, _ = shapes[name]
                pid, lat = serves[name].proc.pid, []
                master = masters[name]
                mpid = master.proc.pid if master is not None else None
                before = proc_stat(pid)
                master_before = proc_stat(mpid) if mpid is not None else None
                for _ in range(per):
                    count += 1
                    prepare(count)
                    t0 = time.perf_counter()
                    await put()
                    lat.append(time.perf_counter() - t0)
                    tick()
                cpu = (proc_stat(pid) - before).cpu_s
                if r:
                    out[name]["cpu"].append(cpu / per * 1e6)
                    if mpid is not None and master_before is not None:
                        mcpu = (proc_stat(mpid) - master_before).cpu_s
                        out[name]["master"].append(mcpu / per * 1e6)
                    out[name]["p50"].append(statistics.median(lat) * 1e3)
    finally:
        for _, _, close in shapes.values():
            await close()
    return out


def report(got: dict[str, dict[str, dict[str, list[float]]]], args: argparse.Namespace) -> Table:
    where = "each with a master in its own process" if args.master_apart else "kvstore serve"
    apart = ["master CPU µs/put (median)", "master ÷ base"] if args.master_apart else []
    table = Table(
        f"Node CPU per put and put p50, this tree beside {args.base} ({where}; "
        f"{args.rounds} rounds of {args.per} puts per node and shape, alternating)",
        ["shape", "node", "node CPU µs/put (median)", "best round", "p50 ms (median)",
         "best round", "CPU ÷ base", "p50 ÷ base", *apart],
    )  # fmt: skip
    for shape, by in got.items():
        base = {k: statistics.median(v) if v else 0.0 for k, v in by["base"].items()}
        for name in ("base", "this tree"):
            r = by[name]
            cpu, p50 = statistics.median(r["cpu"]), statistics.median(r["p50"])
            extra = []
            if args.master_apart:
                master = statistics.median(r["master"])
                extra = [f"{master:.0f}", f"{master / base['master']:.2f}"]
            table.add(shape, name, f"{cpu:.0f}", f"{min(r['cpu']):.0f}", f"{p50:.3f}",
                      f"{min(r['p50']):.3f}", f"{cpu / base['cpu']:.2f}",
                      f"{p50 / base['p50']:.2f}", *extra)  # fmt: skip
    table.notes += [
        "Node CPU: /proc of each serve process (every thread, user and system) over a round "
        "÷ its puts, so work a node does after its ack counts too; each thread's schedstat, "
        "to the microsecond.",
        "trace: KVClient.put_layer of 24 fresh 16-token blocks (H=2, D=16, bf16, int8: "
        "1,352 B chunks), codec included; 512 KiB x 8: NodeClient.put of pre-encoded chunks "
        "(quant none) over a kept tcp:// connection, into a full pool that evicts.",
        "The client is this tree's code for both nodes; each node runs its own tree's code.",
    ]
    if args.master_apart:
        table.notes.append(
            "--master-apart: each node registers with a kvstore master of its own tree in "
            "a process of its own, so every put's ack waits for a commit over gRPC; master "
            "CPU is that process's over the same rounds."
        )
    return table


def main(argv: list[str] | None = None) -> int:
    """Run both shapes against both nodes and print Markdown; 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="the git commit to compare (HEAD)")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per node and shape")
    p.add_argument("--per", type=int, default=300, help="puts per round")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of: {', '.join(SHAPES)}")
    p.add_argument("--host-mem", default="1GiB")
    p.add_argument("--plot", default=None, help="also write a bar chart here")
    p.add_argument("--master-apart", action="store_true",
                   help="run each node with a kvstore master in a process of its own")  # fmt: skip
    args = explain(p, __doc__).parse_args(argv)
    # One thread: torch's second (OpenMP) thread spins for a while after each untimed
    # encode, and would take the second core from the nodes during the puts.
    torch.set_num_threads(1)
    shapes = [s.strip() for s in args.shapes.split(",")]
    if any(s not in SHAPES for s in shapes) or args.rounds < 1 or args.per < 1:
        p.error(f"need --shapes of {SHAPES}, --rounds >= 1, --per >= 1")
    got: dict[str, dict[str, dict[str, list[float]]]] = {}
    with base_tree(args.base) as tree, contextlib.ExitStack() as stack, progress() as bar:
        task = bar.add_task("starting both nodes", total=None)
        started = {
            "base": serve_from(stack, tree, args.host_mem, args.master_apart),
            "this tree": serve_from(stack, ROOT, args.host_mem, args.master_apart),
        }
        serves = {name: node for name, (node, _) in started.items()}
        masters = {name: master for name, (_, master) in started.items()}
        bar.update(task, description="waiting for both nodes to go idle")
        wait_idle(serves)
        total = len(shapes) * (args.rounds + 1) * 2 * args.per
        bar.update(task, description="puts", total=total)
        for shape in shapes:
            got[shape] = asyncio.run(
                rounds(serves, masters, shape, args.rounds, args.per, lambda: bar.advance(task))
            )
    table = report(got, args)
    print_report("Two checkouts' nodes side by side", "bench/ab_nodes.py", argv, [table])
    if args.plot:
        panels = [BarPanel(f"{shape}: node CPU µs per put", "µs", ["base", "this tree"],
                           {"median": [statistics.median(by[n]["cpu"])
                                       for n in ("base", "this tree")]})
                  for shape, by in got.items()]  # fmt: skip
        save_bar_plot(args.plot, panels)
        print(f"Plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

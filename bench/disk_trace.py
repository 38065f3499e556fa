"""The Mooncake conversation trace's prefix hit ratio through a node with a disk tier,
beside the offline ideal and beside host-only memory.

    python bench/disk_trace.py [--host-blocks 4096,16384] [--trace PATH] [--requests N]
                               [--no-read] [--order put-get|get-put] [--plot out.png]

For each H of ``--host-blocks`` it starts two fresh ``kvstore serve`` (loopback, port 0):
(a) host memory sized to hold H blocks of the trace's namespace, nothing below it; (b) the
same host memory and a disk tier (``--disk-path`` a fresh directory under ``--disk-dir``,
``--disk-size`` 8 x H records). Host memory is sized from the node's own slot geometry
(``kvstore.core.arena``: the tiny namespace's slot stride, the arena's default page size,
the slab's slots per span) to the smallest size holding at least H slots; H below means
the slots that size holds (checked against the node's stats when the replay ends, the host
tier full by then). A disk record of a tiny block takes one 4 KiB page
(``kvstore.node.disk.Record.of(...).span``).

Each run replays the trace's requests in order, back to back, through ``KVClient`` on
the "tiny chunks" namespace of ``bench/trace_replay.py`` (every trace hash id is one
16-token block): ``match_prefix(tokens)`` (the hit: the tokens matched), ``put_layer`` of
the whole request (one layer), and with ``--read`` (the default) ``get_layer`` of the
matched prefix, which is what an engine does with a match and what stages disk blocks
back into host memory. ``--order put-get`` (default) puts before that read; ``get-put``
reads before the put (an engine loading its prefix before computing the rest). Hit ratio
= matched tokens / request tokens, over all requests.

Beside each measured figure, offline over the trace's blocks (a block is a trie node:
its hash id and its whole prefix, as the node's chained block hashes are):

- **ideal**: infinite capacity (every block ever put is kept);
- **LRU sim**: a prefix-aware LRU of that many blocks (a request hits its longest prefix
  of blocks all present; a request's blocks are stamped tail first, so a chain loses its
  tail first; with ``--read`` every block of the request is stamped, without only the new
  ones, as the node's put does not touch a block it already holds);
- **Belady MIN**: the same capacity evicting the block used again furthest in the future
  (ties: the deeper block), an upper bound for any online policy on this trace.

The host + disk run is compared at H + 8H = 9H blocks (the disk also holds copies of the
blocks in host memory, so the node holds at most max(H, disk) distinct blocks, and the
disk drops whole segments, a quarter of it at a time: its reach is 6H to 8H; the LRU sim at
8H is shown too). At the end of each run it reports the node's counters: the host tier's
slots and, with a disk, the disk tier's ``written``, ``read``, ``staged_cold``,
``staged_warm``, ``unwritten_evictions`` (blocks host memory evicted with no disk copy:
they left the node), ``skipped`` and ``errors``.

Target (the disk-tier issue): with the disk tier, hit ratio >= 0.95 x ideal at 16k host
blocks. Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import (
    DISK_COUNTERS,
    BarPanel,
    Serve,
    Table,
    expect,
    print_report,
    progress,
    save_bar_plot,
)
from trace_replay import (
    BLOCK,
    DEFAULT_TRACE,
    DTYPE,
    HEAD_DIM,
    HEADS,
    IO_TIMEOUT_S,
    LAYERS,
    ideal_hits,
    load_trace,
    namespace,
    tokens_of,
)

from kvclient import KVClient
from kvstore.core.arena import PAGE_ALIGN, Arena, default_page_bytes, slab_geometry
from kvstore.core.codec import chunk_nbytes
from kvstore.core.kvgen import realistic_kv
from kvstore.dataplane.client import NodeClient
from kvstore.node.disk import Record

DISK_FACTOR = 8
TARGET_H = 16384
TARGET_RATIO = 0.95

# ----------------------------------------------------------------------- sizing


@dataclass(frozen=True)
class Sizing:
    """Host memory for ``blocks`` slots of the tiny namespace and the disk below it."""

    wanted: int
    """H asked for."""
    blocks: int
    """Slots the host tier holds when full (at least ``wanted``)."""
    host_mem: int
    slot_bytes: int
    stride: int
    page_bytes: int
    slots_per_span: int
    span_pages: int
    record_span: int
    disk_size: int


def slot_bytes() -> int:
    """One block's slot: every chunk of it (layers x shards) of ``chunk_nbytes``."""
    ns = namespace()
    chunk = chunk_nbytes(ns.block_tokens, ns.num_kv_heads, ns.head_dim, ns.dtype, ns.quant)
    return chunk * ns.num_layers * ns.tp_size


def record_span(nbytes: int) -> int:
    """Bytes one complete tiny block's disk record occupies (aligned to 4 KiB)."""
    ns = namespace()
    chunks = ns.num_layers * ns.tp_size
    key = (ns.id, bytes(16))
    rec = Record.of(key, bytes(16), "", nbytes, nbytes // chunks, chunks, (1 << chunks) - 1)
    return rec.span


def size_host(wanted: int) -> Sizing:
    """The smallest ``--host-mem`` (a multiple of 4 KiB) whose arena holds ``wanted`` slots
    of the tiny namespace, by the arena's own geometry (default page size for that
    capacity, slab slots per span), checked against an :class:`Arena` of that size."""
    nbytes = slot_bytes()
    stride = Arena.slot_stride(nbytes)
    cap = max(PAGE_ALIGN, (wanted * stride * 31 // 32) // PAGE_ALIGN * PAGE_ALIGN)
    while True:
        page = default_page_bytes(cap)
        n_pages = cap // page
        if n_pages * page >= stride:
            slots, pages = slab_geometry(stride, page, n_pages)
            total = n_pages // pages * slots
            if total >= wanted:
                break
        cap += PAGE_ALIGN
    _, room = Arena(cap, device="cpu", pin_memory=False).slot_room(nbytes)
    expect(room == total, f"arena geometry: {room} slots in {cap} B, computed {total}")
    span = record_span(nbytes)
    return Sizing(wanted, total, cap, nbytes, stride, page, slots, pages, span,
                  DISK_FACTOR * total * span)  # fmt: skip


# ----------------------------------------------------------------------- offline


def block_ids(trace: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each request's blocks as trie node ids (a hash id and its whole prefix), as the
    node's chained block hashes identify them (same walk as ``ideal_hits``)."""
    trie: dict[tuple[int, int], int] = {}
    out = []
    for ids in trace:
        node, blocks = 0, []
        for h in ids:
            child = trie.get((node, h))
            if child is None:
                child = trie[(node, h)] = len(trie) + 1
            blocks.append(child)
            node = child
        out.append(blocks)
    return out


def lru_hits(reqs: Sequence[Sequence[int]], capacity: int, read: bool) -> list[int]:
    """Per request, the leading blocks present in a prefix-aware LRU of ``capacity``."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = []
    for blocks in reqs:
        m = 0
        while m < len(blocks) and blocks[m] in cache:
            m += 1
        hits.append(m)
        for i in range(len(blocks) - 1, -1, -1):  # tail first: the head ends the most recent
            b = blocks[i]
            if b not in cache:
                cache[b] = None
            elif read and i < m:
                cache.move_to_end(b)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def belady_hits(reqs: Sequence[Sequence[int]], capacity: int) -> list[int]:
    """Per request, the leading blocks present under Belady's MIN of ``capacity`` blocks
    (every block of a request is put, then the block used again furthest ahead goes,
    the deeper one first on a tie, so a chain is kept prefix-closed)."""
    uses: dict[int, list[int]] = {}
    depth: dict[int, int] = {}
    for i, blocks in enumerate(reqs):
        for d, b in enumerate(blocks):
            uses.setdefault(b, []).append(i)
            depth[b] = d
    pos = dict.fromkeys(uses, 0)
    never = len(reqs)
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), stale entries skipped
    hits = []
    for blocks in reqs:
        m = 0
        while m < len(blocks) and blocks[m] in cache:
            m += 1
        hits.append(m)
        for b in blocks:
            pos[b] += 1
            k = pos[b]
            nxt = uses[b][k] if k < len(uses[b]) else never
            cache[b] = nxt
            heapq.heappush(heap, (-nxt, -depth[b], b))
        while len(cache) > capacity:
            neg, _, b = heapq.heappop(heap)
            if cache.get(b) == -neg:
                del cache[b]
    return hits


@dataclass
class Offline:
    """Offline hit ratios: ideal, and LRU / MIN by capacity in blocks."""

    ideal: float
    lru: dict[int, float] = field(default_factory=dict)
    belady: dict[int, float] = field(default_factory=dict)


# ----------------------------------------------------------------------- replay


@dataclass
class Run:
    """One configuration's replay."""

    label: str
    size: Sizing
    disk: bool
    requests: int = 0
    request_tokens: int = 0
    matched_tokens: int = 0
    read_tokens: int = 0
    short_reads: int = 0
    """Reads that returned fewer tokens than were matched."""
    short_puts: int = 0
    wall_s: float = 0.0
    host: dict[str, Any] = field(default_factory=dict)
    disk_stats: dict[str, Any] = field(default_factory=dict)
    hits_by_half: tuple[float, float] = (0.0, 0.0)

    @property
    def ratio(self) -> float:
        return self.matched_tokens / self.request_tokens


async def replay(
    serve: Serve,
    trace: list[list[int]],
    res: Run,
    args: argparse.Namespace,
    tick: Callable[[], object],
) -> None:
    """Replay ``trace`` through ``serve`` one request at a time, filling ``res``."""
    ns = namespace()
    lengths = sorted({len(ids) * BLOCK for ids in trace})
    kvs = {t: realistic_kv(t, HEADS, HEAD_DIM, DTYPE, seed=t) for t in lengths}
    out = torch.empty(2, max(lengths), HEADS, HEAD_DIM, dtype=DTYPE)
    node = NodeClient(serve.addresses["data"], timeout_s=IO_TIMEOUT_S)
    half = len(trace) // 2
    halves = [[0, 0], [0, 0]]
    async with await KVClient.connect(serve.addresses["grpc"], ns, timeout_s=IO_TIMEOUT_S) as kv:
        start = time.perf_counter()
        for step, ids in enumerate(trace):
            tokens = tokens_of(ids)
            t = len(tokens)
            matched = await kv.match_prefix(tokens)
            if args.read and args.order == "get-put" and matched:
                res.read_tokens += await _read(kv, tokens, matched, out, res)
            stored = await kv.put_layer(tokens, 0, kvs[t])
            if args.read and args.order == "put-get" and matched:
                res.read_tokens += await _read(kv, tokens, matched, out, res)
            res.short_puts += stored != t
            res.requests += 1
            res.request_tokens += t
            res.matched_tokens += matched
            h = halves[step >= half]
            h[0] += matched
            h[1] += t
            tick()
        res.wall_s = time.perf_counter() - start
    res.hits_by_half = (halves[0][0] / max(halves[0][1], 1), halves[1][0] / max(halves[1][1], 1))
    stats = await node.stats()
    tiers = {t["name"]: t for t in stats["tiers"]}
    res.host = tiers.get("host", {})
    res.disk_stats = tiers.get("disk", {})


async def _read(kv: KVClient, tokens: list[int], matched: int, out: torch.Tensor, res: Run) -> int:
    got = await kv.get_layer(tokens[:matched], 0, out=out)
    n = int(got.shape[1])
    res.short_reads += n < matched
    return n


def run_config(
    trace: list[list[int]], size: Sizing, disk: bool, args: argparse.Namespace, bar: Any
) -> Run:
    """Start a fresh ``kvstore serve`` for one configuration, replay, stop it."""
    label = f"host {size.blocks:,}" + (f" + disk {DISK_FACTOR}x" if disk else " only")
    res = Run(label, size, disk)
    flags = ["--host-mem", str(size.host_mem)]
    with contextlib.ExitStack() as stack:
        if disk:
            where = tempfile.mkdtemp(prefix="kvstore-disk-trace-", dir=args.disk_dir)
            stack.callback(shutil.rmtree, where, True)
            flags += ["--disk-path", where, "--disk-size", str(size.disk_size)]
        task = bar.add_task(f"{label}: starting kvstore serve", total=len(trace))
        serve = stack.enter_context(Serve.start(*flags))
        bar.update(task, description=f"{label}: replaying")
        asyncio.run(replay(serve, trace, res, args, lambda: bar.advance(task)))
        bar.update(task, description=f"{label}: done in {res.wall_s:.0f} s")
    return res


# ----------------------------------------------------------------------- report


def _r(x: float) -> str:
    return f"{x:.3f}"


def hit_table(runs: list[Run], off: Offline, args: argparse.Namespace) -> Table:
    table = Table(
        "Prefix hit ratio (matched tokens ÷ request tokens)",
        ["configuration", "capacity (blocks)", "ideal (∞)", "LRU sim", "Belady MIN",
         "measured", "measured ÷ ideal", "measured ÷ LRU sim"],
    )  # fmt: skip
    for r in runs:
        cap = r.size.blocks * (1 + DISK_FACTOR * r.disk)
        lru, mn = off.lru[cap], off.belady[cap]
        what = f"{r.size.blocks:,} + {DISK_FACTOR}x{r.size.blocks:,}" if r.disk else ""
        table.add(
            r.label,
            f"{cap:,}" + (f" ({what})" if what else ""),
            _r(off.ideal),
            _r(lru),
            _r(mn),
            _r(r.ratio),
            _r(r.ratio / off.ideal),
            _r(r.ratio / lru),
        )
    for r in runs:
        if r.disk:
            cap = r.size.blocks * DISK_FACTOR
            table.add(f"(reference) LRU sim at the disk alone, {DISK_FACTOR}xH", f"{cap:,}",
                      _r(off.ideal), _r(off.lru[cap]), _r(off.belady[cap]), "", "", "")  # fmt: skip
    read = f"get_layer of the matched prefix {'after' if args.order == 'put-get' else 'before'}"
    table.notes += [
        "Per request: match_prefix, put_layer of the whole request"
        + (f", {read} the put" if args.read else " (no reads: --no-read)")
        + ". Offline sims: prefix semantics (a request hits its longest run of leading "
        "blocks all present), every request's blocks put.",
        "The disk holds copies of host blocks too and drops its oldest quarter (segment) "
        "for room, so a host + disk node keeps between 6H and 8H + H distinct blocks; the "
        "9H sims are an upper reference, the 8H row a closer one.",
    ]
    return table


def counter_table(runs: list[Run]) -> Table:
    table = Table(
        "Node counters at the end of each run",
        ["configuration", "wall s", "req/s", "host slots (sized for)", "short reads",
         "short puts", "hit ratio 1st / 2nd half", *DISK_COUNTERS, "disk slots", "queued"],
    )  # fmt: skip
    for r in runs:
        d = r.disk_stats
        n = r.hits_by_half
        table.add(
            r.label,
            f"{r.wall_s:.1f}",
            f"{r.requests / r.wall_s:.0f}",
            f"{r.host.get('slots', '?'):,} ({r.size.blocks:,})",
            r.short_reads,
            r.short_puts,
            f"{n[0]:.3f} / {n[1]:.3f}",
            *(f"{d[c]:,}" if r.disk and c in d else "—" for c in DISK_COUNTERS),
            f"{d['slots']:,}" if r.disk else "—",
            f"{d['queued']:,}" if r.disk else "—",
        )
    table.notes += [
        "host slots: the host tier's slots when the replay ended (full: the trace has more "
        "distinct blocks than any H here), beside the slots --host-mem was sized for.",
        "short reads: get_layer returned fewer tokens than match_prefix had matched (the "
        "master's index ahead of the node). unwritten_evictions: complete blocks host "
        "memory evicted with no disk record matching them (they left the node).",
    ]
    return table


def sizing_table(sizes: list[Sizing]) -> Table:
    table = Table(
        "Sizing (from kvstore.core.arena and kvstore.node.disk)",
        ["H asked", "slot bytes", "stride", "page bytes", "slots / span (pages)",
         "--host-mem", "host slots", "record span", "--disk-size", "disk records"],
    )  # fmt: skip
    for s in sizes:
        table.add(
            f"{s.wanted:,}",
            f"{s.slot_bytes:,}",
            f"{s.stride:,}",
            f"{s.page_bytes:,}",
            f"{s.slots_per_span} ({s.span_pages})",
            f"{s.host_mem:,}",
            f"{s.blocks:,}",
            f"{s.record_span:,}",
            f"{s.disk_size:,}",
            f"{s.disk_size // s.record_span:,}",
        )
    return table


def target_table(runs: list[Run], off: Offline) -> Table:
    table = Table(
        f"Target: host + disk hit ratio ≥ {TARGET_RATIO} x ideal at {TARGET_H:,} host blocks",
        ["H", "host only", "host + disk", "ideal (∞)", "disk ÷ ideal", "LRU sim 9H",
         "disk ÷ LRU sim 9H", "met"],
    )  # fmt: skip
    for r in runs:
        if not r.disk:
            continue
        only = next((o for o in runs if not o.disk and o.size == r.size), None)
        cap = r.size.blocks * (1 + DISK_FACTOR)
        ok = r.ratio >= TARGET_RATIO * off.ideal
        table.add(
            f"{r.size.wanted:,}" + (" (target)" if r.size.wanted == TARGET_H else ""),
            _r(only.ratio) if only else "—",
            _r(r.ratio),
            _r(off.ideal),
            _r(r.ratio / off.ideal),
            _r(off.lru[cap]),
            _r(r.ratio / off.lru[cap]),
            ("✓" if ok else "✗") if r.size.wanted == TARGET_H else ("(✓)" if ok else "(✗)"),
        )
    if not any(r.size.wanted == TARGET_H and r.disk for r in runs):
        table.notes.append(
            f"H = {TARGET_H:,} was not run (--host-blocks): the target is unmeasured."
        )
    return table


def workload_table(
    trace: list[list[int]], reqs: list[list[int]], off: Offline, path: Path
) -> Table:
    table = Table("Workload", ["quantity", "value"])
    blocks = sum(len(r) for r in reqs)
    table.add("trace", f"`{path}`, first {len(trace):,} requests")
    table.add("blocks requested (16 tokens each)", f"{blocks:,}")
    table.add("distinct blocks (hash id + prefix)", f"{len({b for r in reqs for b in r}):,}")
    table.add("ideal hit ratio (no eviction)", _r(off.ideal))
    table.add(
        "namespace",
        f"{LAYERS} layer, H={HEADS}, D={HEAD_DIM}, bf16, {BLOCK}-token blocks, int8",
    )
    return table


def plot(runs: list[Run], off: Offline, path: str) -> None:
    panels = []
    for wanted in dict.fromkeys(r.size.wanted for r in runs):
        mine = [r for r in runs if r.size.wanted == wanted]
        h = mine[0].size.blocks
        labels, values = (
            ["ideal (∞)", f"LRU sim {h}", f"MIN {h}"],
            [off.ideal, off.lru[h], off.belady[h]],
        )
        for r in mine:
            if not r.disk:
                labels.append("host only")
                values.append(r.ratio)
        nine = h * (1 + DISK_FACTOR)
        labels += [f"LRU sim {nine}", f"MIN {nine}"]
        values += [off.lru[nine], off.belady[nine]]
        for r in mine:
            if r.disk:
                labels.append("host + disk")
                values.append(r.ratio)
        panels.append(
            BarPanel(f"H = {h:,} host blocks", "hit ratio", labels, {"hit ratio": values})
        )
    save_bar_plot(path, panels, suptitle="bench/disk_trace.py: prefix hit ratio")


# ----------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        metavar="PATH",
        help="Mooncake-format JSONL trace (default: the bundled sample)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        metavar="N",
        help="replay the first N requests (default 0: all)",
    )
    parser.add_argument(
        "--host-blocks",
        default=f"4096,{TARGET_H}",
        metavar="H,H",
        help=f"host memory sizes in blocks (default 4096,{TARGET_H})",
    )
    parser.add_argument(
        "--read",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="get_layer the matched prefix of each request (default on)",
    )
    parser.add_argument(
        "--order",
        choices=("put-get", "get-put"),
        default="put-get",
        help="with --read: read after the put (default) or before it",
    )
    parser.add_argument(
        "--disk-dir",
        default=None,
        metavar="DIR",
        help="where the disk tiers' directories go (default: the temp dir)",
    )
    parser.add_argument("--plot", metavar="PNG", help="also write a bar chart here")
    args = parser.parse_args(argv)
    try:
        args.hosts = [int(x) for x in args.host_blocks.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--host-blocks {args.host_blocks!r}: a comma-separated list of integers")
    if not args.hosts or min(args.hosts) <= 0 or args.requests < 0:
        parser.error("need --host-blocks > 0 and --requests >= 0")
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    trace = load_trace(args.trace, args.requests)
    reqs = block_ids(trace)
    total = sum(len(r) for r in reqs)
    sizes = [size_host(h) for h in args.hosts]
    off = Offline(sum(ideal_hits(trace)) / total)
    caps = sorted(
        {c for s in sizes for c in (s.blocks, DISK_FACTOR * s.blocks, (1 + DISK_FACTOR) * s.blocks)}
    )
    runs: list[Run] = []
    with progress() as bar:
        task = bar.add_task("offline LRU and MIN", total=2 * len(caps))
        for cap in caps:
            off.lru[cap] = sum(lru_hits(reqs, cap, args.read)) / total
            bar.advance(task)
            off.belady[cap] = sum(belady_hits(reqs, cap)) / total
            bar.advance(task)
        for size in sizes:
            for disk in (False, True):
                runs.append(run_config(trace, size, disk, args, bar))
    wall = time.perf_counter() - t0
    tables = [
        hit_table(runs, off, args),
        target_table(runs, off),
        counter_table(runs),
        sizing_table(sizes),
        workload_table(trace, reqs, off, args.trace),
    ]
    tables[-1].add("bench wall time (s)", f"{wall:.0f}")
    print_report(
        "Prefix hit ratio through a node with a disk tier", "bench/disk_trace.py", argv, tables
    )
    if args.plot:
        plot(runs, off, args.plot)
        print(f"Plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

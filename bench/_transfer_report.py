"""The Markdown report of ``bench/transfer.py``: its sections' tables and its bar chart.

Each ``*_table`` builds one section from a run's :class:`transfer.Results`; :func:`plot`
draws GB/s per point and path. This module imports nothing from ``transfer`` at run time
(``transfer`` imports it): what the report states about the run's knobs (warm-ups, the
client region, probe count) is passed in.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import TYPE_CHECKING

from _common import BarPanel, Table, latency_stats, save_bar_plot
from service import BLOCK, HEAD_DIM, HEADS, big_namespace

from kvstore.core.codec import chunk_nbytes

if TYPE_CHECKING:
    from transfer import Measured, Point, Results

__all__ = [
    "EMPTY_PROBE",
    "GET_PATHS",
    "IDLE_TARGET",
    "PUT_PATHS",
    "RATIO_SIZES",
    "RAW_PROBE",
    "STATS_PROBE",
    "TARGETS",
    "baseline_table",
    "client_cpu_table",
    "cpu_table",
    "e2e_table",
    "exchange_table",
    "idle_table",
    "kv_table",
    "plot",
    "probe_table",
    "ratio_table",
]

MiB = 1 << 20
RATIO_SIZES = ("512 KiB", "4 MiB")
"""Chunk sizes of section 4's ratios."""
TARGETS = {
    "512 KiB": {"ucx put": 0.6, "ucx get": 0.7, "tcp put": 0.7, "tcp get": 0.85},
    "4 MiB": {"ucx put": 0.8, "ucx get": 0.8, "tcp put": 0.8, "tcp get": 0.8},
}
"""kvstore ÷ baseline GB/s targets by chunk size (exchanges of 8 chunks, one in flight):
``ucx://`` ÷ raw NIXL, ``tcp://`` ÷ raw asyncio."""
STATS_PROBE = "kvstore tcp://: stats frame and answer"
"""Section 1b's framed round trip that builds the node's counters on the way."""
EMPTY_PROBE = "kvstore tcp://: a framed request the node does nothing for"
"""Section 1b's framed round trip with no work in the node's handler (``unhold`` of no
hold): the floor under every control step, and section 4's floor's round trip."""
RAW_PROBE = "raw socket: 9 B request, 64 B answer"
"""Section 1b's round trip on a raw asyncio socket (section 3c's lower floor)."""
IDLE_TARGET = 0.15
"""Most idle CPU of the node, in cores."""
CLIENT_CPU_TARGET = 1.5
"""Most client CPU per GB of a ``ucx://`` put, as a multiple of the raw NIXL writer's."""
BASELINES = (("kv ucx put", "raw NIXL WRITE", "ucx put"),
             ("kv ucx layers put", "raw NIXL WRITE", "ucx put"),
             ("kv ucx get", "raw NIXL READ", "ucx get"),
             ("kv tcp put", "raw asyncio put", "tcp put"),
             ("kv tcp get", "raw asyncio get", "tcp get"))  # fmt: skip
"""Each kvstore path, the raw path it is measured against, and its :data:`TARGETS` key."""
CONTROL_TRIPS = {"kv ucx put": 2, "kv ucx layers put": 1}
"""Framed round trips a ``ucx://`` put's client makes around its WRITE (section 3c's floor)."""
PUT_PATHS = ("kv tcp put", "kv ucx put", "kv ucx layers put", "raw asyncio put", "raw NIXL WRITE")
GET_PATHS = (
    "kv tcp get", "kv ucx get", "kv ucx leased get", "raw asyncio get", "raw NIXL READ"
)  # fmt: skip


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def _per_gb(cpu_s: float, m: Measured) -> str:
    return f"{cpu_s / m.moved_gb:.3f}"


def _phase(m: Measured, name: str) -> str:
    return _ms(statistics.median(m.phases[name])) if name in m.phases else "-"


def _ran(res: Results, point: Point, depth: int) -> bool:
    """Whether the run measured ``point`` at ``depth`` (it skips those that do not fit the
    region: then it has none of the point's paths at that depth)."""
    return (point.name, "kv tcp put", depth) in res.by


def _skipped_note(res: Results, region: int) -> str:
    """Which points a depth skipped ("-" rows), or that none was; ``region``: the bytes each
    client process rotates over."""
    out = [f"{p.name} at depth {d}" for p in res.points for d in res.setup.depths
           if not _ran(res, p, d)]  # fmt: skip
    why = f"depth x MiB per exchange must fit the {region // MiB} MiB region on distinct rows"
    return f"not run ('-'): {', '.join(out)} ({why})." if out else "every depth ran everywhere."


def kv_table(res: Results, warmup: int, region: int) -> Table:
    """Section 1: kvstore's exchanges over both transports at each depth, with phases;
    ``warmup``: the fewest untimed exchanges per point, ``region``: the bytes each client
    process rotates over."""
    table = Table(
        "1. kvstore data plane: pre-encoded chunks, depth = exchanges in flight",
        ["op", "chunk", "chunks", "MiB", "depth", "transport", "n", "GB/s", "p50 ms", "p99 ms",
         "control ms", "move ms", "after ms", "node CPU s/GB"],
    )  # fmt: skip
    ways = ("tcp", "ucx", "ucx layers", "ucx leased")
    rows = itertools.product(("put", "get"), res.points, res.setup.depths, ways)
    for op, p, d, transport in rows:
        head = (op, p.label, p.batch, f"{p.exchange_bytes / MiB:.1f}", d, f"{transport}://")
        m = res.by.get((p.name, f"kv {transport} {op}", d))
        if m is None and transport not in ("tcp", "ucx"):
            continue  # (one direction, or depth 1, only)
        if m is None:
            table.add(*head, *["-"] * 8)
            continue
        st = latency_stats(m.seconds)
        table.add(*head, len(m.seconds), f"{m.gbps:.2f}", _ms(st["p50"]), _ms(st["p99"]),
                  _phase(m, "control"), _phase(m, "move"), _phase(m, "after"),
                  _per_gb(m.node_cpu, m))  # fmt: skip
    s = res.setup
    table.notes += [
        f"chunk = payload + 72 B (header, checksum), quant none; chunks per exchange; MiB per "
        f"exchange; depth = exchanges in flight, each on its own connection to the node (one "
        f"NixlAgent per process, as a client). n timed exchanges after max({warmup}, depth) "
        f"warm-ups (about {s.budget // MiB} MiB, {s.min_n}..{s.max_n}, ≥ 2 x depth); "
        + _skipped_note(res, region),
        "GB/s = bytes of the timed exchanges / the wall time they took, first start → last "
        "end, less the untimed pauses between rounds over the client region (re-encoding, "
        "cache flush, nothing in flight); at depth 1 that is bytes per exchange / mean "
        "latency. p50/p99: per exchange, from its request to its end.",
        "Phases (medians): control = request sent → the node's answer (ready / reserved / "
        "data header / leased). move: tcp put = data frame sent → ack (node receive, checksum "
        "of every chunk, master commit); tcp get = payload received; ucx = the "
        "NixlAgent.write/read call. after: ucx put = landed → ack (node checks every "
        "chunk's header, commits to the master; checksums in its scrub); ucx get = the "
        "reader's header check of each chunk (key, spec: tells a reused slot); ucx leased "
        "get = sending release (no answer). ucx get READs each slot at the location the "
        "master's lookup gave (looked up before the timing) with no node exchange; ucx "
        "leased get is the lease → READ → release a reader falls back to.",
        "ucx layers put: an engine's per-layer puts of one prompt (up to 32 layers of the "
        "same blocks, fewer where two prompts' slots would not fit half the pool; depth 1): "
        "its layer 0 is a reserve as above, every later layer a WRITE at the slot locations "
        "the previous ack granted, then write → ack (control: none; after: write → ack).",
        "put: writer process, fresh keys every exchange. get: reader process, reading back "
        "the ucx:// puts of the same point and depth (cycling over those that fit half the "
        "pool).",
        f"Node: kvstore {'node' if s.master_apart else 'serve'} --transport ucx --host-mem "
        f"{s.pool_bytes // MiB}MiB"
        + (
            f" --gpu-mem {s.gpu_bytes // MiB}MiB (ucx:// puts land in device memory)"
            if s.gpu_bytes
            else ""
        )
        + (
            " with a kvstore master in a process of its own (every put's commit crosses gRPC)"
            if s.master_apart
            else " (master + node in one process)"
        )
        + f", pool filled first ({res.fill_s:.1f} s) so puts "
        "evict and land in touched pages. Node CPU: /proc/<pid>/stat before and after each "
        "timed stretch of exchanges (each thread's schedstat, to the microsecond; see section 3 "
        "for totals).",
    ]
    return table


def probe_table(res: Results, probes: int) -> Table:
    """Section 1b: fixed costs of one small round trip of each kind, ``probes`` of each."""
    table = Table(f"1b. fixed costs: one small round trip, {probes} sequential (writer process)",
                  ["round trip", "p50 µs", "p99 µs", "mean µs", "client CPU µs"])  # fmt: skip
    for name, st in res.probes.items():
        cpu = f"{st['cpu'] * 1e6:.0f}" if "cpu" in st else "-"
        table.add(name, *(f"{st[k] * 1e6:.0f}" for k in ("p50", "p99", "mean")), cpu)
    table.notes.append(
        "kvstore rows: one framed JSON request and answer on the node's data port; the one the "
        "node does nothing for (an unhold of a hold that does not exist) is the floor under "
        "every control step in section 1, stats also builds the node's counters. NIXL rows: "
        "against the raw NIXL target process. Client CPU: the writer process's CPU (every "
        "thread) per round trip, on average (section 3c's floor uses it)."
    )
    return table


def _speed(m: Measured | None) -> list[str]:
    """GB/s, p50 ms, p99 ms of a path, or dashes where it was not measured."""
    if m is None:
        return ["-"] * 3
    st = latency_stats(m.seconds)
    return [f"{m.gbps:.2f}", _ms(st["p50"]), _ms(st["p99"])]


def baseline_table(res: Results) -> Table:
    """Section 2: the same bytes without kvstore, at each depth."""
    table = Table(
        "2. the same bytes without kvstore",
        ["direction", "chunk", "chunks", "depth", "raw asyncio GB/s", "p50 ms", "p99 ms",
         "raw NIXL GB/s", "p50 ms", "p99 ms", "memcpy GB/s"],
    )  # fmt: skip
    ways = [("client → node (put)", "raw asyncio put", "raw NIXL WRITE"),
            ("node → client (get)", "raw asyncio get", "raw NIXL READ")]  # fmt: skip
    for (direction, aio, nixl), p, d in itertools.product(ways, res.points, res.setup.depths):
        a, x, c = (res.by.get((p.name, k, d)) for k in (aio, nixl, "memcpy"))
        table.add(direction, p.label, p.batch, d, *_speed(a), *_speed(x),
                  "-" if c is None else f"{c.gbps:.2f}")  # fmt: skip
    table.notes += [
        "raw asyncio: loop.sock_sendall / sock_recv_into between the client process and a "
        "server process, a 9-byte header per exchange, chunks straight into preallocated "
        "rotating memory, a 1-byte ack per put (no framing, no checks, no commit); depth D: "
        "D sockets, one exchange in flight on each.",
        "Both raw servers hold a node's kind of memory (huge pages where the kernel has "
        "them, as the node's arena), so a ratio to them measures kvstore's work, not the "
        "pages it copies into.",
        "raw NIXL: the binding called directly from the writer process, one request carrying "
        "the exchange's spans, spinning on getXferStatus, against bench/nixl_raw.py's target "
        "(progress thread, like a node); UCX_NET_DEVICES=lo. Depth D: D requests posted, "
        "polled in turn from that one thread, the next posted as each completes (over CMA the "
        "post itself copies, so depth barely changes it). memcpy: torch copy_ of the same "
        "chunks, one thread, rotating source; depth 1 only (a ceiling).",
        "GB/s, p50, p99 and the skipped points as in section 1.",
    ]
    return table


def cpu_table(res: Results) -> Table:
    """Section 3: node CPU per GB, all points of each depth together."""
    table = Table("3. CPU per GB moved, all points of section 1 together, per depth",
                  ["transport", "op", "depth", "GB moved", "node CPU s", "node CPU s/GB",
                   "client CPU s/GB"])  # fmt: skip
    for op, transport, d in itertools.product(("put", "get"), ("tcp", "ucx"), res.setup.depths):
        ms = [m for p in res.points if (m := res.by.get((p.name, f"kv {transport} {op}", d)))]
        if not ms:
            continue
        gb = sum(m.moved_gb for m in ms)
        node, client = sum(m.node_cpu for m in ms), sum(m.client_cpu for m in ms)
        table.add(f"{transport}://", op, d, f"{gb:.2f}", f"{node:.2f}", f"{node / gb:.3f}",
                  f"{client / gb:.3f}")  # fmt: skip
    table.notes.append(
        "Node: the kvstore serve process, all threads (its put CPU includes the master's side "
        "of the commit RPC). Client: the writer or reader process (getrusage); over ucx:// "
        "the client's kernel does the copy (CMA), so the copy is billed to the client. Both "
        "over the timed stretches only."
    )
    return table


def client_cpu_table(res: Results) -> Table:
    """Section 3c: the client's CPU per GB beside its raw baseline's, same point and depth."""
    table = Table(
        f"3c. Client CPU per GB beside the raw client's; target for ucx:// put ≤ "
        f"{CLIENT_CPU_TARGET}x the raw NIXL writer's",
        ["chunk", "chunks", "depth", "path", "client CPU s/GB", "baseline",
         "baseline CPU s/GB", "÷ baseline", "floor ÷ baseline: framed / raw socket"],
    )  # fmt: skip
    trip_cpu = [res.probes.get(name, {}).get("cpu") for name in (EMPTY_PROBE, RAW_PROBE)]
    for p, d in itertools.product(res.points, res.setup.depths):
        for path, base, key in BASELINES:
            target = CLIENT_CPU_TARGET if key == "ucx put" else None
            a, b = res.by.get((p.name, path, d)), res.by.get((p.name, base, d))
            if a is None or b is None or not a.moved_gb or not b.moved_gb:
                continue
            ours, theirs = a.client_cpu / a.moved_gb, b.client_cpu / b.moved_gb
            ratio = ours / theirs if theirs > 0 else math.inf
            mark = "" if target is None else (" ✓" if ratio <= target else " ✗")
            floor, trips, gb = "-", CONTROL_TRIPS.get(path), a.nbytes / 1e9
            if trips and None not in trip_cpu and theirs > 0:
                floor = " / ".join(f"{(theirs + trips * c / gb) / theirs:.2f}" for c in trip_cpu)
            table.add(p.label, p.batch, d, path.removeprefix("kv "), f"{ours:.3f}",
                      base, f"{theirs:.3f}", f"{ratio:.2f}{mark}", floor)  # fmt: skip
    table.notes += [
        "Each side's process CPU (getrusage, every thread, user and system) over its timed "
        "stretches ÷ the GB it moved. The raw NIXL client posts each request and spins on "
        "its status on one thread, so its CPU is about its wall time; kvstore's client "
        "spins at most 100 µs on the loop, then waits in a worker's backoff polling. Over "
        "ucx:// on one host UCX copies with CMA in the poster's kernel, so both sides' "
        "figures include the copy, which an RDMA NIC would do.",
        "Floor: the least a ucx:// put's client could spend with kvstore's framing, as a "
        "multiple of the raw writer's: the raw NIXL writer's CPU plus the client CPU of its "
        "control round trips (2 for a put: reserve, landed; 1 for a later layer: write), each "
        "taken at the client CPU of section 1b's framed round trip the node does nothing for, "
        "then of its raw socket round trip (what any client on asyncio spends at least).",
    ]
    return table


LINKS_GBPS = (100, 400)
"""RDMA links (Gb/s) the per-exchange projection assumes."""

EXCHANGE_PATHS = ("kv tcp put", "kv ucx put", "kv ucx layers put", "kv tcp get", "kv ucx get")


def exchange_table(res: Results) -> Table:
    """Section 3b: CPU per exchange and what an RDMA link would leave of each exchange."""
    links = [f"at {g} Gb/s: GB/s (÷ link)" for g in LINKS_GBPS]
    table = Table("3b. CPU per exchange, and an RDMA projection (depth 1)",
                  ["point", "path", "MiB per exchange", "exchanges", "node CPU µs",
                   "on its loop's thread µs", "of which the scrub µs", "client CPU µs",
                   *links])  # fmt: skip
    for point, path in itertools.product(res.points, EXCHANGE_PATHS):
        m = res.by.get((point.name, path, 1))
        if m is None or not m.seconds:
            continue
        n = len(m.seconds)
        node_s, client_s = m.node_cpu / n, m.client_cpu / n
        cells = []
        for gbit in LINKS_GBPS:
            wire_s = m.nbytes * 8 / (gbit * 1e9)
            gbps = m.nbytes / (node_s + client_s + wire_s) / 1e9
            cells.append(f"{gbps:.2f} ({gbps * 8 / gbit:.2f})")
        scrub = "-" if m.scrub_us is None else f"{m.scrub_us:.0f}"
        table.add(point.name, path.removeprefix("kv "), f"{m.nbytes / 2**20:.2f}", n,
                  f"{node_s * 1e6:.0f}", f"{m.node_loop_cpu / n * 1e6:.0f}", scrub,
                  f"{client_s * 1e6:.0f}", *cells)  # fmt: skip
    table.notes.append(
        "Node and client CPU: each process's CPU over the timed exchanges ÷ their number "
        "(section 3's accounting). The projection charges one exchange the node's and the "
        "client's CPU time in series plus the WRITE (or READ) of its bytes at the link's "
        "speed, as if each side's work sat on the exchange's critical path and nothing "
        "overlapped: an RDMA NIC moves the bytes without either CPU. Over ucx:// here the "
        "client's CPU includes the kernel's copy (CMA), which a NIC would do, so the "
        "projection is a floor. The node's CPU is each thread's time on a CPU "
        "(/proc/<pid>/task/*/schedstat, to the microsecond; a thread that ended meanwhile "
        "by its clock ticks). On its loop's thread: the node's main "
        "thread alone, which runs its exchanges and its scrub; the rest is its other threads "
        "(NIXL's progress thread, gRPC's, the heartbeat's, the verifiers'). The scrub "
        "(ucx:// puts): the node's CPU for checking every landed byte's checksum after the "
        "ack (its scrub_cpu_us ÷ "
        "the chunks it scrubbed over the job, x the chunks of an exchange), part of the "
        "node's CPU, since it runs in the exchanges' gaps."
    )
    return table


def _ratio(a: Measured | None, b: Measured | None, target: float) -> str:
    if a is None or b is None:
        return "-"
    r = a.gbps / b.gbps
    return f"{r:.2f} {'✓' if r >= target else '✗'}"


def ratio_table(res: Results) -> Table:
    """Section 4: kvstore ÷ its baseline at the same depth, side by side."""
    small, big = TARGETS["512 KiB"], TARGETS["4 MiB"]
    table = Table(
        f"4. kvstore ÷ baseline (GB/s); targets at 512 KiB: ucx:// put ≥ {small['ucx put']} and "
        f"get ≥ {small['ucx get']} of raw NIXL, tcp:// put ≥ {small['tcp put']} and get ≥ "
        f"{small['tcp get']} of raw asyncio; at 4 MiB ≥ {big['ucx put']} on all",
        ["chunk", "chunks", "depth", "put ucx ÷ NIXL WRITE", "put ucx layers ÷ NIXL WRITE",
         "floor of a one-round-trip ucx put ÷ NIXL WRITE", "get ucx ÷ NIXL READ",
         "put tcp ÷ asyncio", "get tcp ÷ asyncio"],
    )  # fmt: skip
    for p in (p for p in res.points if p.label in RATIO_SIZES):
        goal = TARGETS[p.label]
        for d in res.setup.depths:
            cells = [_ratio(res.by.get((p.name, a, d)), res.by.get((p.name, b, d)), goal[t])
                     for a, b, t in BASELINES]  # fmt: skip
            floor = _floor(res, p, d)
            table.add(p.label, p.batch, d, *cells[:2], floor, *cells[2:])
    table.notes += [
        "Each ratio compares kvstore at depth D with its baseline at the same depth D, the "
        "baseline measured right after it (GB/s as in section 1; - where the depth was "
        "skipped).",
        "Floor: what a put of one WRITE and one round trip could reach if the node did no "
        "work for it (no header checks, commit or grants): the exchange's bytes over the "
        "median of the layered put's WRITE (section 1, move) plus the median framed round "
        "trip of section 1b that the node does nothing for, both measured in this run; "
        "depth 1 only.",
    ]
    return table


def _floor(res: Results, point: Point, depth: int) -> str:
    """The floor of a one-round-trip ``ucx://`` put ÷ raw NIXL WRITE (ratio_table's note)."""
    layers = res.by.get((point.name, "kv ucx layers put", depth))
    raw = res.by.get((point.name, "raw NIXL WRITE", depth))
    rt = res.probes.get(EMPTY_PROBE)
    if depth != 1 or layers is None or raw is None or rt is None or "move" not in layers.phases:
        return "-"
    seconds = statistics.median(layers.phases["move"]) + rt["p50"]
    return f"{point.exchange_bytes / seconds / 1e9 / raw.gbps:.2f}"


def e2e_table(res: Results) -> Table:
    """Section 4b: KVClient with the codec, for context."""
    s = res.setup
    ns, full = big_namespace(s.e2e_layers), s.e2e_tokens // BLOCK * BLOCK
    wire = s.e2e_layers * (full // BLOCK) * chunk_nbytes(BLOCK, HEADS, HEAD_DIM, ns.dtype, "int8")
    bf16 = s.e2e_layers * 2 * full * HEADS * HEAD_DIM * 2
    reps = len(res.e2e[("tcp", "put")])
    table = Table(
        f"4b. end to end: KVClient.put_layer / get_layer x {s.e2e_layers}, {s.e2e_tokens}-token "
        f"prompt (H={HEADS}, D={HEAD_DIM}, bf16, int8), median of {reps} prompts",
        ["transport", "calls", "ms median", "ms best", "bf16 GB/s", "wire GB/s"],
    )
    for transport in ("tcp", "ucx"):
        for op in ("put", "get"):
            secs = res.e2e[(transport, op)]
            med = statistics.median(secs)
            gbps = [f"{n / med / 1e9:.2f}" for n in (bf16, wire)]
            table.add(f"{transport}://", f"{op}_layer x {s.e2e_layers}", _ms(med),
                      _ms(min(secs)), *gbps)  # fmt: skip
    table.notes.append(
        f"Writer and reader processes, codec included; KVClient.connect(..., ucx=False) forces "
        f"tcp://. bf16 bytes {bf16:,}, wire bytes {wire:,}; one warm-up prompt each first."
    )
    return table


def idle_table(res: Results) -> Table:
    """Section 5: the node's idle CPU."""
    table = Table(
        f"5. idle CPU of the kvstore serve --transport ucx process (target < {IDLE_TARGET:.0%} "
        "of a core)",
        ["when", "window s", "% of a core", "busiest threads (% of a core)"],
    )
    for when, w in res.idle:
        busiest = ", ".join(f"{n} {c:.1%}" for n, c in w.threads) or "-"
        mark = "✓" if w.cores < IDLE_TARGET else "✗"
        table.add(when, f"{w.seconds:.1f}", f"{w.cores:.1%} {mark}", busiest)
    table.notes.append(
        "/proc/<pid>/task/*/stat, 10 ms ticks (0.2% of a core over 5 s). The fresh node's "
        f"window starts once it has mapped its host memory, {res.mapping_s:.1f} s after its "
        "ready line (a one-off at start, on a nice-19 thread that then ends)."
    )
    return table


def plot(res: Results, path: str) -> None:
    """GB/s per point and path, puts and gets, at the smallest and the largest depth."""
    ends = sorted({res.setup.depths[0], res.setup.depths[-1]})
    ways = (("client → node (put / WRITE)", PUT_PATHS), ("node → client (get / READ)", GET_PATHS))
    panels = []
    for (title, paths), d in itertools.product(ways, ends):
        pts = [p for p in res.points if _ran(res, p, d)]
        ran = [k for k in paths if all((p.name, k, d) in res.by for p in pts)]  # (layers: d 1)
        series = {k: [res.by[(p.name, k, d)].gbps for p in pts] for k in ran}
        series["memcpy (1 thread, depth 1)"] = [res.by[(p.name, "memcpy", 1)].gbps for p in pts]
        panels.append(BarPanel(f"{title}, depth {d}", "GB/s", [p.name for p in pts], series))
    save_bar_plot(path, panels, suptitle="bench/transfer.py: depth = exchanges in flight",
                  columns=len(ends))  # fmt: skip

"""Tables for people: how ``kvctl`` prints each answer without ``--json``.

``rich`` is imported inside the functions, on first use, so neither ``--json`` nor
``--help`` pays for it. Every function writes to ``out`` and blocks only on that write.
Cells are plain text (no rich markup), so node ids and URIs print as they are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

from kvctl.explain import BlockReport, PrefixReport, ShardLayers, format_ranges

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from kvctl.commands import DrainResult, EvictResult, StatsReport
    from kvstore.control.records import MasterStats, NodeInfo

__all__ = [
    "console_for",
    "human_bytes",
    "new_table",
    "node_state",
    "percent",
    "print_drain",
    "print_evict",
    "print_lookup",
    "print_nodes",
    "print_stats",
    "print_status",
]

_PLAIN_WIDTH = 160
"""Width for output that is not a terminal (rich would assume 80 and wrap URIs)."""
_HEAD_ROWS = 3
_ROWS_BEFORE_STOP = 3
_ROWS_FROM_STOP = 8
_ELIDE_OVER = 16
"""Lookup tables with more blocks than this show the head and the rows around the stop."""


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"1.5 KiB"``, ``"4.0 GiB"``."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def percent(part: int, whole: int) -> str:
    """``part`` of ``whole`` as ``"12.5%"``; ``"-"`` when ``whole`` is 0."""
    return f"{100 * part / whole:.1f}%" if whole else "-"


def console_for(out: TextIO) -> Console:
    """A rich console writing plain cells to ``out`` (160 columns when not a terminal)."""
    from rich.console import Console

    tty = out.isatty()
    return Console(file=out, markup=False, highlight=False, width=None if tty else _PLAIN_WIDTH)


def new_table(*columns: str, title: str | None = None) -> Table:
    """An empty table with these column headings, in the style of every kvctl table."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for name in columns:
        table.add_column(name)
    return table


def print_status(stats: MasterStats, out: TextIO) -> None:
    """The pool totals as a two-column table."""
    table = new_table("", "", title="kvstore pool")
    table.show_header = False
    rows = [
        ("nodes", f"{stats.nodes} ({stats.live_nodes} live)"),
        ("capacity", human_bytes(stats.capacity_bytes)),
        (
            "used",
            f"{human_bytes(stats.used_bytes)} ({percent(stats.used_bytes, stats.capacity_bytes)})",
        ),
        ("blocks", str(stats.blocks)),
        ("objects", str(stats.objects)),
        ("hits", f"{stats.hits} (this master's, since it started)"),
        ("misses", f"{stats.misses} (this master's, since it started)"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console_for(out).print(table)


def node_state(node: NodeInfo) -> str:
    """``alive`` / ``suspect`` / ``dead``, with ``, draining`` when marked."""
    state = "dead" if not node.alive else "suspect" if node.suspect else "alive"
    return f"{state}, draining" if node.draining else state


def _tiers_cell(node: NodeInfo) -> str:
    return "\n".join(
        f"{t.name} {human_bytes(t.used_bytes)} / {human_bytes(t.capacity_bytes)}"
        for t in node.tiers
    )


def print_nodes(nodes: Sequence[NodeInfo], out: TextIO) -> None:
    """One row per node: state (alive / suspect / dead, draining), lease age, epoch,
    transport, data URI, tiers, version."""
    from rich.text import Text

    table = new_table(
        "NODE", "STATE", "LEASE AGE", "EPOCH", "TRANSPORT", "DATA", "TIERS", "VERSION"
    )
    for node in nodes:
        style = "red" if not node.alive else "yellow" if node.suspect or node.draining else ""
        table.add_row(
            node.node_id,
            Text(node_state(node), style=style),
            f"{node.lease_age_s:.1f} s",
            str(node.epoch),
            node.transport,
            node.data_uri,
            _tiers_cell(node),
            node.version,
        )
    console = console_for(out)
    console.print(table)
    if not nodes:
        console.print("no nodes registered")


def print_stats(report: StatsReport, out: TextIO) -> None:
    """The master's counters and the per-tier sums over live nodes."""
    stats = report.stats
    ratio = report.hit_ratio
    console = console_for(out)
    counters = new_table("", "", title="master counters")
    counters.show_header = False
    for key, value in [
        ("nodes", f"{stats.nodes} ({stats.live_nodes} live)"),
        ("blocks", str(stats.blocks)),
        ("objects", str(stats.objects)),
        ("hits", f"{stats.hits} (prefix blocks + objects found, by this master)"),
        ("misses", f"{stats.misses} (prefix blocks + objects not found, by this master)"),
        ("hit ratio", "-" if ratio is None else f"{100 * ratio:.1f}%"),
    ]:
        counters.add_row(key, value)
    console.print(counters)
    tiers = new_table("TIER", "NODES", "CAPACITY", "USED", "USED %", title="tiers (live nodes)")
    for t in report.tiers:
        tiers.add_row(
            t.name,
            str(t.nodes),
            human_bytes(t.capacity_bytes),
            human_bytes(t.used_bytes),
            percent(t.used_bytes, t.capacity_bytes),
        )
    tiers.add_row(
        "total",
        str(stats.live_nodes),
        human_bytes(stats.capacity_bytes),
        human_bytes(stats.used_bytes),
        percent(stats.used_bytes, stats.capacity_bytes),
    )
    console.print(tiers)
    if stats.tenants:
        tenants = new_table("TENANT", "USED", "QUOTA", "OF QUOTA", "EVICTED", title="tenants")
        for u in stats.tenants:
            quota = human_bytes(u.quota_bytes) if u.quota_bytes else "-"
            share = percent(u.used_bytes, u.quota_bytes) if u.quota_bytes else "-"
            tenants.add_row(u.tenant, human_bytes(u.used_bytes), quota, share, str(u.evictions))
        console.print(tenants)


def print_drain(result: DrainResult, out: TextIO) -> None:
    """One line: the node's draining mark after the call."""
    progress = result.progress
    if progress is not None:
        chunks, nbytes = progress.get("drain_moved_chunks", 0), progress.get("drain_moved_bytes", 0)
        out.write(
            f"node {result.node_id}: drained: {chunks} chunks ({nbytes / 2**20:.1f} MiB) copied "
            f"to other nodes in {result.waited_s:.1f} s; it may leave now (SIGTERM)\n"
        )
        return
    mark = "draining (no new placements)" if result.draining else "not draining"
    out.write(f"node {result.node_id}: {mark}\n")


def print_evict(result: EvictResult, out: TextIO) -> None:
    """One line per node, then the total."""
    what = "whole namespace" if result.blocks is None else f"{result.blocks} blocks"
    for n in result.nodes:
        state = f"error: {n.error}" if n.error else f"evicted {n.evicted}, kept {n.kept} pinned"
        out.write(f"node {n.node_id}: {state}\n")
    total = sum(n.evicted for n in result.nodes)
    out.write(f"namespace {result.ns_id.hex()} ({what}): {total} slots evicted\n")


# -- lookup ---------------------------------------------------------------------------------


def _layers_cell(shards: Sequence[ShardLayers]) -> str:
    lines = []
    for s in shards:
        text = f"{s.present}/{s.total}"
        if s.missing:
            text += f" missing {format_ranges(s.missing)}"
        lines.append(f"s{s.shard} {text}" if len(shards) > 1 else text)
    return "\n".join(lines)


def _holders_cell(block: BlockReport) -> str:
    return "\n".join(
        f"{h.node_id}@{h.epoch} {h.state} {h.chunks}ch {h.tier}".rstrip() for h in block.holders
    )


def _visible(n: int, stop: int) -> Iterator[int | range]:
    """Block indices to show, with each hidden run as one ``range``."""
    if n <= _ELIDE_OVER:
        yield from range(n)
        return
    shown = set(range(min(n, _HEAD_ROWS)))
    shown |= set(range(max(0, stop - _ROWS_BEFORE_STOP), min(n, stop + _ROWS_FROM_STOP)))
    hidden_from = None
    for i in range(n):
        if i in shown:
            if hidden_from is not None:
                yield range(hidden_from, i)
                hidden_from = None
            yield i
        elif hidden_from is None:
            hidden_from = i
    if hidden_from is not None:
        yield range(hidden_from, n)


def _lookup_header(report: PrefixReport) -> list[str]:
    ns = report.ns
    lines = [
        f"namespace {ns.id_hex}: {ns.model} @ {ns.revision}, {ns.num_layers} layers x "
        f"{ns.tp_size} shard(s), {ns.block_tokens}-token blocks, {ns.dtype}/{ns.quant}",
        f"prompt: {report.num_tokens} tokens = {report.full_blocks} full blocks"
        f" + {report.tail_tokens} tail tokens",
        f"match: {report.matched_blocks} of {report.full_blocks} blocks readable "
        f"({report.matched_tokens} tokens); MatchPrefix says {report.master_matched_blocks}",
    ]
    stop = report.stop
    if stop is None:
        lines.append("every token of the prompt is in the pool")
    else:
        lines.append(f"stops at block {stop.block}: {stop.reason} - {stop.detail}")
    lines.extend(f"note: {note}" for note in report.notes)
    return lines


def print_lookup(report: PrefixReport, out: TextIO) -> None:
    """Why the prompt matches as far as it does: a summary, then one row per block (long
    prompts show the head and the rows around the stop; ``--json`` has every block)."""
    from rich.text import Text

    console = console_for(out)
    for line in _lookup_header(report):
        console.print(line)
    if not report.blocks:
        return
    stop = report.stop.block if report.stop is not None else report.full_blocks
    table = new_table("BLOCK", "HASH", "STATUS", "HOLDERS", "LAYERS")
    for item in _visible(report.full_blocks, stop):
        if isinstance(item, range):
            counts = Counter(report.blocks[i].status for i in item)
            summary = ", ".join(f"{c} {s}" for s, c in sorted(counts.items()))
            table.add_row(f"{item.start}-{item.stop - 1}", "...", summary, "", "")
            continue
        block = report.blocks[item]
        style = "green" if block.status == "ok" else "red"
        table.add_row(
            str(block.index),
            block.block_hash.hex()[:12],
            Text(block.status, style=style),
            _holders_cell(block),
            _layers_cell(block.shards),
            style="dim" if item > stop else None,
        )
    console.print(table)

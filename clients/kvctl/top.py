"""``kvctl top``: a live view of the pool, redrawn every ``--interval`` seconds (default 1).

Each refresh takes a :class:`Snapshot`: the master's ``Stats`` and ``Nodes`` and, for each
Prometheus endpoint it is given, that process's ``/metrics``. Transfer bytes, evictions
and stale misses exist only there (the master carries neither them nor the nodes' metrics
addresses), so endpoints come from ``--metrics HOST:PORT`` (repeatable) and, with
``--node-metrics-port PORT``, from every live node's data host at that port. Rates are the
difference of two snapshots over the time between them: the live view shows totals until
its second refresh, and ``--once`` takes two snapshots one interval apart and prints the
second, with rates, once (``--json``: as one JSON document).

Blocking: every master call waits at most the client's deadline and every ``/metrics``
read at most the same (on a worker thread, several at once). An endpoint that cannot be
read is shown with its error, not fatal; a master that fails after the first snapshot is
shown in the header and asked again at the next refresh. rich and prometheus_client are
imported here only, so no other command pays for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import signal
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from kvctl.commands import nodes_json, status_json, tier_totals
from kvctl.tables import human_bytes
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from kvstore.control.client import MasterClient
    from kvstore.control.records import MasterStats, NodeInfo
    from kvstore.control.tls import TlsFiles

__all__ = [
    "Frame",
    "MetricsSample",
    "Snapshot",
    "frame_json",
    "metrics_endpoints",
    "parse_metrics",
    "render",
    "run",
    "take_snapshot",
]

_MAX_METRICS_BYTES = 4 * 2**20
"""Longest /metrics answer read (a node's is ~10 KB)."""


# -- what one refresh sees --------------------------------------------------------------------


@dataclass(frozen=True)
class MetricsSample:
    """The counters ``top`` shows from one process's ``/metrics`` (totals since it started).

    ``error`` is non-empty, and every counter empty, when the endpoint could not be read.
    """

    endpoint: str
    error: str = ""
    transfer_bytes: dict[tuple[str, str], float] = field(default_factory=dict)
    """(op, transport) -> bytes moved by the data plane."""
    exchanges: dict[tuple[str, str], float] = field(default_factory=dict)
    """(op, transport) -> data-plane exchanges completed."""
    evictions: dict[str, float] = field(default_factory=dict)
    """tier -> slots evicted."""
    stale_misses: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """The master's view and every endpoint's counters at one moment: ``at`` on the
    monotonic clock (for rates), ``wall`` as ``time.time()`` (for people)."""

    at: float
    wall: float
    stats: MasterStats
    nodes: tuple[NodeInfo, ...]
    metrics: tuple[MetricsSample, ...]


def parse_metrics(endpoint: str, text: str) -> MetricsSample:
    """The counters of a Prometheus text exposition (``kvstore_*`` families only)."""
    from prometheus_client.parser import text_string_to_metric_families

    transfer: dict[tuple[str, str], float] = {}
    exchanges: dict[tuple[str, str], float] = {}
    evictions: dict[str, float] = {}
    stale = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.labels.get("op", ""), s.labels.get("transport", ""))
            if s.name == "kvstore_transfer_bytes_total":
                transfer[key] = transfer.get(key, 0.0) + s.value
            elif s.name == "kvstore_transfer_seconds_count":
                exchanges[key] = exchanges.get(key, 0.0) + s.value
            elif s.name == "kvstore_evictions_total":
                tier = s.labels.get("tier", "")
                evictions[tier] = evictions.get(tier, 0.0) + s.value
            elif s.name == "kvstore_stale_misses_total":
                stale += s.value
    return MetricsSample(endpoint, "", transfer, exchanges, evictions, stale)


def read_metrics(endpoint: str, timeout_s: float) -> MetricsSample:
    """GET ``http://ENDPOINT/metrics`` (blocks up to ``timeout_s``); errors become data."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read(_MAX_METRICS_BYTES + 1)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # (a port not HTTP's)
        return MetricsSample(endpoint, error=_reason(exc))
    if len(body) > _MAX_METRICS_BYTES:
        return MetricsSample(endpoint, error=f"answer over {_MAX_METRICS_BYTES} bytes")
    try:
        return parse_metrics(endpoint, body.decode("utf-8", errors="replace"))
    except ValueError as exc:
        return MetricsSample(endpoint, error=f"not a Prometheus exposition: {exc}")


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason if reason is not None else exc) or type(exc).__name__


def metrics_endpoints(
    explicit: Sequence[str], nodes: Sequence[NodeInfo], node_metrics_port: int | None
) -> list[str]:
    """``explicit`` endpoints, then each live node's data host at ``node_metrics_port``
    (when given), without repeats."""
    found = list(dict.fromkeys(explicit))
    if node_metrics_port is not None:
        for node in nodes:
            if node.alive:
                host = node.data_uri.split("://", 1)[-1].rsplit(":", 1)[0]
                endpoint = f"{host}:{node_metrics_port}"
                if endpoint not in found:
                    found.append(endpoint)
    return found


async def take_snapshot(
    client: MasterClient,
    explicit: Sequence[str],
    node_metrics_port: int | None,
    timeout_s: float,
) -> Snapshot:
    """``Stats``, ``Nodes`` and every endpoint's ``/metrics`` (read concurrently)."""
    stats = await client.stats()
    nodes = tuple(await client.nodes())
    endpoints = metrics_endpoints(explicit, nodes, node_metrics_port)
    samples = await asyncio.gather(
        *(asyncio.to_thread(read_metrics, e, timeout_s) for e in endpoints)
    )
    return Snapshot(time.monotonic(), time.time(), stats, nodes, tuple(samples))


# -- two snapshots: rates ---------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """What one redraw shows: the newest snapshot and, when there was one, the one before
    (for rates). ``error``: the master call that failed this refresh, if any."""

    now: Snapshot
    before: Snapshot | None = None
    error: str = ""

    @property
    def interval_s(self) -> float | None:
        """Seconds between the two snapshots; None for the first frame."""
        if self.before is None:
            return None
        return max(self.now.at - self.before.at, 1e-9)

    def hit_ratio(self) -> float | None:
        """hits / (hits + misses) since the master started; None before any lookup."""
        s = self.now.stats
        return s.hits / (s.hits + s.misses) if s.hits + s.misses else None

    def recent_hit_ratio(self) -> float | None:
        """The same over the last interval; None without one or without lookups in it."""
        if self.before is None:
            return None
        hits = self.now.stats.hits - self.before.stats.hits
        misses = self.now.stats.misses - self.before.stats.misses
        return hits / (hits + misses) if hits + misses > 0 else None

    def rate(self, endpoint: str, pick: str, key: Any) -> float | None:
        """Per-second change of one counter of ``endpoint``: ``pick`` names the
        :class:`MetricsSample` field, ``key`` the entry (None for stale misses)."""
        if self.before is None:
            return None
        now = _counter(self.now, endpoint, pick, key)
        then = _counter(self.before, endpoint, pick, key)
        if now is None or then is None or now < then:  # unread, or the process restarted
            return None
        return (now - then) / (self.interval_s or 1e-9)


def _counter(snap: Snapshot, endpoint: str, pick: str, key: Any) -> float | None:
    for sample in snap.metrics:
        if sample.endpoint == endpoint and not sample.error:
            value = getattr(sample, pick)
            return float(value if key is None else value.get(key, 0.0))
    return None


def frame_json(frame: Frame) -> dict[str, Any]:
    """``kvctl top --once --json``: the pool totals (as ``kvctl status --json``), hit
    ratios, nodes (as ``kvctl nodes --json``), tier sums and, per metrics endpoint, totals
    and per-second rates (None where there is no interval)."""
    now = frame.now
    return {
        "pool": status_json(now.stats),
        "interval_s": frame.interval_s,
        "hit_ratio": frame.hit_ratio(),
        "recent_hit_ratio": frame.recent_hit_ratio(),
        "nodes": nodes_json(now.nodes)["nodes"],
        "tiers": [
            {
                "name": t.name,
                "nodes": t.nodes,
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
            }
            for t in tier_totals(now.nodes)
        ],
        "metrics": [_sample_json(frame, m) for m in now.metrics],
    }


def _sample_json(frame: Frame, m: MetricsSample) -> dict[str, Any]:
    return {
        "endpoint": m.endpoint,
        "error": m.error,
        "transfers": [
            {
                "op": op,
                "transport": transport,
                "bytes": m.transfer_bytes[op, transport],
                "bytes_per_s": frame.rate(m.endpoint, "transfer_bytes", (op, transport)),
                "exchanges": m.exchanges.get((op, transport), 0.0),
                "exchanges_per_s": frame.rate(m.endpoint, "exchanges", (op, transport)),
            }
            for op, transport in sorted(m.transfer_bytes)
        ],
        "evictions": [
            {"tier": tier, "total": total, "per_s": frame.rate(m.endpoint, "evictions", tier)}
            for tier, total in sorted(m.evictions.items())
        ],
        "stale_misses": m.stale_misses,
        "stale_misses_per_s": frame.rate(m.endpoint, "stale_misses", None),
    }


# -- drawing ----------------------------------------------------------------------------------


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _per_s(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "B":
        return f"{human_bytes(round(value))}/s"
    return f"{value:.1f}/s"


def render(frame: Frame, master: str) -> RenderableType:
    """The whole screen for ``frame``: a header, the nodes, the tiers and the metrics."""
    from rich.console import Group
    from rich.text import Text

    s = frame.now.stats
    interval = frame.interval_s
    clock = time.strftime("%H:%M:%S", time.localtime(frame.now.wall))
    header = Text(
        f"{clock} kvstore pool at {master}: {s.nodes} node{'' if s.nodes == 1 else 's'} "
        f"({s.live_nodes} live), "
        f"{human_bytes(s.used_bytes)} of {human_bytes(s.capacity_bytes)} used, "
        f"{s.blocks} blocks, {s.objects} objects | hit ratio {_ratio(frame.hit_ratio())} "
        f"(last {'-' if interval is None else f'{interval:.1f} s'}: "
        f"{_ratio(frame.recent_hit_ratio())})"
    )
    parts: list[RenderableType] = [header]
    if frame.error:
        parts.append(Text(f"master: {frame.error} (showing the last answer)", style="red"))
    parts += [_nodes_table(frame.now.nodes), _tiers_table(frame.now.nodes)]
    if frame.now.metrics:
        parts.append(_metrics_table(frame))
    else:
        parts.append(
            Text("transfers and evictions: give --metrics HOST:PORT or --node-metrics-port PORT")
        )
    return Group(*parts)


def _nodes_table(nodes: Sequence[NodeInfo]) -> Any:
    from rich.text import Text

    from kvctl.tables import new_table, node_state

    table = new_table("NODE", "STATE", "TRANSPORT", "LEASE AGE", "TIERS (used / capacity)")
    for n in nodes:
        style = "red" if not n.alive else "yellow" if n.suspect or n.draining else ""
        tiers = ", ".join(
            f"{t.name} {human_bytes(t.used_bytes)} / {human_bytes(t.capacity_bytes)}"
            for t in n.tiers
        )
        table.add_row(
            n.node_id,
            Text(node_state(n), style=style),
            n.transport,
            f"{n.lease_age_s:.1f} s",
            tiers,
        )
    if not nodes:
        table.add_row("(no nodes registered)", "", "", "", "")
    return table


def _tiers_table(nodes: Sequence[NodeInfo]) -> Any:
    from kvctl.tables import new_table, percent

    table = new_table("TIER", "NODES", "CAPACITY", "USED", "USED %")
    for t in tier_totals(nodes):
        table.add_row(
            t.name,
            str(t.nodes),
            human_bytes(t.capacity_bytes),
            human_bytes(t.used_bytes),
            percent(t.used_bytes, t.capacity_bytes),
        )
    return table


def _moved_cell(frame: Frame, m: MetricsSample, op: str) -> str:
    """One line per transport: bytes per second of ``op`` and the total moved."""
    lines = [
        f"{t} {_per_s(frame.rate(m.endpoint, 'transfer_bytes', (o, t)), 'B')} "
        f"({human_bytes(round(m.transfer_bytes[o, t]))})"
        for o, t in sorted(k for k in m.transfer_bytes if k[0] == op)
    ]
    return "\n".join(lines) or "-"


def _metrics_table(frame: Frame) -> Any:
    from rich.text import Text

    from kvctl.tables import new_table

    table = new_table("METRICS", "PUT", "GET", "EXCHANGES", "EVICTIONS", "STALE MISSES")
    for m in frame.now.metrics:
        if m.error:
            table.add_row(m.endpoint, Text(f"unreadable: {m.error}", style="red"), "", "", "", "")
            continue

        exchanges = "\n".join(
            f"{o} {t} {_per_s(frame.rate(m.endpoint, 'exchanges', (o, t)))}"
            for o, t in sorted(m.exchanges)
        )
        evictions = "\n".join(
            f"{tier} {_per_s(frame.rate(m.endpoint, 'evictions', tier))} ({total:.0f})"
            for tier, total in sorted(m.evictions.items())
        )
        stale = f"{_per_s(frame.rate(m.endpoint, 'stale_misses', None))} ({m.stale_misses:.0f})"
        table.add_row(
            m.endpoint,
            _moved_cell(frame, m, "put"),
            _moved_cell(frame, m, "get"),
            exchanges or "-",
            evictions or "0",
            stale,
        )
    return table


# -- the command -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TopOptions:
    """``kvctl top``'s flags."""

    master: str
    timeout_s: float
    interval_s: float
    once: bool
    json: bool
    metrics: tuple[str, ...]
    node_metrics_port: int | None
    token: str = ""
    tls: TlsFiles | None = None


def run(opts: TopOptions, out: TextIO) -> None:
    """Draw until interrupted (``--once``: print one frame and return). Raises
    KVStoreError when the first snapshot fails; KeyboardInterrupt ends the live view."""
    asyncio.run(_run(opts, out))


async def _run(opts: TopOptions, out: TextIO) -> None:
    from kvstore.control.client import MasterClient

    async with MasterClient(
        opts.master, timeout_s=opts.timeout_s, token=opts.token, tls=opts.tls
    ) as client:

        async def snap() -> Snapshot:
            return await take_snapshot(client, opts.metrics, opts.node_metrics_port, opts.timeout_s)

        before = await snap()
        if opts.once:
            await asyncio.sleep(opts.interval_s)
            frame = Frame(await snap(), before)
            if opts.json:
                import json

                json.dump(frame_json(frame), out, indent=2)
                out.write("\n")
            else:
                _console(out).print(render(frame, opts.master))
            return
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:  # Ctrl-C ends the loop between snapshots, not inside a gRPC call
            loop.add_signal_handler(signal.SIGINT, stop.set)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread: KeyboardInterrupt cancels, as asyncio.run does
        try:
            await _live(opts, out, snap, before, stop)
        finally:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.remove_signal_handler(signal.SIGINT)


async def _live(
    opts: TopOptions, out: TextIO, snap: Any, first: Snapshot, stop: asyncio.Event
) -> None:
    from rich.live import Live

    frame = Frame(first)
    console = _console(out)
    with Live(render(frame, opts.master), console=console, auto_refresh=False) as live:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), opts.interval_s)
            if stop.is_set():
                return
            try:
                frame = Frame(await snap(), frame.now)
            except KVStoreError as exc:
                frame = Frame(frame.now, frame.before, error=str(exc))
            live.update(render(frame, opts.master), refresh=True)


def _console(out: TextIO) -> Console:
    from kvctl.tables import console_for

    return console_for(out)

"""What each ``kvctl`` subcommand asks the master, and the JSON document it prints.

Fetchers are coroutines that take a :class:`~kvstore.control.client.MasterClient`; each
waits at most the client's deadline per RPC and raises only ``kvstore.errors`` types (the
client translates gRPC statuses). Documents are plain dicts, exactly what ``--json``
prints. Nothing heavy is imported at module level: grpc comes with the client, numpy with
:func:`plan_lookup` (the only user of ``kvstore.core.hashing``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from kvctl.explain import PrefixReport, explain_prefix
from kvstore.errors import InvalidArgument, KVStoreError, KVTimeout

if TYPE_CHECKING:
    from kvstore.control.client import MasterClient
    from kvstore.control.records import MasterStats, NodeInfo
    from kvstore.core.hashing import Namespace

__all__ = [
    "DrainResult",
    "EvictResult",
    "LookupPlan",
    "NodeEviction",
    "StatsReport",
    "TierTotal",
    "WaitTimeout",
    "drain",
    "drain_json",
    "evict",
    "evict_json",
    "fetch_lookup",
    "fetch_nodes",
    "fetch_stats",
    "fetch_status",
    "nodes_json",
    "parse_tokens",
    "plan_lookup",
    "read_tokens",
    "stats_json",
    "status_json",
    "tier_totals",
]

MAX_TOKEN = 2**32 - 1


# -- status ---------------------------------------------------------------------------------


async def fetch_status(client: MasterClient) -> MasterStats:
    """The master's pool totals (one ``Stats`` call)."""
    return await client.stats()


def status_json(stats: MasterStats) -> dict[str, int]:
    """``kvctl status --json``: exactly the eight pool totals of docs/architecture.md."""
    return {
        "nodes": stats.nodes,
        "live_nodes": stats.live_nodes,
        "capacity_bytes": stats.capacity_bytes,
        "used_bytes": stats.used_bytes,
        "blocks": stats.blocks,
        "objects": stats.objects,
        "hits": stats.hits,
        "misses": stats.misses,
    }


# -- nodes ----------------------------------------------------------------------------------


async def fetch_nodes(client: MasterClient) -> list[NodeInfo]:
    """Every node the master knows, sorted by id (one ``Nodes`` call)."""
    return await client.nodes()


def nodes_json(nodes: Sequence[NodeInfo]) -> dict[str, Any]:
    """``kvctl nodes --json``: exactly the fields of docs/architecture.md, per node."""
    return {
        "nodes": [
            {
                "id": n.node_id,
                "alive": n.alive,
                "lease_age_s": float(n.lease_age_s),
                "epoch": n.epoch,
                "data": n.data_uri,
                "tiers": [
                    {"name": t.name, "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes}
                    for t in n.tiers
                ],
            }
            for n in nodes
        ]
    }


# -- stats ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierTotal:
    """One tier name ("gpu", "host", ...) summed over the live nodes that have it."""

    name: str
    nodes: int
    capacity_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class StatsReport:
    """The master's totals and counters plus the live nodes' tier usage summed per tier."""

    stats: MasterStats
    tiers: tuple[TierTotal, ...]

    @property
    def hit_ratio(self) -> float | None:
        """hits / (hits + misses); None before the first lookup."""
        total = self.stats.hits + self.stats.misses
        return self.stats.hits / total if total else None


def tier_totals(nodes: Sequence[NodeInfo]) -> tuple[TierTotal, ...]:
    """Capacity and usage per tier name over the live nodes (as ``Stats`` sums them),
    sorted by name."""
    sums: dict[str, list[int]] = {}
    for node in nodes:
        if not node.alive:
            continue
        for tier in node.tiers:
            acc = sums.setdefault(tier.name, [0, 0, 0])
            acc[0] += 1
            acc[1] += tier.capacity_bytes
            acc[2] += tier.used_bytes
    return tuple(TierTotal(name, *sums[name]) for name in sorted(sums))


async def fetch_stats(client: MasterClient) -> StatsReport:
    """``Stats`` plus ``Nodes`` (for the per-tier sums)."""
    stats = await client.stats()
    nodes = await client.nodes()
    return StatsReport(stats, tier_totals(nodes))


def stats_json(report: StatsReport) -> dict[str, Any]:
    """``kvctl stats --json``: the status totals, the hit ratio, the per-tier sums and
    the per-tenant usage (every tenant for an admin token, a client's own)."""
    return {
        **status_json(report.stats),
        "hit_ratio": report.hit_ratio,
        "tiers": [
            {
                "name": t.name,
                "nodes": t.nodes,
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
            }
            for t in report.tiers
        ],
        "tenants": [
            {
                "tenant": t.tenant,
                "used_bytes": t.used_bytes,
                "quota_bytes": t.quota_bytes,
                "evictions": t.evictions,
            }
            for t in report.stats.tenants
        ],
    }


# -- drain ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainResult:
    """A node's draining mark after ``kvctl drain``; with ``--wait``, the node's drain
    counters once it copied everything away (``drain_moved_chunks``, ``drain_moved_bytes``,
    ``drain_passes`` ...: see :mod:`kvstore.node.migrate`) and how long that took."""

    node_id: str
    draining: bool
    progress: dict[str, Any] | None = None
    waited_s: float = 0.0


DRAIN_POLL_S = 0.25


class WaitTimeout(KVTimeout):
    """``kvctl drain --wait`` gave up: the master answered, the node was not done."""


async def drain(
    client: MasterClient,
    node_id: str,
    *,
    undrain: bool,
    wait_s: float = 0.0,
    timeout_s: float = 5.0,
) -> DrainResult:
    """Set (or clear) ``node_id``'s draining mark; raises Miss for an unknown node. With
    ``wait_s`` > 0, then wait until the node has copied every block it holds to other
    nodes (its data port's ``stats``, every :data:`DRAIN_POLL_S`): raises
    :class:`WaitTimeout` naming what is left after ``wait_s`` (or that the node's data
    port does not answer: a node that died is alive at the master until its lease ends),
    Miss when the node leaves first, ChunkError when the drain finished with chunks it
    could not copy."""
    import asyncio
    import time

    from kvstore.control.tls import data_context
    from kvstore.dataplane import NodeClient
    from kvstore.dataplane.client import Dial
    from kvstore.errors import ChunkError, KVTimeout, Miss, TransportError

    tickets = Dial(client.tickets(), data_context(client.tls))  # (one ticket for every dial)
    draining = await client.drain(node_id, undrain=undrain)
    if undrain or wait_s <= 0:
        return DrainResult(node_id, draining)
    t0 = time.monotonic()
    first_pass: int | None = None  # a "done" counts from a pass that started after this
    while True:
        infos = {n.node_id: n for n in await client.nodes()}
        info = infos.get(node_id)
        if info is None or not info.alive:
            raise Miss(f"node {node_id} left before its drain finished")
        try:
            stats = await NodeClient(info.data_uri, tickets, timeout_s=timeout_s).stats()
        except (TransportError, KVTimeout) as exc:  # dead or restarting: the master says
            if time.monotonic() - t0 > wait_s:  # which once its lease ends
                raise WaitTimeout(
                    f"drain of node {node_id} not done within {wait_s:g} s: its data port "
                    f"{info.data_uri} does not answer ({exc})"
                ) from exc
            await asyncio.sleep(DRAIN_POLL_S)
            continue
        waited = time.monotonic() - t0
        passes = stats.get("drain_passes")
        if stats.get("draining") and first_pass is None:
            first_pass = passes
        elif stats.get("draining") and stats.get("drain_state") == "done" and passes != first_pass:
            if stats.get("drain_failed"):
                raise ChunkError(
                    f"drain of node {node_id} finished, but {stats['drain_failed']} chunks "
                    "could not be copied (see the node's log); they leave with the node"
                )
            return DrainResult(node_id, True, stats, waited)
        if waited > wait_s:
            reason = stats.get("drain_reason") or ""
            raise WaitTimeout(
                f"drain of node {node_id} not done within {wait_s:g} s: state "
                f"{stats.get('drain_state')}, {stats.get('drain_left', '?')} chunks left"
                + (f" ({reason})" if reason else "")
            )
        await asyncio.sleep(DRAIN_POLL_S)


_DRAIN_KEYS = ("drain_passes", "drain_moved_chunks", "drain_moved_bytes", "drain_failed",
               "drain_dropped")  # fmt: skip


def drain_json(result: DrainResult) -> dict[str, Any]:
    """``kvctl drain --json``: ``{"node": id, "draining": bool}``; with ``--wait`` also
    ``"waited_s"`` and the node's ``drain_*`` counters (passes, moved chunks and bytes,
    failed, dropped)."""
    out: dict[str, Any] = {"node": result.node_id, "draining": result.draining}
    if result.progress is not None:
        out["waited_s"] = round(result.waited_s, 3)
        out.update({k: result.progress.get(k, 0) for k in _DRAIN_KEYS})
    return out


# -- evict ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeEviction:
    """What one node evicted (``kept``: present but pinned or quarantined)."""

    node_id: str
    evicted: int
    kept: int
    error: str = ""


@dataclass(frozen=True)
class EvictResult:
    """``kvctl evict``: the namespace and what every live node did."""

    ns_id: bytes
    blocks: int | None
    nodes: tuple[NodeEviction, ...]


async def evict(
    client: MasterClient,
    ns_id: bytes,
    blocks: Sequence[bytes] | None,
    timeout_s: float,
    tenant: str = "",
) -> EvictResult:
    """Ask every live node to evict ``blocks`` of ``ns_id`` (all of it when None), of
    ``tenant``'s namespace (an admin names it; a client's is its own).

    Nodes are the only writers of their index entries, so the request goes to each node's
    data port; the node commits its evictions to the master before it answers. A node that
    cannot be reached is reported, not fatal.
    """
    from kvstore.control.tls import data_context
    from kvstore.dataplane import NodeClient
    from kvstore.dataplane.client import Dial

    tickets = Dial(client.tickets(), data_context(client.tls))
    done = []
    for node in await client.nodes():
        if not node.alive:
            continue
        try:
            answer = await NodeClient(node.data_uri, tickets, timeout_s=timeout_s).evict(
                ns_id, blocks, tenant=tenant
            )
            done.append(NodeEviction(node.node_id, answer.evicted, answer.kept))
        except KVStoreError as exc:
            done.append(NodeEviction(node.node_id, 0, 0, str(exc)))
    return EvictResult(ns_id, None if blocks is None else len(blocks), tuple(done))


def evict_json(result: EvictResult) -> dict[str, Any]:
    """``kvctl evict --json``."""
    return {
        "namespace": result.ns_id.hex(),
        "blocks": result.blocks,
        "evicted": sum(n.evicted for n in result.nodes),
        "nodes": [
            {"id": n.node_id, "evicted": n.evicted, "kept": n.kept, "error": n.error}
            for n in result.nodes
        ],
    }


# -- lookup ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LookupPlan:
    """A prompt ready to look up: its namespace, length and full-block hashes."""

    ns: Namespace
    num_tokens: int
    block_hashes: tuple[bytes, ...]

    @property
    def chunks_per_block(self) -> int:
        """``num_layers * tp_size``: the chunks a complete block has."""
        return self.ns.num_layers * self.ns.tp_size


def parse_tokens(text: str) -> list[int]:
    """Token ids from a JSON list or from ints separated by whitespace and/or commas.

    Raises InvalidArgument for anything else, an empty list, or ids outside [0, 2**32).
    """
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            raw = json.loads(stripped)
        except ValueError as exc:
            raise InvalidArgument(f"tokens are not a valid JSON list: {exc}") from exc
        if not isinstance(raw, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in raw
        ):
            raise InvalidArgument("tokens must be a JSON list of integers")
        tokens: list[int] = raw
    else:
        words = stripped.replace(",", " ").split()
        try:
            tokens = [int(w) for w in words]
        except ValueError as exc:
            raise InvalidArgument(f"tokens must be integers: {exc}") from exc
    if not tokens:
        raise InvalidArgument("no tokens given")
    if min(tokens) < 0 or max(tokens) > MAX_TOKEN:
        raise InvalidArgument("token ids must lie in [0, 2**32)")
    return tokens


def read_tokens(path: str, stdin: TextIO) -> list[int]:
    """Token ids from the file at ``path`` (``-``: ``stdin``), see :func:`parse_tokens`.
    Blocks on the read; raises InvalidArgument if the file cannot be read."""
    if path == "-":
        return parse_tokens(stdin.read())
    try:
        with open(path, encoding="utf-8") as f:
            return parse_tokens(f.read())
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read tokens file {path!r}: {exc}") from exc


def plan_lookup(ns: Namespace, tokens: Sequence[int]) -> LookupPlan:
    """Hash ``tokens`` under ``ns``; raises InvalidArgument if the prompt or the namespace
    exceed what one master request may carry."""
    from kvstore.control.wire import MAX_BLOCKS, MAX_CHUNKS
    from kvstore.core.hashing import block_hashes

    plan = LookupPlan(ns, len(tokens), tuple(block_hashes(ns, tokens)))
    if len(plan.block_hashes) > MAX_BLOCKS:
        raise InvalidArgument(
            f"the prompt has {len(plan.block_hashes)} full blocks; one lookup takes at most "
            f"{MAX_BLOCKS}"
        )
    if plan.chunks_per_block >= MAX_CHUNKS:
        raise InvalidArgument(
            f"layers x tp-size = {plan.chunks_per_block}; the master supports fewer than "
            f"{MAX_CHUNKS} chunks per block"
        )
    return plan


async def fetch_lookup(client: MasterClient, plan: LookupPlan) -> PrefixReport:
    """``Lookup`` (holders per block), ``MatchPrefix`` (the master's count) and ``Nodes``
    (holder liveness), explained. MatchPrefix counts toward the master's hits/misses; it
    is sent without ``block_tokens`` so the hit-token counter is left alone."""
    ns, hashes, cpb = plan.ns, list(plan.block_hashes), plan.chunks_per_block
    located = await client.lookup(ns.id, hashes, cpb)
    match = await client.match_prefix(ns.id, hashes, cpb)
    nodes = await client.nodes()
    return explain_prefix(ns, plan.num_tokens, hashes, located, nodes, match.blocks)

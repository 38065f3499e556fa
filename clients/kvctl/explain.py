"""Why a prompt's prefix does or does not match: the explanation behind ``kvctl lookup``.

Pure: :func:`explain_prefix` takes what the master answered (``Lookup`` holders per block,
``Nodes``, the ``MatchPrefix`` count) and returns a :class:`PrefixReport`. No I/O, and
nothing here imports grpc, numpy or torch.

Each holder the index lists for a block is checked against ``Nodes()``::

    alive, suspect   readable (a suspect node is still read from)
    dead             its lease expired; the index keeps its entries until the sweeper runs
    stale_epoch      the node is at another epoch now (it re-registered)
    unknown          Nodes() does not know the node

A block (chunk index ``layer * tp_size + shard``, see the proto) is::

    ok               every chunk is present on readable holders
    no_holder        the index lists no holder at all
    holder_dead      every chunk is indexed, but some only on holders that are not readable
    missing_layers   some chunks are indexed on no holder (never written, aborted, evicted)

The match stops at the first block that is not ``ok``; a prompt whose full blocks all match
stops at its partial tail (``partial_tail``: a partial block is never cached), if any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.dataplane.location import tier_of
from kvstore.errors import ProtocolError

if TYPE_CHECKING:
    from kvstore.control.records import Holder, NodeInfo
    from kvstore.core.hashing import Namespace

__all__ = [
    "BlockReport",
    "HolderState",
    "PrefixReport",
    "ShardLayers",
    "Stop",
    "explain_prefix",
    "format_ranges",
    "report_json",
]

READABLE_STATES = frozenset({"alive", "suspect"})
"""Holder states whose chunks a client can read."""


@dataclass(frozen=True)
class HolderState:
    """One holder of a block as the index lists it, with its node's state from ``Nodes()``."""

    node_id: str
    epoch: int
    data_uri: str
    state: str
    chunks: int
    """Chunks of this block the holder has (of ``num_layers * tp_size``)."""
    tier: str = ""
    """Where the holder keeps its copy: ``host``, ``gpu``, ``disk`` (only there),
    ``host+disk`` (in host memory and written to disk: kept across a restart); empty when
    the node did not say."""

    @property
    def readable(self) -> bool:
        """True if a client can read this holder's chunks (alive or suspect)."""
        return self.state in READABLE_STATES


@dataclass(frozen=True)
class ShardLayers:
    """Layers of one TP shard of a block present on readable holders."""

    shard: int
    present: int
    total: int
    missing: tuple[tuple[int, int], ...]
    """Missing layers as inclusive ``(first, last)`` ranges, ascending."""


@dataclass(frozen=True)
class BlockReport:
    """One full block of the prompt: its hash, holders, readable layers and status."""

    index: int
    block_hash: bytes
    status: str
    holders: tuple[HolderState, ...]
    shards: tuple[ShardLayers, ...]


@dataclass(frozen=True)
class Stop:
    """Where the prefix match stops (``block`` is an index; ``full_blocks`` for the tail)."""

    block: int
    reason: str
    detail: str


@dataclass(frozen=True)
class PrefixReport:
    """The whole explanation for one prompt under one namespace."""

    ns: Namespace
    num_tokens: int
    blocks: tuple[BlockReport, ...]
    matched_blocks: int
    """Leading ``ok`` blocks: what a client can read now."""
    master_matched_blocks: int
    """What ``MatchPrefix`` answered (counts holders the sweeper has not dropped yet)."""
    stop: Stop | None
    notes: tuple[str, ...]

    @property
    def full_blocks(self) -> int:
        """Full blocks of the prompt (the partial tail is never cached)."""
        return len(self.blocks)

    @property
    def tail_tokens(self) -> int:
        """Tokens after the last full block."""
        return self.num_tokens - self.full_blocks * self.ns.block_tokens

    @property
    def matched_tokens(self) -> int:
        """``matched_blocks`` in tokens."""
        return self.matched_blocks * self.ns.block_tokens


def explain_prefix(
    ns: Namespace,
    num_tokens: int,
    block_hashes: Sequence[bytes],
    located: Sequence[Sequence[Holder]],
    nodes: Sequence[NodeInfo],
    master_matched_blocks: int,
) -> PrefixReport:
    """Explain the prefix match of a ``num_tokens``-token prompt whose full blocks hash to
    ``block_hashes``, from ``located`` (Lookup's holders per block, masks cut to
    ``num_layers * tp_size`` chunks), ``nodes`` (Nodes()) and MatchPrefix's count.

    Never blocks. Raises ProtocolError if ``located`` does not have one entry per block.
    """
    if len(located) != len(block_hashes):
        raise ProtocolError(
            f"master answered Lookup with {len(located)} blocks for {len(block_hashes)} hashes"
        )
    by_id = {info.node_id: info for info in nodes}
    blocks = tuple(
        _block_report(ns, i, h, holders, by_id)
        for i, (h, holders) in enumerate(zip(block_hashes, located, strict=True))
    )
    matched = _leading(blocks, lambda b: b.status == "ok")
    tail = num_tokens - len(blocks) * ns.block_tokens
    return PrefixReport(
        ns=ns,
        num_tokens=num_tokens,
        blocks=blocks,
        matched_blocks=matched,
        master_matched_blocks=master_matched_blocks,
        stop=_stop(blocks, matched, tail, ns.block_tokens),
        notes=_notes(blocks, matched, master_matched_blocks),
    )


def _block_report(
    ns: Namespace,
    index: int,
    block_hash: bytes,
    holders: Sequence[Holder],
    by_id: dict[str, NodeInfo],
) -> BlockReport:
    cpb = ns.num_layers * ns.tp_size
    full = (1 << cpb) - 1
    states = tuple(_holder_state(h, by_id, full) for h in holders)
    readable = indexed = 0
    for holder, state in zip(holders, states, strict=True):
        indexed |= holder.mask
        if state.readable:
            readable |= holder.mask
    if not holders:
        status = "no_holder"
    elif readable & full == full:
        status = "ok"
    elif indexed & full == full:
        status = "holder_dead"
    else:
        status = "missing_layers"
    shards = _shard_layers(readable & full, ns.num_layers, ns.tp_size)
    return BlockReport(index, block_hash, status, states, shards)


def _holder_state(holder: Holder, by_id: dict[str, NodeInfo], full: int) -> HolderState:
    info = by_id.get(holder.node_id)
    if info is None:
        state = "unknown"
    elif info.epoch != holder.epoch:
        state = "stale_epoch"
    elif not info.alive:
        state = "dead"
    else:
        state = "suspect" if info.suspect else "alive"
    chunks = (holder.mask & full).bit_count()
    tier = tier_of(holder.location)
    return HolderState(holder.node_id, holder.epoch, holder.data_uri, state, chunks, tier)


def _bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``, ascending (cost: one step per set bit)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _shard_layers(mask: int, num_layers: int, tp_size: int) -> tuple[ShardLayers, ...]:
    """Per shard, the layers whose chunk is in ``mask`` (work ~ the missing chunks)."""
    full = (1 << (num_layers * tp_size)) - 1
    missing: list[list[int]] = [[] for _ in range(tp_size)]
    for chunk in _bits(~mask & full):
        missing[chunk % tp_size].append(chunk // tp_size)
    return tuple(
        ShardLayers(s, num_layers - len(layers), num_layers, tuple(_ranges(layers)))
        for s, layers in enumerate(missing)
    )


def _ranges(sorted_ints: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Runs of consecutive ints as inclusive ``(first, last)`` pairs."""
    start = prev = -2
    for n in sorted_ints:
        if n != prev + 1:
            if start >= 0:
                yield start, prev
            start = n
        prev = n
    if start >= 0:
        yield start, prev


def format_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    """``((2, 2), (5, 7))`` as ``"2, 5-7"``."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _layers_phrase(ranges: Sequence[tuple[int, int]]) -> str:
    one = len(ranges) == 1 and ranges[0][0] == ranges[0][1]
    return f"{'layer' if one else 'layers'} {format_ranges(ranges)}"


def _leading(blocks: Sequence[BlockReport], complete: Callable[[BlockReport], bool]) -> int:
    n = 0
    for block in blocks:
        if not complete(block):
            break
        n += 1
    return n


def _stop(blocks: Sequence[BlockReport], matched: int, tail: int, block_tokens: int) -> Stop | None:
    if matched < len(blocks):
        block = blocks[matched]
        return Stop(matched, block.status, _detail(block))
    if tail > 0:
        return Stop(
            matched,
            "partial_tail",
            f"the last {tail} tokens do not fill a block of {block_tokens}; "
            "a partial block is never cached",
        )
    return None


def _detail(block: BlockReport) -> str:
    if block.status == "no_holder":
        return "no node holds this block (never written, evicted, or its holder was dropped)"
    unreadable = [f"{h.node_id}@{h.epoch} ({h.state})" for h in block.holders if not h.readable]
    missing = "; ".join(
        f"shard {s.shard}: {_layers_phrase(s.missing)} missing"
        if len(block.shards) > 1
        else f"{_layers_phrase(s.missing)} missing"
        for s in block.shards
        if s.missing
    )
    if block.status == "holder_dead":
        return f"{missing}; indexed only on unreadable holders: {', '.join(unreadable)}"
    if unreadable:
        return f"{missing} (also unreadable holders: {', '.join(unreadable)})"
    return missing


def _notes(blocks: Sequence[BlockReport], matched: int, master: int) -> tuple[str, ...]:
    indexed = _leading(blocks, lambda b: b.status in ("ok", "holder_dead"))
    if master == matched:
        return ()
    if master == indexed:
        return (
            f"MatchPrefix counts {master} blocks: the master still counts holders whose "
            "lease expired until its sweeper drops them; reads from them fail",
        )
    return (
        f"MatchPrefix counted {master} blocks but Lookup shows {indexed} indexed: the index "
        "changed between the calls; run again",
    )


def report_json(report: PrefixReport) -> dict[str, Any]:
    """The report as a JSON-ready dict (``kvctl lookup --json``)."""
    ns = report.ns
    stop = report.stop
    return {
        "namespace": {
            "id": ns.id_hex,
            "model": ns.model,
            "revision": ns.revision,
            "adapter": ns.adapter,
            "cache_salt": ns.cache_salt,
            "num_layers": ns.num_layers,
            "num_kv_heads": ns.num_kv_heads,
            "head_dim": ns.head_dim,
            "dtype": ns.dtype,
            "block_tokens": ns.block_tokens,
            "quant": ns.quant,
            "tp_size": ns.tp_size,
        },
        "tokens": report.num_tokens,
        "full_blocks": report.full_blocks,
        "tail_tokens": report.tail_tokens,
        "matched_blocks": report.matched_blocks,
        "matched_tokens": report.matched_tokens,
        "master_matched_blocks": report.master_matched_blocks,
        "stop": None
        if stop is None
        else {"block": stop.block, "reason": stop.reason, "detail": stop.detail},
        "notes": list(report.notes),
        "blocks": [_block_json(b) for b in report.blocks],
    }


def _block_json(block: BlockReport) -> dict[str, Any]:
    return {
        "index": block.index,
        "hash": block.block_hash.hex(),
        "status": block.status,
        "holders": [
            {
                "node": h.node_id,
                "epoch": h.epoch,
                "state": h.state,
                "data": h.data_uri,
                "chunks": h.chunks,
            }
            for h in block.holders
        ],
        "shards": [
            {
                "shard": s.shard,
                "layers_present": s.present,
                "layers": s.total,
                "missing_layers": [list(r) for r in s.missing],
            }
            for s in block.shards
        ],
    }

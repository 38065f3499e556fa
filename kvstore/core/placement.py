"""Sticky block placement: weighted rendezvous (HRW) hashing over live nodes.

Every writer of a block (PP/TP ranks in other processes) must pick the same node without
talking to each other, so the choice depends only on the block hash and the node list.
Each node gets the score ``-weight / ln(u)`` with ``u`` in (0, 1) drawn from
``xxh3_64(node_id || block_hash)``; the highest score wins (Schindelhauer & Schomaker's
weighted rendezvous: node ``i`` wins with probability ``w_i / sum(w)``).

Weights follow free capacity, quantised to powers of two (``weight_for_free``) so that two
writers holding slightly different snapshots of the node list still agree. Where they do
disagree, nothing breaks: presence is the union over holders, and a second copy of a chunk
is harmless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvstore.errors import Unreachable

__all__ = ["Candidate", "rank_nodes", "unplaceable_reason", "weight_for_free"]

_U64 = float(2**64)


@dataclass(frozen=True)
class Candidate:
    """A node that may receive new blocks: its id and its placement weight (> 0)."""

    node_id: str
    weight: float


def weight_for_free(free_bytes: int) -> float:
    """Placement weight for a node with ``free_bytes`` free: the power of two below it."""
    return float(2 ** max(0, int(free_bytes).bit_length() - 1)) if free_bytes > 0 else 1.0


def _score(node_id: str, block_hash: bytes, weight: float) -> float:
    h = xxhash.xxh3_64_intdigest(node_id.encode() + block_hash)
    u = (h + 0.5) / _U64  # strictly inside (0, 1)
    return -weight / math.log(u)


def rank_nodes(block_hash: bytes, candidates: Sequence[Candidate], replicas: int = 1) -> list[str]:
    """The ``replicas`` best nodes for ``block_hash``, best first.

    Deterministic for a given candidate set. Raises :class:`Unreachable` when there is no
    candidate (no live node to place on).
    """
    if not candidates:
        raise Unreachable("no live storage node to place a block on")
    scored = sorted(
        candidates, key=lambda c: (_score(c.node_id, block_hash, c.weight), c.node_id), reverse=True
    )
    return [c.node_id for c in scored[: max(1, replicas)]]


def unplaceable_reason(infos: Sequence[Any]) -> str:
    """Why none of ``infos`` (the master's node list: ``alive``, ``draining``, ``suspect``
    of each) takes new blocks, in one line for the error a put raises."""
    alive = [n for n in infos if n.alive]
    if not alive:
        return f"no live storage node to place a block on ({len(infos)} known, none alive)"
    draining = sum(n.draining for n in alive)
    suspect = sum(n.suspect and not n.draining for n in alive)
    return (
        f"no storage node takes new blocks: of {len(alive)} live, {draining} draining "
        f"(kvctl drain --undrain NODE) and {suspect} suspect (silent, or a read of it failed)"
    )

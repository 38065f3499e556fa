"""KV-aware routing: which engine instance should take a prompt, weighing reuse against load.

The form is Dynamo's KV router (and Mooncake's Conductor): each instance gets a cost, the
lowest wins, ties go to the less loaded instance, then to the first one named::

    reused_i   = max(own_i, pool)          tokens it need not compute
    prefill_i  = prompt - reused_i         tokens it must compute
    loaded_i   = max(0, pool - own_i)      tokens it would read from the pool
    cost_i     = overlap_weight * prefill_i
               + transfer_weight * loaded_i
               + load_weight * active_i

``own_i`` is the prefix instance ``i`` holds in its own (GPU) cache, where it reports one;
``pool`` the prefix the pool holds (the same for every instance: any of them can load it);
``active_i`` the tokens instance ``i`` is working on (prefill queued plus decode batch).
Computing a token costs ``overlap_weight``; reading one from the pool ``transfer_weight``
(well below: a transfer is cheaper than the compute it saves, but not free); ``load_weight``
turns queued work into the delay it means for this prompt. Defaults: 1, 0.1, 1.
Pure functions, no I/O: the master's ``Route`` RPC and ``bench/pd.py`` call the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

__all__ = ["Instance", "RouteChoice", "RouteScore", "choose"]

MAX_INSTANCES = 4096
"""Instances one routing decision may weigh."""


@dataclass(frozen=True)
class Instance:
    """An engine instance a prompt may go to, as its router knows it."""

    id: str
    active_tokens: int = 0
    """Tokens it is working on now (queued prefill plus its decode batch)."""
    cached_tokens: int = 0
    """The prompt's prefix it holds in its own cache (0 where it does not report one)."""


@dataclass(frozen=True)
class RouteScore:
    """One instance's terms and cost."""

    id: str
    own_tokens: int
    pool_tokens: int
    prefill_tokens: int
    loaded_tokens: int
    active_tokens: int
    cost: float


@dataclass(frozen=True)
class RouteChoice:
    """The instance chosen and every instance's score, in the order given."""

    choice: str
    pool_tokens: int
    scores: tuple[RouteScore, ...]


def choose(
    prompt_tokens: int,
    pool_tokens: int,
    instances: Sequence[Instance],
    *,
    overlap_weight: float = 1.0,
    transfer_weight: float = 0.1,
    load_weight: float = 1.0,
) -> RouteChoice:
    """Score every instance (see the module docstring) and pick the cheapest.

    Raises :class:`InvalidArgument` for no instances, too many, repeated ids, negative
    counts or weights.
    """
    if not instances or len(instances) > MAX_INSTANCES:
        raise InvalidArgument(f"routing needs 1 to {MAX_INSTANCES} instances, got {len(instances)}")
    if len({i.id for i in instances}) != len(instances):
        raise InvalidArgument("instance ids must be distinct")
    for name, w in (
        ("overlap", overlap_weight),
        ("transfer", transfer_weight),
        ("load", load_weight),
    ):
        if not w >= 0:
            raise InvalidArgument(f"{name}_weight must be >= 0, got {w}")
    if prompt_tokens < 0 or pool_tokens < 0:
        raise InvalidArgument("token counts must be >= 0")
    pool = min(pool_tokens, prompt_tokens)
    scores = []
    for inst in instances:
        if inst.active_tokens < 0 or inst.cached_tokens < 0:
            raise InvalidArgument(f"instance {inst.id!r} has a negative count")
        own = min(inst.cached_tokens, prompt_tokens)
        prefill = prompt_tokens - max(own, pool)
        loaded = max(0, pool - own)
        cost = (
            overlap_weight * prefill + transfer_weight * loaded + load_weight * inst.active_tokens
        )
        scores.append(RouteScore(inst.id, own, pool, prefill, loaded, inst.active_tokens, cost))
    best = min(range(len(scores)), key=lambda k: (scores[k].cost, scores[k].active_tokens, k))
    return RouteChoice(scores[best].id, pool, tuple(scores))

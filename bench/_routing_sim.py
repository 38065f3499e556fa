"""Routing a real request trace over engine instances: KV-aware (``kvstore.core.routing``)
against round robin, with and without the pool, as a discrete-event simulation.

Each request of a Mooncake-format trace (``timestamp`` ms, ``input_length``, ``hash_ids``:
one id per 512-token block, shared ids = shared prefix) goes to one of ``instances``
prefill instances. Each instance keeps an LRU prefix cache of ``cache_blocks`` blocks of
its own (its GPU memory); with the pool, every prefill also lands in a shared LRU pool of
``pool_blocks`` blocks that any instance can load from. An instance serves its queue in
order; a request's prefill costs ``compute_s`` per token it computes plus ``load_s`` per
token it loads from the pool (both measured on the reference engine in the same run), and
its time to first token is its wait in the queue plus that. The router sees what a real one
would: each instance's cached prefix for the prompt, the pool's, and the tokens queued.
Arrivals are rescaled so that round robin without any reuse would keep the instances
``load`` busy. Pure computation, deterministic.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from bench._common import latency_stats
from kvstore.core.routing import Instance, choose

__all__ = ["Outcome", "load_requests", "simulate"]

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Request:
    at_s: float
    tokens: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Outcome:
    """One policy's results over the trace."""

    policy: str
    hit_rate: float  # prompt tokens reused (own cache or pool) / prompt tokens
    own_rate: float  # of those, from the instance's own cache
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float


def load_requests(path: Path, limit: int) -> list[Request]:
    out = []
    with path.open() as f:
        for line in f:
            if limit and len(out) >= limit:
                break
            if line.strip():
                r = json.loads(line)
                out.append(
                    Request(r["timestamp"] / 1e3, int(r["input_length"]), tuple(r["hash_ids"]))
                )
    return out


class _Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.held = capacity, OrderedDict[int, None]()

    def prefix(self, blocks: tuple[int, ...]) -> int:
        n = 0
        while n < len(blocks) and blocks[n] in self.held:
            n += 1
        return n

    def add(self, blocks: tuple[int, ...]) -> None:
        for b in blocks:
            self.held[b] = None
            self.held.move_to_end(b)
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)


def simulate(
    requests: list[Request],
    policy: str,
    *,
    instances: int,
    cache_blocks: int,
    pool_blocks: int,
    compute_s: float,
    load_s: float,
    load: float,
) -> Outcome:
    """Run the trace under ``policy`` (``"round robin"``, ``"kv-aware"``, each with or
    without ``" + pool"``). KV-aware routing weighs a loaded token at ``load_s /
    compute_s`` of a computed one (what the Route cost's ``transfer_weight`` is for)."""
    use_pool, aware = policy.endswith("+ pool"), policy.startswith("kv-aware")
    work = sum(r.tokens for r in requests) * compute_s
    span = max(requests[-1].at_s - requests[0].at_s, 1e-9)
    scale = work / (instances * load * span)  # stretch time so round robin is `load` busy
    caches = [_Lru(cache_blocks) for _ in range(instances)]
    pool = _Lru(pool_blocks)
    free_at = [0.0] * instances
    queued: list[list[tuple[float, int]]] = [[] for _ in range(instances)]  # (done, tokens)
    ttfts, reused, own_reused, total = [], 0, 0, 0
    for k, req in enumerate(requests):
        now = req.at_s * scale
        for q in queued:
            q[:] = [(d, t) for d, t in q if d > now]
        own = [min(req.tokens, c.prefix(req.blocks) * TRACE_BLOCK_TOKENS) for c in caches]
        in_pool = min(req.tokens, pool.prefix(req.blocks) * TRACE_BLOCK_TOKENS) if use_pool else 0
        if aware:
            insts = [
                Instance(str(i), sum(t for _, t in queued[i]), own[i]) for i in range(instances)
            ]
            weight = load_s / compute_s
            pick = int(choose(req.tokens, in_pool, insts, transfer_weight=weight).choice)
        else:
            pick = k % instances
        got = max(own[pick], in_pool)
        loaded = max(0, in_pool - own[pick])
        service = (req.tokens - got) * compute_s + loaded * load_s
        start = max(now, free_at[pick])
        free_at[pick] = start + service
        queued[pick].append((free_at[pick], req.tokens - got))
        ttfts.append(free_at[pick] - now)
        reused, own_reused, total = (
            reused + got,
            own_reused + min(got, own[pick]),
            total + req.tokens,
        )
        caches[pick].add(req.blocks)
        if use_pool:
            pool.add(req.blocks)
    stats = latency_stats(ttfts)
    return Outcome(
        policy,
        reused / total,
        own_reused / max(reused, 1),
        stats["mean"],
        stats["p50"],
        stats["p99"],
    )

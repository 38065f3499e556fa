"""KV-aware routing and the cluster event stream, for routers in front of engine instances.

:meth:`RoutingOps.route` asks the master which instance should take a prompt (the pool's
prefix hit weighed against each instance's own cache and load: :mod:`kvstore.core.routing`).
:meth:`RoutingOps.events` follows every store and removal in the pool, numbered and
resumable (``kvstore/master/events.py``); :class:`PoolIndex` folds that stream into the
index a router keeps (block -> holders), reconnecting where it left off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.control.records import ClusterEvent, ClusterEventKind
from kvstore.core.routing import Instance, RouteChoice
from kvstore.errors import InvalidArgument, KVStoreError

from . import args

if TYPE_CHECKING:
    from .client import ClientCore as _Base
else:
    _Base = object

__all__ = ["PoolIndex", "RoutingOps"]

logger = logging.getLogger("kvclient.routing")

_WEIGHTS = ("overlap_weight", "transfer_weight", "load_weight")


class RoutingOps(_Base):
    """Mixin of :class:`~kvclient.KVClient` with the routing calls."""

    async def route(
        self,
        token_ids: Sequence[int] | Any,
        instances: Sequence[Instance],
        *,
        timeout: float | None = None,
        **weights: float,
    ) -> RouteChoice:
        """Which of ``instances`` should take this prompt: the pool's prefix hit weighed
        against each instance's own cache (``Instance.cached_tokens``, where it reports
        one) and load (``active_tokens``), by the cost function of
        :mod:`kvstore.core.routing` (``weights``: ``overlap_weight``, ``transfer_weight``,
        ``load_weight``). One RPC. Raises :class:`InvalidArgument` for bad instances."""
        hashes = self.block_hashes(token_ids)
        if isinstance(instances, str | bytes) or not isinstance(instances, Sequence):
            raise InvalidArgument("instances must be a sequence of kvclient.Instance")
        for i, inst in enumerate(instances):
            if not isinstance(inst, Instance):
                raise InvalidArgument(f"instances[{i}] is not a kvclient.Instance")
            args.text(inst.id, f"instances[{i}].id")
            args.nonneg_int(inst.active_tokens, f"instances[{i}].active_tokens")
            args.nonneg_int(inst.cached_tokens, f"instances[{i}].cached_tokens")
        for name, weight in weights.items():
            if name not in _WEIGHTS:
                raise InvalidArgument(f"unknown weight {name!r}; route takes {_WEIGHTS}")
            args.number(weight, name)
        self._limit(timeout)
        call = self._master.route(
            self.ns.id, hashes, self._chunks_per_block, self.ns.block_tokens, len(token_ids),
            instances, **weights,
        )  # fmt: skip
        return await self._deadline(call, timeout, "route")  # type: ignore[no-any-return]

    async def events(
        self,
        after_seq: int = 0,
        log_id: str = "",
        *,
        all_namespaces: bool = False,
        snapshot: bool = False,
        timeout: float | None = None,
    ) -> AsyncGenerator[tuple[str, list[ClusterEvent]], None]:
        """The cluster event stream of this client's namespace (every namespace with
        ``all_namespaces``): ``(log_id, events)`` batches, in order; the first names the
        log; resuming after ``after_seq`` of ``log_id`` gives exactly the events missed,
        or CLEARED first when they are no longer kept. With ``snapshot`` a stream that
        starts afresh (a first connect too) sends, after CLEARED, a STORED event for each
        node's chunks of every block held, then SNAPSHOT_DONE, then the live events.
        ``timeout`` (default: the master's stream limit) bounds the whole stream."""
        after_seq = args.nonneg_int(after_seq, "after_seq")
        log_id = args.text(log_id, "log_id")
        ns = b"" if args.flag(all_namespaces, "all_namespaces") else self.ns.id
        limit = 3600.0 if timeout is None else args.seconds(timeout)
        snapshot = args.flag(snapshot, "snapshot")
        stream = self._master.events(ns, after_seq, log_id, snapshot=snapshot, timeout=limit)
        async for batch in stream:
            yield batch


_MASKS: dict[tuple[int, ...], int] = {}
"""Chunk lists seen → their mask (a snapshot's events mostly carry a few: whole blocks)."""


def _mask(chunks: tuple[int, ...]) -> int:
    mask = _MASKS.get(chunks)
    if mask is None:
        mask = 0
        for c in chunks:
            mask |= 1 << c
        if len(_MASKS) >= 4096:  # (bounded)
            _MASKS.clear()
        _MASKS[chunks] = mask
    return mask


class PoolIndex:
    """A router's own index of the pool, kept by the cluster event stream: per block, the
    nodes that hold chunks of it (and which). It asks for a snapshot, so it starts with
    what the pool holds and is rebuilt whenever its stream starts afresh (a resume that
    cannot continue, another master, a reader that fell behind).

    ``apply`` folds events in; ``follow`` runs the stream (reconnecting after an error,
    resuming after the last event seen, or afresh while a rebuild is not whole) until
    cancelled or ``timeout`` passes.
    """

    def __init__(self) -> None:
        self.blocks: dict[tuple[bytes, bytes], dict[str, tuple[int, int]]] = {}
        """(ns id, block hash) -> node id -> (epoch, chunk mask)."""
        self.log_id = ""
        self.last_seq = 0
        self.cleared = 0
        self.rebuilding = False
        """From a CLEARED until the index is whole again: SNAPSHOT_DONE, or the first event
        numbered past the CLEARED (a master that sends no snapshot). A stream that breaks
        meanwhile starts afresh."""

    def apply(self, log_id: str, events: Sequence[ClusterEvent]) -> None:
        """Fold one batch of the stream in."""
        self.log_id = log_id
        for ev in events:
            if self.rebuilding and ev.seq > self.last_seq:
                self.rebuilding = False  # (live events: the master sent no snapshot)
            self.last_seq = ev.seq
            key = (ev.ns_id, ev.block_hash)
            if ev.kind is ClusterEventKind.CLEARED:
                self.blocks.clear()
                self.cleared += 1
                self.rebuilding = True
            elif ev.kind is ClusterEventKind.SNAPSHOT_DONE:
                self.rebuilding = False
            elif ev.kind is ClusterEventKind.STORED:
                held = self.blocks.setdefault(key, {})
                epoch, mask = held.get(ev.node_id, (ev.epoch, 0))
                mask = mask if epoch == ev.epoch else 0
                held[ev.node_id] = (ev.epoch, mask | _mask(ev.chunks))
            elif ev.kind is ClusterEventKind.REMOVED:
                held = self.blocks.get(key, {})
                held.pop(ev.node_id, None)
                if not held:
                    self.blocks.pop(key, None)
            elif ev.kind is ClusterEventKind.NODE_DEAD:
                for k in list(self.blocks):
                    held = self.blocks[k]
                    if held.get(ev.node_id, (ev.epoch + 1, 0))[0] <= ev.epoch:
                        del held[ev.node_id]
                    if not held:
                        del self.blocks[k]

    def prefix_blocks(self, ns_id: bytes, hashes: Sequence[bytes], chunks_per_block: int) -> int:
        """Leading blocks of ``hashes`` whose every chunk some node holds, as far as the
        stream said."""
        full, n = (1 << chunks_per_block) - 1, 0
        for h in hashes:
            union = 0
            for _, mask in self.blocks.get((ns_id, h), {}).values():
                union |= mask
            if union & full != full:
                break
            n += 1
        return n

    async def follow(
        self,
        kv: Any,
        *,
        all_namespaces: bool = False,
        retry_s: float = 0.5,
        timeout: float | None = None,
    ) -> None:
        """Run ``kv.events`` into this index until cancelled (or ``timeout`` seconds),
        resuming after the last event seen whenever the stream breaks (afresh, with a
        snapshot, at first and while a rebuild is not whole)."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while end is None or loop.time() < end:
            try:
                left = None if end is None else max(0.1, end - loop.time())
                after, of = (0, "") if self.rebuilding else (self.last_seq, self.log_id)
                async for log_id, events in kv.events(
                    after, of, all_namespaces=all_namespaces, snapshot=True, timeout=left
                ):
                    self.apply(log_id, events)
            except KVStoreError as exc:
                logger.info("event stream broke (%s); resuming after %d", exc, self.last_seq)
            await asyncio.sleep(retry_s)

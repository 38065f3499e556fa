"""What a ``stream_layers`` knows from its watch: which node committed which chunks of each
block, and where their slots live.

The master's watch sends the snapshot as COMMIT events, then every later change. Folded
into a :class:`StreamState`, they say when a layer is complete and, per block, a holder of
its chunk with the slot's location, so each layer is read with no lookup (and, from a
``ucx://`` node, with no node exchange either: see :mod:`kvclient.reads`). Pure state: no
I/O, no clock but the deadline passed in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.errors import Miss
from kvstore.master.records import Holder

__all__ = ["StreamState", "next_batch"]

T = TypeVar("T")


@dataclass
class _Held:
    mask: int
    epoch: int
    location: bytes


class StreamState:
    """Per watched block, per node: chunks committed, epoch and slot location."""

    def __init__(self, n_blocks: int) -> None:
        self._held: list[dict[str, _Held]] = [{} for _ in range(n_blocks)]

    def apply(self, ev: Any, next_layer: int) -> None:
        """Fold one watch event in; raises :class:`Miss` naming ``next_layer`` on ABORT."""
        kind = ev.kind
        if kind == "SNAPSHOT_DONE" or not 0 <= ev.block_index < len(self._held):
            return
        block = self._held[ev.block_index]
        if kind == "COMMIT":
            bits = 0
            for c in ev.chunks:
                bits |= 1 << c
            old = block.get(ev.node_id)
            if old is not None and old.epoch == ev.epoch:
                old.mask |= bits
                old.location = ev.location or old.location
            else:
                block[ev.node_id] = _Held(bits, ev.epoch, ev.location)
        elif kind == "EVICT":
            block.pop(ev.node_id, None)
        elif kind == "ABORT":
            raise Miss(
                f"writer aborted block {ev.block_index} before layer {next_layer}: {ev.reason}",
                layer=next_layer,
                blocks=[ev.block_index],
            )

    def ready(self, chunk: int) -> bool:
        """Whether every block has chunk index ``chunk`` on some node."""
        bit = 1 << chunk
        return all(any(h.mask & bit for h in block.values()) for block in self._held)

    def located(self, chunk: int, uris: Mapping[str, str]) -> dict[int, list[Holder]] | None:
        """Block index → its holders of chunk index ``chunk`` (with their slot locations,
        by node id), for every block; None when some block has none among the nodes in
        ``uris`` (node id → data URI of the live nodes)."""
        bit = 1 << chunk
        out: dict[int, list[Holder]] = {}
        for i, block in enumerate(self._held):
            having = [
                Holder(node, uris[node], h.epoch, h.mask, h.location)
                for node, h in sorted(block.items())
                if h.mask & bit and node in uris
            ]
            if not having:
                return None
            out[i] = having
        return out


async def next_batch(events: AsyncIterator[T], deadline: float, layer: int) -> T:
    """The next batch of watch events before ``deadline`` (``time.monotonic()``); a
    :class:`Miss` naming ``layer`` when the deadline passes or the watch ends first."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        async with asyncio.timeout(left):
            return await anext(events)
    except StopAsyncIteration:
        raise Miss(f"watch ended before layer {layer}", layer=layer) from None
    except TimeoutError as exc:
        raise Miss(f"stream timed out waiting for layer {layer}", layer=layer) from exc

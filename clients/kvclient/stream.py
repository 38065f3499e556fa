"""``stream_layers``: a prompt's layers read as they land, into new tensors, the caller's
tensors or an engine's paged cache.

The master's watch sends the snapshot as COMMIT events, then every later change. Folded
into a :class:`StreamState` (pure state: no I/O, no clock but the deadline passed in), they
say when a layer is complete and, per block, a holder of its chunk with the slot's
location, so each layer is read with no lookup (and, from a ``ucx://`` node, with no node
exchange either: see :mod:`kvclient.reads`). :class:`StreamOps` is the mixin of
:class:`~kvclient.KVClient` that runs the stream; where each layer's blocks go is a
:class:`LayerSink` per layer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from kvstore.control.records import Holder
from kvstore.core.codec import KV, ChunkKey, kv_span
from kvstore.errors import BadShape, Miss

from . import args
from .handles import prefix_len

if TYPE_CHECKING:
    from .client import ClientCore as _Base
else:
    _Base = object

__all__ = ["LayerSink", "StreamOps", "StreamState", "next_batch"]

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


class LayerSink(NamedTuple):
    """Where one streamed layer's blocks go: ``put(i, chunk, key)`` verifies and decodes
    block ``i``'s chunk into place; ``value()``, once every block is in, is what the
    stream yields for the layer."""

    put: Callable[[int, torch.Tensor, ChunkKey], None]
    value: Callable[[], Any]
    device: torch.device = torch.device("cpu")
    """Where ``put`` decodes to."""


class StreamOps(_Base):
    """Mixin of :class:`~kvclient.KVClient` with the streaming reads."""

    async def stream_layers(
        self,
        token_ids: Sequence[int] | Any,
        timeout: float | None = None,
        *,
        shard: int = 0,
        device: Any = None,
        out: Sequence[KV] | None = None,
    ) -> AsyncGenerator[tuple[int, Any], None]:
        """Yield ``(layer, [2, n_full_tokens, H, D])`` in layer order as layers land.

        Waits for blocks that do not exist yet: subscribes to the master's watch first,
        then takes its snapshot, so no commit is lost. ``timeout`` bounds the whole
        stream. ``out``: one destination per layer (``[2, T_out, H, D]`` or a (K, V) pair
        of ``[T_out, H, D]``, one ``T_out`` for all), decoded into in place, with no
        further copy; the stream then covers the whole blocks ``out`` holds and yields
        views of it. Raises :class:`BadShape` for a wrong ``out``, before any I/O, and
        :class:`Miss` naming the layer on a writer's abort, on an eviction of a layer not
        yet read, or on the timeout.
        """
        hashes, sink_of = self._stream_sinks(token_ids, shard, device, out)
        try:
            async for layer, value in self._stream(hashes, timeout, shard, sink_of):
                yield layer, value
        except asyncio.CancelledError:
            self._closed_during("stream_layers")  # (close() ended what it waited on)
            raise

    def _stream_sinks(
        self, token_ids: Sequence[int] | Any, shard: int, device: Any, out: Sequence[KV] | None
    ) -> tuple[list[bytes], Callable[[int], LayerSink]]:
        """The block hashes a stream covers and the sink of each layer, ``out`` checked.
        Without ``out``, a layer's tensor is allocated when the layer is read, so a caller
        that drops each layer holds one at a time."""
        hashes = self.block_hashes(token_ids)
        self._chunk_index(0, shard)
        device = args.device(device)
        B, L = self.ns.block_tokens, self.ns.num_layers
        if out is None:
            shape = (2, len(hashes) * B, self.ns.num_kv_heads, self.ns.head_dim)

            def new(layer: int) -> LayerSink:
                t = torch.empty(shape, dtype=self._dtype, device=device)
                return self._tensor_sink(t, len(hashes))

            return hashes, new
        out = args.sequence(out, "out")
        if len(out) != L:
            raise BadShape(f"out must hold one destination per layer ({L}), got {len(out)}")
        sizes = {self._check_layer_tensor(o, None, f"out[{i}]") for i, o in enumerate(out)}
        if len(sizes) > 1:
            raise BadShape(f"out's layers hold different token counts: {sorted(sizes)}")
        hashes = hashes[: sizes.pop() // B]
        sinks = [self._tensor_sink(o, len(hashes)) for o in out]
        return hashes, sinks.__getitem__

    def _tensor_sink(self, target: KV, n_blocks: int) -> LayerSink:
        return LayerSink(
            self._into(target),
            lambda: kv_span(target, 0, n_blocks * self.ns.block_tokens),
            args.kv_device(target),
        )

    async def _stream(
        self,
        hashes: list[bytes],
        timeout: float | None,
        shard: int,
        sink_of: Callable[[int], LayerSink],
    ) -> AsyncGenerator[tuple[int, Any], None]:
        """Stream the layers of ``hashes`` (shard ``shard``) into ``sink_of(layer)``,
        yielding ``(layer, sink.value())`` as each layer is complete."""
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        L = self.ns.num_layers
        if not hashes:
            for layer in range(L):
                yield layer, sink_of(layer).value()
            return
        state = StreamState(len(hashes))
        next_layer = 0
        events = self._master.watch(self.ns.id, hashes, self._chunks_per_block, timeout=limit)
        try:
            while next_layer < L:
                for ev in await next_batch(events, deadline, next_layer):
                    state.apply(ev, next_layer)
                while next_layer < L and state.ready(next_layer * self.ns.tp_size + shard):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Miss(f"stream timed out before layer {next_layer}", layer=next_layer)
                    sink = sink_of(next_layer)
                    read = self._stream_layer(hashes, next_layer, shard, state, sink)
                    if not await self._deadline(read, left, "stream_layers"):
                        raise Miss(
                            f"layer {next_layer} was announced but is no longer complete",
                            layer=next_layer,
                        )
                    yield next_layer, sink.value()
                    next_layer += 1
        finally:
            await events.aclose()

    async def _stream_layer(
        self, hashes: list[bytes], layer: int, shard: int, state: StreamState, sink: LayerSink
    ) -> bool:
        """Read one announced layer into ``sink``, from the holders and slot locations the
        watch gave (no lookup); blocks that do not load that way (evicted, moved, node
        gone) are looked up afresh. Whether every block loaded."""
        chunk, n = self._chunk_index(layer, shard), len(hashes)
        located = state.located(chunk, self._uri_of)
        if located is None:  # a holder this client has not seen yet
            await self._live_nodes(refresh=True)
            located = state.located(chunk, self._uri_of)
        loaded: set[int] = set()
        if located is not None:
            located = {i: self._reads.ranked(hs) for i, hs in located.items()}
            loaded = await self._fetch(hashes, layer, shard, located, sink.put, sink.device)
            if len(loaded) == n:
                return True
        again = await self._locate(hashes, chunk, load_all=True)
        again = {i: hs for i, hs in again.items() if i not in loaded}
        loaded |= await self._fetch(hashes, layer, shard, again, sink.put, sink.device)
        return prefix_len(loaded, n) == n

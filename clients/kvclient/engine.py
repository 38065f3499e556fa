"""Engine-facing operations of :class:`~kvclient.KVClient`: start/wait pairs and paged KV.

These are the calls an inference engine's hooks make. They never block the caller on the
network: ``start_*`` validates, hashes, launches the quantization (on CUDA, on the caller's
current stream, recording an event the transport waits on) and returns a
:class:`~kvclient.handles.Handle`. They may be called from any thread; the work runs on the
client's event loop. Partial failures come back as data (:class:`~kvclient.handles.Result`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.core.codec import ChunkKey, encode_blocks
from kvstore.errors import BadShape

from .handles import Handle, Result, StreamHandle, prefix_len
from .paged import ChunkView, chunk_views, decode_into, encode_paged

if TYPE_CHECKING:
    from .client import KVClient

__all__ = ["EngineOps"]


class EngineOps:
    """Mixin of :class:`~kvclient.KVClient` with the engine-facing calls."""

    def _launch_encode(
        self: KVClient, t: torch.Tensor, hashes: list[bytes], layer: int, shard: int
    ) -> Callable[[], Awaitable[list[torch.Tensor]]]:
        """Start quantizing a contiguous ``[2, T, H, D]`` layer (see :meth:`_launch`)."""
        keys = [ChunkKey(h, layer, shard) for h in hashes]
        B, quant = self.ns.block_tokens, self.ns.quant
        return self._launch(t.is_cuda, lambda: encode_blocks(t, B, keys, quant))

    def _launch(
        self: KVClient, on_cuda: bool, encode: Callable[[], list[torch.Tensor]]
    ) -> Callable[[], Awaitable[list[torch.Tensor]]]:
        """Start ``encode``; the returned coroutine function yields the chunks.

        CUDA: the kernels are queued now, from the calling thread on its current stream,
        and an event is recorded after them; the coroutine waits on that event (off the
        loop), never on a device-wide sync. CPU: the coroutine runs ``encode`` on the
        client's codec thread.
        """
        if on_cuda:
            chunks = encode()
            event = torch.cuda.Event()
            event.record()

            async def after_event() -> list[torch.Tensor]:
                await self._run_codec(event.synchronize)
                return [c.cpu() for c in chunks]

            return after_event

        async def on_codec_thread() -> list[torch.Tensor]:
            return await self._run_codec(encode)

        return on_codec_thread

    def _paged_views(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str,
        *,
        writable: bool,
    ) -> tuple[list[bytes], list[ChunkView]]:
        """Hashes and per-chunk views of the engine's cache, validated before any I/O."""
        hashes = self.block_hashes(token_ids)
        ns = self.ns
        views = chunk_views(
            cache, block_ids, ns.block_tokens, len(hashes), layout, writable=writable,
            num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim, dtype=self._dtype,
        )  # fmt: skip
        return hashes, views

    def _put_paged(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        layer: int,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str,
        shard: int,
        timeout: float | None,
        what: str,
    ) -> tuple[list[bytes], Awaitable[set[int]]]:
        hashes, views = self._paged_views(token_ids, cache, block_ids, layout, writable=False)
        index = self._chunk_index(layer, shard)
        keys = [ChunkKey(h, layer, shard) for h in hashes]
        encoded = self._launch(cache.is_cuda, lambda: encode_paged(views, keys, self.ns.quant))

        async def put() -> set[int]:
            return await self._send_chunks(hashes, index, await encoded())

        return hashes, self._tracked_put(put(), hashes, timeout, what) if hashes else _none()

    async def put_layer_paged(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        layer: int,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str = "blocks_first",
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> int:
        """:meth:`~kvclient.KVClient.put_layer` reading straight from an engine's paged
        cache (``layout`` ``"blocks_first"`` ``[num_blocks, 2, bs, H, D]`` or ``"kv_first"``
        ``[2, num_blocks, bs, H, D]``; ``block_ids[i]`` holds the request's tokens
        ``i*bs .. (i+1)*bs - 1``; ``bs`` may differ from ``block_tokens``). Returns the
        tokens stored (leading blocks)."""
        hashes, run = self._put_paged(
            token_ids, layer, cache, block_ids, layout, shard, timeout, "put_layer_paged"
        )
        return prefix_len(await run, len(hashes)) * self.ns.block_tokens

    def start_put_layer_paged(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        layer: int,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str = "blocks_first",
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> Handle:
        """Non-blocking :meth:`put_layer_paged`: a handle whose ``wait()`` gives
        ``Result(tokens, missing)``. The cache blocks must not change until then."""
        hashes, run = self._put_paged(
            token_ids, layer, cache, block_ids, layout, shard, timeout, "start_put_layer_paged"
        )

        async def result() -> Result:
            stored = await run
            missing = [(i, layer) for i in range(len(hashes)) if i not in stored]
            return Result(len(stored) * self.ns.block_tokens, missing)

        return Handle(self._loop, result())

    def _get_paged(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        layer: int,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str,
        shard: int,
        timeout: float | None,
        *,
        load_all: bool,
    ) -> tuple[list[bytes], Awaitable[set[int]]]:
        hashes, views = self._paged_views(token_ids, cache, block_ids, layout, writable=True)
        index = self._chunk_index(layer, shard)

        def sink(i: int, buf: torch.Tensor, key: ChunkKey) -> None:
            decode_into(buf, views[i], expect_key=key)

        async def get() -> set[int]:
            located = await self._locate(hashes, index, load_all=load_all)
            return await self._fetch(hashes, layer, shard, located, sink)

        return hashes, self._deadline(get(), timeout, "get_layer_paged")

    async def get_layer_paged(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        layer: int,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str = "blocks_first",
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> int:
        """Dequantize the longest present prefix of layer ``layer`` straight into the
        engine's paged ``cache`` (layouts as :meth:`put_layer_paged`); the tokens loaded.
        Blocks of the cache outside the request's tokens are never written."""
        hashes, run = self._get_paged(
            token_ids, layer, cache, block_ids, layout, shard, timeout, load_all=False
        )
        return prefix_len(await run, len(hashes)) * self.ns.block_tokens

    def start_get_layer_paged(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        layer: int,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str = "blocks_first",
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> Handle:
        """Non-blocking :meth:`get_layer_paged` loading every present block (holes
        included); ``Result.missing`` names the blocks to recompute."""
        hashes, run = self._get_paged(
            token_ids, layer, cache, block_ids, layout, shard, timeout, load_all=True
        )

        async def result() -> Result:
            loaded = await run
            missing = [(i, layer) for i in range(len(hashes)) if i not in loaded]
            return Result(len(loaded) * self.ns.block_tokens, missing)

        return Handle(self._loop, result())

    def start_put_layer(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        layer: int,
        t: torch.Tensor,
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> Handle:
        """Start :meth:`~kvclient.KVClient.put_layer`; returns at once with a handle whose
        ``wait()`` gives ``Result(tokens, missing)``. ``t`` must not be modified until then.
        Raises :class:`BadShape`/:class:`InvalidArgument` at once for bad arguments."""
        hashes = self.block_hashes(token_ids)
        self._check_layer_tensor(t, len(token_ids))
        index = self._chunk_index(layer, shard)
        encoded = self._launch_encode(t, hashes, layer, shard) if hashes else None

        async def run() -> Result:
            if encoded is None:
                return Result(0, [])

            async def put() -> set[int]:
                return await self._send_chunks(hashes, index, await encoded())

            stored = await self._tracked_put(put(), hashes, timeout, "start_put_layer")
            missing = [(i, layer) for i in range(len(hashes)) if i not in stored]
            return Result(len(stored) * self.ns.block_tokens, missing)

        return Handle(self._loop, run())

    def start_get_layer(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        layer: int,
        out: torch.Tensor,
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> Handle:
        """Start loading layer ``layer`` into ``out`` (``[2, >= T_full, H, D]``): every
        block present anywhere is loaded, holes included; ``Result.missing`` names the
        blocks not loaded. Returns at once."""
        hashes = self.block_hashes(token_ids)
        index = self._chunk_index(layer, shard)
        self._check_layer_tensor(out, out.shape[1] if out.dim() == 4 else -1, "out")
        if out.shape[1] < len(hashes) * self.ns.block_tokens:
            raise self._short_out(out, len(hashes))

        async def run() -> Result:
            async def get() -> set[int]:
                located = await self._locate(hashes, index, load_all=True)
                return await self._fetch(hashes, layer, shard, located, self._into(out))

            loaded = await self._deadline(get(), timeout, "start_get_layer")
            missing = [(i, layer) for i in range(len(hashes)) if i not in loaded]
            return Result(len(loaded) * self.ns.block_tokens, missing)

        return Handle(self._loop, run())

    def start_stream_layers(
        self: KVClient,
        token_ids: Sequence[int] | Any,
        timeout: float | None = None,
        *,
        shard: int = 0,
        device: Any = None,
    ) -> StreamHandle:
        """Start :meth:`~kvclient.KVClient.stream_layers` in the background; a decode
        hook calls ``handle.layer(l)`` just before it needs layer ``l``."""
        n_tokens = len(self.block_hashes(token_ids)) * self.ns.block_tokens

        async def run(deliver: Callable[[int, Any], None]) -> Result:
            async for layer, t in self.stream_layers(
                token_ids, timeout, shard=shard, device=device
            ):
                deliver(layer, t)
            return Result(n_tokens, [])

        return StreamHandle(self._loop, self.ns.num_layers, run)

    def _short_out(self: KVClient, out: torch.Tensor, n_blocks: int) -> BadShape:
        return BadShape(
            f"out holds {out.shape[1]} tokens; {n_blocks} full blocks need "
            f"{n_blocks * self.ns.block_tokens}"
        )


async def _none() -> set[int]:
    return set()

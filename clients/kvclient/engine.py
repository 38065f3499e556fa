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

from kvstore.core.codec import ChunkKey
from kvstore.errors import BadShape

from .encoding import launch
from .handles import Handle, Result, StreamHandle, no_blocks, prefix_len
from .paged import ChunkView, chunk_views, decode_into, encode_paged

if TYPE_CHECKING:
    from .client import ClientCore as _Base
else:
    _Base = object

__all__ = ["EngineOps"]


class EngineOps(_Base):
    """Mixin of :class:`~kvclient.KVClient` with the engine-facing calls."""

    def _paged_views(
        self,
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
        self,
        token_ids: Sequence[int] | Any,
        layer: int,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str,
        shard: int,
        timeout: float | None,
        what: str,
    ) -> tuple[list[bytes], Callable[[], Awaitable[set[int]]]]:
        hashes, views = self._paged_views(token_ids, cache, block_ids, layout, writable=False)
        index = self._chunk_index(layer, shard)
        keys = [ChunkKey(h, layer, shard) for h in hashes]
        encoded = launch(
            cache.is_cuda,
            lambda out: encode_paged(views, keys, self.ns.quant, out=out),
            self._run_codec,
        )

        async def put() -> set[int]:
            return await self._put_encoded(hashes, index, encoded)

        if not hashes:
            return hashes, no_blocks
        return hashes, lambda: self._tracked_put(put, hashes, timeout, what)

    async def put_layer_paged(
        self,
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
        return prefix_len(await run(), len(hashes)) * self.ns.block_tokens

    def start_put_layer_paged(
        self,
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
        return self._result_handle(run, len(hashes), layer)

    def _get_paged(
        self,
        token_ids: Sequence[int] | Any,
        layer: int,
        cache: torch.Tensor,
        block_ids: Any,
        layout: str,
        shard: int,
        timeout: float | None,
        *,
        load_all: bool,
    ) -> tuple[list[bytes], Callable[[], Awaitable[set[int]]]]:
        hashes, views = self._paged_views(token_ids, cache, block_ids, layout, writable=True)
        index = self._chunk_index(layer, shard)

        def sink(i: int, buf: torch.Tensor, key: ChunkKey) -> None:
            decode_into(buf, views[i], expect_key=key)

        async def get() -> set[int]:
            located = await self._locate(hashes, index, load_all=load_all)
            return await self._fetch(hashes, layer, shard, located, sink)

        return hashes, lambda: self._deadline(get(), timeout, "get_layer_paged")

    async def get_layer_paged(
        self,
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
        return prefix_len(await run(), len(hashes)) * self.ns.block_tokens

    def start_get_layer_paged(
        self,
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
        return self._result_handle(run, len(hashes), layer)

    def start_put_layer(
        self,
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
        hashes, run = self._put_contiguous(token_ids, layer, t, shard, timeout, "start_put_layer")
        return self._result_handle(run, len(hashes), layer)

    def start_get_layer(
        self,
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

        async def get() -> set[int]:
            located = await self._locate(hashes, index, load_all=True)
            return await self._fetch(hashes, layer, shard, located, self._into(out))

        return self._result_handle(
            lambda: self._deadline(get(), timeout, "start_get_layer"), len(hashes), layer
        )

    def start_stream_layers(
        self,
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

    def _result_handle(self, run: Callable[[], Awaitable[set[int]]], n: int, layer: int) -> Handle:
        """A handle whose result counts the blocks ``run`` stored or loaded and names the
        other ones of the ``n`` as missing."""

        async def result() -> Result:
            done = await run()
            missing = [(i, layer) for i in range(n) if i not in done]
            return Result(len(done) * self.ns.block_tokens, missing)

        return Handle(self._loop, result)

    def _short_out(self, out: torch.Tensor, n_blocks: int) -> BadShape:
        return BadShape(
            f"out holds {out.shape[1]} tokens; {n_blocks} full blocks need "
            f"{n_blocks * self.ns.block_tokens}"
        )

"""Engine-facing operations of :class:`~kvclient.KVClient`: start/wait pairs and paged KV.

These are the calls an inference engine's hooks make. They never block the caller on the
network: ``start_*`` validates, hashes, launches the quantization (on CUDA, on the caller's
current stream, recording an event the transport waits on) and returns a
:class:`~kvclient.handles.Handle`. They may be called from any thread; the work runs on the
client's event loop. Partial failures come back as data (:class:`~kvclient.handles.Result`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.core.codec import KV, ChunkKey
from kvstore.errors import BadShape, InvalidArgument

from . import args
from .encoding import launch
from .handles import Handle, Result, StreamHandle, all_of, prefix_len
from .paged import ChunkView, chunk_views, decode_into, encode_paged
from .stream import LayerSink

if TYPE_CHECKING:
    from .client import ClientCore
    from .stream import StreamOps

    class _Base(StreamOps, ClientCore): ...
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
        hashes: list[bytes] | None = None,
    ) -> tuple[list[bytes], list[ChunkView]]:
        """Hashes (``hashes`` when the caller has them already) and per-chunk views of the
        engine's cache, validated before any I/O."""
        hashes = self.block_hashes(token_ids) if hashes is None else hashes
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
        skip_tokens: int = 0,
    ) -> tuple[list[bytes], Callable[[], Awaitable[set[int]]]]:
        hashes, views = self._paged_views(token_ids, cache, block_ids, layout, writable=False)
        index = self._chunk_index(layer, shard)
        first = self._first_block(skip_tokens, len(hashes), exact=True)
        first = max(first, self._held_prefix(hashes))  # pinned for us: stored already
        rest, views = hashes[first:], views[first:]
        if not rest:
            return hashes, lambda: all_of(first)
        keys = [ChunkKey(h, layer, shard) for h in rest]
        encoded = launch(
            cache.device,  # a Tensor or a PagedCache
            lambda out: encode_paged(views, keys, self.ns.quant, out=out),
            self._run_codec,
            len(keys) * self._chunk_bytes,
        )

        async def put() -> set[int]:
            stored = await self._put_encoded(rest, index, encoded)
            return {first + i for i in stored} | set(range(first))

        return hashes, lambda: self._tracked_put(put, rest, timeout, what)

    def _first_block(self, skip_tokens: Any, n_blocks: int, *, exact: bool) -> int:
        """The first block a call with ``skip_tokens`` touches (checked)."""
        B = self.ns.block_tokens
        ok = isinstance(skip_tokens, int) and not isinstance(skip_tokens, bool)
        if not ok or skip_tokens < 0 or (exact and skip_tokens % B):
            what = f"a multiple of block_tokens ({B})" if exact else "an int >= 0"
            raise InvalidArgument(f"skip_tokens must be {what}, got {skip_tokens!r}")
        return min(skip_tokens // B, n_blocks)

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
        skip_tokens: int = 0,
    ) -> Handle:
        """Non-blocking :meth:`put_layer_paged`: a handle whose ``wait()`` gives
        ``Result(tokens, missing)``. The cache blocks must not change until then.
        ``skip_tokens`` (a multiple of ``block_tokens``): the leading blocks already saved
        (an earlier step of a chunked prefill, or loaded from the pool) are neither
        encoded nor sent, and count as stored."""
        hashes, run = self._put_paged(
            token_ids, layer, cache, block_ids, layout, shard, timeout, "start_put_layer_paged",
            skip_tokens,
        )  # fmt: skip
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
        skip_tokens: int = 0,
        lookup: Callable[[], Awaitable[Any]] | None = None,
        hashes: list[bytes] | None = None,
    ) -> tuple[list[bytes], Callable[[], Awaitable[set[int]]]]:
        hashes, views = self._paged_views(
            token_ids, cache, block_ids, layout, writable=True, hashes=hashes
        )
        index = self._chunk_index(layer, shard)
        first = self._first_block(skip_tokens, len(hashes), exact=False)
        partial = skip_tokens % self.ns.block_tokens

        def sink(i: int, buf: torch.Tensor, key: ChunkKey) -> None:
            decode_into(buf, views[i], expect_key=key, skip=partial if i == first else 0)

        async def get() -> set[int]:
            located = await self._locate(
                hashes, index, load_all=load_all, start=first, lookup=lookup
            )
            loaded = await self._fetch(hashes, layer, shard, located, sink, cache.device)
            return loaded | set(range(first))

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
        skip_tokens: int = 0,
    ) -> Handle:
        """Non-blocking :meth:`get_layer_paged` loading every present block (holes
        included); ``Result.missing`` names the blocks to recompute. ``skip_tokens``: the
        engine's own prefix (e.g. its local prefix-cache hit, any multiple of its block
        size): those tokens of the cache are never written, even inside the block that
        holds the first token to load, and their blocks count as loaded."""
        hashes, run = self._get_paged(
            token_ids, layer, cache, block_ids, layout, shard, timeout, load_all=True,
            skip_tokens=skip_tokens,
        )  # fmt: skip
        return self._result_handle(run, len(hashes), layer)

    def start_get_layers_paged(
        self,
        token_ids: Sequence[int] | Any,
        caches: Sequence[torch.Tensor],
        block_ids: Any,
        layout: str = "blocks_first",
        shard: int = 0,
        *,
        timeout: float | None = None,
        skip_tokens: int = 0,
    ) -> list[Handle]:
        """:meth:`start_get_layer_paged` for every layer at once (``caches[l]`` is layer
        ``l``'s cache), with one Lookup RPC for all of them instead of one per layer; a
        handle per layer, each done when its layer is in. Raises at once like it."""
        L = self.ns.num_layers
        caches = args.tensors(caches, "caches")
        if len(caches) != L:
            raise BadShape(f"caches must hold one paged cache per layer ({L})")
        hashes = self.block_hashes(token_ids)
        first = self._first_block(skip_tokens, len(hashes), exact=False)
        shared: list[asyncio.Future[Any]] = []

        async def lookup() -> Any:
            if not shared:  # the first layer to run asks; the others wait for its answer
                ask = self._master.lookup(self.ns.id, hashes[first:], self._chunks_per_block)
                shared.append(asyncio.ensure_future(ask))
            return await asyncio.shield(shared[0])

        # Every layer's arguments are checked before any layer's read starts: a bad cache
        # raises with nothing written into the others (they are the engine's memory).
        runs = []
        for layer, cache in enumerate(caches):
            runs.append(self._get_paged(
                token_ids, layer, cache, block_ids, layout, shard, timeout, load_all=True,
                skip_tokens=skip_tokens, lookup=lookup, hashes=hashes,
            ))  # fmt: skip
        return [self._result_handle(run, len(n), layer) for layer, (n, run) in enumerate(runs)]

    def start_put_layer(
        self,
        token_ids: Sequence[int] | Any,
        layer: int,
        t: KV,
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> Handle:
        """Start :meth:`~kvclient.KVClient.put_layer` (``t`` ``[2, T, H, D]`` or a (K, V)
        pair); returns at once with a handle whose
        ``wait()`` gives ``Result(tokens, missing)``. ``t`` must not be modified until then.
        Raises :class:`BadShape`/:class:`InvalidArgument` at once for bad arguments."""
        hashes, run = self._put_contiguous(token_ids, layer, t, shard, timeout, "start_put_layer")
        return self._result_handle(run, len(hashes), layer)

    def start_get_layer(
        self,
        token_ids: Sequence[int] | Any,
        layer: int,
        out: KV,
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> Handle:
        """Start loading layer ``layer`` into ``out`` (``[2, T_out, H, D]``, or a (K, V)
        pair of ``[T_out, H, D]``): every block present anywhere among the whole blocks
        ``out`` holds is loaded, holes included; ``Result.missing`` names the prompt's
        blocks not loaded (those past ``out`` among them). Returns at once."""
        every = self.block_hashes(token_ids)
        index = self._chunk_index(layer, shard)
        hashes = every[: self._check_layer_tensor(out, None, "out") // self.ns.block_tokens]

        async def get() -> set[int]:
            located = await self._locate(hashes, index, load_all=True)
            device = args.kv_device(out)
            return await self._fetch(hashes, layer, shard, located, self._into(out), device)

        return self._result_handle(
            lambda: self._deadline(get(), timeout, "start_get_layer"), len(every), layer
        )

    def start_stream_layers(
        self,
        token_ids: Sequence[int] | Any,
        timeout: float | None = None,
        *,
        shard: int = 0,
        device: Any = None,
        out: Sequence[KV] | None = None,
    ) -> StreamHandle:
        """Start :meth:`~kvclient.KVClient.stream_layers` in the background; a decode
        hook calls ``handle.layer(l)`` just before it needs layer ``l``. ``out`` as for
        ``stream_layers`` (checked at once)."""
        hashes, sink_of = self._stream_sinks(token_ids, shard, device, out)
        stream = self._stream(hashes, timeout, shard, sink_of)
        return self._stream_handle(stream, len(hashes) * self.ns.block_tokens)

    def start_stream_layers_paged(
        self,
        token_ids: Sequence[int] | Any,
        caches: Sequence[torch.Tensor],
        block_ids: Any,
        layout: str = "blocks_first",
        timeout: float | None = None,
        *,
        shard: int = 0,
    ) -> StreamHandle:
        """Stream every layer straight into the engine's paged cache as it lands:
        ``caches[l]`` is layer ``l``'s cache (layouts as :meth:`put_layer_paged`),
        ``block_ids`` the request's engine blocks. ``handle.layer(l)`` returns the tokens
        of layer ``l`` in place (all of the prompt's whole blocks) once they are. Raises
        :class:`BadShape`/:class:`InvalidArgument` at once for bad caches or block ids."""
        L = self.ns.num_layers
        caches = args.tensors(caches, "caches")
        if len(caches) != L:
            raise BadShape(f"caches must hold one paged cache per layer ({L})")
        hashes = self.block_hashes(token_ids)
        views = [
            self._paged_views(token_ids, cache, block_ids, layout, writable=True, hashes=hashes)[1]
            for cache in caches
        ]
        n_tokens = len(hashes) * self.ns.block_tokens

        def sink(layer_views: list[ChunkView], device: torch.device) -> LayerSink:
            def put(i: int, buf: torch.Tensor, key: ChunkKey) -> None:
                decode_into(buf, layer_views[i], expect_key=key)

            return LayerSink(put, lambda: n_tokens, device)

        sinks = [sink(v, c.device) for v, c in zip(views, caches, strict=True)]
        stream = self._stream(hashes, timeout, shard, sinks.__getitem__)
        return self._stream_handle(stream, n_tokens)

    def _stream_handle(self, stream: AsyncGenerator[tuple[int, Any], None], n: int) -> StreamHandle:
        async def run(deliver: Callable[[int, Any], None]) -> Result:
            async for layer, value in stream:
                deliver(layer, value)
            return Result(n, [])

        return StreamHandle(self._loop, self.ns.num_layers, run)

    def _result_handle(self, run: Callable[[], Awaitable[set[int]]], n: int, layer: int) -> Handle:
        """A handle whose result counts the blocks ``run`` stored or loaded and names the
        other ones of the ``n`` as missing."""

        async def result() -> Result:
            done = await run()
            missing = [(i, layer) for i in range(n) if i not in done]
            return Result(len(done) * self.ns.block_tokens, missing)

        return Handle(self._loop, result)

"""What a node checks in every chunk that lands in its memory before it acks the put:
header, key, the namespace's spec (shape, dtype, quantization) and checksum.

Over ``tcp://`` each chunk is hashed piece by piece as its bytes arrive, while they are in
this core's cache (measured: xxh3 of a just-received 128 KiB piece ~60 GB/s, of a chunk read
back from memory ~8.5 GB/s). The whole chunk is then checked by the namespace's
:class:`~kvstore.core.headers.HeaderChecks` (its ``verify_host``): the first chunk of a
header form in full, later chunks of a form that passed with an ``xxh3_64`` checksum by
comparing the header and the streamed hash. A verdict is never weaker than
:func:`~kvstore.core.codec.verify_chunk`'s.

Over ``ucx://`` another process wrote the bytes, so they are read once from memory: a
batch in host memory of at most :data:`INLINE_VERIFY_BYTES` on the event loop, a larger one
(or one in the GPU tier, where each check waits for the device) split over verifier
threads, since xxh3 releases the GIL.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from kvstore.core.codec import ChunkKey, ChunkSpec, verify_chunk, verify_host_bytes
from kvstore.core.hashing import Namespace
from kvstore.core.headers import HeaderChecks
from kvstore.errors import ChunkError
from kvstore.transport.base import Connection

__all__ = [
    "INLINE_VERIFY_BYTES",
    "SMALL_CHUNK_BYTES",
    "ChunkChecks",
    "LandedChunk",
    "StreamedChunk",
]

logger = logging.getLogger("kvstore.node")

INLINE_VERIFY_BYTES = 32 * 2**20
"""``ucx://`` batches up to this size are verified on the loop (at most ~5 ms of it here):
measured faster than the verifier threads up to 32 MiB, slower at 256 MiB
(docs/decisions.md)."""

SMALL_CHUNK_BYTES = 64 * 2**10
"""``tcp://`` chunks up to this size are received together and checked as numpy bytes."""

_MAX_VERIFY_THREADS = 4
_MAX_SPECS = 1024


class LandedChunk(NamedTuple):
    """A chunk of a put to check: its request position, block, chunk index and slot view."""

    position: int
    block: bytes
    chunk: int
    view: torch.Tensor


class ChunkChecks:
    """The node's chunk checks and its verifier threads; :meth:`close` stops the threads."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or max(1, min(_MAX_VERIFY_THREADS, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvstore-verify")
        self._specs: dict[bytes, ChunkSpec] = {}
        self._headers: dict[bytes, HeaderChecks] = {}

    def close(self) -> None:
        """Stop the verifier threads (waits for checks in flight)."""
        self._pool.shutdown(wait=True)

    def spec(self, ns: Namespace) -> ChunkSpec:
        """What every chunk of ``ns`` must look like (kept per namespace)."""
        spec = self._specs.get(ns.id)
        if spec is None:
            if len(self._specs) >= _MAX_SPECS:
                self._specs.clear()
                self._headers.clear()
            spec = self._specs[ns.id] = ChunkSpec.of(ns)
        return spec

    def check(self, peer: str, ns: Namespace, part: list[LandedChunk]) -> list[int]:
        """Verify header, key, spec and checksum of landed chunks; the positions that
        failed. Runs on the loop or a verifier thread (reads every byte once); a host
        chunk is checked as numpy bytes (no tensors built). Host chunks of one size are
        checked in one call (:meth:`~kvstore.core.headers.HeaderChecks.unverified`),
        those it cannot pass in full."""
        if not _in_host(part):
            return self._each(peer, ns, part, _verify)
        checks = self.header_checks(ns)
        part = _left(ns, part, checks.unverified)
        verify = checks.verify_host
        return self._each(peer, ns, part, lambda view, key, _: verify(_bytes(view), key))

    def headers(self, peer: str, ns: Namespace, items: list[LandedChunk]) -> list[int]:
        """Check the header, key and spec of each chunk (64 bytes each:
        what a ``ucx://`` put's ack waits for; the checksum is the scrub's); the positions
        that failed. Headers of a form this namespace passed before are only compared, all
        in one call (:meth:`~kvstore.core.headers.HeaderChecks.unknown`); the rest are
        checked in full."""
        checks = self.header_checks(ns)
        if _in_host(items):
            items = _left(ns, items, checks.unknown)
        check = checks.check
        return self._each(peer, ns, items, lambda view, key, _: check(view, key))

    def header_checks(self, ns: Namespace) -> HeaderChecks:
        """The header checks of ``ns`` (kept per namespace, as its spec)."""
        checks = self._headers.get(ns.id)
        if checks is None:
            checks = self._headers[ns.id] = HeaderChecks(self.spec(ns))
        return checks

    def _each(
        self,
        peer: str,
        ns: Namespace,
        items: list[LandedChunk],
        test: Callable[[torch.Tensor, ChunkKey, ChunkSpec], object],
    ) -> list[int]:
        bad = []
        spec = self.spec(ns)
        for item in items:
            try:
                test(item.view, _key(ns, item), spec)
            except ChunkError as exc:
                logger.warning("rejected chunk from %s: %s", peer, exc)
                bad.append(item.position)
        return bad

    async def written(
        self,
        peer: str,
        ns: Namespace,
        items: list[LandedChunk],
        in_host: Callable[[torch.Tensor], bool],
    ) -> list[int]:
        """``ucx://``: check every chunk a writer says it wrote; the positions that failed.

        Inline on the loop for a host-memory batch of at most :data:`INLINE_VERIFY_BYTES`
        (cheaper than handing it to threads and waiting for them); otherwise off the loop,
        split over the verifier threads, so other connections keep being served (the slots
        are pinned by the exchange).
        """
        size = sum(item.view.numel() for item in items)
        if size <= INLINE_VERIFY_BYTES and all(in_host(item.view) for item in items):
            return self.check(peer, ns, items)
        loop, n = asyncio.get_running_loop(), self.threads
        parts = [items[k::n] for k in range(n) if items[k::n]]
        checked = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self.check, peer, ns, p) for p in parts)
        )
        return sorted(i for bad in checked for i in bad)

    async def receive(
        self,
        conn: Connection,
        ns: Namespace,
        targets: list[LandedChunk | None],
        chunk_bytes: int,
        timeout: float,
        bounce: Callable[[torch.Tensor], bool],
    ) -> list[int]:
        """``tcp://``: receive the pending frame's payload (one buffer of ``chunk_bytes``
        per target), buffer ``k`` straight into ``targets[k].view`` (None: discarded),
        checking each chunk piece by piece as it arrives; the positions that failed.

        A target for which ``bounce(view)`` holds (a slot in the GPU tier, of a block put
        over ``ucx://`` before) is received into host memory, checked there and then copied
        in. Raises what the connection raises.
        """
        items = [t for t in targets if t is not None]
        if items and all(it.view.numel() <= SMALL_CHUNK_BYTES and not bounce(it.view)
                         for it in items):  # fmt: skip
            return await self._receive_small(conn, ns, targets, chunk_bytes, timeout)
        checks = self.header_checks(ns)
        streams: list[StreamedChunk | None] = [None] * len(targets)
        bounced: list[tuple[LandedChunk, torch.Tensor]] = []
        for k, it in enumerate(targets):
            if it is None:
                continue
            buf = it.view
            if bounce(buf):
                buf = _host_buffer(buf)
                bounced.append((it, buf))
            key = ChunkKey(it.block, *divmod(it.chunk, ns.tp_size))
            streams[k] = StreamedChunk(buf.numpy(), key, it.position)
        failed: list[int] = []

        def arrived(k: int, upto: int) -> None:
            st = streams[k]
            assert st is not None
            st.advance(upto)
            if upto == st.host.size:
                try:
                    st.verify(checks)
                except ChunkError as exc:
                    logger.warning("rejected chunk from %s: %s", conn.peer, exc)
                    failed.append(st.position)

        views = [None if st is None else st.host for st in streams]
        await conn.recv_payload_into(views, timeout, arrived)
        for it, buf in bounced:
            if it.position not in failed:
                it.view.copy_(buf)
        return failed

    async def _receive_small(
        self,
        conn: Connection,
        ns: Namespace,
        targets: list[LandedChunk | None],
        chunk_bytes: int,
        timeout: float,
    ) -> list[int]:
        """:meth:`receive` for chunks of at most :data:`SMALL_CHUNK_BYTES` in host memory:
        the whole payload lands in one host buffer with one receive (discarded chunks
        too: a receive per chunk cost more), each chunk is checked there as numpy bytes
        (:meth:`HeaderChecks.verify_host`, no tensors built per chunk; those of a form it
        passed in one call, :meth:`HeaderChecks.unverified`) and copied into its slot if it
        passes (one more copy of a small chunk, cheaper than the per-chunk
        tensor work it saves)."""
        scratch = np.empty(len(targets) * chunk_bytes, dtype=np.uint8)
        await conn.recv_payload_whole(scratch, timeout)
        checks = self.header_checks(ns)
        live = [(k, t) for k, t in enumerate(targets) if t is not None]
        keys = [_key(ns, t) for _, t in live]
        base = scratch.ctypes.data  # (chunks of a known form are checked in one call)
        full = set(checks.unverified([base + k * chunk_bytes for k, _ in live], chunk_bytes, keys))
        failed: list[int] = []
        for j, (k, t) in enumerate(live):
            buf = scratch[k * chunk_bytes : (k + 1) * chunk_bytes]
            if j in full:
                try:
                    checks.verify_host(buf, keys[j])
                except ChunkError as exc:
                    logger.warning("rejected chunk from %s: %s", conn.peer, exc)
                    failed.append(t.position)
                    continue
            t.view.numpy()[:] = buf
        return failed


class StreamedChunk:
    """One ``tcp://`` chunk being received into ``host`` (1-D ``uint8``), checked as it
    arrives: the xxh3_64 of its first ``done`` bytes (of the ``end`` its checksum covers,
    all but the last 8) is made piece by piece while they are in cache, and
    :meth:`verify` then checks the whole chunk as
    :meth:`~kvstore.core.headers.HeaderChecks.verify_host` does, the streamed hash
    standing in for a second read of the payload."""

    __slots__ = ("done", "end", "hash", "host", "key", "position")

    def __init__(self, host: np.ndarray, key: ChunkKey, position: int = 0) -> None:
        self.host = host
        self.key = key
        self.position = position
        self.end = max(0, host.size - 8)
        self.done = 0
        self.hash = xxhash.xxh3_64()

    def advance(self, upto: int) -> None:
        """Bytes ``[0, upto)`` have arrived: hash those not hashed yet."""
        stop = min(upto, self.end)
        if stop > self.done:
            self.hash.update(self.host[self.done : stop].data)
            self.done = stop

    def verify(self, checks: HeaderChecks) -> None:
        """Check header, key, spec and checksum (raises :class:`ChunkError` as
        :func:`~kvstore.core.codec.verify_chunk` does). Unless every byte the checksum
        covers was advanced over, the payload is hashed again: never less than one pass."""
        whole = self.done == self.end
        checks.verify_host(self.host, self.key, self.hash.intdigest() if whole else None)


def _verify(view: torch.Tensor, key: ChunkKey, spec: ChunkSpec) -> object:
    """:func:`verify_chunk`; for a host chunk :func:`verify_host_bytes` (measured: 25 µs
    against 41 for a 256 KiB chunk in cache)."""
    if view.device.type == "cpu" and view.is_contiguous():
        return verify_host_bytes(view.numpy(), key, spec)
    return verify_chunk(view, key, spec)


def _key(ns: Namespace, chunk: LandedChunk) -> ChunkKey:
    """What ``chunk`` of ``ns`` is: its block, layer and shard."""
    return ChunkKey(chunk.block, *divmod(chunk.chunk, ns.tp_size))


def _in_host(items: list[LandedChunk]) -> bool:
    """Whether every one of ``items`` (at least one) is contiguous in host memory."""
    return bool(items) and all(it.view.is_cpu and it.view.is_contiguous() for it in items)


def _left(
    ns: Namespace,
    items: list[LandedChunk],
    known: Callable[[list[int], int, list[ChunkKey]], Sequence[int]],
) -> list[LandedChunk]:
    """Of ``items`` (contiguous, in host memory), those ``known`` (a
    :class:`~kvstore.core.headers.HeaderChecks` method's one call into C) did not pass:
    all of them for chunks of several sizes or where the C extension is not built."""
    if len(sizes := {it.view.numel() for it in items}) != 1:
        return items
    addrs = [it.view.data_ptr() for it in items]
    return [items[k] for k in known(addrs, sizes.pop(), [_key(ns, it) for it in items])]


def _bytes(view: torch.Tensor) -> np.ndarray:
    """A contiguous host chunk as 1-D ``uint8`` numpy bytes (no copy)."""
    return view.view(torch.uint8).reshape(-1).numpy()


def _host_buffer(view: torch.Tensor) -> torch.Tensor:
    """A host buffer to receive ``view``'s bytes into before they are copied in."""
    return torch.empty_like(view, device="cpu")

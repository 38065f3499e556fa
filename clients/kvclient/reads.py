"""The client's reads of one layer's chunks from the nodes that hold them.

:class:`ChunkReader` runs, per node, the cheapest read that node allows and hands every
chunk that verifies to a sink (which dequantizes it into the caller's tensor):

- **direct** (``ucx://`` nodes whose lookup or watch gave the slot's location, see
  :mod:`kvstore.dataplane.location`): one-sided NIXL READs of the slots into registered
  staging, with no exchange with the node at all. The slot may have been evicted and reused
  meanwhile, so a chunk counts only once its header (key, spec) and checksum verify; the
  blocks that do not, or a READ that fails, go on to the leased read within the same call
  (counted in :attr:`ReadStats.retried`). Nothing read this way is ever reported as bad:
  a torn or reused slot is not the node's fault.
- **leased** (``ucx://``): ``lease`` → spans → READ → ``release``: the node pins the slots
  while the reader READs them.
- ``tcp://``: ``get`` → the chunks, straight from their slots.

A chunk that fails its checks on the leased or ``tcp://`` path is a miss for its block and
is reported to its node in the background (the node re-checks it and drops a bad one).

**Failover.** Each read of a node has a per-node deadline (``node_timeout_s``, well under
a call's), so a frozen node costs that, not the call. A node whose read failed or timed out
is ranked last among a block's holders for :data:`FAILED_FOR_S` (:meth:`ChunkReader.ranked`),
and the caller tries the block's next holder.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch

from kvstore.control.records import Holder
from kvstore.core.codec import ChunkKey, ChunkSpec
from kvstore.core.headers import HeaderChecks
from kvstore.dataplane import ChunkRef, NodeClient
from kvstore.dataplane.location import SlotLocation
from kvstore.dataplane.messages import MAX_CHUNKS_PER_REQUEST
from kvstore.errors import ChunkError, ChunkKeyMismatch, KVStoreError, TransportError

from .ucx import UcxPath

__all__ = [
    "FAILED_FOR_S",
    "ChunkReader",
    "LayerRead",
    "NodeEntry",
    "ReadStats",
    "Sink",
    "batches",
]

logger = logging.getLogger("kvclient")

T = TypeVar("T")

Sink = Callable[[int, torch.Tensor, ChunkKey], None]
"""Verifies and decodes block ``i``'s chunk (raises :class:`ChunkError` when it fails)."""

_MAX_REPORTS = 16
"""Reports (bad chunks to nodes, failed nodes to the master) in flight at once."""

FAILED_FOR_S = 5.0
"""How long a node whose read failed is ranked last among a block's holders."""

_MAX_FAILED = 4096
"""Failed nodes remembered at once."""


@dataclass
class NodeEntry:
    """A live node as the client sees it (from the master's node list)."""

    node_id: str
    data_uri: str
    free_bytes: int
    ucx: bool = False
    """Move bulk bytes to/from this node by NIXL (see :func:`kvclient.ucx.prefer_ucx`)."""
    nixl_metadata: bytes = b""
    host: str = ""
    epoch: int = 0


class LayerRead(NamedTuple):
    """Which chunks a read is after: chunk index ``chunk`` (``layer * tp_size + shard``) of
    the blocks ``hashes``, to be decoded on ``device`` (where ``ucx://`` reads land: the
    staging of that device, so a GPU reader's chunks never pass through host memory)."""

    hashes: list[bytes]
    layer: int
    shard: int
    chunk: int
    device: torch.device = torch.device("cpu")

    def key(self, i: int) -> ChunkKey:
        """What block ``i``'s chunk must be."""
        return ChunkKey(self.hashes[i], self.layer, self.shard)

    def ref(self, i: int) -> ChunkRef:
        """Block ``i``'s chunk as a node request names it."""
        return ChunkRef(self.hashes[i], self.chunk)


@dataclass
class ReadStats:
    """What this client's reads did, in chunks (monotonic; read them any time)."""

    direct: int = 0
    """Chunks READ straight from their slot's location, with no node exchange."""
    retried: int = 0
    """Chunks a direct READ did not get intact (slot reused, torn, READ failed) that were
    read again through the node (a stale location costs one more exchange, never a miss)."""
    leased: int = 0
    """Chunks read through a ``lease`` exchange (``ucx://``)."""
    tcp: int = 0
    """Chunks read through a ``get`` exchange (``tcp://``)."""
    failed_reads: int = 0
    """Reads of a node that failed or passed the per-node deadline (its blocks went on to
    their next holder, if any)."""


class ChunkReader:
    """Reads chunks of one namespace from nodes; one per client, owned by its loop.

    ``node(uri)`` gives the node's data-plane client, ``discard(uri)`` drops its pooled
    connections after a failure, ``run_codec(nbytes, fn, *args)`` runs verification and
    decoding (:meth:`~kvclient.KVClient._run_codec`); ``node_timeout_s`` bounds each read of
    one node; ``report_node(node_id, epoch, why, timeout=)`` (the master client's) is told
    of a node whose read failed, once per :data:`FAILED_FOR_S`, in the background: the
    master marks it suspect at once, so other clients read its blocks elsewhere first;
    ``node_failed(uri)`` is called at each failed read of the node at ``uri``.
    """

    def __init__(
        self,
        *,
        ns_id: bytes,
        spec: ChunkSpec,
        chunk_bytes: int,
        timeout_s: float,
        node_timeout_s: float,
        ucx: UcxPath,
        node: Callable[[str], NodeClient],
        discard: Callable[[str], Awaitable[None]],
        run_codec: Callable[..., Awaitable[Any]],
        report_node: Callable[..., Awaitable[bool]] | None = None,
        node_failed: Callable[[str], None] = lambda uri: None,
    ) -> None:
        self.stats = ReadStats()
        self._ns_id = ns_id
        self._headers = HeaderChecks(spec)
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        self._node_timeout_s = node_timeout_s
        self._failed: dict[str, float] = {}
        """Data URI → monotonic time until which it is ranked last."""
        self._ucx = ucx
        self._node = node
        self._discard = discard
        self._run_codec = run_codec
        self._report_node = report_node
        self._node_failed = node_failed
        self._reports: set[asyncio.Task[None]] = set()

    async def read(
        self,
        node: NodeEntry | None,
        uri: str,
        idx: list[int],
        want: LayerRead,
        locations: Mapping[int, bytes],
        sink: Sink,
    ) -> set[int]:
        """Read ``want``'s chunks of blocks ``idx`` from the node at ``uri`` and pass the
        intact ones to ``sink``; the block indices loaded. A node that fails is a miss for
        its blocks. ``locations[i]``: block ``i``'s slot location as the index gave it (may
        be absent or empty)."""
        loaded: set[int] = set()  # (what arrived before a failure still counts)
        try:
            async with asyncio.timeout(self._node_timeout_s):
                await self._read(node, uri, idx, want, locations, sink, loaded)
            return loaded
        except (TransportError, TimeoutError) as exc:
            logger.warning("get from %s failed: %s", uri, str(exc) or type(exc).__name__)
            self.stats.failed_reads += 1
            self._node_failed(uri)
            if len(self._failed) >= _MAX_FAILED:
                self._failed.clear()
            if node is not None and self._failed.get(uri, 0.0) <= time.monotonic():
                self._report_failed(node, str(exc) or "no answer within the per-node deadline")
            self._failed[uri] = time.monotonic() + FAILED_FOR_S
            await self._discard(uri)
            return loaded

    def _report_failed(self, node: NodeEntry, why: str) -> None:
        report = self._report_node
        if report is None or len(self._reports) >= _MAX_REPORTS:
            return

        async def send() -> None:
            try:
                await report(node.node_id, node.epoch, why, timeout=2.0)
            except KVStoreError as exc:
                logger.info("report of node %s not delivered: %s", node.node_id, exc)

        self._background(send())

    def _background(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def ranked(self, holders: Sequence[Holder]) -> list[Holder]:
        """``holders`` in the order to try them: as given, but nodes whose read failed in
        the last :data:`FAILED_FOR_S` last."""
        if not self._failed:
            return list(holders)
        now = time.monotonic()
        return sorted(holders, key=lambda h: self._failed.get(h.data_uri, 0.0) > now)

    async def _read(
        self,
        node: NodeEntry | None,
        uri: str,
        idx: list[int],
        want: LayerRead,
        locations: Mapping[int, bytes],
        sink: Sink,
        loaded: set[int],
    ) -> None:
        """The read itself, adding the blocks loaded to ``loaded`` as they arrive: direct,
        then leased for the rest, over ``ucx://``; a get over ``tcp://``."""
        if node is None or not node.ucx:
            loaded |= await self._tcp(uri, idx, want, sink)
            return
        todo = idx
        spans = _direct_spans(idx, want.chunk, locations, self._chunk_bytes)
        if spans is not None:
            loaded |= await self._direct(node, idx, spans, want, sink)
            todo = [i for i in idx if i not in loaded]
            self.stats.retried += len(todo)
        if todo:
            loaded |= await self._leased(node, todo, want, sink)

    async def _tcp(self, uri: str, idx: list[int], want: LayerRead, sink: Sink) -> set[int]:
        """``get`` → the found chunks into a receive buffer → verify and decode."""
        spec = [want.ref(i) for i in idx]
        bufs = torch.empty(0, dtype=torch.uint8)

        def into(found: list[int]) -> list[Any]:
            nonlocal bufs
            bufs = torch.empty(len(found), self._chunk_bytes, dtype=torch.uint8)
            return [row.numpy() for row in bufs]

        have = [idx[k] for k in await self._node(uri).get(self._ns_id, spec, into)]
        self.stats.tcp += len(have)
        ok, bad = await self._decode(have, bufs, want, sink)
        self._report_bad(uri, want, bad)
        return ok  # type: ignore[no-any-return]

    async def _direct(
        self,
        node: NodeEntry,
        idx: list[int],
        spans: list[list[int]],
        want: LayerRead,
        sink: Sink,
    ) -> set[int]:
        """READ each slot at its location into staging, then verify and decode; the
        blocks loaded. Failures are left to the caller's leased retry, never reported."""
        peer = await self._ucx.peer(node.nixl_metadata, node.host)
        async with self._ucx.staging(len(idx), self._chunk_bytes, want.device) as rows:
            try:
                await self._ucx.read(peer, spans, list(rows.unbind(0)), self._timeout_s)
            except TransportError as exc:
                logger.info("direct read from %s failed, asking the node: %s", node.data_uri, exc)
                return set()
            ok, _ = await self._decode(idx, rows, want, sink, logging.INFO)
        self.stats.direct += len(ok)
        return ok  # type: ignore[no-any-return]

    async def _leased(
        self,
        node: NodeEntry,
        idx: list[int],
        want: LayerRead,
        sink: Sink,
    ) -> set[int]:
        """``lease`` → spans → one-sided READ into staging → ``release`` → decode."""
        spec = [want.ref(i) for i in idx]
        peer = await self._ucx.peer(node.nixl_metadata, node.host)
        lease = self._node(node.data_uri).lease(self._ns_id, spec, self._timeout_s)
        async with self._ucx.staging(len(idx), self._chunk_bytes, want.device) as rows:
            async with lease as (found, leased):
                have = [idx[k] for k in found]
                if have:
                    spans = [list(s) for s in leased.spans]
                    read_into = list(rows[: len(have)].unbind(0))
                    await self._ucx.read(peer, spans, read_into, self._timeout_s)
            # Released before decoding: the bytes are in ``rows``, the slots free again.
            self.stats.leased += len(have)
            ok, bad = await self._decode(have, rows, want, sink)
        self._report_bad(node.data_uri, want, bad)
        return ok  # type: ignore[no-any-return]

    async def _decode(
        self,
        have: list[int],
        bufs: torch.Tensor,
        want: LayerRead,
        sink: Sink,
        level: int = logging.WARNING,
    ) -> tuple[set[int], list[int]]:
        """:meth:`_decode_all` through ``run_codec``: on the loop when the chunks are few
        and decode on the host, else on the codec thread."""
        nbytes = len(have) * self._chunk_bytes if want.device.type == "cpu" else None
        return await self._run_codec(  # type: ignore[no-any-return]
            nbytes, self._decode_all, have, bufs, want, sink, level
        )

    def _decode_all(
        self,
        have: list[int],
        bufs: torch.Tensor,
        want: LayerRead,
        sink: Sink,
        level: int = logging.WARNING,
    ) -> tuple[set[int], list[int]]:
        """Check each received chunk's header against the namespace, then hand it to
        ``sink`` (which verifies and decodes it); a bad chunk is a miss for its block, never
        an error for the call. Returns (block indices loaded, indices of chunks that are
        bad where they are stored — not those of a reused slot, which carry another key)."""
        ok: set[int] = set()
        bad: list[int] = []
        keys = [want.key(i) for i in have]
        todo: Collection[int] = range(len(have))
        if have and bufs.device.type == "cpu":  # (known forms compared in one call)
            addrs = [bufs[k].data_ptr() for k in range(len(have))]
            todo = set(self._headers.unknown(addrs, bufs.shape[1], keys))
        try:
            for k, i in enumerate(have):
                key = keys[k]
                try:
                    if k in todo:
                        self._headers.check(bufs[k], key)
                    sink(i, bufs[k], key)
                    ok.add(i)
                except ChunkKeyMismatch as exc:
                    logger.debug("chunk %d is stale: %s", i, exc)
                except ChunkError as exc:
                    logger.log(level, "chunk %d rejected: %s", i, exc)
                    bad.append(i)
        finally:
            if want.device.type == "cuda":
                # The decode kernels read ``bufs`` (staging, reused once this returns) and
                # write ``out``, which the caller may read on any stream: done before both.
                torch.cuda.current_stream(want.device).synchronize()
        return ok, bad

    def _report_bad(self, uri: str, want: LayerRead, bad: list[int]) -> None:
        """Tell the node that chunks it served failed verification, in the background (at
        most :data:`_MAX_REPORTS` reports in flight; more are dropped, and a later read
        reports again). The node checks them itself and drops those that are bad, so the
        next writer stores them."""
        if not bad or len(self._reports) >= _MAX_REPORTS:
            return
        chunks = [want.ref(i) for i in bad]

        async def report() -> None:
            try:
                await self._node(uri).report(self._ns_id, chunks)
            except KVStoreError as exc:
                logger.info("bad-chunk report to %s not delivered: %s", uri, exc)

        self._background(report())

    async def close(self) -> None:
        """Cancel reports still in flight."""
        for report in list(self._reports):
            report.cancel()
        await asyncio.gather(*self._reports, return_exceptions=True)


def _direct_spans(
    idx: list[int], index: int, locations: Mapping[int, bytes], nbytes: int
) -> list[list[int]] | None:
    """The span of each block's chunk at its slot's location, or None unless every block
    of ``idx`` has a usable one (then the node is asked, once, for all of them)."""
    spans = []
    for i in idx:
        loc = SlotLocation.unpack(locations.get(i, b""))
        span = loc.span(index, nbytes) if loc is not None else None
        if span is None:
            return None
        spans.append(span)
    return spans


def batches(idx: list[int]) -> list[list[int]]:
    """``idx`` cut into requests the node accepts (one exchange per layer per node for
    any prompt under ``MAX_CHUNKS_PER_REQUEST`` blocks)."""
    step = MAX_CHUNKS_PER_REQUEST
    return [idx[i : i + step] for i in range(0, len(idx), step)]

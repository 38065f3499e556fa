"""The client's writes of one layer's chunks to the nodes placement chose.

:class:`ChunkWriter` sends every chunk to each of its nodes at once, one exchange per node
and batch, and counts a block stored once ``min_replicas`` of its nodes stored it:

- ``ucx://``: ``reserve`` → spans → one-sided NIXL WRITE → ``landed`` → ack; or, where the
  ack of this writer's previous layer granted this layer's slots (:class:`Grants`), the
  WRITE first and then ``write`` → ack, one round trip. An ack grants the next layer of
  this shard when this client writes it (``write_layers``: a pipeline-parallel rank never
  asks for the next rank's first layer, which that rank would wait on).
- ``tcp://``: ``put`` + chunks → ack, the chunks from host memory (a device chunk is
  copied to the host once, on the codec thread).

A put may wait on a node for another writer's transfer of the same chunk for a share
(:data:`WAIT_SHARE`) of what is left of its deadline (:data:`PUT_DEADLINE`); the rest is
left for storing the chunk itself. Once every block has its ``min_replicas`` copies, the
other replicas' exchanges get ``node_timeout_s`` more, then are cancelled: a frozen replica
costs that, not the call.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from kvstore.dataplane import NodeClient, PutChunk
from kvstore.dataplane.messages import Ready
from kvstore.errors import KVStoreError, KVTimeout, MasterUnreachable, TransportError

from .encoding import copy_rows
from .reads import NodeEntry, batches
from .ucx import Grants, UcxPath

__all__ = ["PUT_DEADLINE", "WAIT_SHARE", "ChunkWriter"]

PUT_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("kvclient_put_deadline")
"""The running put's deadline (loop time), set for its task by the client's tracked put."""

_NODE_FAILED = (TransportError, KVTimeout)
"""What a node's put raises when the node or the link to it, not the request, failed
(:class:`MasterUnreachable` aside: the node answered, its master did not)."""

WAIT_SHARE = 0.5
"""Share of a put's remaining time it may spend waiting on a node for another writer's
transfer of the same chunk; the rest is left for storing the chunk itself."""


class ChunkWriter:
    """Writes chunks of one namespace to nodes; one per client, owned by its loop.

    ``node(uri)`` gives the node's data-plane client; ``run_codec(nbytes, fn, *args)`` runs
    copies (:meth:`~kvclient.KVClient._run_codec`); ``ucx`` is the client's ``ucx://``
    path (agent and staging); ``node_failed(uri)`` is called when the node at ``uri`` or
    the link to it failed a put, or did not answer it in time (not when it answered that
    its master did not take the commit).
    """

    def __init__(
        self,
        *,
        ns_raw: bytes,
        tp_size: int,
        chunk_bytes: int,
        write_layers: range,
        min_replicas: int,
        timeout_s: float,
        node_timeout_s: float,
        ucx: UcxPath,
        node: Callable[[str], NodeClient],
        run_codec: Callable[..., Awaitable[Any]],
        node_failed: Callable[[str], None] = lambda uri: None,
    ) -> None:
        self.writer = uuid.uuid4().hex
        """Who this client is to nodes' grants."""
        self.grants = Grants()
        self._ns_raw = ns_raw
        self._tp_size = tp_size
        self._chunk_bytes = chunk_bytes
        self._write_layers = write_layers
        self._min_replicas = min_replicas
        self._timeout_s = timeout_s
        self._node_timeout_s = node_timeout_s
        self._ucx = ucx
        self._node = node
        self._run_codec = run_codec
        self._node_failed = node_failed

    async def send(
        self,
        hashes: list[bytes],
        index: int,
        chunks: Sequence[torch.Tensor],
        placements: Sequence[Sequence[NodeEntry]],
    ) -> set[int]:
        """Send chunk ``i`` (of block ``hashes[i]``, chunk ``index`` of its slot) to every
        node of ``placements[i]``, all at once; the indices stored on ``min_replicas`` of
        them (on all, when fewer are placed). Raises the first node's error when nothing
        is stored."""
        groups: dict[str, list[int]] = {}
        by_id: dict[str, NodeEntry] = {}
        for i, placed in enumerate(placements):
            for node in placed:
                groups.setdefault(node.node_id, []).append(i)
                by_id[node.node_id] = node
        parts = [(nid, part) for nid, idx in groups.items() for part in batches(idx)]
        host = chunks
        if chunks and chunks[0].device.type != "cpu" and not all(n.ucx for n in by_id.values()):
            # A device chunk bound for a tcp:// node: copied to the host once, off the loop.
            host = await self._run_codec(None, lambda: [c.cpu() for c in chunks])
        need = [min(self._min_replicas, len(placed)) for placed in placements]
        copies = [0] * len(hashes)
        errors: list[KVStoreError] = []
        if len(parts) == 1:  # one exchange: awaited as it is (a task and a wait set: ~16 µs)
            ((nid, part),) = parts
            try:
                for i in await self._put_to_node(by_id[nid], part, hashes, index, chunks, host):
                    copies[i] += 1
            except KVStoreError as failed:
                errors.append(failed)
            return self._stored(copies, need, errors)
        uris = {
            asyncio.ensure_future(
                self._put_to_node(by_id[nid], part, hashes, index, chunks, host)
            ): by_id[nid].data_uri
            for nid, part in parts
        }
        pending = set(uris)
        grace_until: float | None = None
        try:
            while pending:
                wait_s = None if grace_until is None else grace_until - time.monotonic()
                if wait_s is not None and wait_s <= 0:
                    break
                done, pending = await asyncio.wait(
                    pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
                )
                fatal = None
                for task in done:  # (every finished task's outcome is read)
                    exc = task.exception()
                    if exc is None:
                        for i in task.result():
                            copies[i] += 1
                    elif isinstance(exc, KVStoreError):
                        errors.append(exc)
                    else:
                        fatal = fatal or exc
                if fatal is not None:
                    raise fatal
                if grace_until is None and all(c >= n for c, n in zip(copies, need, strict=True)):
                    grace_until = time.monotonic() + self._node_timeout_s
        finally:
            for task in pending:  # (a node that did not answer within the grace or deadline)
                self._node_failed(uris[task])
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            if pending:
                await asyncio.wait(pending, timeout=min(2.0, self._timeout_s))
        return self._stored(copies, need, errors)

    def _stored(self, copies: list[int], need: list[int], errors: list[KVStoreError]) -> set[int]:
        """The indices with ``need`` copies; the first error when there is none."""
        stored = {i for i, c in enumerate(copies) if c >= need[i]}
        if errors and not stored:
            raise errors[0]
        return stored

    async def _put_to_node(
        self,
        node: NodeEntry,
        idx: list[int],
        hashes: list[bytes],
        index: int,
        chunks: Sequence[torch.Tensor],
        host: Sequence[torch.Tensor],
    ) -> set[int]:
        """One put exchange: ``put`` → READY → data → ack over ``tcp://`` (sending
        ``host``, the chunks in host memory), or ``reserve`` → spans → one-sided WRITE →
        ``landed`` → ack over ``ucx://`` (from ``chunks``, wherever they are). A node or
        link that failed it is said (``node_failed``)."""
        spec = [PutChunk(hashes[i], hashes[i - 1] if i else None, index, self._chunk_bytes)
                for i in idx]  # fmt: skip
        now = asyncio.get_running_loop().time()
        wait_s = max(0.0, PUT_DEADLINE.get(now + self._timeout_s) - now) * WAIT_SHARE
        peer = self._node(node.data_uri)
        try:
            if node.ucx:
                nxt = index + self._tp_size  # this shard's next layer: granted with the ack
                grant = (nxt,) if nxt // self._tp_size in self._write_layers else ()
                blocks = [hashes[i] for i in idx]
                granter = f"{node.node_id}@{node.epoch}"  # a restarted node grants afresh
                spans = self.grants.take(granter, blocks, index, self._chunk_bytes)
                if spans is not None:  # one round trip: WRITE, then say so
                    await self._write_ucx(node, spans, [chunks[i] for i in idx])
                    ack = await peer.write(self._ns_raw, spec, self.writer, grant, wait_s)
                else:

                    async def write(ready: Ready) -> None:
                        picked = [chunks[idx[k]] for k in ready.sending()]
                        await self._write_ucx(node, list(ready.spans or ()), picked)

                    ack = await peer.reserve(
                        self._ns_raw, spec, write, wait_s, writer=self.writer, grant=grant
                    )
                self.grants.keep(granter, blocks, ack.grants, ack.grant_s)
            else:
                ack = await peer.put(self._ns_raw, spec, [host[i].numpy() for i in idx], wait_s)
        except _NODE_FAILED as exc:
            if not isinstance(exc, MasterUnreachable):  # (the node answered: its master not)
                self._node_failed(node.data_uri)
            raise
        # Failed a check, or busy (another writer's transfer did not end in time): not stored.
        return set(idx) - {idx[k] for k in ack.not_stored()}

    async def _write_ucx(self, node: NodeEntry, spans: Any, chunks: list[torch.Tensor]) -> None:
        if not chunks:
            return
        peer = await self._ucx.peer(node.nixl_metadata, node.host)
        if all(self._ucx.holds(c) for c in chunks):  # encoded straight into staging
            await self._ucx.write(peer, spans, chunks, self._timeout_s)
            self._ucx.stats.written_in_place += len(chunks)
            return
        step = self._ucx.rows_per_transfer(self._chunk_bytes)
        for lo in range(0, len(chunks), step):
            part = chunks[lo : lo + step]
            async with self._ucx.staging(len(part), self._chunk_bytes, part[0].device) as rows:
                host = part[0].device.type == "cpu"
                nbytes = len(part) * self._chunk_bytes if host else None
                staged = await self._run_codec(nbytes, copy_rows, rows, part)  # before the WRITE
                await self._ucx.write(peer, spans[lo : lo + step], staged, self._timeout_s)
                self._ucx.stats.written_copied += len(part)

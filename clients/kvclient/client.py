"""The async client engines embed: :class:`KVClient` (docs/architecture.md, "Client library").

A client talks to the master over gRPC for *where* (placement candidates, lookups, prefix
matches, watches) and straight to storage nodes over the data plane for the bytes. Every
public call has a deadline (``timeout_s`` by default, ``timeout=`` per call) that covers
the whole call, retries included, and raises only :class:`kvclient.errors.KVStoreError`
subclasses.

Copies a chunk takes, put over ``tcp://``: quantize straight from the caller's (possibly
strided) layer into a per-call encode buffer (1), then the kernel's socket copy. Get: the
kernel's socket copy into a receive buffer, then dequantize straight into ``out`` (1).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import torch

from kvstore.control.auth import token_from_env
from kvstore.control.client import MasterClient
from kvstore.control.records import Holder
from kvstore.control.tls import data_context, tls_from_env
from kvstore.core.codec import (
    KV,
    ChunkKey,
    ChunkSpec,
    chunk_nbytes,
    decode_chunk,
    encode_blocks,
    kv_halves,
    kv_span,
)
from kvstore.core.hashing import Namespace, block_hashes, dtype_name
from kvstore.core.placement import Candidate, rank_nodes, unplaceable_reason, weight_for_free
from kvstore.dataplane import NodeClient
from kvstore.errors import (
    BadShape,
    Closed,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    TransportError,
    Unreachable,
)

from . import args
from .encoding import Encoded, launch
from .engine import EngineOps
from .handles import all_of, prefix_len
from .objects import ObjectOps
from .pool import ConnectionPool
from .reads import FAILED_FOR_S, ChunkReader, LayerRead, NodeEntry, batches
from .routing import RoutingOps
from .stream import StreamOps
from .ucx import DEFAULT_STAGING_BYTES, UcxPath, agent_host, prefer_ucx, staging_device
from .writes import PUT_DEADLINE, ChunkWriter

__all__ = ["DEFAULT_MAX_OBJECT_BYTES", "ClientCore", "KVClient"]

logger = logging.getLogger("kvclient")

T = TypeVar("T")

DEFAULT_MAX_OBJECT_BYTES = 64 * 2**20
"""Largest ``put_object`` value accepted by default."""


INLINE_CODEC_BYTES = 128 << 10
"""Host codec work of at most this many chunk bytes (an encode into them, a decode of them)
runs on the client's loop instead of its codec thread: measured on a 2-core AMD VM, the
hand-off and wake-up cost ~200 µs, more than such an encode takes (int8, 16-token blocks,
H=8, D=128: 2 blocks, ~68 KiB of chunks, 77 µs on the loop against 310 via the thread; 4
blocks, ~136 KiB, 101 against 288; docs/decisions.md)."""
_NODES_TTL_S = 1.0
"""How long a placement snapshot of the node list is used. Past half of it, the call that
finds it so refreshes it in the background (calls go on with the snapshot meanwhile), so
steady traffic never waits for the master's ``Nodes`` RPC; past all of it, a call waits for
a new one, unless :data:`_NODES_STALE_S` lets it go on."""

_NODES_STALE_S = 5.0
"""How old a snapshot may be and still be used past :data:`_NODES_TTL_S`: the call that
finds it so starts a refresh, and calls go on with it until the refresh lands (one
``Nodes`` RPC, a few ms), so the first put after a quiet spell (an engine whose requests
come seconds apart) does not wait for the master. Only while the snapshot is trusted: a
refresh that failed, or a node that failed (or did not answer) this client's put or read
since the snapshot was fetched, makes the next call past the TTL wait for a new one. Half
the default node lease (10 s), which is how long the master itself takes to suspect a
silent node (docs/decisions.md)."""

_MAX_PLACED = 16384
"""Blocks whose nodes a client remembers from their last put (~3 MB at most): a prompt's
later layers go where its earlier ones went (:meth:`KVClient._place`)."""

_HOLD_TRUST = 0.8
"""Share of a hold's ``hold_s`` a client counts on (the node's clock starts later)."""

_MAX_HELD = 65536
"""Held blocks a client remembers (expired ones are dropped first; past it, no more)."""

_MAX_NODE_CLIENTS = 4096
"""Node clients kept (one per data URI; dropped all at once past this)."""


def _torch_dtype(name: str) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


class ClientCore:
    """The core of :class:`KVClient`: connection, placement, put, get, match, stream,
    objects. :class:`KVClient` adds the engine-facing calls of
    :class:`~kvclient.engine.EngineOps` on top.

    Options (``KVClient.connect(..., name=value)``): ``replicas``, ``timeout_s`` (every
    call's default deadline), ``max_object_bytes``, ``connections_per_node``, ``ucx``
    (False: ``tcp://`` only), ``staging_bytes`` (registered ``ucx://`` staging),
    ``write_layers`` (the layers this client puts, default all: a pipeline-parallel rank
    passes its own range, so its ``ucx://`` puts never ask for a grant of the next rank's
    first layer, which that rank would wait on), ``node_timeout_s`` (each read of one node,
    default a quarter of ``timeout_s``: a frozen holder costs that, then the block's next
    holder is read), ``min_replicas`` (of the ``replicas`` nodes a block is put on, how many
    must store it for it to count as stored; default all: once every block has that many
    copies, the other replicas' puts get ``node_timeout_s`` more, then are cancelled)."""

    def __init__(
        self,
        master: MasterClient,
        ns: Namespace,
        *,
        replicas: int = 1,
        timeout_s: float = 10.0,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
        connections_per_node: int = 4,
        ucx: bool = True,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        write_layers: range | None = None,
        node_timeout_s: float | None = None,
        min_replicas: int | None = None,
    ) -> None:
        replicas = args.positive_int(replicas, "replicas", 1 << 16)
        self.ns = ns
        self.replicas = replicas
        self.timeout_s = args.seconds(timeout_s, "timeout_s")
        self.node_timeout_s = (
            self.timeout_s / 4
            if node_timeout_s is None
            else args.seconds(node_timeout_s, "node_timeout_s")
        )
        self.min_replicas = (
            replicas if min_replicas is None else args.positive_int(min_replicas, "min_replicas")
        )
        if self.min_replicas > replicas:
            raise InvalidArgument(f"min_replicas must be in [1, replicas={replicas}]")
        connections_per_node = args.positive_int(connections_per_node, "connections_per_node")
        ucx = args.flag(ucx, "ucx")
        staging_bytes = args.nonneg_int(staging_bytes, "staging_bytes")
        if write_layers is not None and not isinstance(write_layers, range):
            kind = type(write_layers).__name__
            raise InvalidArgument(f"write_layers must be a range or None, got {kind}")
        self.max_object_bytes = args.positive_int(max_object_bytes, "max_object_bytes")
        self._master = master
        self._pool = ConnectionPool(
            connections_per_node, tickets=master.tickets(), ssl_context=data_context(master.tls)
        )
        self._dtype = _torch_dtype(dtype_name(ns.dtype))
        self._chunks_per_block = ns.num_layers * ns.tp_size
        self._chunk_bytes = chunk_nbytes(
            ns.block_tokens, ns.num_kv_heads, ns.head_dim, ns.dtype, ns.quant
        )
        self._ns_raw = ns.canonical_bytes()
        self._nodes: list[NodeEntry] = []
        self._by_uri: dict[str, NodeEntry] = {}
        self._uri_of: dict[str, str] = {}
        self._no_place = ""
        self._held: dict[bytes, float] = {}
        self._holds: dict[str, list[tuple[tuple[bytes, ...], tuple[str, str]]]] = {}  # by tag
        """Block hash → loop time its pins (by ``match_prefix(hold_s=...)``) surely last."""
        self._allow_ucx = ucx
        self._ucx = UcxPath(staging_bytes)
        self._nodes_at = -1e9
        self._distrusts = 0
        """Failures seen so far (:meth:`_distrust_nodes`)."""
        self._nodes_clean = -1
        """:attr:`_distrusts` over the whole fetch of the snapshot (-1: none fetched, or a
        failure came while the master answered)."""
        self._placing: tuple[list[NodeEntry], dict[str, NodeEntry], list[Candidate]] | None = None
        self._placed: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()
        """Block hash → the node ids its last put went to, oldest first (bounded)."""
        self._shunned: dict[str, float] = {}
        """Data URI of a node that failed this client → monotonic time until which it
        takes no new blocks from it (:meth:`_node_failed`)."""
        self._placeable_memo: tuple[list[NodeEntry], int, float, list[NodeEntry]] | None = None
        self._nodes_lock = asyncio.Lock()
        self._nodes_ahead: asyncio.Task[None] | None = None
        self._codec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvclient-codec")
        self._inflight: dict[asyncio.Task[Any], list[bytes]] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        """ABORTs of failed puts on their way to the master (:meth:`_abort_soon`)."""
        self._node_clients: dict[str, NodeClient] = {}
        self._spec = ChunkSpec.of(ns)
        self._reads = ChunkReader(
            ns_id=ns.id,
            spec=self._spec,
            chunk_bytes=self._chunk_bytes,
            timeout_s=self.timeout_s,
            node_timeout_s=self.node_timeout_s,
            ucx=self._ucx,
            node=self._node,
            discard=self._pool.discard,
            run_codec=self._run_codec,
            report_node=self._master.report_node,
            node_failed=self._node_failed,
        )
        self._writes = ChunkWriter(
            ns_raw=self._ns_raw,
            tp_size=ns.tp_size,
            chunk_bytes=self._chunk_bytes,
            write_layers=range(ns.num_layers) if write_layers is None else write_layers,
            min_replicas=self.min_replicas,
            timeout_s=self.timeout_s,
            node_timeout_s=self.node_timeout_s,
            ucx=self._ucx,
            node=self._node,
            run_codec=self._run_codec,
            node_failed=self._node_failed,
        )
        self._loop = asyncio.get_running_loop()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        master: str | Sequence[str],
        ns: Namespace,
        *,
        replicas: int = 1,
        timeout_s: float = 10.0,
        token: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        **options: Any,
    ) -> Self:
        """Connect to the master at ``host:port`` and check that it answers. Several masters
        sharing one Redis (a list, or ``"a:p,b:p"``): calls fail over to the next one when
        theirs is down or silent, within their deadline. ``token``: this client's token for
        a master with an auth file (default ``$KVSTORE_TOKEN``, else the file
        ``$KVSTORE_TOKEN_FILE`` names; none if neither is set). ``ca_file``: a master with
        TLS, the CA (PEM) its certificate chains to (default ``$KVSTORE_TLS_CA``);
        ``cert_file``/``key_file``: this client's certificate for a master that requires
        one (default ``$KVSTORE_TLS_CERT``/``$KVSTORE_TLS_KEY``); none set: plaintext.

        Blocks up to ``timeout_s``. Raises :class:`~kvstore.errors.Unreachable` or
        :class:`~kvstore.errors.KVTimeout` when no master answers,
        :class:`~kvstore.errors.Unauthorized` when it does not take the token.
        """
        target = master if isinstance(master, str) else ",".join(master)
        known = inspect.signature(cls.__init__).parameters
        unknown = sorted(o for o in options if o not in known or o in ("self", "master", "ns"))
        if unknown:  # (refused before anything is dialled)
            raise InvalidArgument(f"KVClient.connect got unknown options {unknown}")
        if token is None:
            token = token_from_env()
        # (MasterClient refuses a token gRPC metadata cannot carry: check_token)
        tls = tls_from_env(
            cert=None if cert_file is None else args.text(cert_file, "cert_file", 4096),
            key=None if key_file is None else args.text(key_file, "key_file", 4096),
            ca=None if ca_file is None else args.text(ca_file, "ca_file", 4096),
        )
        timeout_s = args.seconds(timeout_s, "timeout_s")
        mc = MasterClient(target, timeout_s=timeout_s, token=args.text(token, "token"), tls=tls)
        try:
            await mc.stats()
            return cls(mc, ns, replicas=replicas, timeout_s=timeout_s, **options)
        except BaseException:
            await mc.close()
            raise

    async def close(self) -> None:
        """Abort puts still in flight (watchers see ABORT), close connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        inflight = dict(self._inflight)
        for task in inflight:
            task.cancel()
        if inflight:
            await asyncio.wait(list(inflight), timeout=self.timeout_s)
            # A put cancelled before it started never ran its own abort: publish them all
            # here (watchers stop at the first abort, a second one is harmless).
            hashes = list(dict.fromkeys(h for hs in inflight.values() for h in hs))
            await self._abort(hashes, "client closed with puts in flight")
        if self._aborting:  # (each bounded by _abort's own deadline)
            await asyncio.wait(list(self._aborting), timeout=self.timeout_s)
        if self._nodes_ahead is not None:
            self._nodes_ahead.cancel()
            await asyncio.wait([self._nodes_ahead], timeout=self.timeout_s)
        await self._reads.close()
        await self._pool.close()
        await self._ucx.close()
        await self._master.close()
        self._codec.shutdown(wait=False, cancel_futures=True)

    async def warm_up(self, device: Any = None, *, timeout: float | None = None) -> list[str]:
        """Pay this client's one-time costs now instead of in its first put or get: a data
        connection to each live node and, where a node takes ``ucx://``, this client's
        NIXL agent (UCX's start: ~0.45 s of CPU here), its host staging and ``device``'s
        (where the KV lives: default the host) registered, the host staging's pages mapped,
        and each such node loaded as a peer and sent a notification (UCX then sets its
        endpoint up: the first transfer's ~10 ms here). Returns the data URIs of the nodes
        ready for ``ucx://`` (none with ``ucx=False``).

        Optional: a put or get does what it needs of this on first use, and waits for a
        warm-up in flight rather than repeat it. An engine calls it once while it starts
        (the connector's worker does, when the engine registers its KV caches). A node
        that does not answer within ``node_timeout_s`` is logged and skipped. Raises
        :class:`InvalidArgument` for a ``device`` that is not one, :class:`KVTimeout`,
        what asking the master raises, and :class:`TransportError` when NIXL cannot start
        or register the staging."""
        self._limit(timeout)
        try:
            dev = staging_device(device)
        except (RuntimeError, AssertionError) as exc:  # (torch: no such device, no CUDA)
            raise InvalidArgument(f"warm_up: no device {device!r} here ({exc})") from None
        return list(await self._deadline(self._warm_up(dev), timeout, "warm_up"))

    async def _warm_up(self, device: torch.device) -> list[str]:
        await self._live_nodes(refresh=True)
        nodes = list(self._by_uri.values())  # (every live node: draining ones are read)
        dials = asyncio.gather(*map(self._dial, nodes))  # (each logs its own failure)
        ucx = [n for n in nodes if n.ucx]
        try:
            if ucx:
                await self._ucx.start(agent_host([n.host for n in ucx]), device)
        except BaseException:
            dials.cancel()
            raise
        await dials
        ready = []
        for node in ucx:
            try:
                await self._ucx.greet(node.nixl_metadata, node.host)
            except Closed:
                raise
            except KVStoreError as exc:
                logger.warning("warm-up: ucx:// node %s skipped: %s", node.data_uri, exc)
                continue
            ready.append(node.data_uri)
        return ready

    async def _dial(self, node: NodeEntry) -> None:
        """A data connection to ``node``, dialled and kept in the pool; a failure logged."""
        try:
            async with self._pool.use(node.data_uri, self.node_timeout_s):
                pass
        except Closed:
            raise
        except KVStoreError as exc:
            logger.warning("warm-up: node %s not dialled: %s", node.data_uri, exc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ pure helpers

    def block_hashes(self, token_ids: Sequence[int] | Any) -> list[bytes]:
        """Block hashes of the full blocks of ``token_ids`` (the tail is ignored)."""
        return block_hashes(self.ns, token_ids)

    def _chunk_index(self, layer: int, shard: int) -> int:
        layer = args.index(layer, "layer", self.ns.num_layers)
        return layer * self.ns.tp_size + args.index(shard, "shard", self.ns.tp_size)

    def _limit(self, timeout: float | None) -> float:
        """The call's deadline in seconds: ``timeout``, checked, or the client's default."""
        return self.timeout_s if timeout is None else args.seconds(timeout)

    async def _deadline(self, coro: Any, timeout: float | None, what: str) -> Any:
        """Run ``coro`` under the call's deadline; translate the expiry to KVTimeout."""
        try:
            if self._closed:
                raise Closed("client is closed")
            limit = self._limit(timeout)
        except KVStoreError:
            if asyncio.iscoroutine(coro):
                coro.close()
            else:  # (a future: a shielded task, a gather)
                coro.cancel()
            raise
        try:
            async with asyncio.timeout(limit):
                return await coro
        except TimeoutError as exc:
            if isinstance(exc, KVStoreError):
                raise
            raise KVTimeout(f"{what} did not complete within {limit:.3g} s") from exc
        except asyncio.CancelledError:
            self._closed_during(what)
            raise

    def _closed_during(self, what: str) -> None:
        """Raise :class:`Closed` where a call's wait was cancelled because :meth:`close`
        ended what it waited on (its connections, the master's channel), not because its
        caller's own task was cancelled (that stays a cancellation)."""
        me = asyncio.current_task()
        if self._closed and (me is None or not me.cancelling()):
            raise Closed(f"{what}: the client was closed while it was in flight") from None

    async def _run_codec(self, nbytes: int | None, fn: Callable[..., T], *args: Any) -> T:
        """Run quantize/dequantize work of ``nbytes`` chunk bytes on host memory: on the
        loop when at most :data:`INLINE_CODEC_BYTES`, else on the client's one codec
        thread (``nbytes`` None: work that waits for a device, always there)."""
        if nbytes is not None and nbytes <= INLINE_CODEC_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._codec, fn, *args)

    # ------------------------------------------------------------------ placement

    def _node(self, uri: str) -> NodeClient:
        """The data port of the node at ``uri``, over this client's connection pool."""
        node = self._node_clients.get(uri)
        if node is None:
            if len(self._node_clients) > _MAX_NODE_CLIENTS:
                self._node_clients.clear()
            node = self._node_clients[uri] = NodeClient(uri, self._pool, timeout_s=self.timeout_s)
        return node

    async def _live_nodes(self, refresh: bool = False) -> list[NodeEntry]:
        """The placeable nodes (a snapshot at most :data:`_NODES_TTL_S` old, or
        :data:`_NODES_STALE_S` while trusted; ``refresh``: a new one)."""
        age = time.monotonic() - self._nodes_at
        usable = age <= _NODES_TTL_S or (age <= _NODES_STALE_S and self._nodes_trusted)
        if not refresh and usable:
            if age > _NODES_TTL_S / 2 and self._nodes_ahead is None and not self._closed:
                self._nodes_ahead = asyncio.create_task(self._refresh_nodes_ahead())
            return self._nodes
        async with self._nodes_lock:
            now = time.monotonic()
            if refresh or now - self._nodes_at > _NODES_TTL_S:
                distrusts = self._distrusts
                infos = await self._master.nodes()
                known = {
                    n.node_id: NodeEntry(
                        n.node_id,
                        n.data_uri,
                        n.free_bytes,
                        self._allow_ucx and prefer_ucx(n.transport, n.host, n.nixl_metadata),
                        n.nixl_metadata,
                        n.host,
                        n.epoch,
                    )
                    for n in infos
                    if n.alive
                }
                self._by_uri = {n.data_uri: n for n in known.values()}
                self._uri_of = {n.node_id: n.data_uri for n in known.values()}
                self._nodes = [known[n.node_id] for n in infos if n.placeable]
                self._no_place = "" if self._nodes else unplaceable_reason(infos)
                self._nodes_at = now
                # (a failure while the master answered: that answer may predate it)
                self._nodes_clean = distrusts if distrusts == self._distrusts else -1
            return self._nodes

    @property
    def _nodes_trusted(self) -> bool:
        """Whether the snapshot may be used past its TTL (:data:`_NODES_STALE_S`): no
        failure since it was fetched, nor while it was."""
        return self._nodes_clean == self._distrusts

    def _node_failed(self, uri: str) -> None:
        """The node at ``uri`` failed this client's put or read (or did not answer in
        time): the snapshot is distrusted (:meth:`_distrust_nodes`), and the node takes no
        new blocks from this client for :data:`~kvclient.reads.FAILED_FOR_S` (the master
        lists a node that died until its lease ends)."""
        self._distrust_nodes()
        if len(self._shunned) >= _MAX_NODE_CLIENTS:
            self._shunned.clear()
        self._shunned[uri] = time.monotonic() + FAILED_FOR_S

    def _placeable(self, nodes: list[NodeEntry]) -> list[NodeEntry]:
        """``nodes`` less those that failed this client lately (:meth:`_node_failed`); all
        of them when every one did. The same list while that holds (``_place`` caches by
        it)."""
        if not self._shunned:
            return nodes
        now, memo = time.monotonic(), self._placeable_memo
        if memo is not None and memo[0] is nodes and memo[1] == self._distrusts and now < memo[2]:
            return memo[3]
        self._shunned = {u: t for u, t in self._shunned.items() if t > now}
        kept = [n for n in nodes if n.data_uri not in self._shunned]
        if not kept or len(kept) == len(nodes):
            kept = nodes
        until = min(self._shunned.values(), default=float("inf"))
        self._placeable_memo = (nodes, self._distrusts, until, kept)
        return kept

    def _distrust_nodes(self) -> None:
        """A node failed this client (or a refresh failed): the snapshot is not used past
        its TTL (:data:`_NODES_STALE_S`), nor is one fetched before now."""
        self._distrusts += 1

    async def _refresh_nodes_ahead(self) -> None:
        """:meth:`_live_nodes` refreshed off the calls' path; a failure is left to the call
        that then finds the snapshot expired (it asks the master itself)."""
        try:
            await self._live_nodes(refresh=True)
        except Exception as exc:  # (a background task: every failure is the next call's)
            self._distrust_nodes()
            logger.debug("node list refresh ahead of expiry failed: %s", exc)
        finally:
            self._nodes_ahead = None

    def _place(self, key: bytes, nodes: list[NodeEntry]) -> list[NodeEntry]:
        """The nodes ``key`` goes to: those its last put from this client went to while
        every one of them is still placeable, else HRW over ``nodes``, weighted by free
        bytes (then remembered). A snapshot refreshed between two layers of a prompt may
        weigh the nodes anew; the prompt's later layers still go where its first went, so
        a block's chunks stay on one holder and the grants its last ack gave are used. The
        candidates are built once per node snapshot, not once per block. Raises
        :class:`Unreachable` saying why when no node takes new blocks. A node that failed
        this client lately takes none of them while others are left (:meth:`_placeable`)."""
        if not nodes:
            raise Unreachable(self._no_place or "no live storage node to place a block on")
        nodes = self._placeable(nodes)
        if self._placing is None or self._placing[0] is not nodes:
            by_id = {n.node_id: n for n in nodes}
            cands = [Candidate(n.node_id, weight_for_free(n.free_bytes)) for n in nodes]
            self._placing = (nodes, by_id, cands)
        _, by_id, cands = self._placing
        before = self._placed.get(key)
        if before is not None and all(i in by_id for i in before):
            self._placed.move_to_end(key)
            return [by_id[i] for i in before]
        if len(cands) == 1:  # one node: it is every block's place
            chosen = [by_id[cands[0].node_id]]
        else:
            chosen = [by_id[i] for i in rank_nodes(key, cands, self.replicas)]
        self._placed[key] = tuple(n.node_id for n in chosen)
        self._placed.move_to_end(key)
        if len(self._placed) > _MAX_PLACED:
            self._placed.popitem(last=False)
        return chosen

    # ------------------------------------------------------------------ put

    def _check_layer_tensor(self, t: Any, n_tokens: int | None, name: str = "t") -> int:
        """Check a :data:`~kvstore.core.codec.KV` (``[2, T, H, D]`` or a (K, V) pair of
        ``[T, H, D]``) against the namespace (``T == n_tokens`` unless None); its ``T``."""
        ns = self.ns
        if not isinstance(t, (torch.Tensor, tuple, list)):
            kind = type(t).__name__
            raise BadShape(f"{name} must be a torch.Tensor or a (K, V) pair, got {kind}")
        try:
            k, _ = kv_halves(t, name)
        except InvalidArgument as exc:
            raise BadShape(str(exc)) from None
        T = k.shape[0] if n_tokens is None else n_tokens
        if tuple(k.shape) != (T, ns.num_kv_heads, ns.head_dim):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else f"(K, V) of {tuple(k.shape)}"
            want = (2, T, ns.num_kv_heads, ns.head_dim)
            raise BadShape(
                f"{name} has shape {got}; namespace expects {want} or (K, V) of {want[1:]}"
            )
        if k.dtype != self._dtype:
            raise BadShape(f"{name} has dtype {k.dtype}; namespace expects {self._dtype}")
        return int(T)

    async def put_layer(
        self,
        token_ids: Sequence[int] | Any,
        layer: int,
        t: KV,
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> int:
        """Store layer ``layer`` (shard ``shard``) of a prompt's KV; ``t`` is ``[2, T, H, D]``,
        or K and V apart as a pair of ``[T, H, D]`` tensors (read in place, never stacked).

        ``T`` must equal ``len(token_ids)``; the partial tail block is ignored. Chunks
        already in the pool are skipped and count as stored (first writer wins). Returns
        the tokens stored (the leading blocks that were stored), a multiple of
        ``block_tokens``. Blocks up to the deadline. Raises :class:`BadShape` or
        :class:`InvalidArgument` before any I/O, :class:`CapacityError` when a node has no
        room, :class:`KVTimeout`, :class:`TransportError` subclasses.
        """
        hashes, run = self._put_contiguous(token_ids, layer, t, shard, timeout, "put_layer")
        return prefix_len(await run(), len(hashes)) * self.ns.block_tokens

    def _put_contiguous(
        self,
        token_ids: Sequence[int] | Any,
        layer: int,
        t: KV,
        shard: int,
        timeout: float | None,
        what: str,
    ) -> tuple[list[bytes], Callable[[], Awaitable[set[int]]]]:
        """Validate (before any I/O), start the encode, and return the block hashes and
        the put to await: it yields the indices of the blocks stored."""
        hashes = self.block_hashes(token_ids)
        self._check_layer_tensor(t, len(token_ids))
        index = self._chunk_index(layer, shard)
        self._limit(timeout)
        k = self._held_prefix(hashes)  # pinned for us: stored, nothing to encode or send
        if k == len(hashes):
            return hashes, lambda: all_of(k)
        rest, B = hashes[k:], self.ns.block_tokens
        encoded = self._launch_encode(kv_span(t, k * B, len(token_ids)), rest, layer, shard)

        async def put() -> set[int]:
            return {k + i for i in await self._put_encoded(rest, index, encoded)} | set(range(k))

        return hashes, lambda: self._tracked_put(put, rest, timeout, what)

    def _held_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` a ``match_prefix(hold_s=...)`` of this client
        found complete and pinned on every holder, the pins not yet expired: every chunk of
        them is stored and cannot be evicted, so a put skips them before encoding."""
        if not self._held:
            return 0
        now, k = self._loop.time(), 0
        while k < len(hashes) and self._held.get(hashes[k], 0.0) > now:
            k += 1
        return k

    def _launch_encode(self, t: KV, hashes: list[bytes], layer: int, shard: int) -> Encoded:
        """Start quantizing a contiguous ``[2, T, H, D]`` layer (see
        :func:`kvclient.encoding.launch`)."""
        keys = [ChunkKey(h, layer, shard) for h in hashes]
        B, quant = self.ns.block_tokens, self.ns.quant
        encode = lambda out: encode_blocks(t, B, keys, quant, out=out)  # noqa: E731
        return launch(args.kv_device(t), encode, self._run_codec, len(keys) * self._chunk_bytes)

    async def _put_encoded(self, hashes: list[bytes], index: int, encoded: Encoded) -> set[int]:
        """Encode and send: into registered staging on the KV's device (host memory or the
        GPU's own) when a ``ucx://`` node may take the chunks, so the one-sided WRITE needs
        no extra copy; else into new rows there."""
        nodes = await self._live_nodes()
        rows = len(hashes)
        use_staging = any(n.ucx for n in nodes) and self._ucx.fits(rows, self._chunk_bytes)
        buffer = (
            self._ucx.staging(rows, self._chunk_bytes, encoded.device)
            if use_staging
            else contextlib.nullcontext()
        )
        async with buffer as staged:
            return await self._send_chunks(hashes, index, await encoded(staged))

    async def _tracked_put(
        self,
        put: Callable[[], Awaitable[set[int]]],
        hashes: list[bytes],
        timeout: float | None,
        what: str,
    ) -> set[int]:
        """Run a put as a task registered in flight, under the call's deadline. If it
        fails, times out or is cancelled — by the caller or by :meth:`close` — an ABORT for
        its blocks goes to their watchers, in the background (:meth:`_abort_soon`): the
        caller waits for the put to stop touching its tensors, not for the master. Raises
        :class:`Closed` on a closed client, and when :meth:`close` cut the put off."""
        if self._closed:
            raise Closed("client is closed")

        async def put_or_abort() -> set[int]:
            try:
                return set(await put())
            except BaseException:
                self._abort_soon(hashes, f"{what} failed or was cancelled")
                raise

        limit = self._limit(timeout)
        token = PUT_DEADLINE.set(asyncio.get_running_loop().time() + limit)
        try:
            task = asyncio.ensure_future(put_or_abort())  # (takes a copy of the context)
        finally:
            PUT_DEADLINE.reset(token)
        self._inflight[task] = hashes
        task.add_done_callback(lambda t: self._inflight.pop(t, None))
        try:
            return set(await self._deadline(asyncio.shield(task), timeout, what))
        except BaseException as exc:
            task.cancel()
            await asyncio.wait([task], timeout=min(2.0, self.timeout_s))
            if isinstance(exc, asyncio.CancelledError):
                self._closed_during(what)  # (close() cancelled the put: Closed)
            raise

    async def _send_chunks(
        self, hashes: list[bytes], index: int, chunks: Sequence[torch.Tensor]
    ) -> set[int]:
        """Send chunk ``i`` of ``hashes[i]`` to its placement nodes (:class:`ChunkWriter`);
        the indices stored on ``min_replicas`` of them."""
        nodes = await self._live_nodes()
        return await self._writes.send(
            hashes, index, chunks, [self._place(h, nodes) for h in hashes]
        )

    def _abort_soon(self, hashes: list[bytes], reason: str) -> None:
        """:meth:`_abort` as a task of its own (kept until done; :meth:`close` waits for
        those still going), so that a put that failed because the master did not answer
        does not keep its caller past the put's deadline for the ABORT too."""
        task = asyncio.ensure_future(self._abort(hashes, reason))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def _abort(self, hashes: list[bytes], reason: str) -> None:
        """Tell watchers that this writer gave up (best effort, short deadline)."""
        try:
            async with asyncio.timeout(min(2.0, self.timeout_s)):
                await self._master.abort(self.ns.id, hashes, reason)
        except (KVStoreError, TimeoutError) as exc:
            logger.debug("abort not delivered: %s", exc)

    # ------------------------------------------------------------------ get

    async def get_layer(
        self,
        token_ids: Sequence[int] | Any,
        layer: int,
        device: Any = None,
        out: KV | None = None,
        shard: int = 0,
        *,
        timeout: float | None = None,
    ) -> Any:
        """Read the longest present prefix of layer ``layer`` for ``token_ids``.

        Returns ``[2, n, H, D]`` (``n`` a multiple of ``block_tokens``, possibly 0) on
        ``device`` (default CPU), or, when ``out`` is given, a view of it holding the first
        ``n`` tokens (written in place). ``out`` is ``[2, T_out, H, D]`` or K and V apart, a
        pair of ``[T_out, H, D]`` (then a pair of views is returned); it may hold fewer
        tokens than the prompt (e.g. just what :meth:`match_prefix` found): at most its
        whole blocks are read. A miss is a short (or empty) result, never an error. Raises
        :class:`BadShape` for a wrong ``out``, :class:`KVTimeout`, transport errors when the
        master cannot be asked.
        """
        hashes = self.block_hashes(token_ids)
        index = self._chunk_index(layer, shard)
        device = args.device(device)
        B = self.ns.block_tokens
        if out is not None:
            hashes = hashes[: self._check_layer_tensor(out, None, "out") // B]

        async def get() -> Any:
            located = await self._locate(hashes, index, load_all=False)
            target = out
            if target is None:
                n = len(located)
                shape = (2, n * B, self.ns.num_kv_heads, self.ns.head_dim)
                target = torch.empty(shape, dtype=self._dtype, device=device)
            into = self._into(target)
            loaded = await self._fetch(hashes, layer, shard, located, into, args.kv_device(target))
            return kv_span(target, 0, prefix_len(loaded, len(located)) * B)

        return await self._deadline(get(), timeout, "get_layer")

    def _into(self, out: KV) -> Callable[[int, torch.Tensor, ChunkKey], None]:
        """A sink that dequantizes block ``i``'s chunk straight into ``out``'s slice."""
        B = self.ns.block_tokens

        def sink(i: int, buf: torch.Tensor, key: ChunkKey) -> None:
            decode_chunk(buf, out=kv_span(out, i * B, (i + 1) * B), expect_key=key)  # type: ignore[call-overload]

        return sink

    async def _locate(
        self,
        hashes: list[bytes],
        index: int,
        *,
        load_all: bool,
        start: int = 0,
        lookup: Callable[[], Awaitable[list[list[Holder]]]] | None = None,
    ) -> dict[int, list[Holder]]:
        """Block index → the live holders of chunk ``index``, in the order to try them:
        the leading run from block ``start`` of blocks that have one, or (``load_all``)
        every block from ``start`` that has one. ``lookup``: the master's answer for
        ``hashes[start:]`` shared by several layers' reads (one Lookup RPC for them all)."""
        if len(hashes) <= start:
            return {}
        wanted = hashes[start:]
        if lookup is not None:
            holders = await lookup()
        else:
            holders = await self._master.lookup(self.ns.id, wanted, self._chunks_per_block)
        located: dict[int, list[Holder]] = {}
        for i, block in enumerate(holders, start):
            having = self._reads.ranked([h for h in block if h.has(index)])
            if having:
                located[i] = having
            elif not load_all:
                break
        return located

    async def _fetch(
        self,
        hashes: list[bytes],
        layer: int,
        shard: int,
        located: dict[int, list[Holder]],
        sink: Callable[[int, torch.Tensor, ChunkKey], None],
        device: torch.device | None = None,
    ) -> set[int]:
        """Read the located chunks and hand each intact one to ``sink`` (on the loop for
        a few host chunks, else on the codec thread); the block indices loaded.
        ``device``: where ``sink`` decodes to (default the host), so ``ucx://`` reads land
        in that device's staging. ``located[i]``: block ``i``'s holders in the order to
        try them. Each round reads every block still missing from its next holder, one
        read per node per batch (:class:`~kvclient.reads.ChunkReader`); a block whose
        holder failed, passed its per-node deadline or lacked it goes to the next one in
        the next round, within the call's deadline."""
        chunk = layer * self.ns.tp_size + shard
        want = LayerRead(hashes, layer, shard, chunk, staging_device(device))
        todo = {i: list(hs) for i, hs in located.items() if hs}
        loaded: set[int] = set()
        while todo:
            plan: dict[str, list[int]] = {}
            for i, holders in todo.items():
                plan.setdefault(holders[0].data_uri, []).append(i)
            if any(uri not in self._by_uri for uri in plan):
                await self._live_nodes(refresh=True)
            locations = {i: hs[0].location for i, hs in todo.items()}
            got = await asyncio.gather(
                *(
                    self._reads.read(self._by_uri.get(uri), uri, part, want, locations, sink)
                    for uri, idx in plan.items()
                    for part in batches(idx)
                )
            )
            loaded |= set().union(*got)
            todo = {i: hs[1:] for i, hs in todo.items() if i not in loaded and len(hs) > 1}
        return loaded

    # ------------------------------------------------------------------ prefix match

    async def match_prefix(
        self,
        token_ids: Sequence[int] | Any,
        hold_s: float = 0,
        *,
        timeout: float | None = None,
        tag: str | None = None,
    ) -> int:
        """Tokens of ``token_ids`` whose KV is in the pool for every layer and shard.

        A multiple of ``block_tokens``. With ``hold_s > 0`` the matched slots are pinned on
        their nodes for ``hold_s`` seconds so a following read finds them; with a ``tag``
        (e.g. the engine's request id) :meth:`release` lets them go sooner. Raises
        :class:`KVTimeout` and transport errors; a miss is 0.
        """
        hashes = self.block_hashes(token_ids)
        hold_s = args.seconds(hold_s, "hold_s", zero=True)
        if tag is not None:
            args.text(tag, "tag")
        self._limit(timeout)
        if not hashes:
            return 0
        match = self._match(hashes, hold_s, tag)
        return int(await self._deadline(match, timeout, "match_prefix"))

    async def release(self, tag: str, *, timeout: float | None = None) -> int:
        """Release the holds ``match_prefix(..., tag=tag)`` took, before they expire; how
        many holds were released. Unknown tags release nothing. Nodes that cannot be
        reached keep theirs until they expire (logged, never raised)."""
        self._limit(timeout)
        holds = self._holds.pop(args.text(tag, "tag"), [])
        for hashes, _ in holds:
            for h in hashes:
                self._held.pop(h, None)

        async def one(uri: str, hold_id: str) -> bool:
            try:
                return await self._node(uri).unhold(hold_id)
            except TransportError as exc:
                logger.warning("unhold on %s failed: %s", uri, exc)
                return False

        pairs = {ref for _, ref in holds}
        done = self._deadline(asyncio.gather(*(one(u, i) for u, i in pairs)), timeout, "release")
        return sum(await done)

    async def _match(self, hashes: list[bytes], hold_s: float, tag: str | None = None) -> int:
        blocks, holders = await self._master.match_prefix(
            self.ns.id,
            hashes,
            self._chunks_per_block,
            block_tokens=self.ns.block_tokens,
            skip_holders=hold_s <= 0,
        )
        if hold_s > 0 and blocks:
            by_uri: dict[str, list[bytes]] = {}
            for i, block in enumerate(holders[:blocks]):
                for h in block:
                    by_uri.setdefault(h.data_uri, []).append(hashes[i])
            until = self._loop.time() + hold_s * _HOLD_TRUST
            uris = list(by_uri)
            got = await asyncio.gather(*(self._hold(u, by_uri[u], hold_s) for u in uris))
            held = {u: pinned for u, (pinned, _) in zip(uris, got, strict=True)}
            if tag is not None and len(self._holds) < _MAX_HELD:
                refs = [(u, hold_id) for u, (_, hold_id) in zip(uris, got, strict=True) if hold_id]
                self._holds.setdefault(tag, []).extend((tuple(by_uri[r[0]]), r) for r in refs)
            if len(self._held) > _MAX_HELD:
                self._held = {h: t for h, t in self._held.items() if t > self._loop.time()}
            for i, block in enumerate(holders[:blocks]):
                if len(self._held) < _MAX_HELD and all(
                    hashes[i] in held[h.data_uri] for h in block
                ):
                    self._held[hashes[i]] = until
        return blocks * self.ns.block_tokens

    async def _hold(
        self, uri: str, hashes: list[bytes], hold_s: float
    ) -> tuple[set[bytes], str | None]:
        """Pin ``hashes`` on the node at ``uri``; the ones it pinned (a leading run) and
        the hold's id. A node that fails it or does not answer within ``node_timeout_s``
        pins nothing (the match stands; its blocks are read as unheld), and is not asked
        again, nor given this client's new blocks, for a while (:meth:`_node_failed`)."""
        if self._shunned.get(uri, 0.0) > time.monotonic():
            return set(), None  # (it failed this client moments ago: not asked again yet)
        node = NodeClient(uri, self._pool, timeout_s=self.node_timeout_s)
        try:
            held = await node.hold(self.ns.id, hashes, hold_s)
        except (TransportError, KVTimeout) as exc:
            logger.warning("hold on %s failed: %s", uri, exc)
            self._node_failed(uri)
            return set(), None
        return set(hashes[: held.blocks]), held.hold_id


class KVClient(EngineOps, StreamOps, RoutingOps, ObjectOps, ClientCore):
    """Reads and writes one namespace's KV in the pool. Create with :meth:`connect`.

    Not fork-safe: create clients after an engine forks its workers. Safe to use from many
    tasks of one event loop at once; the ``start_*`` calls from any thread.
    """

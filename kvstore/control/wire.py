"""Bounds, validation and protobuf <-> record conversion for the ``kvstore.v1`` control plane.

The master validates every request here before touching state (a violation raises
:class:`kvstore.errors.InvalidArgument`, which the servicer answers as
``INVALID_ARGUMENT``); the master client uses the same converters in the other
direction, so both sides agree on one set of limits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set

from kvstore.control.records import (
    BlockAdd,
    BlockRef,
    ClusterEvent,
    ClusterEventKind,
    CommitBatch,
    Holder,
    Holding,
    NodeInfo,
    NodeRecord,
    ObjectAdd,
    ObjectHolder,
    Tier,
    WatchEvent,
    WatchKind,
    mask_from_bytes,
    mask_to_bytes,
)
from kvstore.core.routing import MAX_INSTANCES, Instance, RouteChoice, RouteScore
from kvstore.dataplane.location import MAX_LOCATION_BYTES
from kvstore.errors import InvalidArgument, ProtocolError
from kvstore.v1 import kvstore_pb2 as pb

__all__ = [
    "ID_BYTES",
    "MAX_BLOCKS",
    "MAX_CHUNKS",
    "MAX_COMMIT_ITEMS",
    "MAX_COUNTERS",
    "MAX_KEY_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_NAME_LEN",
    "MAX_NIXL_METADATA",
    "MAX_TEXT_LEN",
    "MAX_TIERS",
    "block_holders_to_pb",
    "check_block_hashes",
    "check_chunks_per_block",
    "check_commit",
    "check_counters",
    "check_key",
    "check_node_id",
    "check_ns_id",
    "check_text",
    "commit_from_pb",
    "commit_to_pb",
    "holders_from_pb",
    "node_info_from_pb",
    "node_info_to_pb",
    "object_holder_from_pb",
    "record_from_register",
    "tiers_from_pb",
    "tiers_to_pb",
    "watch_event_from_pb",
    "watch_event_to_pb",
]

ID_BYTES = 16
"""Length of an ``ns_id`` and of a block hash (xxh3-128 digests)."""
MAX_BLOCKS = 65536
"""Block hashes per Lookup / MatchPrefix / Watch / Abort request."""
MAX_CHUNKS = 65536
"""Chunk indices and ``chunks_per_block`` are below this (num_layers * tp_size)."""
MAX_COMMIT_ITEMS = 65536
"""Items per list of a Commit (adds, evicts, object adds, object removes)."""
MAX_TIERS = 16
MAX_COUNTERS = 256
MAX_NAME_LEN = 256
"""Node ids, tier names, counter names, transport, version, host."""
MAX_TEXT_LEN = 4096
"""Data URIs and reasons."""
MAX_KEY_BYTES = 1024
"""``put_object`` keys, UTF-8 encoded."""
MAX_NIXL_METADATA = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20
"""gRPC send/receive message limit on both sides."""

_WATCH_KIND_TO_PB = {
    WatchKind.COMMIT: pb.WatchEvent.COMMIT,
    WatchKind.EVICT: pb.WatchEvent.EVICT,
    WatchKind.ABORT: pb.WatchEvent.ABORT,
    WatchKind.SNAPSHOT_DONE: pb.WatchEvent.SNAPSHOT_DONE,
}
_WATCH_KIND_FROM_PB = {v: k for k, v in _WATCH_KIND_TO_PB.items()}


# -- validation ---------------------------------------------------------------------------


def check_ns_id(ns_id: bytes) -> bytes:
    """``ns_id`` if it is 16 bytes, else InvalidArgument."""
    if len(ns_id) != ID_BYTES:
        raise InvalidArgument(f"ns_id must be {ID_BYTES} bytes, got {len(ns_id)}")
    return bytes(ns_id)


def check_block_hashes(hashes: Sequence[bytes], *, allow_empty: bool = True) -> list[bytes]:
    """The hashes as a list if there are at most MAX_BLOCKS of 16 bytes each."""
    if len(hashes) > MAX_BLOCKS:
        raise InvalidArgument(
            f"{len(hashes)} block hashes in one request; the limit is {MAX_BLOCKS}"
        )
    if not hashes and not allow_empty:
        raise InvalidArgument("no block hashes given")
    out = [bytes(h) for h in hashes]
    for i, h in enumerate(out):
        if len(h) != ID_BYTES:
            raise InvalidArgument(f"block hash {i} is {len(h)} bytes, expected {ID_BYTES}")
    return out


def check_chunks_per_block(n: int, *, required: bool) -> int:
    """``n`` if ``0 <= n < MAX_CHUNKS`` (and ``n >= 1`` when required)."""
    if n >= MAX_CHUNKS or n < 0:
        raise InvalidArgument(f"chunks_per_block {n} out of range [0, {MAX_CHUNKS})")
    if required and n == 0:
        raise InvalidArgument("chunks_per_block must be >= 1 (num_layers * tp_size)")
    return n


def check_node_id(node_id: str) -> str:
    """``node_id`` if non-empty, printable, without whitespace and at most MAX_NAME_LEN."""
    if not node_id or len(node_id) > MAX_NAME_LEN:
        raise InvalidArgument(f"node id must be 1..{MAX_NAME_LEN} characters")
    # (Of the printable characters only " " is whitespace: one search, not one call a character.)
    if not node_id.isprintable() or " " in node_id:
        raise InvalidArgument(f"node id {node_id!r} has whitespace or unprintable characters")
    return node_id


def check_text(value: str, what: str, limit: int = MAX_TEXT_LEN) -> str:
    """``value`` if at most ``limit`` characters."""
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters; the limit is {limit}")
    return value


def check_key(key: str) -> str:
    """An object key: non-empty, at most MAX_KEY_BYTES UTF-8 bytes."""
    if not key or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidArgument(f"object key must be 1..{MAX_KEY_BYTES} bytes")
    return key


def check_counters(counters: Mapping[str, int]) -> dict[str, int]:
    """At most MAX_COUNTERS named counters with short names."""
    if len(counters) > MAX_COUNTERS:
        raise InvalidArgument(f"{len(counters)} counters; the limit is {MAX_COUNTERS}")
    for name in counters:
        check_text(name, "counter name", MAX_NAME_LEN)
    return dict(counters)


def _check_chunks(chunks: Iterable[int]) -> tuple[int, ...]:
    out = tuple(chunks)
    if len(out) > MAX_CHUNKS:
        raise InvalidArgument(f"{len(out)} chunks for one block; the limit is {MAX_CHUNKS}")
    for c in out:
        if not 0 <= c < MAX_CHUNKS:
            raise InvalidArgument(f"chunk index {c} out of range [0, {MAX_CHUNKS})")
    return out


def _check_count(n: int, what: str, limit: int = MAX_COMMIT_ITEMS) -> None:
    if n > limit:
        raise InvalidArgument(f"{n} {what} in one request; the limit is {limit}")


# -- tiers and nodes ----------------------------------------------------------------------


def tiers_from_pb(tiers: Sequence[pb.Tier] | Sequence[Tier]) -> tuple[Tier, ...]:
    """Validated tiers (at most MAX_TIERS, short names, used <= capacity not required), from
    their messages or records."""
    _check_count(len(tiers), "tiers", MAX_TIERS)
    return tuple(
        Tier(check_text(t.name, "tier name", MAX_NAME_LEN), t.capacity_bytes, t.used_bytes)
        for t in tiers
    )


def tiers_to_pb(tiers: Iterable[Tier]) -> list[pb.Tier]:
    """Tiers as protobuf messages."""
    return [
        pb.Tier(name=t.name, capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes)
        for t in tiers
    ]


def record_from_register(req: pb.RegisterRequest) -> NodeRecord:
    """A validated :class:`NodeRecord` (epoch 0) from a Register request."""
    if len(req.nixl_metadata) > MAX_NIXL_METADATA:
        raise InvalidArgument(f"nixl_metadata is over {MAX_NIXL_METADATA} bytes")
    if not req.data_uri:
        raise InvalidArgument("data_uri is required")
    return NodeRecord(
        node_id=check_node_id(req.node_id),
        data_uri=check_text(req.data_uri, "data_uri"),
        transport=check_text(req.transport or "tcp", "transport", MAX_NAME_LEN),
        nixl_metadata=bytes(req.nixl_metadata),
        tiers=tiers_from_pb(req.tiers),
        version=check_text(req.version, "version", MAX_NAME_LEN),
        host=check_text(req.host, "host", MAX_NAME_LEN),
    )


def node_info_to_pb(info: NodeInfo) -> pb.NodeInfo:
    """A :class:`NodeInfo` as its protobuf message."""
    return pb.NodeInfo(
        node_id=info.node_id,
        alive=info.alive,
        suspect=info.suspect,
        draining=info.draining,
        lease_age_s=info.lease_age_s,
        epoch=info.epoch,
        data_uri=info.data_uri,
        transport=info.transport,
        nixl_metadata=info.nixl_metadata,
        tiers=tiers_to_pb(info.tiers),
        version=info.version,
        host=info.host,
        counters=dict(info.counters),
    )


def node_info_from_pb(msg: pb.NodeInfo) -> NodeInfo:
    """Inverse of :func:`node_info_to_pb`."""
    return NodeInfo(
        node_id=msg.node_id,
        alive=msg.alive,
        suspect=msg.suspect,
        draining=msg.draining,
        lease_age_s=msg.lease_age_s,
        epoch=msg.epoch,
        data_uri=msg.data_uri,
        transport=msg.transport,
        nixl_metadata=bytes(msg.nixl_metadata),
        tiers=tuple(Tier(t.name, t.capacity_bytes, t.used_bytes) for t in msg.tiers),
        version=msg.version,
        host=msg.host,
        counters=dict(msg.counters),
    )


# -- commits ------------------------------------------------------------------------------


def commit_from_pb(req: pb.CommitRequest) -> CommitBatch:
    """A validated :class:`CommitBatch` from a Commit request (seq must be >= 1)."""
    for n, what in (
        (len(req.adds), "adds"),
        (len(req.evicts), "evicts"),
        (len(req.object_adds), "object adds"),
        (len(req.object_removes), "object removes"),
    ):
        _check_count(n, what)
    return check_commit(
        CommitBatch(
            req.node_id,
            req.epoch,
            req.seq,
            tuple(BlockAdd(a.ns_id, a.block_hash, tuple(a.chunks), a.location) for a in req.adds),
            tuple(BlockRef(e.ns_id, e.block_hash) for e in req.evicts),
            tuple(ObjectAdd(o.key, o.nbytes, o.version) for o in req.object_adds),
            tuple(req.object_removes),
            tiers_from_pb(req.tiers),
        )
    )


def check_commit(batch: CommitBatch) -> CommitBatch:
    """``batch`` with every field checked as a Commit request's is (seq >= 1, counts, id and
    hash lengths, chunk indices, object keys); InvalidArgument otherwise.

    A batch already made of valid records and tuples (a node's, or :func:`commit_from_pb`'s)
    is returned as it is: rebuilding it gives an equal one, and took 14 µs of the ~100 µs
    that a commit of 8 adds and 8 evictions cost the master (``bench/commit_path.py``; the
    test alone: 2.5 µs). Anything else is checked and rebuilt field by field, which also
    gives every error its message."""
    check_node_id(batch.node_id)
    if batch.seq < 1:
        raise InvalidArgument("commit seq must be >= 1")
    if _plain(batch):
        return batch
    for items, what in (
        (batch.adds, "adds"),
        (batch.evicts, "evicts"),
        (batch.object_adds, "object adds"),
        (batch.object_removes, "object removes"),
    ):
        _check_count(len(items), what)
    adds = tuple(
        BlockAdd(
            check_ns_id(a.ns_id),
            _check_hash(a.block_hash),
            _check_chunks(a.chunks),
            _check_location(a.location),
        )
        for a in batch.adds
    )
    evicts = tuple(BlockRef(check_ns_id(e.ns_id), _check_hash(e.block_hash)) for e in batch.evicts)
    objects = tuple(ObjectAdd(check_key(o.key), o.nbytes, o.version) for o in batch.object_adds)
    removes = tuple(check_key(k) for k in batch.object_removes)
    tiers = tiers_from_pb(batch.tiers)
    return CommitBatch(batch.node_id, batch.epoch, batch.seq, adds, evicts, objects, removes, tiers)


def _plain(batch: CommitBatch) -> bool:
    """True if :func:`check_commit` would accept ``batch`` and rebuild it into an equal
    batch: exact records in tuples, every id, hash, chunk index, location and tier name
    within its bounds, no object changes (rare; those take the full check). False says
    nothing about validity; it never raises."""
    if type(batch) is not CommitBatch or batch.object_adds != () or batch.object_removes != ():
        return False  # (not `()`: object changes, lists, None: the full check says which)
    adds, evicts, tiers = batch.adds, batch.evicts, batch.tiers
    if type(adds) is not tuple or type(evicts) is not tuple or type(tiers) is not tuple:
        return False
    if len(adds) > MAX_COMMIT_ITEMS or len(evicts) > MAX_COMMIT_ITEMS or len(tiers) > MAX_TIERS:
        return False
    try:
        for a in adds:
            if type(a) is not BlockAdd:
                return False
            ns_id, block_hash, chunks, location = a.ns_id, a.block_hash, a.chunks, a.location
            if (
                type(ns_id) is not bytes
                or len(ns_id) != ID_BYTES
                or type(block_hash) is not bytes
                or len(block_hash) != ID_BYTES
                or type(chunks) is not tuple
                or len(chunks) > MAX_CHUNKS
                or type(location) is not bytes
                or len(location) > MAX_LOCATION_BYTES
            ):
                return False
            for c in chunks:  # (the test _check_chunks makes, inline)
                if not 0 <= c < MAX_CHUNKS:
                    return False
        for e in evicts:
            if (
                type(e) is not BlockRef
                or type(e.ns_id) is not bytes
                or len(e.ns_id) != ID_BYTES
                or type(e.block_hash) is not bytes
                or len(e.block_hash) != ID_BYTES
            ):
                return False
        for t in tiers:
            if type(t) is not Tier or type(t.name) is not str or len(t.name) > MAX_NAME_LEN:
                return False
    except Exception:  # (a malformed item: the full check says what is wrong with it)
        return False
    return True


def _check_location(raw: bytes) -> bytes:
    if len(raw) > MAX_LOCATION_BYTES:
        raise InvalidArgument(f"slot location is {len(raw)} bytes, at most {MAX_LOCATION_BYTES}")
    return bytes(raw)


def _check_hash(h: bytes) -> bytes:
    if len(h) != ID_BYTES:
        raise InvalidArgument(f"block hash is {len(h)} bytes, expected {ID_BYTES}")
    return bytes(h)


def commit_to_pb(batch: CommitBatch) -> pb.CommitRequest:
    """A :class:`CommitBatch` as a Commit request."""
    return pb.CommitRequest(
        node_id=batch.node_id,
        epoch=batch.epoch,
        seq=batch.seq,
        adds=[
            pb.BlockAdd(
                ns_id=a.ns_id, block_hash=a.block_hash, chunks=a.chunks, location=a.location
            )
            for a in batch.adds
        ],
        evicts=[pb.BlockRef(ns_id=e.ns_id, block_hash=e.block_hash) for e in batch.evicts],
        object_adds=[
            pb.ObjectAdd(key=o.key, nbytes=o.nbytes, version=o.version) for o in batch.object_adds
        ],
        object_removes=list(batch.object_removes),
        tiers=tiers_to_pb(batch.tiers),
    )


# -- holders and events -------------------------------------------------------------------


def block_holders_to_pb(
    holders: Mapping[str, Holding],
    uris: Mapping[str, str],
    chunks_per_block: int,
    last: Set[str] = frozenset(),
) -> pb.BlockHolders:
    """One block's holders (by node id, those in ``last`` — suspect nodes — after the
    others) with their data URIs; nodes without a known URI are left out."""
    return pb.BlockHolders(
        holders=[
            pb.Holder(
                node_id=node,
                data_uri=uris[node],
                epoch=h.epoch,
                mask=mask_to_bytes(h.mask, chunks_per_block),
                location=h.location,
            )
            for node, h in sorted(holders.items(), key=lambda item: (item[0] in last, item[0]))
            if node in uris
        ]
    )


def holders_from_pb(msg: pb.BlockHolders) -> list[Holder]:
    """One block's holders as :class:`Holder` records."""
    return [
        Holder(h.node_id, h.data_uri, h.epoch, mask_from_bytes(h.mask), h.location)
        for h in msg.holders
    ]


def object_holder_from_pb(msg: pb.ObjectHolder) -> ObjectHolder:
    """An object holder record from its message."""
    return ObjectHolder(msg.node_id, msg.epoch, msg.nbytes, msg.data_uri, msg.version)


def route_instances_from_pb(msgs: Sequence[pb.RouteInstance]) -> list[Instance]:
    """Validated routing instances (at most MAX_INSTANCES, short ids)."""
    _check_count(len(msgs), "instances", MAX_INSTANCES)
    return [
        Instance(check_text(m.id, "instance id", MAX_NAME_LEN), m.active_tokens, m.cached_tokens)
        for m in msgs
    ]


def route_instances_to_pb(instances: Sequence[Instance]) -> list[pb.RouteInstance]:
    """Routing instances as messages."""
    return [
        pb.RouteInstance(id=i.id, active_tokens=i.active_tokens, cached_tokens=i.cached_tokens)
        for i in instances
    ]


def route_choice_to_pb(choice: RouteChoice) -> pb.RouteResponse:
    """A routing decision as a Route response."""
    return pb.RouteResponse(
        choice=choice.choice,
        pool_tokens=choice.pool_tokens,
        scores=[pb.RouteScore(id=s.id, own_tokens=s.own_tokens, pool_tokens=s.pool_tokens,
                              prefill_tokens=s.prefill_tokens, loaded_tokens=s.loaded_tokens,
                              active_tokens=s.active_tokens, cost=s.cost)
                for s in choice.scores],
    )  # fmt: skip


def route_choice_from_pb(msg: pb.RouteResponse) -> RouteChoice:
    """Inverse of :func:`route_choice_to_pb`."""
    scores = tuple(
        RouteScore(s.id, s.own_tokens, s.pool_tokens, s.prefill_tokens, s.loaded_tokens,
                   s.active_tokens, s.cost)
        for s in msg.scores
    )  # fmt: skip
    return RouteChoice(msg.choice, msg.pool_tokens, scores)


def cluster_event_to_pb(event: ClusterEvent) -> pb.ClusterEvent:
    """A :class:`~kvstore.control.records.ClusterEvent` as its message."""
    return pb.ClusterEvent(
        seq=event.seq, kind=event.kind.value,  # type: ignore[arg-type]
        ns_id=event.ns_id, block_hash=event.block_hash,
        node_id=event.node_id, epoch=event.epoch, chunks=event.chunks, medium=event.medium,
        reason=event.reason,
    )  # fmt: skip


def cluster_event_from_pb(msg: pb.ClusterEvent) -> ClusterEvent:
    """Inverse of :func:`cluster_event_to_pb`; an unknown kind raises ProtocolError."""
    try:
        kind = ClusterEventKind(msg.kind)
    except ValueError:
        raise ProtocolError(f"unknown cluster event kind {msg.kind}") from None
    return ClusterEvent(
        msg.seq, kind, msg.ns_id, msg.block_hash, msg.node_id, msg.epoch, tuple(msg.chunks),
        msg.medium, msg.reason,
    )  # fmt: skip


def watch_event_to_pb(event: WatchEvent) -> pb.WatchEvent:
    """A :class:`WatchEvent` as its message."""
    return pb.WatchEvent(
        kind=_WATCH_KIND_TO_PB[event.kind],
        block_index=event.block_index,
        chunks=event.chunks,
        node_id=event.node_id,
        epoch=event.epoch,
        reason=event.reason,
        location=event.location,
    )


def watch_event_from_pb(msg: pb.WatchEvent) -> WatchEvent:
    """Inverse of :func:`watch_event_to_pb`; an unknown kind raises ProtocolError."""
    kind = _WATCH_KIND_FROM_PB.get(msg.kind)
    if kind is None:
        raise ProtocolError(f"unknown watch event kind {msg.kind}")
    return WatchEvent(
        kind, msg.block_index, tuple(msg.chunks), msg.node_id, msg.epoch, msg.reason, msg.location
    )

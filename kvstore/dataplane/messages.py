"""Messages of the node's data-plane exchange: one typed class per message, built and parsed
here and nowhere else. They travel as frame headers (``kvstore.transport.framing`` draws the
bytes of a frame); byte strings travel as lowercase hex. Imports neither torch nor NIXL.

One request is in flight per connection; every exchange starts with a client header whose
``op`` names it. A node with the cluster secret first runs the handshake of
:mod:`kvstore.dataplane.handshake` (hello, challenge, proof) on each new connection. A
chunk is named by ``(block hash, chunk index)`` with ``chunk index = layer * tp_size +
shard``::

    put       C: Put{op: put, ns: <canonical ns hex>, chunks: [[block, parent, index, nbytes]..],
                     wait_s} + one buffer per chunk, in order   (tcp://: one round trip)
              N: Ack{op: ack, stored, skipped, failed: [i ..], busy: [i ..]}
                   | Error                      (REJECT: nothing stored; the payload is read)
                   After the master commit. skipped: landed here already; failed: positions
                   whose chunk failed a check; busy: another writer's transfer of the chunk
                   did not end within wait_s (the node waits that long for it, and stores
                   this writer's copy if that transfer fails), or its slot is quarantined —
                   not stored. wait_s: how long this writer may wait for another writer.
    reserve   C: Put{op: reserve, ...}                  (ucx://, no payload)
              N: Ready{op: reserved, accept: [0|1|2 ..], spans: [[addr, nbytes, dev, mem] ..]}
                   STORED 0: landed here already; SEND 1: write it into its span; BUSY 2:
                   as for put (not stored, write nothing). One span per SEND chunk; the
                   slots are pinned.
              C: one-sided NIXL WRITE of each SEND chunk into its span, then Landed{op: landed}
              N: Ack as for put     (no ``landed`` within the I/O timeout: the slots are
                   quarantined, since the writer may still be writing into them)
                   With {writer, grant: [index ..]} in the reserve (or write): the Ack also
                   carries grants: [[position, index, location] ..], grant_s — that chunk of
                   that block is claimed for this writer for grant_s, its slot pinned.
    write     C: one-sided NIXL WRITE of each chunk at its grant's location, then
                 Put{op: write, ns, chunks, writer, grant}             (ucx://, granted)
              N: Ack as for put  (a chunk without a live grant of this writer: failed)
    get       C: Get{op: get, ns_id, chunks: [[block, index] ..]}
              N: Found{op: data, found: [0|1 ..]} + one buffer per found chunk
    lease     C: Lease{op: lease, ns_id, chunks, lease_s}              (ucx://)
              N: Leased{op: leased, found, spans, lease_s}   (pinned <= lease_s)
              C: one-sided NIXL READ of the spans, then Release{op: release} (no answer)
                   (a reader that reads after its lease expired verifies each chunk's key
                   and checksum: a reused slot is a miss, never another block's bytes)
    hold      C: Hold{op: hold, ns_id, blocks: [block ..], ttl_s}
              N: Held{op: held, hold_id, blocks: n}  (n leading blocks pinned until ttl/unhold)
    unhold    C: Unhold{op: unhold, hold_id}           N: Unheld{op: ok, released: bool}
    put_object C: PutObject{op: put_object, key, nbytes}   N: Ready{accept: [1]} | Error
              C: Data + 1 buffer                       N: Ack{stored: 1}
    get_object C: GetObject{op: get_object, key}       N: Found{found: [0|1]} + 0|1 buffer
    remove_object C: RemoveObject{op: remove_object, key}  N: Removed{op: ok, removed: bool}
    evict     C: Evict{op: evict, ns_id, blocks?: [block ..]}   (operator; all of ns_id if no
              N: Evicted{op: evicted, evicted: n, kept: n}      blocks; pinned ones kept)
    report    C: Report{op: report, ns_id, chunks}     (chunks that failed a reader's check)
              N: Reported{op: reported, dropped: n}    (each re-checked; a bad one dropped)
    stats     C: Stats{op: stats}                      N: NodeStats{op: stats, ...counters}

Error{op: error, code, message} answers any request; its code maps to the exception tree:
``invalid`` → InvalidArgument, ``shape`` → BadShape, ``namespace`` → NamespaceMismatch,
``capacity`` → CapacityError, ``protocol`` → ProtocolError, ``unauthorized`` → Unauthorized
(the connection's handshake failed, :mod:`kvstore.dataplane.handshake`), ``forbidden`` →
PermissionDenied (the connection's role may not make this request), ``master`` →
MasterUnreachable (the node could not commit the request's changes to the master),
``internal`` → TransportError.
Every parser checks types and bounds (:data:`MAX_CHUNKS_PER_REQUEST`, :data:`MAX_KEY_LEN`)
and raises :class:`~kvstore.errors.ProtocolError` for anything malformed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Self, TypeVar

from kvstore.dataplane.fields import (
    MAX_CHUNKS_PER_REQUEST,
    MAX_GRANT_CHUNKS,
    MAX_KEY_LEN,
    MAX_NS_HEX,
    MAX_WRITER_LEN,
)
from kvstore.dataplane.fields import count_of as _count
from kvstore.dataplane.fields import field_of as _field
from kvstore.dataplane.fields import hex16 as _hex16
from kvstore.dataplane.fields import ints_of as _ints
from kvstore.dataplane.fields import list_of as _list
from kvstore.dataplane.fields import number_of as _number
from kvstore.dataplane.fields import object_key_of as _key
from kvstore.dataplane.fields import spans_of as _spans
from kvstore.dataplane.fields import tenant_of as _tenant
from kvstore.errors import (
    BadShape,
    CapacityError,
    InvalidArgument,
    KVStoreError,
    MasterUnreachable,
    NamespaceMismatch,
    PermissionDenied,
    ProtocolError,
    TransportError,
    Unauthorized,
)

__all__ = [
    "BUSY",
    "MAX_CHUNKS_PER_REQUEST",
    "MAX_KEY_LEN",
    "MAX_NS_HEX",
    "REQUESTS",
    "SEND",
    "STORED",
    "Ack",
    "ChunkRef",
    "Data",
    "Error",
    "Evict",
    "Evicted",
    "Found",
    "Get",
    "GetObject",
    "Held",
    "Hold",
    "Landed",
    "Lease",
    "Leased",
    "Message",
    "NodeStats",
    "Put",
    "PutChunk",
    "PutObject",
    "Ready",
    "Release",
    "RemoveObject",
    "Removed",
    "Report",
    "Reported",
    "Stats",
    "Unheld",
    "Unhold",
    "error_for",
    "expect",
    "parse_request",
]

STORED = 0
"""``accept`` value: the chunk is landed and checked on this node already; not sent."""
SEND = 1
"""``accept`` value: send this chunk; this exchange has claimed it."""
BUSY = 2
"""``accept`` value: another writer's transfer of this chunk is in flight (or its slot is
quarantined); it is not stored, and this writer sends nothing for it."""

_CODES: dict[str, type[KVStoreError]] = {
    "invalid": InvalidArgument,
    "shape": BadShape,
    "namespace": NamespaceMismatch,
    "capacity": CapacityError,
    "protocol": ProtocolError,
    "forbidden": PermissionDenied,
    "unauthorized": Unauthorized,
    "master": MasterUnreachable,
    "internal": TransportError,
}

M = TypeVar("M", bound="Message")


# ----------------------------------------------------------------------------- messages


class Message:
    """A data-plane message: ``OP`` names it on the wire; :meth:`header` builds the frame
    header and :meth:`parse` reads one (raising :class:`ProtocolError`)."""

    OP: ClassVar[str]

    def header(self) -> dict[str, Any]:
        """The frame header carrying this message."""
        return {"op": self.OP}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        """The message ``header`` carries; :class:`ProtocolError` when it is malformed."""
        return cls()


class PutChunk(NamedTuple):
    """One chunk a put names: its block, the block before it (None for the first), its chunk
    index in the block's slot (``layer * tp_size + shard``) and its encoded size."""

    block: bytes
    parent: bytes | None
    chunk: int
    nbytes: int


class ChunkRef(NamedTuple):
    """One chunk a read names: ``(block hash, chunk index)``."""

    block: bytes
    chunk: int


def _refs(header: dict[str, Any]) -> tuple[ChunkRef, ...]:
    refs = []
    for item in _list(header, "chunks"):
        if not isinstance(item, list) or len(item) != 2 or type(item[1]) is not int:
            raise ProtocolError("a chunk is [block, index]")
        refs.append(ChunkRef(_hex16(item[0]), item[1]))
    return tuple(refs)


def _refs_wire(refs: tuple[ChunkRef, ...]) -> list[list[Any]]:
    return [[r.block.hex(), r.chunk] for r in refs]


@dataclass(frozen=True, slots=True)
class Put(Message):
    """A put: over ``tcp://`` (``ucx=False``, op ``put``) the chunks travel in this frame's
    payload; over ``ucx://`` (op ``reserve``) the writer WRITEs them into the spans of the
    :class:`Ready` answer and says :class:`Landed`; with ``granted`` (op ``write``) it has
    WRITTEN them already, into slots a grant of an earlier ack gave it.

    ``writer`` names the writer (grants are its own); ``grant``: the chunk indices of these
    blocks it will write next (``ucx://``), which the ack may grant."""

    OP: ClassVar[str] = "put"
    ns: bytes
    """The namespace's canonical bytes."""
    chunks: tuple[PutChunk, ...]
    wait_s: float = 0.0
    ucx: bool = False
    granted: bool = False
    writer: str = ""
    grant: tuple[int, ...] = ()
    tenant: str = ""
    """The tenant the chunks are stored for: only a node (a drain's copies) or an admin
    names one; a client's puts are its own tenant's (:mod:`kvstore.core.tenancy`)."""

    @property
    def op(self) -> str:
        """``put``, ``reserve`` or ``write``."""
        return "write" if self.granted else "reserve" if self.ucx else "put"

    def header(self) -> dict[str, Any]:
        spec = [[c.block.hex(), c.parent.hex() if c.parent else "", c.chunk, c.nbytes]
                for c in self.chunks]  # fmt: skip
        out = {"op": self.op, "ns": self.ns.hex(), "chunks": spec, "wait_s": self.wait_s}
        if self.writer:
            out["writer"], out["grant"] = self.writer, list(self.grant)
        if self.tenant:
            out["tenant"] = self.tenant
        return out

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        ns = _field(header, "ns", str)
        if len(ns) > MAX_NS_HEX:
            raise ProtocolError("field 'ns' is too long for a canonical namespace")
        try:
            raw = bytes.fromhex(ns)
        except ValueError as exc:
            raise ProtocolError("field 'ns' is not hex") from exc
        chunks = []
        before: tuple[str, bytes] | None = None  # the previous chunk's block: as sent, parsed
        for item in _list(header, "chunks"):
            if not isinstance(item, list) or len(item) != 4:
                raise ProtocolError("a put chunk is [block, parent, index, nbytes]")
            block, parent, index, nbytes = item
            if type(index) is not int or type(nbytes) is not int:
                raise ProtocolError("a put chunk's index and nbytes are ints")
            if not parent:
                up = None
            elif before is not None and parent == before[0]:
                up = before[1]  # (mostly the block before it in the same put: parsed once)
            else:
                up = _hex16(parent, "parent")
            before = (block, _hex16(block))
            chunks.append(PutChunk(before[1], up, index, nbytes))
        op = header["op"]
        writer = _field(header, "writer", str, "")
        if len(writer) > MAX_WRITER_LEN:
            raise ProtocolError(f"field 'writer' is longer than {MAX_WRITER_LEN}")
        grant = _ints(header, "grant") if "grant" in header else ()
        if len(grant) > MAX_GRANT_CHUNKS:
            raise ProtocolError(f"a put asks for at most {MAX_GRANT_CHUNKS} chunks per block")
        if op == "write" and not writer:
            raise ProtocolError("a 'write' names its writer")
        return cls(raw, tuple(chunks), _number(header, "wait_s", 0.0), op != "put",
                   op == "write", writer, grant, _tenant(header))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """The node's answer to a ``ucx://`` put (``reserved``): what to write (``accept``) and
    where; also its answer to ``put_object`` (``ready``: send the value)."""

    OP: ClassVar[str] = "ready"
    accept: tuple[int, ...]
    spans: tuple[tuple[int, ...], ...] | None = None
    """One ``Span.to_wire()`` per SEND chunk (``ucx://`` only)."""

    def header(self) -> dict[str, Any]:
        if self.spans is None:
            return {"op": "ready", "accept": list(self.accept)}
        return {
            "op": "reserved",
            "accept": list(self.accept),
            "spans": [list(s) for s in self.spans],
        }

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        accept = _ints(header, "accept")
        if any(a not in (STORED, SEND, BUSY) for a in accept):
            raise ProtocolError(f"accept values are {STORED}, {SEND} or {BUSY}")
        spans = _spans(header) if header.get("op") == "reserved" else None
        if spans is not None and len(spans) != accept.count(SEND):
            raise ProtocolError("a reserved answer has one span per chunk to send")
        return cls(accept, spans)

    def sending(self) -> list[int]:
        """Positions of the chunks to send."""
        return [i for i, a in enumerate(self.accept) if a == SEND]


@dataclass(frozen=True, slots=True)
class Data(Message):
    """The frame that carries a put's payload buffers."""

    OP: ClassVar[str] = "data"


@dataclass(frozen=True, slots=True)
class Landed(Message):
    """``ucx://``: the writer's WRITEs of every SEND chunk completed."""

    OP: ClassVar[str] = "landed"


@dataclass(frozen=True, slots=True)
class Ack(Message):
    """The end of a put: chunks stored, skipped (landed already), and the request positions
    that failed a check or were busy (neither is stored). ``grants``: ``(position, chunk
    index, slot location)`` — the writer may WRITE that chunk of that position's block at
    the location (:class:`~kvstore.dataplane.location.SlotLocation`) and then say so with a
    ``write``, for ``grant_s`` seconds from the node's sending this ack."""

    OP: ClassVar[str] = "ack"
    stored: int
    skipped: int = 0
    failed: tuple[int, ...] = ()
    busy: tuple[int, ...] = ()
    grants: tuple[tuple[int, int, bytes], ...] = ()
    grant_s: float = 0.0

    def header(self) -> dict[str, Any]:
        out = {"op": "ack", "stored": self.stored, "skipped": self.skipped,
               "failed": list(self.failed), "busy": list(self.busy)}  # fmt: skip
        if self.grants:
            out["grants"] = [[p, c, loc.hex()] for p, c, loc in self.grants]
            out["grant_s"] = self.grant_s
        return out

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        grants = []
        for item in _list(header, "grants", empty=True) if "grants" in header else []:
            if not isinstance(item, list) or len(item) != 3:
                raise ProtocolError("a grant is [position, chunk index, location]")
            position, chunk, loc = item
            if type(position) is not int or type(chunk) is not int or not isinstance(loc, str):
                raise ProtocolError("a grant is [int, int, hex]")
            try:
                grants.append((position, chunk, bytes.fromhex(loc)))
            except ValueError as exc:
                raise ProtocolError("a grant's location is not hex") from exc
        return cls(_count(header, "stored"), _count(header, "skipped"),
                   _ints(header, "failed"), _ints(header, "busy"), tuple(grants),
                   _number(header, "grant_s", 0.0))  # fmt: skip

    def not_stored(self) -> set[int]:
        """Request positions whose chunk is not stored."""
        return {*self.failed, *self.busy}


@dataclass(frozen=True, slots=True)
class Get(Message):
    """Read chunks over ``tcp://``: the answer is :class:`Found` plus their bytes."""

    OP: ClassVar[str] = "get"
    ns_id: bytes
    chunks: tuple[ChunkRef, ...]

    def header(self) -> dict[str, Any]:
        return {"op": "get", "ns_id": self.ns_id.hex(), "chunks": _refs_wire(self.chunks)}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_hex16(header.get("ns_id"), "ns_id"), _refs(header))


@dataclass(frozen=True, slots=True)
class Found(Message):
    """Which of the named chunks (or the object) are here; their bytes follow in order."""

    OP: ClassVar[str] = "data"
    found: tuple[int, ...]

    def header(self) -> dict[str, Any]:
        return {"op": "data", "found": list(self.found)}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        found = _ints(header, "found")
        if any(f not in (0, 1) for f in found):
            raise ProtocolError("found values are 0 or 1")
        return cls(found)

    def present(self, expected: int) -> list[int]:
        """Positions found, after checking the answer names ``expected`` chunks."""
        if len(self.found) != expected:
            raise ProtocolError(f"answer names {len(self.found)} chunks, asked for {expected}")
        return [i for i, f in enumerate(self.found) if f]


@dataclass(frozen=True, slots=True)
class Lease(Message):
    """``ucx://`` read: pin the named chunks for at most ``lease_s`` and send their spans."""

    OP: ClassVar[str] = "lease"
    ns_id: bytes
    chunks: tuple[ChunkRef, ...]
    lease_s: float

    def header(self) -> dict[str, Any]:
        return {"op": "lease", "ns_id": self.ns_id.hex(), "chunks": _refs_wire(self.chunks),
                "lease_s": self.lease_s}  # fmt: skip

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_hex16(header.get("ns_id"), "ns_id"), _refs(header),
                   _number(header, "lease_s", 10.0))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Leased(Message):
    """The chunks found, one span per found chunk, and the lease the node granted."""

    OP: ClassVar[str] = "leased"
    found: tuple[int, ...]
    spans: tuple[tuple[int, ...], ...]
    lease_s: float

    def header(self) -> dict[str, Any]:
        return {"op": "leased", "found": list(self.found),
                "spans": [list(s) for s in self.spans], "lease_s": self.lease_s}  # fmt: skip

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        found = Found.parse(header).found
        spans = _spans(header)
        if len(spans) != sum(found):
            raise ProtocolError("a leased answer has one span per chunk found")
        return cls(found, spans, _number(header, "lease_s"))


@dataclass(frozen=True, slots=True)
class Release(Message):
    """The reader is done with its lease (no answer)."""

    OP: ClassVar[str] = "release"


@dataclass(frozen=True, slots=True)
class Hold(Message):
    """Pin the leading present blocks of ``blocks`` for ``ttl_s`` (a held prefix match)."""

    OP: ClassVar[str] = "hold"
    ns_id: bytes
    blocks: tuple[bytes, ...]
    ttl_s: float

    def header(self) -> dict[str, Any]:
        return {"op": "hold", "ns_id": self.ns_id.hex(), "blocks": [b.hex() for b in self.blocks],
                "ttl_s": self.ttl_s}  # fmt: skip

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        blocks = tuple(_hex16(b) for b in _list(header, "blocks", empty=True))
        return cls(_hex16(header.get("ns_id"), "ns_id"), blocks, _number(header, "ttl_s"))


@dataclass(frozen=True, slots=True)
class Held(Message):
    """A hold's id and how many leading blocks it pins."""

    OP: ClassVar[str] = "held"
    hold_id: str
    blocks: int

    def header(self) -> dict[str, Any]:
        return {"op": "held", "hold_id": self.hold_id, "blocks": self.blocks}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_field(header, "hold_id", str), _count(header, "blocks"))


@dataclass(frozen=True, slots=True)
class Unhold(Message):
    """Release a hold before its ttl."""

    OP: ClassVar[str] = "unhold"
    hold_id: str

    def header(self) -> dict[str, Any]:
        return {"op": "unhold", "hold_id": self.hold_id}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_field(header, "hold_id", str))


@dataclass(frozen=True, slots=True)
class Unheld(Message):
    """Whether the hold existed."""

    OP: ClassVar[str] = "ok"
    released: bool

    def header(self) -> dict[str, Any]:
        return {"op": "ok", "released": self.released}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_field(header, "released", bool))


@dataclass(frozen=True, slots=True)
class PutObject(Message):
    """Store an object value of ``nbytes`` under ``key``: answered :class:`Ready`, then the
    value follows in a :class:`Data` frame. ``version``: the writer's (its clock at the
    put, in ns; absent: 0); a node keeps the newer of two values of one key."""

    OP: ClassVar[str] = "put_object"
    key: str
    nbytes: int
    version: int = 0

    def header(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": "put_object", "key": self.key, "nbytes": self.nbytes}
        if self.version:
            out["version"] = self.version
        return out

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        version = _count(header, "version") if "version" in header else 0
        if version >= 1 << 64:
            raise ProtocolError(f"object version {version} is over 64 bits")
        return cls(_key(header), _count(header, "nbytes"), version)


@dataclass(frozen=True, slots=True)
class GetObject(Message):
    """Read an object: answered :class:`Found` plus its value."""

    OP: ClassVar[str] = "get_object"
    key: str

    def header(self) -> dict[str, Any]:
        return {"op": "get_object", "key": self.key}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_key(header))


@dataclass(frozen=True, slots=True)
class RemoveObject(Message):
    """Remove an object: answered :class:`Removed`."""

    OP: ClassVar[str] = "remove_object"
    key: str

    def header(self) -> dict[str, Any]:
        return {"op": "remove_object", "key": self.key}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_key(header))


@dataclass(frozen=True, slots=True)
class Removed(Message):
    """Whether the object existed."""

    OP: ClassVar[str] = "ok"
    removed: bool

    def header(self) -> dict[str, Any]:
        return {"op": "ok", "removed": self.removed}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_field(header, "removed", bool))


@dataclass(frozen=True, slots=True)
class Evict(Message):
    """An operator's eviction: ``blocks`` of a namespace, or (None) all of it."""

    OP: ClassVar[str] = "evict"
    ns_id: bytes
    blocks: tuple[bytes, ...] | None = None
    tenant: str = ""
    """The tenant whose namespace it is (``""``: the pool's own, untenanted ids)."""

    def header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"op": "evict", "ns_id": self.ns_id.hex()}
        if self.blocks is not None:
            header["blocks"] = [b.hex() for b in self.blocks]
        if self.tenant:
            header["tenant"] = self.tenant
        return header

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        ns_id = _hex16(header.get("ns_id"), "ns_id")
        blocks = header.get("blocks")
        if blocks is not None:
            blocks = tuple(_hex16(b) for b in _list(header, "blocks", empty=True))
        return cls(ns_id, blocks, _tenant(header))


@dataclass(frozen=True, slots=True)
class Evicted(Message):
    """Slots evicted, and those kept because they were pinned or quarantined."""

    OP: ClassVar[str] = "evicted"
    evicted: int
    kept: int

    def header(self) -> dict[str, Any]:
        return {"op": "evicted", "evicted": self.evicted, "kept": self.kept}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_count(header, "evicted"), _count(header, "kept"))


@dataclass(frozen=True, slots=True)
class Report(Message):
    """A reader's word that chunks it got from this node failed verification."""

    OP: ClassVar[str] = "report"
    ns_id: bytes
    chunks: tuple[ChunkRef, ...]

    def header(self) -> dict[str, Any]:
        return {"op": "report", "ns_id": self.ns_id.hex(), "chunks": _refs_wire(self.chunks)}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_hex16(header.get("ns_id"), "ns_id"), _refs(header))


@dataclass(frozen=True, slots=True)
class Reported(Message):
    """How many of the reported chunks the node found bad and dropped."""

    OP: ClassVar[str] = "reported"
    dropped: int

    def header(self) -> dict[str, Any]:
        return {"op": "reported", "dropped": self.dropped}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_count(header, "dropped"))


@dataclass(frozen=True, slots=True)
class Stats(Message):
    """Ask for the node's own counters."""

    OP: ClassVar[str] = "stats"


@dataclass(frozen=True, slots=True)
class NodeStats(Message):
    """The node's counters, as a JSON object: node_id, epoch, slots, pinned_slots, leases,
    holds, inflight (chunks a put is transferring or has granted now), grants (chunks
    claimed for a writer's next ``write``), notifications (NIXL notifications read: one
    per client warm-up), objects, capacity_bytes, used_bytes,
    tiers: [{name, slots, pinned_slots, capacity_bytes, used_bytes}], and the drain's
    progress: draining, drain_state, drain_reason, drain_passes, drain_moved_chunks,
    drain_moved_bytes, drain_left, drain_failed, drain_dropped (kvstore.node.migrate)."""

    OP: ClassVar[str] = "stats"
    counters: dict[str, Any] = field(default_factory=dict)

    def header(self) -> dict[str, Any]:
        return {**self.counters, "op": "stats"}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls({k: v for k, v in header.items() if k != "op"})


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A refused request: ``code`` names the exception class (see the module docstring)."""

    OP: ClassVar[str] = "error"
    code: str
    message: str

    def header(self) -> dict[str, Any]:
        return {"op": "error", "code": self.code, "message": self.message}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(str(header.get("code")), str(header.get("message", "unknown error")))

    @classmethod
    def of(cls, exc: BaseException) -> Error:
        """The error message that reports ``exc`` to the client."""
        code = next((name for name, c in _CODES.items() if isinstance(exc, c)), "internal")
        return cls(code, str(exc) or type(exc).__name__)

    def exception(self) -> KVStoreError:
        """The exception this error stands for."""
        return _CODES.get(self.code, TransportError)(f"node: {self.message}")


REQUESTS: dict[str, type[Message]] = {
    "put": Put,
    "reserve": Put,
    "write": Put,
    "get": Get,
    "lease": Lease,
    "hold": Hold,
    "unhold": Unhold,
    "put_object": PutObject,
    "get_object": GetObject,
    "remove_object": RemoveObject,
    "evict": Evict,
    "report": Report,
    "stats": Stats,
}
"""Every request a node serves, by ``op``."""


def parse_request(header: dict[str, Any]) -> Message:
    """The request ``header`` carries; :class:`ProtocolError` for an unknown op or a
    malformed message, :class:`InvalidArgument` for a bad object key."""
    op = header.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown op {op!r}")
    return cls.parse(header)


def error_for(header: dict[str, Any]) -> KVStoreError:
    """The exception an ``{op: error}`` header stands for."""
    return Error.parse(header).exception()


def expect(header: dict[str, Any], cls: type[M], *ops: str) -> M:
    """Parse ``header`` as ``cls`` (whose op, or one of ``ops``, it must carry); raise what
    an error header says, :class:`ProtocolError` for another op or a malformed message."""
    op = header.get("op")
    if op == "error":
        raise error_for(header)
    if op not in (ops or (cls.OP,)):
        raise ProtocolError(f"expected {(ops or (cls.OP,))[0]!r} from peer, got {op!r}")
    return cls.parse(header)

"""Messages of the node's data-plane exchange, carried as frame headers (see
``kvstore.transport.framing`` for the bytes on the wire).

One request is in flight per connection; every exchange starts with a client header whose
``op`` names it. Byte strings travel as lowercase hex. A chunk is named by
``(block hash, chunk index)`` with ``chunk index = layer * tp_size + shard``.

::

    put         C: {op: put, ns: <canonical ns hex>, chunks: [[block, parent, index, nbytes]...],
                    wait_s}   (how long this writer may wait for another writer's transfer)
                N: {op: ready, accept: [0|1|2 ...]}   (SEND 1: send it; STORED 0: landed here
                   already, skip; BUSY 2: another writer's transfer of it did not end within
                   wait_s, or its slot is quarantined: not stored, send nothing)
                   | {op: error, code, message}     (REJECT: nothing reserved, send nothing)
                C: {op: data} + one buffer per accepted chunk, in order
                N: {op: ack, stored: n, skipped: n, failed: [i ...], busy: [i ...]}
                   (after the master commit; ``failed``: positions whose chunk failed a check)
    get         C: {op: get, ns_id, chunks: [[block, index]...]}
                N: {op: data, found: [0|1 ...]} + one buffer per found chunk
    reserve     C: {op: reserve, ns, chunks: [[block, parent, index, nbytes]...], wait_s} (ucx://)
                N: {op: reserved, accept: [0|1|2 ...], spans: [[addr, nbytes, dev, mem]...]}
                   | {op: error, ...}               (slots pinned; one span per accepted chunk)
                C: one-sided NIXL WRITE of each accepted chunk into its span, then
                C: {op: landed}                     N: ack as for put (after the master commit)
                   (no ``landed`` within the I/O timeout: the slots are quarantined, since
                   the writer may still be writing into them)
    lease       C: {op: lease, ns_id, chunks: [[block, index]...], lease_s}        (ucx://)
                N: {op: leased, found: [0|1 ...], spans: [...], lease_s}  (pinned <= lease_s)
                C: one-sided NIXL READ of the spans, then {op: release}   (no answer)
                   (a reader that reads after its lease expired verifies each chunk's key
                   and checksum: a reused slot is a miss, never another block's bytes)
    hold        C: {op: hold, ns_id, blocks: [block ...], ttl_s}
                N: {op: held, hold_id, blocks: n}   (n leading blocks pinned until ttl or unhold)
    unhold      C: {op: unhold, hold_id}             N: {op: ok, released: bool}
    put_object  C: {op: put_object, key, nbytes}     N: ready | error
                C: {op: data} + 1 buffer             N: {op: ack, stored: 1}
    get_object  C: {op: get_object, key}             N: {op: data, found: [0|1]} + 0|1 buffer
    remove_object C: {op: remove_object, key}        N: {op: ok, removed: bool}
    evict       C: {op: evict, ns_id, blocks?: [block ...]}   (operator; all of ns_id if
                N: {op: evicted, evicted: n, kept: n}          no blocks; pinned ones kept)
    report      C: {op: report, ns_id, chunks: [[block, index]...]}   (a reader's bad chunks)
                N: {op: reported, dropped: n}   (each re-checked here; a bad one is dropped)
    stats       C: {op: stats}                       N: {op: stats, ...counters}

Error codes map to the exception tree: ``invalid`` → InvalidArgument, ``shape`` → BadShape,
``namespace`` → NamespaceMismatch, ``capacity`` → CapacityError, ``protocol`` →
ProtocolError, ``internal`` → TransportError.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import (
    BadShape,
    CapacityError,
    InvalidArgument,
    KVStoreError,
    NamespaceMismatch,
    ProtocolError,
    TransportError,
)

__all__ = [
    "BUSY",
    "MAX_CHUNKS_PER_REQUEST",
    "MAX_KEY_LEN",
    "SEND",
    "STORED",
    "error_for",
    "error_header",
    "hex16",
    "raise_if_error",
    "require",
]

MAX_CHUNKS_PER_REQUEST = 4096
"""Most chunks one put or get may name (fits the frame limits: 4096 buffers, 1 MiB header);
clients split larger batches."""

STORED = 0
"""``accept`` value: the chunk is landed and checked on this node already; not sent."""
SEND = 1
"""``accept`` value: send this chunk; this exchange has claimed it."""
BUSY = 2
"""``accept`` value: another writer's transfer of this chunk is in flight (or its slot is
quarantined); it is not stored, and this writer sends nothing for it."""

MAX_KEY_LEN = 1024
"""Longest object key, in UTF-8 bytes."""

_CODES: dict[str, type[KVStoreError]] = {
    "invalid": InvalidArgument,
    "shape": BadShape,
    "namespace": NamespaceMismatch,
    "capacity": CapacityError,
    "protocol": ProtocolError,
    "internal": TransportError,
}


def error_header(exc: BaseException) -> dict[str, Any]:
    """The ``{op: error}`` header that reports ``exc`` to the client."""
    code = "internal"
    for name, cls in _CODES.items():
        if isinstance(exc, cls):
            code = name
            break
    return {"op": "error", "code": code, "message": str(exc) or type(exc).__name__}


def error_for(header: dict[str, Any]) -> KVStoreError:
    """The exception an ``{op: error}`` header stands for."""
    cls = _CODES.get(str(header.get("code")), TransportError)
    return cls(f"node: {header.get('message', 'unknown error')}")


def raise_if_error(header: dict[str, Any], expect: str) -> dict[str, Any]:
    """Return ``header`` if its op is ``expect``; raise what an error header says otherwise."""
    op = header.get("op")
    if op == "error":
        raise error_for(header)
    if op != expect:
        raise ProtocolError(f"expected {expect!r} from peer, got {op!r}")
    return header


def require(header: dict[str, Any], name: str, kind: type) -> Any:
    """``header[name]`` checked to be of ``kind``; ProtocolError otherwise."""
    value = header.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def hex16(value: Any, what: str = "block hash") -> bytes:
    """Decode a 16-byte id sent as 32 hex digits; ProtocolError otherwise."""
    if not isinstance(value, str) or len(value) != 32:
        raise ProtocolError(f"{what} must be 32 hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError as exc:
        raise ProtocolError(f"{what} is not hex: {value[:40]!r}") from exc

"""The data-plane protocol's limits and the checked readers of a header's fields, which
every message of :mod:`kvstore.dataplane.messages` parses with: each raises
:class:`~kvstore.errors.ProtocolError` (or :class:`~kvstore.errors.InvalidArgument` for an
object key) naming the field, for a missing field, a wrong type or a value out of bounds."""

from __future__ import annotations

from typing import Any

from kvstore.errors import InvalidArgument, ProtocolError

__all__ = [
    "MAX_CHUNKS_PER_REQUEST",
    "MAX_GRANT_CHUNKS",
    "MAX_KEY_LEN",
    "MAX_NS_HEX",
    "MAX_TENANT_LEN",
    "MAX_WRITER_LEN",
    "count_of",
    "field_of",
    "hex16",
    "ints_of",
    "list_of",
    "number_of",
    "object_key_of",
    "spans_of",
    "tenant_of",
]

MAX_CHUNKS_PER_REQUEST = 4096
"""Most chunks one request may name (fits the frame limits: 4096 buffers); clients split
larger batches."""

MAX_KEY_LEN = 1024
"""Longest object key, in UTF-8 bytes."""

MAX_TENANT_LEN = 128
"""Longest tenant name a request may carry."""

MAX_NS_HEX = 8192
"""Longest canonical namespace, in hex digits."""

MAX_WRITER_LEN = 64
"""Longest writer id."""

MAX_GRANT_CHUNKS = 64
"""Most chunk indices per block a put may ask to be granted."""


def field_of(header: dict[str, Any], name: str, kind: type, default: Any = ...) -> Any:
    value = header.get(name, default)
    if (
        value is ...
        or not isinstance(value, kind)
        or (kind is not bool and isinstance(value, bool))
    ):
        got = "nothing" if value is ... else type(value).__name__
        want = getattr(kind, "__name__", str(kind))  # (``int | float`` has no __name__)
        raise ProtocolError(f"field {name!r} must be {want}, got {got}")
    return value


def number_of(header: dict[str, Any], name: str, default: Any = ...) -> float:
    value = field_of(header, name, int | float, default)  # type: ignore[arg-type]
    if not value >= 0:
        raise ProtocolError(f"field {name!r} must be >= 0, got {value!r}")
    return float(value)


def count_of(header: dict[str, Any], name: str) -> int:
    value = field_of(header, name, int)
    if value < 0:
        raise ProtocolError(f"field {name!r} must be >= 0, got {value}")
    return int(value)


def hex16(value: Any, what: str = "block hash") -> bytes:
    """A 16-byte id sent as 32 hex digits; ProtocolError otherwise."""
    if not isinstance(value, str) or len(value) != 32:
        raise ProtocolError(f"{what} must be 32 hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError as exc:
        raise ProtocolError(f"{what} is not hex: {value[:40]!r}") from exc


def list_of(header: dict[str, Any], name: str, *, empty: bool = False) -> list[Any]:
    items = field_of(header, name, list)
    if len(items) > MAX_CHUNKS_PER_REQUEST or (not items and not empty):
        raise ProtocolError(f"field {name!r} names 1..{MAX_CHUNKS_PER_REQUEST} items")
    return items


def ints_of(header: dict[str, Any], name: str) -> tuple[int, ...]:
    items = list_of(header, name, empty=True)
    if not all(type(v) is int for v in items):
        raise ProtocolError(f"field {name!r} must be a list of ints")
    return tuple(items)


def spans_of(header: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    items = list_of(header, "spans", empty=True)
    if not all(isinstance(s, list) and all(type(v) is int for v in s) for s in items):
        raise ProtocolError("field 'spans' must be a list of int lists")
    return tuple(tuple(s) for s in items)


def object_key_of(header: dict[str, Any]) -> str:
    key = field_of(header, "key", str)
    if not key:
        raise InvalidArgument("object key must not be empty")
    try:
        size = len(key.encode())
    except UnicodeEncodeError as exc:
        raise InvalidArgument("object key is not valid UTF-8") from exc
    if size > MAX_KEY_LEN:
        raise InvalidArgument(f"object key must be 1..{MAX_KEY_LEN} bytes")
    return key


def tenant_of(header: dict[str, Any]) -> str:
    tenant = field_of(header, "tenant", str, "")
    if len(tenant) > MAX_TENANT_LEN:
        raise ProtocolError(f"field 'tenant' is longer than {MAX_TENANT_LEN}")
    return tenant

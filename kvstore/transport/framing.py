"""The data-plane wire format: one frame = a small JSON header plus raw payload buffers.

Backends move frames and buffers only; this module is the one place that knows the bytes.
A frame on the wire (all integers little-endian)::

    offset        size      field
    ------------  --------  ----------------------------------------------------------
    0             4         magic  b"KVF1"  (format version 1)
    4             1         flags  u8, must be 0 (reserved for e.g. compression)
    5             1         reserved u8, must be 0
    6             2         n      u16  number of payload buffers (0 .. max_buffers)
    8             4         h      u32  header length in bytes (1 .. max_header_bytes)
    12            8 * n     sizes  u64 each: the length of payload buffer 0 .. n-1
    12 + 8n       h         header JSON object, UTF-8, no NaN/Infinity
    12 + 8n + h   sum(sizes) payload buffers 0 .. n-1, back to back, no padding

    +------+---+---+-----+-----+---------+---------+-----------+-------+-----+
    | KVF1 | f | r |  n  |  h  | size[0] |   ...   |  header   | buf 0 | ... |
    +------+---+---+-----+-----+---------+---------+-----------+-------+-----+
      4     1   1    2     4       8                    h      size[0]

Everything before the payload is the *prefix*. A receiver reads the fixed 12 bytes
(:data:`FIXED_SIZE`), learns from them how long the rest of the prefix is, reads and parses
it, and only then decides where each payload buffer goes — so a storage node can allocate a
slot and receive the chunk straight into it. Every length is checked against
:class:`FrameLimits` *before* anything is allocated: garbage, a truncated prefix or a frame
declaring more than the limits raises :class:`~kvstore.errors.ProtocolError`.

All functions here are pure: no I/O, no state.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidArgument, ProtocolError

__all__ = [
    "DEFAULT_LIMITS",
    "FIXED_SIZE",
    "MAGIC",
    "MAX_BUFFERS_ON_WIRE",
    "Frame",
    "FrameLimits",
    "encode_prefix",
    "parse_fixed",
    "parse_prefix",
    "parse_rest",
]

MAGIC = b"KVF1"
"""First four bytes of every frame; the trailing digit is the format version."""

_FIXED = struct.Struct("<4sBBHI")
FIXED_SIZE = _FIXED.size
"""Length of the fixed part of the prefix (magic, flags, reserved, n, h): 12 bytes."""

MAX_BUFFERS_ON_WIRE = 0xFFFF
"""The most payload buffers the u16 count can describe."""

_encode_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_decode_json = json.JSONDecoder().decode
# (one encoder and decoder for the process: json.dumps with options builds one per call)

_KiB = 1024
_MiB = 1024 * _KiB
_GiB = 1024 * _MiB


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """Bounds a receiver enforces on every frame (and a sender on its own frames).

    Raises :class:`~kvstore.errors.InvalidArgument` when constructed with a non-positive
    bound or more buffers than the u16 count can carry.
    """

    max_header_bytes: int = 1 * _MiB
    """Longest JSON header, in bytes."""
    max_buffers: int = 4096
    """Most payload buffers in one frame (at most 65535, the u16 on the wire)."""
    max_buffer_bytes: int = 1 * _GiB
    """Largest single payload buffer."""
    max_payload_bytes: int = 1 * _GiB
    """Largest sum of all payload buffers of one frame."""

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_buffers", "max_buffer_bytes", "max_payload_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"FrameLimits.{name} must be a positive int, got {value!r}")
        if self.max_buffers > MAX_BUFFERS_ON_WIRE:
            raise InvalidArgument(
                f"FrameLimits.max_buffers must be <= {MAX_BUFFERS_ON_WIRE}, got {self.max_buffers}"
            )
        if self.max_header_bytes > 0xFFFFFFFF:
            raise InvalidArgument("FrameLimits.max_header_bytes must fit in a u32")


DEFAULT_LIMITS = FrameLimits()
"""1 MiB header, 4096 buffers, 1 GiB per buffer and per frame."""


@dataclass(frozen=True, slots=True)
class Frame:
    """A received frame's prefix: its header and the sizes of the payload still to read."""

    header: dict[str, Any]
    """The decoded JSON header (a fresh object owned by the receiver)."""
    sizes: list[int] = field(default_factory=list)
    """Length of each payload buffer, in wire order."""

    @property
    def payload_bytes(self) -> int:
        """Total payload length of the frame."""
        return sum(self.sizes)


def encode_prefix(
    header: dict[str, Any], sizes: Sequence[int], limits: FrameLimits = DEFAULT_LIMITS
) -> bytes:
    """Encode the prefix (everything before the payload) of a frame.

    Pure, never blocks. Raises :class:`~kvstore.errors.InvalidArgument` when ``header`` is not
    a JSON-serialisable dict with string keys, or the frame exceeds ``limits`` (the sender
    checks its own limits so that it never emits a frame it would itself refuse).
    """
    if not isinstance(header, dict):
        raise InvalidArgument(f"a frame header must be a dict, got {type(header).__name__}")
    try:
        body = _encode_json(header).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"frame header is not JSON-serialisable: {exc}") from exc
    sizes = list(sizes)
    problem = _check_lengths(len(body), sizes, limits)
    if problem:
        raise InvalidArgument(f"frame exceeds the sender's limits: {problem}")
    return b"".join(
        (
            _FIXED.pack(MAGIC, 0, 0, len(sizes), len(body)),
            struct.pack(f"<{len(sizes)}Q", *sizes),
            body,
        )
    )


def parse_fixed(data: bytes | bytearray | memoryview, limits: FrameLimits = DEFAULT_LIMITS) -> int:
    """Check the fixed 12-byte start of a prefix; return how many prefix bytes follow it.

    ``data`` must hold at least :data:`FIXED_SIZE` bytes (extra bytes are ignored). Pure.
    Raises :class:`~kvstore.errors.ProtocolError` on a short buffer, a wrong magic, non-zero
    flags, or a buffer count / header length beyond ``limits``.
    """
    if len(data) < FIXED_SIZE:
        raise ProtocolError(f"truncated frame prefix: {len(data)} of {FIXED_SIZE} bytes")
    magic, flags, reserved, nbuf, hlen = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a kvstore frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if flags or reserved:
        raise ProtocolError(f"unsupported frame flags {flags:#04x}/{reserved:#04x}")
    if nbuf > limits.max_buffers:
        raise ProtocolError(f"frame declares {nbuf} buffers, limit {limits.max_buffers}")
    if hlen == 0 or hlen > limits.max_header_bytes:
        raise ProtocolError(
            f"frame declares a {hlen}-byte header, limit 1..{limits.max_header_bytes}"
        )
    return int(8 * nbuf + hlen)


def parse_rest(
    fixed: bytes | bytearray | memoryview,
    rest: bytes | bytearray | memoryview,
    limits: FrameLimits = DEFAULT_LIMITS,
) -> Frame:
    """Parse the variable part of a prefix (sizes and header) that follows ``fixed``.

    ``fixed`` is the 12-byte start already accepted by :func:`parse_fixed`; ``rest`` holds
    exactly the number of bytes it returned. Pure. Raises
    :class:`~kvstore.errors.ProtocolError` on a length mismatch, sizes beyond ``limits``, or
    a header that is not a UTF-8 JSON object.
    """
    _, _, _, nbuf, hlen = _FIXED.unpack_from(fixed)
    if len(rest) != 8 * nbuf + hlen:
        raise ProtocolError(
            f"frame prefix has {len(rest)} bytes after the fixed part, expected {8 * nbuf + hlen}"
        )
    sizes = list(struct.unpack_from(f"<{nbuf}Q", rest))
    problem = _check_lengths(hlen, sizes, limits)
    if problem:
        raise ProtocolError(f"frame exceeds the receiver's limits: {problem}")
    try:
        header = _decode_json(str(rest[8 * nbuf :], "utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame header is not UTF-8 JSON: {exc}") from exc
    except RecursionError:  # (a header of 3,000 "[": any peer, before any handshake)
        raise ProtocolError("frame header is JSON nested too deeply") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"frame header must be a JSON object, got {type(header).__name__}")
    return Frame(header=header, sizes=sizes)


def parse_prefix(
    data: bytes | bytearray | memoryview, limits: FrameLimits = DEFAULT_LIMITS
) -> tuple[Frame, int]:
    """Parse a whole prefix from the start of ``data``; return the frame and its length.

    Bytes after the prefix (the payload, the next frame) are ignored. Pure. Raises
    :class:`~kvstore.errors.ProtocolError` on garbage, a truncated prefix or a frame beyond
    ``limits``.
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    rest_len = parse_fixed(view, limits)
    end = FIXED_SIZE + rest_len
    if len(view) < end:
        raise ProtocolError(f"truncated frame prefix: {len(view)} of {end} bytes")
    return parse_rest(view[:FIXED_SIZE], view[FIXED_SIZE:end], limits), end


def _check_lengths(header_len: int, sizes: list[int], limits: FrameLimits) -> str:
    """Describe the first way a frame's lengths break ``limits``; empty when they fit."""
    if header_len > limits.max_header_bytes:
        return f"{header_len}-byte header > {limits.max_header_bytes}"
    if len(sizes) > limits.max_buffers:
        return f"{len(sizes)} buffers > {limits.max_buffers}"
    total = 0
    for i, size in enumerate(sizes):
        if size < 0 or size > limits.max_buffer_bytes:
            return f"buffer {i} of {size} bytes > {limits.max_buffer_bytes}"
        total += size
    if total > limits.max_payload_bytes:
        return f"{total}-byte payload > {limits.max_payload_bytes}"
    return ""

"""Where a committed slot lives, so that a reader can READ it without asking its node.

A node that serves one-sided reads (``ucx://``) commits each block with its slot's
location; the master keeps it beside the holder, opaque, and hands it back with lookups and
watch events. The packed form (little-endian, 20 bytes)::

    version u8 = 1 | addr u64 | stride u32 | chunks u32 | dev_id u16 | mem u8

A slot no one can READ one-sidedly (a ``tcp://`` node's, or a block held only on disk)
is committed with a *tier mark* instead, two bytes: ``version u8 = 2 | tier u8`` (0 host,
1 gpu, 2 disk, 3 host+disk), so the index still says which tier holds each copy
(:func:`tier_of`). A block in host memory that the disk tier has written is ``host+disk``:
its mark says so, and so does bit 7 of a packed location's ``mem`` (:data:`ON_DISK`,
:func:`with_disk`).

``addr`` is the address of chunk 0 in the node's registered memory (its NIXL agent's
address space), chunk ``i`` lives at ``addr + i * stride``; ``mem`` is the memory kind's
code in a span's wire form (``[addr, nbytes, dev_id, mem]``,
:class:`kvstore.transport.nixl_spans.Span`). A location is a hint, never a promise: the
slot may be evicted and reused at any moment, so what a reader READs from it counts only
after its key and checksum verify; otherwise the reader asks the node (the leased read).
Imports neither torch nor NIXL.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

__all__ = [
    "MAX_LOCATION_BYTES",
    "ON_DISK",
    "TIERS",
    "SlotLocation",
    "tier_mark",
    "tier_of",
    "with_disk",
]

MAX_LOCATION_BYTES = 32
"""Most bytes a location may take in a commit (the master refuses longer ones)."""

_VERSION = 1
_PACKED = struct.Struct("<BQIIHB")
_MAX_MEM_CODE = 15
_MARK = 2
TIERS = ("host", "gpu", "disk", "host+disk")
"""The tiers a mark names, by code."""
_VRAM = 1
"""NIXL's VRAM_SEG code (DRAM_SEG is 0)."""
ON_DISK = 0x80
"""Set in a packed location's ``mem`` byte: the slot's block is also on the node's disk."""


def tier_mark(tier: str) -> bytes:
    """The location committed for a slot of ``tier`` that no one READs one-sidedly."""
    return bytes((_MARK, TIERS.index(tier)))


def tier_of(location: bytes) -> str:
    """The tier a committed location says holds the copy: ``"host"``, ``"gpu"``,
    ``"disk"``, or ``""`` when it says nothing (empty, malformed). Never raises."""
    if len(location) == 2 and location[0] == _MARK and location[1] < len(TIERS):
        return TIERS[location[1]]
    loc = SlotLocation.unpack(location)
    if loc is None:
        return ""
    if loc.mem == _VRAM:
        return "gpu"
    return "host+disk" if location[-1] & ON_DISK else "host"


def with_disk(location: bytes, on_disk: bool) -> bytes:
    """``location`` (a host slot's, packed or a mark) saying whether the block also has a
    disk copy; other locations unchanged."""
    if tier_of(location) in ("host", "host+disk") and len(location) == 2:
        return tier_mark("host+disk" if on_disk else "host")
    if SlotLocation.unpack(location) is None:
        return location
    mem = location[-1] & ~ON_DISK | (ON_DISK if on_disk else 0)
    return location[:-1] + bytes((mem,))


class SlotLocation(NamedTuple):
    """A slot's place in its node's registered memory (see the module docstring)."""

    addr: int
    stride: int
    num_chunks: int
    dev_id: int = 0
    mem: int = 0

    def pack(self) -> bytes:
        """The packed form; raises ``struct.error`` for a field out of range."""
        return _PACKED.pack(_VERSION, *self)

    @classmethod
    def unpack(cls, raw: bytes) -> SlotLocation | None:
        """The location ``raw`` packs, or None for an empty, malformed or unknown one (a
        reader then takes the leased path). Never raises."""
        if len(raw) != _PACKED.size or raw[0] != _VERSION:
            return None
        _, addr, stride, num_chunks, dev_id, mem = _PACKED.unpack(raw)
        mem &= ~ON_DISK  # (where else the block is does not change where this slot is)
        if not addr or not stride or not num_chunks or mem > _MAX_MEM_CODE:
            return None
        return cls(addr, stride, num_chunks, dev_id, mem)

    def span(self, index: int, nbytes: int) -> list[int] | None:
        """The wire span of chunk ``index`` (``nbytes`` long), or None when the slot has no
        such chunk or ``nbytes`` does not fit its stride."""
        if not 0 <= index < self.num_chunks or not 0 < nbytes <= self.stride:
            return None
        return [self.addr + index * self.stride, nbytes, self.dev_id, self.mem]

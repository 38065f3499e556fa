"""lz4 on the disk tier: chunks stored as byte planes + lz4 where that makes reads faster.

A chunk of raw (``quant="none"``) 16-bit KV compresses with lz4 only once its values are
split into byte planes (every value's low byte, then every high byte: bfloat16's sign and
exponent bytes together), by 1.16-1.23; the pool's INT8 and INT4 chunks do not compress at
all (ratio 0.996). ``bench/lz4_chunks.py`` measured it and ``docs/decisions.md`` records
the rule built on it: reading ``n`` bytes stored ``ratio`` times smaller costs
``n/(ratio*disk) + n/decompress``, which beats ``n/disk`` only while
``disk < decompress * (1 - 1/ratio)``. So:

- :class:`Lz4Policy` measures, when the tier opens, its disk's read GB/s and this
  machine's decompression GB/s (:func:`measure_decompress`, on realistic bfloat16 KV) and
  learns each namespace's ratio from the blocks it packs. A namespace's blocks are packed
  while its ratio beats the one the disk needs (:meth:`Lz4Policy.ratio_needed`); one block
  in :data:`RELEARN` is tried again after it stops paying, so a change is noticed. Where
  the disk reads faster than lz4 decompresses, nothing is ever packed, at no cost.
- A packed record keeps a chunk as it is when lz4 does not make it smaller
  (:func:`pack_chunks`), and the whole record as it is when packing saves nothing.

A packed payload (header flag :data:`PACKED`)::

    u32 per chunk: its stored bytes, | LZ4 when compressed | pad to 8
    each chunk's stored bytes, in chunk order

Every read checks the stored payload's xxh3_64 before anything is decompressed; a packed
chunk that then does not decompress to its size is a :class:`ChecksumError` too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import lz4.block
import numpy as np

from kvstore.errors import ChecksumError

__all__ = [
    "LZ4",
    "MIN_PROBE_DISK",
    "MODES",
    "PROBE_BYTES",
    "RELEARN",
    "Lz4Policy",
    "measure_decompress",
    "pack_chunks",
    "packed_size_ok",
    "unpack_chunks",
]

LZ4 = 1 << 31
"""Set in a chunk's table entry when its bytes are lz4 (else stored as they are)."""
MODES = ("auto", "lz4", "off")
"""``--disk-compress``: by measurement, always (tests, slow disks), never."""
RELEARN = 64
"""A namespace whose blocks stopped paying has one block in this many packed again."""
LEARN_BYTES = 8 * 2**20
"""Raw bytes of a namespace packed before its ratio decides."""
FORGET_BYTES = 256 * 2**20
"""Past this many raw bytes a namespace's tallies are halved (recent blocks weigh more)."""
MAX_NAMESPACES = 4096
PROBE_BYTES = 8 * 2**20
"""Bytes written and read back to measure a disk's read speed when its tier opens."""
MIN_PROBE_DISK = 8 * PROBE_BYTES
"""A disk tier smaller than this is not measured (``auto`` packs nothing on it)."""


def _table_bytes(n: int) -> int:
    return -(-4 * n // 8) * 8


def _planes(chunk: memoryview) -> np.ndarray:
    """``chunk``'s 16-bit values as byte planes (an odd last byte stays last)."""
    a = np.frombuffer(chunk, np.uint8)
    n = len(a) & ~1
    out = np.empty_like(a)
    out[: n // 2] = a[0:n:2]
    out[n // 2 : n] = a[1:n:2]
    out[n:] = a[n:]
    return out


def _unplane(planes: bytes, dst: np.ndarray) -> None:
    a = np.frombuffer(planes, np.uint8)
    n = len(dst) & ~1
    dst[0:n:2] = a[: n // 2]
    dst[1:n:2] = a[n // 2 : n]
    dst[n:] = a[n:]


def pack_chunks(chunks: list[memoryview]) -> list[bytes | memoryview] | None:
    """Worker thread: a packed payload's parts for ``chunks`` (table first), or None when
    packing saves no bytes (the record is stored as it is)."""
    table = np.zeros(_table_bytes(len(chunks)) // 4, np.uint32)
    parts: list[bytes | memoryview] = [b""]
    for i, chunk in enumerate(chunks):
        packed = lz4.block.compress(_planes(chunk), mode="fast", store_size=False)
        if len(packed) < len(chunk):
            table[i] = len(packed) | LZ4
            parts.append(packed)
        else:
            table[i] = len(chunk)
            parts.append(chunk)
    parts[0] = table.tobytes()
    if sum(len(p) for p in parts) >= sum(len(c) for c in chunks):
        return None
    return parts


def packed_size_ok(payload_bytes: int, raw_bytes: int, chunks: int) -> bool:
    """Whether a packed payload of ``payload_bytes`` can hold ``chunks`` chunks of
    ``raw_bytes`` in all (packing is kept only when it saves bytes)."""
    return _table_bytes(chunks) <= payload_bytes < raw_bytes


def unpack_chunks(payload: memoryview, dst: memoryview, chunks: int, chunk_bytes: int) -> None:
    """Worker thread: a packed payload (checksum verified) into ``dst`` (``chunks`` chunks
    of ``chunk_bytes``, in order). :class:`ChecksumError` when it does not unpack."""
    table = np.frombuffer(payload, np.uint32, count=chunks)
    out = np.frombuffer(dst, np.uint8)
    at = _table_bytes(chunks)
    for j, entry in enumerate(table.tolist()):
        size = entry & ~LZ4
        src = payload[at : at + size]
        into = out[j * chunk_bytes : (j + 1) * chunk_bytes]
        if len(src) != size:
            raise ChecksumError(f"packed chunk {j} runs past its record")
        if entry & LZ4:
            try:
                planes = lz4.block.decompress(src, uncompressed_size=chunk_bytes)
            except (lz4.block.LZ4BlockError, ValueError) as exc:
                raise ChecksumError(f"packed chunk {j} does not decompress: {exc}") from exc
            if len(planes) != chunk_bytes:  # (lz4 returns a short block without a word)
                raise ChecksumError(f"packed chunk {j} unpacks to {len(planes)} bytes")
            _unplane(planes, into)
        elif size == chunk_bytes:
            into[:] = np.frombuffer(src, np.uint8)
        else:
            raise ChecksumError(f"stored chunk {j} is {size} bytes, not {chunk_bytes}")
        at += size


def measure_decompress(repeat: int = 3) -> float:
    """This machine's GB/s (of raw bytes, one thread) unpacking realistic bfloat16 KV (a
    256-token chunk of 8 heads of 128), best of ``repeat``: what a packed read costs."""
    import torch

    from kvstore.core.kvgen import realistic_kv

    raw = realistic_kv(256, 8, 128, torch.bfloat16, seed=7).view(torch.uint8).numpy().ravel()
    parts = pack_chunks([raw.data])
    if parts is None:
        return 0.0
    payload = memoryview(b"".join(parts))
    dst = memoryview(bytearray(len(raw)))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        unpack_chunks(payload, dst, 1, len(raw))
        best = min(best, time.perf_counter() - t0)
    return len(raw) / best / 1e9


@dataclass(slots=True)
class _Tally:
    raw: int = 0
    stored: int = 0
    skipped: int = 0


class Lz4Policy:
    """Which blocks the disk tier packs (owner's thread): see the module docstring.

    ``disk_gbps`` and ``decompress_gbps`` are the measurements the rule rests on (0:
    unknown, which in ``auto`` packs nothing)."""

    def __init__(self, mode: str, disk_gbps: float = 0.0, decompress_gbps: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"disk compression {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self.disk_gbps = disk_gbps
        self.decompress_gbps = decompress_gbps
        self._ns: dict[bytes, _Tally] = {}
        self.raw_bytes = 0
        """Bytes of the blocks offered for packing since the tier opened (their chunks)."""
        self.stored_bytes = 0
        """What those blocks took on disk (packed, or as they were where packing saved
        nothing)."""

    def ratio_needed(self) -> float:
        """The ratio above which a packed read beats a plain one on this disk (inf: none)."""
        if self.disk_gbps <= 0 or self.decompress_gbps <= self.disk_gbps:
            return float("inf")
        return 1.0 / (1.0 - self.disk_gbps / self.decompress_gbps)

    def wants(self, ns_id: bytes) -> bool:
        """Whether a block of namespace ``ns_id`` is packed when written."""
        if self.mode != "auto":
            return self.mode == "lz4"
        needed = self.ratio_needed()
        if needed == float("inf"):
            return False
        t = self._ns.get(ns_id)
        if t is None or t.raw < LEARN_BYTES or t.raw >= needed * t.stored:
            return True
        t.skipped += 1
        return t.skipped % RELEARN == 0

    def learn(self, ns_id: bytes, raw: int, stored: int) -> None:
        """A block of ``ns_id`` offered for packing took ``stored`` bytes for ``raw``."""
        self.raw_bytes += raw
        self.stored_bytes += stored
        t = self._ns.pop(ns_id, None) or _Tally()
        self._ns[ns_id] = t  # (most recent last: the oldest namespace goes first)
        t.raw += raw
        t.stored += stored
        if t.raw > FORGET_BYTES:
            t.raw //= 2
            t.stored //= 2
        while len(self._ns) > MAX_NAMESPACES:
            del self._ns[next(iter(self._ns))]

    def describe(self) -> str:
        """One line for the log: the mode and what it rests on."""
        if self.mode != "auto":
            return self.mode
        needed = self.ratio_needed()
        return (f"auto: disk reads {self.disk_gbps:.2f} GB/s, lz4 unpacks "
                f"{self.decompress_gbps:.2f} GB/s, "
                + ("packing never pays" if needed == float("inf")
                   else f"packs namespaces compressing more than {needed:.2f}x"))  # fmt: skip

    def stats(self) -> dict[str, object]:
        needed = self.ratio_needed()
        return {
            "mode": self.mode,
            "disk_read_gbps": round(self.disk_gbps, 3),
            "decompress_gbps": round(self.decompress_gbps, 3),
            "ratio_needed": None if needed == float("inf") else round(needed, 3),
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
        }

"""The chunk codec: one block x one layer x one TP shard of KV, as a self-checking buffer.

A chunk is a ``[2, T, H, D]`` tensor (K then V) in float16, bfloat16 or float32. It is
encoded into one flat uint8 buffer, on the tensor's device, that names itself (block hash,
layer, shard), says how to decode it and carries a checksum, so a storage node can verify a
chunk that landed in its memory and a reader can tell a reused slot from the chunk it
asked for. All integers are little-endian; every section starts 64-byte aligned (the
checksum 8-byte aligned), so scales and payload are read through aligned tensor views::

    offset        size      field
    ┌─────────────┬─────────┬──────────────────────────────────────────────────────────┐
    │ 0           │ 4       │ magic  b"KVCK"                                           │
    │ 4           │ 2       │ u16 format version (1)                                   │
    │ 6           │ 2       │ u16 header size (64)                                     │
    │ 8           │ 16      │ block hash (xxh3-128 digest; zeros when no key)          │
    │ 24          │ 4       │ u32 layer                                                │
    │ 28          │ 4       │ u32 shard (TP rank)                                      │
    │ 32          │ 4 x 3   │ u32 T (tokens), H (KV heads), D (head dim)               │
    │ 44          │ 1       │ u8 dtype      1 float16 · 2 bfloat16 · 3 float32         │
    │ 45          │ 1       │ u8 scheme     0 raw · 1..4 INT8 · 5, 6 INT4 (SCHEMES)    │
    │ 46          │ 1       │ u8 checksum   1 xxh3_64 · 2 mulsum64 (device)            │
    │ 47          │ 1       │ u8 flags (0)                                             │
    │ 48          │ 8       │ u64 payload bytes P                                      │
    │ 56          │ 4       │ u32 scale bytes S                                        │
    │ 60          │ 4       │ u32 header check: low 32 bits of xxh3_64(bytes 0..59)    │
    ├─────────────┼─────────┼──────────────────────────────────────────────────────────┤
    │ 64          │ S       │ scales, float16, K's then V's (layout per scheme below)  │
    │             │ pad     │ zeros up to a multiple of 64                             │
    ├─────────────┼─────────┼──────────────────────────────────────────────────────────┤
    │ 64 + S'     │ P       │ payload [2, T, H, D]: int8 codes, int4 codes two to a    │
    │             │         │ byte ([2, T, H, D/2]), or the raw dtype                  │
    │             │ pad     │ zeros up to a multiple of 8                              │
    ├─────────────┼─────────┼──────────────────────────────────────────────────────────┤
    │ N - 8       │ 8       │ u64 checksum of bytes 0 .. N-9 (header, scales, payload) │
    └─────────────┴─────────┴──────────────────────────────────────────────────────────┘

The size depends only on (T, H, D, dtype, scheme) — :func:`chunk_nbytes` — so slots are
sized before any data exists.

INT8 schemes (symmetric codes in [-127, 127], float16 scales; ``x ≈ q·s (+ m)``), each half
(K or V) quantized in one of four ways, scales stored in the order listed:

* ``c``  per channel: ``s[H, D]`` over the block's T tokens.
* ``cc`` per channel, centered: ``m[H, D]`` (mid-range) and ``s[H, D]``; ``x ≈ m + q·s``.
  K's outlier channels carry a large, nearly constant offset; centering removes it.
* ``t``  per token and head: ``s[T, H]`` over D.
* ``ct`` channel-smoothed per token: ``c[H, D]`` (channel max) and ``s[T, H]``;
  ``x ≈ q·s·c``.

Schemes: 1 ``int8-kc-vt`` (K c, V t), 2 ``int8-kt-vt`` (t, t), 3 ``int8-kcc-vt`` (cc, t),
4 ``int8-kcc-vct`` (cc, ct). ``quant="int8"`` means :data:`DEFAULT_INT8`, chosen by the
attention-output error study in :mod:`kvstore.core.kvgen` (docs/codec.md).

INT4 schemes (KIVI-style: asymmetric codes 0..15, ``x ≈ lo + q·step``, float16 ``lo`` and
``step`` per group, both rounded toward -inf, codes packed two to a byte along D, the even
channel in the low nibble; D must be even): K per channel over groups of ``gk`` tokens
(``kg``: ``lo[T/gk, H, D]`` then ``step[T/gk, H, D]``), V per token and head over groups of
``gv`` channels (``vg``: ``lo[T, H, D/gv]`` then ``step``). A scheme names its group size
``G``; ``gk`` is the largest divisor of T and ``gv`` the largest divisor of D that is at
most ``G``, so the size still depends only on the shape. Schemes: 5 ``int4-g32``, 6
``int4-g128``; ``quant="int4"`` means :data:`DEFAULT_INT4`.

Checksums (:mod:`kvstore.core.checksum`): ``xxh3_64`` (default for CPU buffers) or
``mulsum64`` (default elsewhere, computed on the device with torch ops; catches every
one-bit error). Decode verifies either kind wherever it runs (xxh3 of a device buffer
costs a host copy, which :func:`copy_stats` counts).
"""

from __future__ import annotations

import math
import struct
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple, overload

import numpy as np
import torch
import xxhash
from torch import Tensor

from kvstore.core import fused, kernels, native
from kvstore.core.checksum import (
    compute_checksum,
    stored_checksum,
    write_checksums,
    write_xxh3,
)
from kvstore.core.hashing import dtype_name
from kvstore.errors import (
    BadShape,
    ChecksumError,
    ChunkFormatError,
    ChunkKeyMismatch,
    ChunkSpecMismatch,
    ChunkVersionError,
    InvalidArgument,
)

__all__ = [
    "CHECKSUMS",
    "DEFAULT_INT4",
    "DEFAULT_INT8",
    "FORMAT_VERSION",
    "HEADER_NBYTES",
    "KV",
    "MAGIC",
    "QUANT_SCHEMES",
    "SCHEMES",
    "ChunkHeader",
    "ChunkKey",
    "ChunkSpec",
    "CopyStats",
    "check_header",
    "check_header_bytes",
    "chunk_nbytes",
    "copy_stats",
    "decode_chunk",
    "encode_blocks",
    "encode_chunk",
    "group_size",
    "header_form",
    "kv_halves",
    "kv_span",
    "read_header",
    "verify_chunk",
    "verify_host_bytes",
]

MAGIC = b"KVCK"
FORMAT_VERSION = 1
HEADER_NBYTES = 64
_HEADER = struct.Struct("<4sHH16sIIIIIBBBBQII")
_CHECKED = HEADER_NBYTES - 4  # the header check covers bytes 0..59
_ALIGN = 64
_U32 = 2**32

_DTYPES: dict[int, torch.dtype] = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
_DTYPE_CODES_BY_NAME = {dtype_name(v): k for k, v in _DTYPES.items()}

SCHEMES: dict[str, int] = {
    "raw": 0,
    "int8-kc-vt": 1,
    "int8-kt-vt": 2,
    "int8-kcc-vt": 3,
    "int8-kcc-vct": 4,
    "int4-g32": 5,
    "int4-g128": 6,
}
"""Every scheme this build encodes and decodes, name → id recorded in the header."""

_SCHEME_NAMES = {v: k for k, v in SCHEMES.items()}
_SCHEME_MODES: dict[int, tuple[str, str]] = {
    1: ("c", "t"),
    2: ("t", "t"),
    3: ("cc", "t"),
    4: ("cc", "ct"),
    5: ("kg", "vg"),
    6: ("kg", "vg"),
}
_INT4_GROUPS: dict[int, int] = {5: 32, 6: 128}
"""INT4 scheme id → its group size G."""

DEFAULT_INT8 = "int8-kcc-vct"
"""What ``quant="int8"`` encodes (lowest attention error on realistic KV; docs/codec.md)."""

DEFAULT_INT4 = "int4-g32"
"""What ``quant="int4"`` encodes (docs/codec.md, INT4: size and error by group size)."""

QUANT_SCHEMES: dict[str, str] = {"int8": DEFAULT_INT8, "int4": DEFAULT_INT4, "none": "raw",
                                 **{s: s for s in SCHEMES}}  # fmt: skip
"""Every accepted ``quant`` argument → the scheme it encodes."""

CHECKSUMS: dict[str, int] = {"xxh3_64": 1, "mulsum64": 2}
"""Checksum kinds, name → id recorded in the header."""

_CHECKSUM_NAMES = {v: k for k, v in CHECKSUMS.items()}
_ZERO_KEY_HASH = bytes(16)


class ChunkKey(NamedTuple):
    """What a chunk is: ``(block_hash, layer, shard)``; ``block_hash`` is 16 bytes."""

    block_hash: bytes
    layer: int
    shard: int


class ChunkSpec(NamedTuple):
    """What every chunk of one namespace looks like: ``[2, tokens, heads, head_dim]`` of
    ``dtype``, quantized as ``quant`` (``"int8"`` / ``"int4"``: any INT8 / INT4 scheme;
    ``"none"``: raw; a scheme's name: that scheme). A node checks each chunk's header
    against it before acking; a reader before decoding."""

    tokens: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    quant: str

    @classmethod
    def of(cls, ns: Any) -> ChunkSpec:
        """The spec of a :class:`~kvstore.core.hashing.Namespace`'s chunks."""
        dtype = _DTYPES[_DTYPE_CODES_BY_NAME[dtype_name(ns.dtype)]]
        return cls(ns.block_tokens, ns.num_kv_heads, ns.head_dim, dtype, ns.quant)


@dataclass(frozen=True)
class ChunkHeader:
    """A validated chunk header (see the module docstring for the byte layout)."""

    key: ChunkKey
    shape: tuple[int, int, int, int]
    """``(2, T, H, D)``."""
    dtype: torch.dtype
    scheme: str
    """A key of :data:`SCHEMES`."""
    checksum: str
    """A key of :data:`CHECKSUMS`."""
    nbytes: int
    """Total encoded size, header and checksum included."""
    version: int = FORMAT_VERSION

    @property
    def quant(self) -> str:
        """``"none"`` for raw chunks, ``"int8"`` / ``"int4"`` for every INT8 / INT4 scheme."""
        return "none" if self.scheme == "raw" else self.scheme[:4]

    @property
    def quants(self) -> tuple[str, str]:
        """The ``quant`` values a namespace of this chunk may declare: its family and its
        scheme's own name."""
        return self.quant, self.scheme


@dataclass(frozen=True)
class CopyStats:
    """Bytes the codec moved; ``extra_*`` counts copies beyond the one unavoidable pass.

    The unavoidable pass is input → chunk buffer on encode and chunk buffer → output on
    decode. Extra copies are: staging a misaligned or non-contiguous buffer, the host copy
    that xxh3 needs for a device buffer, and moving a chunk to another device.
    """

    encoded_bytes: int = 0
    decoded_bytes: int = 0
    extra_copies: int = 0
    extra_bytes: int = 0


_stats_lock = threading.Lock()
_stats = {"encoded_bytes": 0, "decoded_bytes": 0, "extra_copies": 0, "extra_bytes": 0}


def copy_stats() -> CopyStats:
    """Process-wide totals since import (monotonic; subtract two snapshots for a delta)."""
    with _stats_lock:
        return CopyStats(**_stats)


def _count(**deltas: int) -> None:
    with _stats_lock:
        for name, value in deltas.items():
            _stats[name] += value


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Layout:
    shape: tuple[int, int, int]  # T, H, D
    dtype: torch.dtype
    scheme: int
    scale_slots: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...]
    """(half, shape, strides, element offset in the scale region) per scale tensor, K's
    then V's; shapes broadcast against ``[T, H, D]``: ``(1, H, D)`` per channel and
    ``(T, H, 1)`` per token, stored contiguous (as ``[H, D]`` and ``[T, H]``)."""
    scales_nbytes: int
    payload_offset: int
    payload_nbytes: int
    checksum_offset: int
    values_nbytes: int  # K and V decoded, in ``dtype``

    @property
    def nbytes(self) -> int:
        return self.checksum_offset + 8

    @property
    def padding(self) -> list[tuple[int, int]]:
        """Byte ranges between sections, zero in every chunk."""
        gaps = [(HEADER_NBYTES + self.scales_nbytes, self.payload_offset),
                (self.payload_offset + self.payload_nbytes, self.checksum_offset)]  # fmt: skip
        return [(a, b) for a, b in gaps if b > a]


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def group_size(n: int, g: int) -> int:
    """The largest divisor of ``n`` that is at most ``g``: an INT4 group along ``n``."""
    return next(k for k in range(min(n, g), 0, -1) if n % k == 0)


def _scale_slots(scheme: int, t: int, h: int, d: int) -> tuple[Any, ...]:
    per_channel, per_token = ((1, h, d), (h * d, d, 1)), ((t, h, 1), (h, 1, 1))
    shapes = {"c": [per_channel], "cc": [per_channel] * 2, "t": [per_token],
              "ct": [per_channel, per_token]}  # fmt: skip
    if scheme in _INT4_GROUPS:
        gt, gd = t // group_size(t, _INT4_GROUPS[scheme]), d // group_size(d, _INT4_GROUPS[scheme])
        shapes["kg"] = [((gt, h, d), (h * d, d, 1))] * 2
        shapes["vg"] = [((t, h, gd), (h * gd, gd, 1))] * 2
    slots, start = [], 0
    for half, mode in enumerate(_SCHEME_MODES.get(scheme, ())):
        for shape, strides in shapes[mode]:
            slots.append((half, shape, strides, start))
            start += math.prod(shape)
    return tuple(slots)


@lru_cache(maxsize=256)
def _layout(t: int, h: int, d: int, dtype: torch.dtype, scheme: int) -> _Layout:
    itemsize = 1 if scheme else torch.empty((), dtype=dtype).element_size()
    slots = _scale_slots(scheme, t, h, d)
    scales = sum(2 * math.prod(shape) for _, shape, _, _ in slots)
    payload_offset = HEADER_NBYTES + _align(scales, _ALIGN)
    payload = 2 * t * h * d * itemsize // (2 if scheme in _INT4_GROUPS else 1)
    checksum_offset = payload_offset + _align(payload, 8)
    values = 2 * t * h * d * dtype.itemsize
    return _Layout(
        (t, h, d), dtype, scheme, slots, scales, payload_offset, payload, checksum_offset, values
    )


def _scheme_id(quant: str) -> int:
    if not isinstance(quant, str) or quant not in QUANT_SCHEMES:
        raise InvalidArgument(f"unknown quant {quant!r}; expected one of {sorted(QUANT_SCHEMES)}")
    return SCHEMES[QUANT_SCHEMES[quant]]


def _checked_layout(t: int, h: int, d: int, dtype: torch.dtype, quant: str) -> _Layout:
    for name, v in (("T", t), ("H", h), ("D", d)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < _U32:
            raise BadShape(f"chunk dimension {name}={v!r} must be an int in [1, 2**32)")
    scheme = _scheme_id(quant)
    if scheme in _INT4_GROUPS and d % 2:
        raise BadShape(f"INT4 packs two channels to a byte: head_dim D={d} must be even")
    layout = _layout(t, h, d, dtype, scheme)
    if layout.scales_nbytes >= _U32:
        raise BadShape(f"chunk [2, {t}, {h}, {d}] is too large for one chunk")
    return layout


def chunk_nbytes(T: int, H: int, D: int, dtype: Any, quant: str = "int8") -> int:
    """Exact encoded size of a ``[2, T, H, D]`` chunk; depends on nothing else.

    Pure and cheap (cached). Raises :class:`BadShape` for a bad dimension or dtype and
    :class:`InvalidArgument` for an unknown ``quant``.
    """
    return _checked_layout(T, H, D, getattr(torch, dtype_name(dtype)), quant).nbytes


# ----------------------------------------------------------------------------- checksums


def _count_copy(nbytes: int) -> None:  # a device buffer copied to the host for xxh3
    _count(extra_copies=1, extra_bytes=nbytes)


def _verify_checksum(
    buf: Tensor, host: np.ndarray | None, header: ChunkHeader, layout: _Layout
) -> None:
    """Raise :class:`ChecksumError` unless ``buf`` (``host``: its numpy view, if on the
    host) matches its stored checksum."""
    end = layout.checksum_offset
    want = stored_checksum(buf, end, host)
    actual = compute_checksum(buf, end, header.checksum, host, _count_copy)
    if actual != want:
        raise _checksum_error(header, want, actual)


def _checksum_error(header: ChunkHeader, want: int, actual: int) -> ChecksumError:
    return ChecksumError(
        f"chunk {_fmt_key(header.key)} fails its {header.checksum} checksum "
        f"(stored {want:#018x}, computed {actual:#018x}): bits flipped in flight or at rest"
    )


# ----------------------------------------------------------------------------- header


def _fmt_key(key: ChunkKey) -> str:
    return f"(block {key.block_hash.hex()[:12]}…, layer {key.layer}, shard {key.shard})"


def _check_key(key: Any) -> ChunkKey:
    if type(key) is ChunkKey:  # the usual case, taken as it is (1.3 → 0.3 µs a key)
        block_hash, layer, shard = key
        if (
            type(block_hash) is bytes
            and len(block_hash) == 16
            and type(layer) is int
            and type(shard) is int
            and 0 <= layer < _U32
            and 0 <= shard < _U32
        ):
            return key
    if key is None or (isinstance(key, (bytes, bytearray)) and len(key) == 0):
        return ChunkKey(_ZERO_KEY_HASH, 0, 0)
    if not isinstance(key, tuple) or len(key) != 3:
        raise InvalidArgument(f"chunk key must be a ChunkKey(hash, layer, shard), got {key!r}")
    block_hash, layer, shard = key
    if not isinstance(block_hash, (bytes, bytearray)) or len(block_hash) != 16:
        raise InvalidArgument(f"chunk key block_hash must be 16 bytes, got {block_hash!r}")
    for name, v in (("layer", layer), ("shard", shard)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U32:
            raise InvalidArgument(f"chunk key {name} must be an int in [0, 2**32), got {v!r}")
    return ChunkKey(bytes(block_hash), layer, shard)


def _pack_header(key: ChunkKey, layout: _Layout, checksum: int) -> bytes:
    fields = (MAGIC, FORMAT_VERSION, HEADER_NBYTES, *key, *layout.shape,
              _DTYPE_CODES[layout.dtype], layout.scheme, checksum, 0,
              layout.payload_nbytes, layout.scales_nbytes, 0)  # fmt: skip
    body = _HEADER.pack(*fields)[:_CHECKED]
    return body + struct.pack("<I", xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF)


class _Form(NamedTuple):
    """What a header form says (:data:`_FORMS`): all a chunk header holds but its key and
    check, and the C kernels' decode plan where they decode it (None: they never do)."""

    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    scheme: str
    checksum: str
    quants: tuple[str, str]
    """:attr:`ChunkHeader.quants` of its chunks."""
    layout: _Layout
    plan: Any

    def fits(self, spec: ChunkSpec) -> bool:
        """Whether a chunk of this form passes ``spec`` (as :func:`_check_expected`)."""
        shape = (2, spec.tokens, spec.heads, spec.head_dim)
        return shape == self.shape and spec.dtype == self.dtype and spec.quant in self.quants


_FORMS: dict[tuple[bytes, bytes, int], _Form] = {}
"""Header forms :func:`_parse_header` passed: (bytes 0..7, bytes 32..59, chunk size) → what
they say. A header of a known form has only its key and its check left to read (~1 µs
against ~3); every form a process meets is one of a few per namespace, and past
:data:`_MAX_FORMS` the memory starts again."""
_MAX_FORMS = 256
_KEY_AT = struct.Struct("<16sII")
"""The key's fields in a header, from byte 8."""


def _form_of(raw: bytes, size: int) -> _Form | None:
    """The known form of the 64-byte header ``raw`` of a chunk of ``size`` bytes, if its
    header check holds (None: unknown form, or a check that fails)."""
    form = _FORMS.get((raw[:8], raw[32:_CHECKED], size))
    if form is None or int.from_bytes(raw[_CHECKED:], "little") != (
        xxhash.xxh3_64_intdigest(raw[:_CHECKED]) & 0xFFFFFFFF
    ):
        return None
    return form


def _parse_header(raw: bytes, size: int) -> tuple[ChunkHeader, _Layout]:
    if size < HEADER_NBYTES:
        raise ChunkFormatError(f"truncated chunk: {size} bytes, the header alone needs 64")
    form = _form_of(raw, size) if len(raw) == HEADER_NBYTES else None
    if form is not None:
        key = ChunkKey._make(_KEY_AT.unpack_from(raw, 8))
        header = ChunkHeader(key, form.shape, form.dtype, form.scheme, form.checksum,
                             form.layout.nbytes)  # fmt: skip
        return header, form.layout
    (magic, version, hsize, block_hash, layer, shard, t, h, d, dcode, scheme, ckind, flags,
     payload, scales, check) = _HEADER.unpack(raw)  # fmt: skip
    if magic != MAGIC:
        raise ChunkFormatError(f"not a kvstore chunk: magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise ChunkVersionError(f"chunk version {version}; this build reads {FORMAT_VERSION}")
    if hsize != HEADER_NBYTES:
        raise ChunkFormatError(f"chunk header size {hsize}, expected {HEADER_NBYTES}")
    if check != xxhash.xxh3_64_intdigest(raw[:_CHECKED]) & 0xFFFFFFFF:
        raise ChecksumError("chunk header is corrupted (header check does not match)")
    if dcode not in _DTYPES or scheme not in _SCHEME_NAMES or ckind not in _CHECKSUM_NAMES:
        raise ChunkFormatError(f"unknown dtype {dcode}, scheme {scheme} or checksum {ckind}")
    if flags != 0 or min(t, h, d) == 0 or (scheme in _INT4_GROUPS and d % 2):
        raise ChunkFormatError(f"inconsistent chunk header: flags {flags}, shape T={t} H={h} D={d}")
    layout = _layout(t, h, d, _DTYPES[dcode], scheme)
    if (payload, scales) != (layout.payload_nbytes, layout.scales_nbytes):
        raise ChunkFormatError(
            f"inconsistent chunk header: shape [2, {t}, {h}, {d}] {_DTYPES[dcode]} "
            f"{_SCHEME_NAMES[scheme]} implies payload {layout.payload_nbytes} B and scales "
            f"{layout.scales_nbytes} B, header says {payload} B and {scales} B"
        )
    if size != layout.nbytes:
        what = "truncated chunk" if size < layout.nbytes else "chunk buffer too long"
        raise ChunkFormatError(f"{what}: {size} bytes, its header implies {layout.nbytes}")
    key = ChunkKey(block_hash, layer, shard)
    names = (_SCHEME_NAMES[scheme], _CHECKSUM_NAMES[ckind])
    header = ChunkHeader(key, (2, t, h, d), _DTYPES[dcode], *names, layout.nbytes, version)
    if len(_FORMS) >= _MAX_FORMS:
        _FORMS.clear()
    modes, plan = _SCHEME_MODES.get(scheme), None
    if modes and scheme not in _INT4_GROUPS and native.available():
        plan = native.plan_of(modes, layout.shape, layout.scale_slots,
                              (HEADER_NBYTES, layout.payload_offset))  # fmt: skip
    form = _Form(header.shape, header.dtype, *names, header.quants, layout, plan)
    _FORMS[raw[:8], raw[32:_CHECKED], size] = form
    return header, layout


# ----------------------------------------------------------------------------- buffers


def _as_bytes_tensor(buf: Any) -> Tensor:
    """View ``buf`` as a 1-D, 8-byte-aligned uint8 tensor, copying only if it must."""
    if isinstance(buf, (bytes, bytearray, memoryview)):
        try:
            buf = np.frombuffer(buf, dtype=np.uint8)
        except (ValueError, TypeError, BufferError) as exc:
            raise InvalidArgument(f"chunk buffer is not contiguous bytes: {exc}") from exc
    if isinstance(buf, np.ndarray) and buf.dtype in (np.uint8, np.int8) and buf.ndim == 1:
        if not buf.flags.c_contiguous:
            _count(extra_copies=1, extra_bytes=buf.nbytes)
            buf = np.ascontiguousarray(buf)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffers: we only read
            buf = torch.from_numpy(buf.view(np.uint8))
    if not isinstance(buf, Tensor) or buf.dtype not in (torch.uint8, torch.int8) or buf.dim() != 1:
        got = f"{type(buf).__name__} {getattr(buf, 'dtype', '')} {getattr(buf, 'shape', '')}"
        raise InvalidArgument(f"a chunk buffer is 1-D uint8 bytes, got {got}")
    t = buf if buf.dtype == torch.uint8 else buf.view(torch.uint8)
    if (t.numel() and t.stride(0) != 1) or t.data_ptr() % 8 or t.storage_offset() % 8:
        _count(extra_copies=1, extra_bytes=t.numel())
        t = t.clone()
    return t


# ----------------------------------------------------------------------------- quantization


def _scale_views(base: Tensor, start: int, layout: _Layout) -> tuple[list[Tensor], list[Tensor]]:
    """K's and V's scale tensors ``[*lead, *shape]`` in ``base [*lead, L]`` (float16 rows,
    or a float32 copy of the scale region) whose scale region starts at storage offset
    ``start``; one ``as_strided`` op each."""
    views: tuple[list[Tensor], list[Tensor]] = ([], [])
    lead, lead_strides = tuple(base.shape[:-1]), base.stride()[:-1]
    for half, shape, strides, at in layout.scale_slots:
        views[half].append(base.as_strided((*lead, *shape), (*lead_strides, *strides), start + at))
    return views


def _payload_view(buf: Tensor, layout: _Layout) -> Tensor:
    """The payload of ``buf [*lead, nbytes]`` as ``[*lead, 2, T, H, D]`` int8 codes or raw
    values, or ``[*lead, 2, T, H, D/2]`` packed INT4 codes (uint8)."""
    if layout.scheme in _INT4_GROUPS:
        typed, (t, h, d) = buf.view(torch.uint8), layout.shape
        d //= 2
    else:
        typed = buf.view(torch.int8 if layout.scheme else layout.dtype)
        t, h, d = layout.shape
    start = typed.storage_offset() + layout.payload_offset // typed.element_size()
    stride = (*typed.stride()[:-1], t * h * d, h * d, d, 1)
    return typed.as_strided((*typed.shape[:-1], 2, t, h, d), stride, start)


def _encode_rows(
    x: tuple[Tensor, Tensor], rows: Tensor, layout: _Layout, keys: list[ChunkKey], kind: int
) -> None:
    """Encode K and V ``[N, T, H, D]`` into ``rows [N, nbytes]`` (uint8, rows 8-aligned)."""
    n = rows.shape[0]
    headers = b"".join(_pack_header(k, layout, kind) for k in keys)
    # On the host, byte fields go through a numpy view (a slice costs far less than a torch
    # op) and xxh3 reads rows in place, after all tiles: hashing each row right after its
    # tile was slower, it evicts the next tile's working set.
    host = rows.numpy() if rows.device.type == "cpu" else None
    frames = np.frombuffer(headers, dtype=np.uint8).reshape(n, -1)
    target: Any = rows if host is None else host  # both take slice assignment
    target[:, :HEADER_NBYTES] = frames if host is not None else torch.tensor(frames)
    for start, stop in layout.padding:
        target[:, start:stop] = 0
    if layout.scheme == 0:
        payload = _payload_view(rows, layout)
        payload[:, 0].copy_(x[0])
        payload[:, 1].copy_(x[1])
    else:
        _quantize(x, rows, layout)
        _require_finite(rows, host, layout)
    if host is not None and kind == CHECKSUMS["xxh3_64"]:
        write_xxh3(host, layout.checksum_offset, 0, n)
    else:
        write_checksums(rows, layout.checksum_offset, _CHECKSUM_NAMES[kind], _count_copy)
    _count(encoded_bytes=n * layout.nbytes)


def _quantize(x: tuple[Tensor, Tensor], rows: Tensor, layout: _Layout) -> None:
    """Quantize K and V ``[N, T, H, D]`` into ``rows``, one tile at a time: each pass over a
    tile that outgrows L2 runs ~1.8x slower per byte (docs/codec.md, Speed)."""
    n, (t, h, d) = rows.shape[0], layout.shape
    device = x[0].device
    blocks, heads = kernels.tile_shape(n, t, h, d, device)
    codes = _payload_view(rows, layout)  # [N, 2, T, H, D]
    rows16 = rows.view(torch.float16)
    scales = _scale_views(rows16, int(rows16.storage_offset()) + HEADER_NBYTES // 2, layout)
    modes, int8 = _SCHEME_MODES[layout.scheme], layout.scheme not in _INT4_GROUPS
    if int8 and native.quantize(x[0], x[1], codes, scales, modes):
        return  # C kernels, one call per half of the layer (kvstore.core.native)
    if int8 and fused.quantize(x[0], x[1], codes, scales, modes):
        return  # one compiled call for the layer (kvstore.core.fused)
    work: list[tuple[kernels.Encoder, list[tuple[Tensor, ...]]]] = []
    for half, mode in enumerate(modes):
        views = [x[half], codes[:, half], *scales[half]]
        per_tile = zip(*(kernels.tiles(v, blocks, heads) for v in views), strict=True)
        work.append((kernels.ENCODERS[mode], list(per_tile)))
    for k in range(len(work[0][1])):
        for encode, tiles in work:
            xt, qt, *sc = tiles[k]
            encode(kernels.scratch(xt.shape, device).copy_(xt), qt, sc)


def _require_finite(rows: Tensor, host: np.ndarray | None, layout: _Layout) -> None:
    # NaN/inf anywhere in the KV (or |x| beyond float16 scales) makes a stored scale
    # non-finite. On the host: a float16 with every exponent bit set, found as an integer
    # (its bits but the sign at least 0x7C00: ~5 µs for a layer's 8 chunks, where numpy's
    # float16 isfinite took ~65); elsewhere: a non-finite float32 sum (finite scales
    # cannot overflow it), one host sync per call.
    end = HEADER_NBYTES + layout.scales_nbytes
    if host is not None:
        bits = host[:, HEADER_NBYTES:end].view(np.uint16)
        finite = not bits.size or int((bits & 0x7FFF).max()) < 0x7C00
    else:
        scales = rows[:, HEADER_NBYTES:end].view(torch.float16)
        finite = math.isfinite(scales.sum(dtype=torch.float32).item())
    if not finite:
        raise InvalidArgument(
            "KV holds NaN/inf or values too large for this scheme's float16 scales "
            "(INT8: |x| > ~8e6; INT4: beyond float16's range, |x| > 65504); encode it "
            "with quant='none'"
        )


# ----------------------------------------------------------------------------- public API


KV = Tensor | tuple[Tensor, Tensor]
"""One layer's (or chunk's) K and V: a ``[2, T, H, D]`` tensor (K then V), or K and V kept
apart as a pair of ``[T, H, D]`` tensors (any strides, one shape, dtype and device), as
engines hold them. Every codec call that takes or fills KV accepts either, without a copy."""


def kv_halves(t: Any, name: str = "KV") -> tuple[Tensor, Tensor]:
    """``t`` (a :data:`KV`) as its K and V ``[T, H, D]`` views, validated (no copy).

    Raises :class:`InvalidArgument` for anything but a tensor or a pair of tensors, and
    :class:`BadShape` for a tensor that is not ``[2, T, H, D]``, halves that differ in
    shape, dtype or device, or a dtype the codec cannot encode.
    """
    if isinstance(t, Tensor):
        if t.dim() != 4 or t.shape[0] != 2:
            raise BadShape(f"{name} must be [2, T, H, D] (K then V), got {tuple(t.shape)}")
        k, v = t[0], t[1]
    elif isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, Tensor) for x in t):
        k, v = t
        if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise BadShape(
                f"{name} as (K, V) must be two [T, H, D] tensors of one dtype and device, "
                f"got {tuple(k.shape)} {k.dtype} {k.device} and {tuple(v.shape)} {v.dtype} "
                f"{v.device}"
            )
    else:
        raise InvalidArgument(f"{name} must be a Tensor or a (K, V) pair, got {type(t).__name__}")
    if k.dtype not in _DTYPE_CODES:
        raise BadShape(f"unsupported {name} dtype {k.dtype}; expected float16, bfloat16 or float32")
    return k, v


def kv_span(t: KV, start: int, stop: int) -> KV:
    """Tokens ``start:stop`` of ``t``, of the same kind (a view; no validation)."""
    if isinstance(t, Tensor):
        return t[:, start:stop]
    return t[0][start:stop], t[1][start:stop]


def _checksum_kind(checksum: str | None, device: torch.device) -> int:
    if checksum is None:
        return CHECKSUMS["xxh3_64" if device.type == "cpu" else "mulsum64"]
    if checksum not in CHECKSUMS:
        raise InvalidArgument(f"unknown checksum {checksum!r}; expected one of {list(CHECKSUMS)}")
    return CHECKSUMS[checksum]


def _check_out_buf(out: Any, shape: tuple[int, ...], device: torch.device) -> Tensor:
    if not isinstance(out, Tensor) or out.dtype != torch.uint8:
        raise InvalidArgument(f"out must be a uint8 tensor, got {getattr(out, 'dtype', out)!r}")
    if tuple(out.shape) != shape:
        raise InvalidArgument(f"out has shape {tuple(out.shape)}; the chunks need {shape}")
    if out.device != device:
        raise InvalidArgument(f"out is on {out.device}, the KV on {device}")
    rows_ok = out.dim() == 1 or (out.stride(0) % 8 == 0 and out.stride(0) >= shape[-1])
    if out.stride(-1) != 1 or out.data_ptr() % 8 or not rows_ok:
        raise InvalidArgument("out must be contiguous, 8-byte aligned, non-overlapping rows")
    return out


def _prepare(k: Tensor, block_tokens: int, quant: str, checksum: str | None) -> tuple[_Layout, int]:
    layout = _checked_layout(block_tokens, k.shape[1], k.shape[2], k.dtype, quant)
    return layout, _checksum_kind(checksum, k.device)


def encode_chunk(
    t: KV,
    quant: str = "int8",
    key: ChunkKey | bytes | None = None,
    out: Tensor | None = None,
    checksum: str | None = None,
) -> Tensor:
    """Encode one ``[2, T, H, D]`` chunk (or a (K, V) pair, :data:`KV`) into a 1-D uint8
    tensor on ``t``'s device.

    ``t`` may be any strided view (e.g. ``layer[:, a:b]``); its values are read once and
    written straight into the chunk buffer. ``quant``: ``"int8"`` (:data:`DEFAULT_INT8`),
    ``"none"`` (raw bytes) or a scheme name. ``key`` None (or ``b""``) is the all-zero key.
    ``out``, when given, is a preallocated contiguous, 8-byte-aligned uint8 tensor of
    exactly :func:`chunk_nbytes` bytes (e.g. a slot view) that is filled and returned; its
    contents are unspecified if this raises. ``checksum`` forces ``"xxh3_64"`` or
    ``"mulsum64"`` (default: xxh3 on CPU, mulsum64 elsewhere). Runs synchronously; on a
    GPU it syncs once (the scale sanity check). Raises :class:`BadShape` for a bad
    shape or dtype, :class:`InvalidArgument` for a bad quant, key or ``out`` and for
    NaN/inf (or beyond float16-scale range) KV under INT8.
    """
    k, v = kv_halves(t)
    layout, kind = _prepare(k, k.shape[0], quant, checksum)
    checked = _check_key(key)
    if out is None:
        out = torch.empty(layout.nbytes, dtype=torch.uint8, device=k.device)
    else:
        _check_out_buf(out, (layout.nbytes,), k.device)
    with torch.no_grad():
        _encode_rows((k.unsqueeze(0), v.unsqueeze(0)), out.view(1, -1), layout, [checked], kind)
    return out


def encode_blocks(
    layer: KV,
    block_tokens: int,
    keys: Sequence[ChunkKey | None],
    quant: str = "int8",
    out: Tensor | Sequence[Tensor] | None = None,
    checksum: str | None = None,
) -> list[Tensor]:
    """Encode the first ``len(keys)`` full blocks of a ``[2, T_total, H, D]`` layer (or a
    (K, V) pair of ``[T_total, H, D]``, :data:`KV`).

    Block ``i`` is ``layer[:, i*block_tokens:(i+1)*block_tokens]`` with key ``keys[i]``;
    tokens past the last block are ignored. Blocks are quantized in cache-sized tiles
    (several small blocks, or one block's heads in parts), straight into the outputs.
    ``out``: None (one new ``[N, nbytes]`` tensor whose rows are returned), a uint8
    ``[N, nbytes]`` tensor (rows may be strided, row stride a multiple of 8), or a sequence
    of N 1-D buffers as for :func:`encode_chunk` (encoded one by one). Returns the N chunk
    tensors (views of ``out``), byte-identical to :func:`encode_chunk` of each block.
    Blocks and raises like :func:`encode_chunk`, plus :class:`BadShape` if the layer
    holds fewer than ``len(keys) * block_tokens`` tokens.
    """
    n = len(keys)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidArgument(f"block_tokens must be a positive int, got {block_tokens!r}")
    if n < 1:
        raise InvalidArgument("encode_blocks needs at least one key")
    k, v = kv_halves(layer)
    layout, kind = _prepare(k, block_tokens, quant, checksum)
    if n * block_tokens > k.shape[0]:
        raise BadShape(f"{n} blocks of {block_tokens} tokens need more than {k.shape[0]}")
    checked = [_check_key(key) for key in keys]
    if out is not None and not isinstance(out, Tensor):
        if len(out) != n:
            raise InvalidArgument(f"out has {len(out)} buffers for {n} blocks")
        B = block_tokens
        span = [kv_span((k, v), i * B, (i + 1) * B) for i in range(n)]
        return [encode_chunk(span[i], quant, checked[i], out[i], checksum) for i in range(n)]
    if out is None:
        rows = torch.empty(n, layout.nbytes, dtype=torch.uint8, device=k.device)
    else:
        rows = _check_out_buf(out, (n, layout.nbytes), k.device)
    x = tuple(h[: n * block_tokens].unflatten(0, (n, block_tokens)) for h in (k, v))
    with torch.no_grad():
        _encode_rows((x[0], x[1]), rows, layout, checked, kind)
    return list(rows.unbind(0))


def read_header(buf: Any) -> ChunkHeader:
    """Parse and validate a chunk's header only (cheap: 64 bytes, no payload read).

    ``buf``: a 1-D uint8 tensor (any device; a device buffer costs a 64-byte host copy),
    numpy array, bytes, bytearray or memoryview. Checks magic, version, the header check,
    that every field is known and that the buffer is exactly as long as the header says.
    Raises :class:`ChunkFormatError`, :class:`ChunkVersionError` or
    :class:`ChecksumError` (header corrupted); :class:`InvalidArgument` if ``buf`` is not a
    byte buffer.
    """
    return _read(_as_bytes_tensor(buf))[0]


def _read(t: Tensor) -> tuple[ChunkHeader, _Layout, np.ndarray | None]:
    """Parse ``t``'s header; also return ``t`` as a numpy array when it is on the host."""
    host = t.numpy() if t.is_cpu else None  # (is_cpu: 0.04 µs; device.type: 0.3-0.45)
    size = t.numel()
    if size < HEADER_NBYTES:
        raw = b""
    elif host is not None:
        raw = host[:HEADER_NBYTES].tobytes()
    else:
        raw = t[:HEADER_NBYTES].cpu().numpy().tobytes()
    return (*_parse_header(raw, size), host)


def _check_expected(
    header: ChunkHeader, expect_key: ChunkKey | None, expect_spec: ChunkSpec | None = None
) -> None:
    # (a key equal to the header's is right whatever its type; only a mismatch is checked)
    if expect_key is not None and header.key != expect_key:
        want = _check_key(expect_key)
        if header.key != want:
            raise ChunkKeyMismatch(f"chunk is {_fmt_key(header.key)}, expected {_fmt_key(want)}")
    if expect_spec is not None:
        s = expect_spec
        shape = (2, s.tokens, s.heads, s.head_dim)
        if header.shape != shape or header.dtype != s.dtype or s.quant not in header.quants:
            raise ChunkSpecMismatch(
                f"chunk {_fmt_key(header.key)} is {list(header.shape)} {header.dtype} "
                f"{header.scheme}; its namespace stores {list(shape)} {s.dtype} {s.quant}"
            )


def check_header(
    buf: Any, expect_key: ChunkKey | None = None, expect_spec: ChunkSpec | None = None
) -> ChunkHeader:
    """Validate a chunk's header, its key and its spec without reading the payload (64
    bytes: what a node checks before acking a put); return the header.

    Raises as :func:`read_header`, plus :class:`ChunkKeyMismatch` if ``expect_key`` differs
    and :class:`ChunkSpecMismatch` if shape, dtype or quantization is not ``expect_spec``.
    """
    header = read_header(buf)
    _check_expected(header, expect_key, expect_spec)
    return header


def check_header_bytes(
    raw: bytes, size: int, expect_key: ChunkKey | None = None, expect_spec: ChunkSpec | None = None
) -> ChunkHeader:
    """:func:`check_header` of a chunk of ``size`` bytes whose first 64 bytes are ``raw``,
    already read (so the verdict is on those bytes, whatever the buffer holds by now)."""
    if size >= HEADER_NBYTES and len(raw) != HEADER_NBYTES:
        raise ChunkFormatError(f"a chunk header is {HEADER_NBYTES} bytes, got {len(raw)}")
    header, _ = _parse_header(raw, size)  # (a size under 64 raises "truncated" first)
    _check_expected(header, expect_key, expect_spec)
    return header


def header_form(raw: bytes, size: int, key: ChunkKey) -> tuple[Any, ...] | None:
    """What decides whether a chunk of ``size`` bytes whose 64-byte header is ``raw`` passes
    :func:`check_header` against a key and a spec, less the key: the header's fields other
    than the key and its check, and ``size``. None when the header check fails or ``raw``
    names another key than ``key``. Two chunks of one form pass or fail against one spec
    alike, so a node checks a form once with :func:`check_header` and later chunks of it
    with this alone (~1 µs against ~16 for :func:`check_header` of a host chunk)."""
    if len(raw) != HEADER_NBYTES:
        return None
    fields = _HEADER.unpack(raw)
    if fields[3:6] != key or fields[15] != xxhash.xxh3_64_intdigest(raw[:_CHECKED]) & 0xFFFFFFFF:
        return None
    return (*fields[:3], *fields[6:15], size)


def verify_chunk(
    buf: Any, expect_key: ChunkKey | None = None, expect_spec: ChunkSpec | None = None
) -> ChunkHeader:
    """Validate header, key, spec and checksum without dequantizing; return the header.

    What a storage node runs on a chunk that landed in its memory before committing it.
    Reads the whole buffer once (on its own device for ``mulsum64``). Raises as
    :func:`check_header`, plus :class:`ChecksumError` if the contents do not match the
    checksum.
    """
    t = _as_bytes_tensor(buf)
    header, layout, host = _read(t)
    _check_expected(header, expect_key, expect_spec)
    with torch.no_grad():
        _verify_checksum(t, host, header, layout)
    return header


def verify_host_bytes(
    buf: np.ndarray, expect_key: ChunkKey | None = None, expect_spec: ChunkSpec | None = None
) -> ChunkHeader:
    """:func:`verify_chunk` for a chunk in a 1-D host ``uint8`` numpy array, without building
    tensors: what a node runs on many small chunks received together (measured: ~10 µs a
    1.3 KB chunk against ~60 µs through tensors). Raises as :func:`verify_chunk`."""
    header, layout = _parse_header(buf[:HEADER_NBYTES].tobytes(), buf.size)
    _check_expected(header, expect_key, expect_spec)
    if header.checksum != "xxh3_64":
        return verify_chunk(buf, expect_key, expect_spec)
    end = layout.checksum_offset
    want = int(buf[end : end + 8].view("<u8")[0])
    actual = xxhash.xxh3_64_intdigest(buf[:end].data)
    if actual != want:
        raise _checksum_error(header, want, actual)
    return header


def _target(device: Any, out: tuple[Tensor, Tensor] | None, buf: Tensor) -> torch.device:
    try:
        wanted = None if device is None else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(f"bad device {device!r}: {exc}") from exc
    if out is not None and wanted is not None and out[0].device != wanted:
        raise InvalidArgument(f"out is on {out[0].device} but device={device} was requested")
    return out[0].device if out is not None else wanted or buf.device


def _check_out_kv(out: Any, header: ChunkHeader) -> tuple[Tensor, Tensor]:
    if not isinstance(out, (Tensor, tuple, list)):
        raise InvalidArgument(f"out must be a Tensor or a (K, V) pair, got {type(out).__name__}")
    try:
        k, v = kv_halves(out, "out")
    except BadShape as exc:  # say what the chunk needs
        raise BadShape(f"{exc}; chunk is {header.shape} {header.dtype}") from None
    if tuple(k.shape) != header.shape[1:] or k.dtype != header.dtype:
        shape = tuple(out.shape) if isinstance(out, Tensor) else (2, *k.shape)
        raise BadShape(f"out is {shape} {k.dtype}; chunk is {header.shape} {header.dtype}")
    return k, v


@overload
def decode_chunk(
    buf: Any,
    device: torch.device | str | None = None,
    out: Tensor | None = None,
    expect_key: ChunkKey | None = None,
    expect_spec: ChunkSpec | None = None,
) -> Tensor: ...
@overload
def decode_chunk(
    buf: Any,
    device: torch.device | str | None = None,
    *,
    out: tuple[Tensor, Tensor],
    expect_key: ChunkKey | None = None,
    expect_spec: ChunkSpec | None = None,
) -> tuple[Tensor, Tensor]: ...


def decode_chunk(
    buf: Any,
    device: torch.device | str | None = None,
    out: KV | None = None,
    expect_key: ChunkKey | None = None,
    expect_spec: ChunkSpec | None = None,
) -> KV:
    """Verify and decode a chunk into ``[2, T, H, D]`` of its original dtype.

    ``buf``: a 1-D uint8 tensor, numpy array, bytes, bytearray or memoryview. The result
    lives on ``device`` (default: ``out``'s device, else ``buf``'s, CPU for non-tensors);
    the checksum is verified where ``buf`` lives, then only the encoded bytes move.
    ``out`` (any strided view of the right shape and dtype, e.g. a slice of a layer or a
    paged-cache block, or a (K, V) pair of ``[T, H, D]`` views, :data:`KV`) is written in
    place and returned. Never returns data that failed
    verification. Raises :class:`ChunkFormatError`, :class:`ChunkVersionError`,
    :class:`ChecksumError`, :class:`ChunkKeyMismatch` (``expect_key`` given and different),
    :class:`ChunkSpecMismatch` (``expect_spec`` given and different), :class:`BadShape`
    (``out`` does not fit) or :class:`InvalidArgument`.
    """
    if device is None and type(buf) is Tensor and _decode_known(buf, out, expect_key, expect_spec):
        return out  # type: ignore[return-value]
    t = _as_bytes_tensor(buf)
    header, layout, host = _read(t)
    _check_expected(header, expect_key, expect_spec)
    halves = None if out is None else _check_out_kv(out, header)
    target = _target(device, halves, t)
    # (no grad mode here: the checksums and moves are of uint8 tensors, and _decode_into
    # enters it where torch ops write the output; entering it costs ~1 µs a chunk)
    _verify_checksum(t, host, header, layout)
    if t.device != target:
        _count(extra_copies=1, extra_bytes=t.numel())
        try:
            t = t.to(target)
        except (RuntimeError, AssertionError) as exc:  # e.g. torch built without CUDA
            raise InvalidArgument(f"cannot move the chunk to {target}: {exc}") from exc
    if out is None:
        out = torch.empty(header.shape, dtype=header.dtype, device=target)
        halves = (out[0], out[1])
    assert halves is not None
    _decode_into(t, layout, halves)
    _count(decoded_bytes=layout.values_nbytes)
    return out


def _decode_known(
    buf: Tensor, out: Any, expect_key: ChunkKey | None, expect_spec: ChunkSpec | None
) -> bool:
    """:func:`decode_chunk`'s usual case, without the objects it builds (~5 µs a chunk):
    an aligned host chunk of a header form met before, the C kernels' scheme and an
    ``xxh3_64`` checksum, decoded into a host ``out`` of its shape and dtype (a tensor or a
    (K, V) pair, channels contiguous). It checks what :func:`decode_chunk` checks, the
    header check, key, spec and checksum included; False (nothing written) for any other
    case and for any check that fails, which :func:`decode_chunk` then takes the long way
    (and raises for)."""
    size = buf.numel()
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_cpu or size < HEADER_NBYTES:
        return False
    if buf.stride(0) != 1 or buf.data_ptr() % 8 or buf.storage_offset() % 8:
        return False
    host = buf.numpy()
    raw = host[:HEADER_NBYTES].tobytes()
    form = _form_of(raw, size)
    if form is None or form.plan is None or form.checksum != "xxh3_64":
        return False
    if expect_key is not None and _KEY_AT.unpack_from(raw, 8) != expect_key:  # (tuples)
        return False
    if expect_spec is not None and not form.fits(expect_spec):
        return False
    if type(out) is Tensor:
        if out.shape != form.shape or out.dtype != form.dtype or not out.is_cpu:
            return False
        st = out.stride()
        base, half = out.data_ptr(), st[0] * out.element_size()
        ptrs, strides = (base, base + half), (st[1:], st[1:])
    elif type(out) in (tuple, list) and len(out) == 2 and all(type(x) is Tensor for x in out):
        k, v = out
        shape = form.shape[1:]
        if k.shape != shape or v.shape != shape or k.dtype != form.dtype or v.dtype != k.dtype:
            return False
        if not (k.is_cpu and v.is_cpu):
            return False
        ptrs, strides = (k.data_ptr(), v.data_ptr()), (k.stride(), v.stride())
    else:
        return False
    if any(st[2] != 1 or 0 in st for st in strides):
        return False  # (a zero stride: an expanded view, which the long way refuses)
    layout = form.layout
    _, h, d = layout.shape
    if not native._enabled(form.dtype, h, d, _SCHEME_MODES[layout.scheme]):
        return False
    end = layout.checksum_offset
    if int(host[end : end + 8].view("<u8")[0]) != xxhash.xxh3_64_intdigest(host[:end].data):
        return False
    native.decode_at(form.plan, layout.shape, form.dtype, buf.data_ptr(), ptrs, strides)
    _count(decoded_bytes=layout.values_nbytes)
    return True


def _decode_into(buf: Tensor, layout: _Layout, out: tuple[Tensor, Tensor]) -> None:
    """Dequantize the 1-D chunk ``buf`` into K and V ``[T, H, D]`` (any strides)."""
    modes, int8 = _SCHEME_MODES.get(layout.scheme), layout.scheme not in _INT4_GROUPS
    places = (HEADER_NBYTES, layout.payload_offset)
    if modes and int8 and native.dequantize(buf, modes, layout.shape, layout.scale_slots,
                                            places, out):  # fmt: skip
        return  # C kernels, from pointers (kvstore.core.native)
    with torch.no_grad():
        _decode_with_torch(buf, layout, out)


def _decode_with_torch(buf: Tensor, layout: _Layout, out: tuple[Tensor, Tensor]) -> None:
    """:func:`_decode_into` by torch ops: raw chunks, INT4, and INT8 where the C kernels
    decline (the fused path, then eager)."""
    if layout.scheme == 0:
        payload = _payload_view(buf, layout)  # [2, T, H, D]
        out[0].copy_(payload[0])
        out[1].copy_(payload[1])
        return
    modes, int8 = _SCHEME_MODES[layout.scheme], layout.scheme not in _INT4_GROUPS
    payload = _payload_view(buf, layout)
    region = buf[HEADER_NBYTES : HEADER_NBYTES + layout.scales_nbytes].view(torch.float16)
    scales = _scale_views(region.float(), 0, layout)
    if int8 and fused.dequantize(payload, scales, modes, out):
        return  # one compiled call (kvstore.core.fused)
    dtype, device = out[0].dtype, out[0].device
    tmp = None if dtype == torch.float32 else kernels.scratch(layout.shape, device)
    for half in (0, 1):
        dst = out[half]
        work = dst if tmp is None else tmp
        kernels.DECODERS[modes[half]](payload[half], scales[half], work)
        if tmp is not None:
            dst.copy_(work)

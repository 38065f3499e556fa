"""Namespaces and prefix block hashes (docs/architecture.md, "Data model").

A :class:`Namespace` has a canonical byte serialisation; ``ns.id`` is its xxh3-128
digest. Token ids are written as little-endian u32 and cut into full blocks of
``block_tokens``; a partial tail is never hashed. The chain is::

    h[-1] = ns.id
    h[i]  = xxh3_128_digest(h[i-1] || le_u32(tokens[i*B:(i+1)*B]))

so a block hash names its whole prefix and its namespace. Digests are 16 bytes,
big-endian (``xxhash.xxh3_128_digest``). The TP rank is not part of any hash: every
shard of a block shares the block hash and is told apart by the chunk key's ``shard``.

Canonical namespace bytes (version 3): the ASCII tag ``kvstore-ns/3`` followed by each
field, in the order of :data:`NAMESPACE_FIELDS`, as ``u16 name length, name, u32 value
length, value`` (little-endian lengths, UTF-8 text; integers in decimal, absent optional
fields as the empty string). ``cache_salt`` is written as its digest, 32 hex digits of
``SHA-256("kvstore salt v2" || salt)[:16]``, so the bytes a put carries to a node name the
salt without showing it (:func:`digest_salt`). Nothing here depends on Python's
``hash()``, the platform or the Python version, and nothing imports torch.
"""

from __future__ import annotations

import array
import copy
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

__all__ = [
    "DTYPES",
    "KV_FORMAT",
    "NAMESPACE_FIELDS",
    "BlockHash",
    "Namespace",
    "block_hashes",
    "digest_salt",
    "dtype_name",
]

BlockHash = bytes
"""A 16-byte xxh3-128 digest naming one block and, through the chain, its whole prefix."""

DTYPES = ("float16", "bfloat16", "float32")
"""KV dtypes a namespace may declare (canonical names)."""

QUANTS = ("int8", "int4", "none", "int8-kc-vt", "int8-kt-vt", "int8-kcc-vt", "int8-kcc-vct",
          "int4-g32", "int4-g128")  # fmt: skip
"""What a namespace may declare: a family (``int8``, ``int4``: its default scheme; ``none``:
raw) or one scheme by name (``kvstore.core.codec.QUANT_SCHEMES`` holds the same names)."""

NAMESPACE_FIELDS = (
    "model",
    "revision",
    "adapter",
    "cache_salt",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "block_tokens",
    "quant",
    "tp_size",
    "kv_format",
)
"""Fields in canonical order; changing any of them changes ``ns.id`` and every block hash."""

KV_FORMAT = 1
"""What a chunk's payload means: 1 = per token, K of every KV head of the shard, then V
(``[2, T, H, D]``, token-major), whatever page form the engine keeps (the connector converts;
``kvclient.layouts``). A later meaning gets a new number, so its chunks live in other
namespaces and are never read as this one. Version 2 namespaces (``kvstore-ns/2``) had no
such field: the vLLM connector of that time stored its attention backend's page bytes."""

_TAG = b"kvstore-ns/3"
_SALT_HEX = 32
_MAX_TOKEN = 2**32 - 1
_U32_ITEMSIZE = array.array("I").itemsize


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name for a ``torch.dtype``, numpy dtype or string ("bf16" allowed)."""
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(
        name, name
    )
    if name not in DTYPES:
        raise InvalidArgument(f"unsupported KV dtype {dtype!r}; expected one of {DTYPES}")
    return name


@dataclass(frozen=True)
class Namespace:
    """What a cached KV belongs to: model, weights, adapter, tenant and cache geometry.

    Two requests share cached KV only when every field is equal. ``num_kv_heads`` is
    per TP shard. ``dtype`` accepts a ``torch.dtype`` or its name and is stored as the
    canonical name (``"bfloat16"``).
    """

    model: str
    revision: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = "bfloat16"
    block_tokens: int = 256
    quant: str = "int8"
    adapter: str | None = None
    cache_salt: str | None = None
    tp_size: int = 1
    kv_format: int = KV_FORMAT
    id: bytes = field(init=False, repr=False, compare=False)
    salt_digest: str = field(init=False, repr=False)
    """What the canonical bytes hold for ``cache_salt`` (``""``: none); a namespace parsed
    from them has only this, its ``cache_salt`` None."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size",
                     "kv_format"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"Namespace.{name} must be a positive int, got {value!r}")
        if self.num_layers > 4096:
            raise InvalidArgument(f"Namespace.num_layers {self.num_layers} exceeds 4096")
        if self.quant not in QUANTS:
            raise InvalidArgument(f"Namespace.quant must be one of {QUANTS}, got {self.quant!r}")
        if not self.model:
            raise InvalidArgument("Namespace.model must be non-empty")
        digest = "" if self.cache_salt is None else digest_salt(str(self.cache_salt))
        object.__setattr__(self, "salt_digest", digest)
        object.__setattr__(self, "id", xxhash.xxh3_128_digest(self.canonical_bytes()))

    def canonical_bytes(self) -> bytes:
        """The versioned, platform-independent serialisation that ``id`` hashes."""
        parts = [_TAG]
        for name in NAMESPACE_FIELDS:
            value = self.salt_digest if name == "cache_salt" else getattr(self, name)
            text = "" if value is None else str(value)
            raw_name, raw_value = name.encode(), text.encode("utf-8")
            parts.append(struct.pack("<H", len(raw_name)) + raw_name)
            parts.append(struct.pack("<I", len(raw_value)) + raw_value)
        return b"".join(parts)

    @classmethod
    def from_canonical_bytes(cls, raw: bytes) -> Namespace:
        """Parse :meth:`canonical_bytes` back (used by the master and ``kvctl``)."""
        if not raw.startswith(_TAG):
            raise InvalidArgument("not a canonical namespace (bad tag)")
        values: dict[str, str] = {}
        pos = len(_TAG)
        try:
            while pos < len(raw):
                (n,) = struct.unpack_from("<H", raw, pos)
                name = raw[pos + 2 : pos + 2 + n].decode()
                pos += 2 + n
                (m,) = struct.unpack_from("<I", raw, pos)
                values[name] = raw[pos + 4 : pos + 4 + m].decode("utf-8")
                pos += 4 + m
        except (struct.error, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"truncated or invalid canonical namespace: {exc}") from exc
        if set(values) != set(NAMESPACE_FIELDS):
            raise InvalidArgument(f"canonical namespace has fields {sorted(values)}")
        ints = ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size", "kv_format")
        kwargs: dict[str, Any] = {k: int(values[k]) if k in ints else values[k] for k in values}
        kwargs["adapter"] = kwargs["adapter"] or None
        digest = kwargs.pop("cache_salt")
        if digest and (len(digest) != _SALT_HEX or digest.strip("0123456789abcdef")):
            raise InvalidArgument("canonical namespace: cache_salt is not a salt digest")
        ns = cls(**kwargs)
        if digest:
            object.__setattr__(ns, "salt_digest", digest)
            object.__setattr__(ns, "id", xxhash.xxh3_128_digest(ns.canonical_bytes()))
        if ns.canonical_bytes() != raw:
            raise InvalidArgument("canonical namespace does not round-trip")
        return ns

    def with_id(self, pool_id: bytes) -> Namespace:
        """This namespace stored under ``pool_id`` (a tenant's, :mod:`kvstore.core.tenancy`):
        equal fields, ``id`` replaced. Block hashes still chain from the client's id."""
        if pool_id == self.id:
            return self
        other = copy.copy(self)
        object.__setattr__(other, "id", pool_id)
        return other

    @property
    def id_hex(self) -> str:
        """``id`` as 32 hex digits (logs, Redis keys, ``kvctl``)."""
        return self.id.hex()

    def full_blocks(self, num_tokens: int) -> int:
        """How many full blocks ``num_tokens`` tokens make (the tail is never cached)."""
        return num_tokens // self.block_tokens


def digest_salt(salt: str) -> str:
    """What a namespace's canonical bytes hold for ``cache_salt``: 32 hex digits."""
    try:
        raw = salt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"Namespace.cache_salt is not valid UTF-8: {exc}") from exc
    return hashlib.sha256(b"kvstore salt v2" + raw).hexdigest()[:_SALT_HEX]


def _tokens_le_u32(token_ids: Sequence[int] | np.ndarray | Any) -> np.ndarray:
    """Token ids as a contiguous little-endian u32 array, validated."""
    if isinstance(token_ids, list | tuple) and _U32_ITEMSIZE == 4:
        # 4x faster than np.asarray on a list of Python ints; same validation.
        try:
            packed = array.array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise InvalidArgument(f"token ids must be integers in [0, 2**32): {exc}") from exc
        return np.frombuffer(packed, dtype=np.uint32).astype("<u4", copy=False)
    if hasattr(token_ids, "numpy") and not isinstance(token_ids, np.ndarray):
        token_ids = token_ids.detach().cpu().numpy()  # type: ignore[union-attr]  # torch
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidArgument(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        raise InvalidArgument("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def block_hashes(ns: Namespace, token_ids: Sequence[int] | np.ndarray | Any) -> list[BlockHash]:
    """The block hash of every full block of ``token_ids`` under ``ns`` (tail ignored).

    Accepts a list of ints, a numpy integer array or a 1-D torch tensor. Pure and
    deterministic; about 0.25 ms per 128k-token prompt on a 2-core x86 VM (see ``bench/``).
    """
    tokens = _tokens_le_u32(token_ids)
    step = ns.block_tokens * 4
    data = memoryview(tokens.view(np.uint8))  # type: ignore[arg-type]
    out: list[BlockHash] = []
    prev = ns.id
    digest = xxhash.xxh3_128_digest
    for start in range(0, (len(data) // step) * step, step):
        prev = digest(prev + data[start : start + step])
        out.append(prev)
    return out

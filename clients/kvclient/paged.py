"""Paged-KV adapters: encode chunks from, and decode them into, an engine's paged cache.

Pure tensor logic, no I/O. Engines keep one layer's KV in pages ("engine blocks") of
``block_size`` tokens, in one of three layouts (logical shapes; any strides work)::

    "blocks_first"  [num_blocks, 2, block_size, H, D]     e.g. vLLM's FlashInfer backend (<0.32)
    "kv_first"      [2, num_blocks, block_size, H, D]     e.g. vLLM's FlashAttention backend (<0.32)
    "kv_pair"       (K, V), each [num_blocks, block_size, H, D], strides of their own

The last is what :mod:`kvclient.layouts` makes of an engine's page form (vLLM's CPU pages
hold each head's K transposed, ``[D, block_size]``, and its V as ``[block_size, D]``: two
strided views with different strides; its AMX pages are tiles, two 6-D views of a *tiled*
cache, read and written a block at a time). Whatever the form, a chunk holds the
namespace's canonical KV: per token, K and V of every KV head.

A request owns ``block_ids``: its token ``t`` lives in engine block
``block_ids[t // block_size]`` at offset ``t % block_size``. Our chunk ``j`` is the request's
tokens ``j*B .. (j+1)*B - 1`` (``B`` = the namespace's ``block_tokens``). :func:`chunk_views`
cuts each chunk into pieces (:class:`Piece`), runs of tokens that are one strided view of
the cache. Every ``block_size`` is supported, aligned to ``B`` or not (e.g. 1, 96 or 384
against 256): an unaligned one only means more chunks take the staged path.

A chunk that is one piece is **direct**: the codec reads it from, and dequantizes it into,
the engine's memory with no copy. Otherwise it is **staged**: gathered into (or decoded
from) a small staging buffer, one chunk or a few at a time, never the whole layer. Where
block ``b + 1`` starts in memory right where block ``b`` ends (a contiguous ``kv_first``
cache), pieces over consecutive block ids merge, so a chunk over blocks 40, 41, ..., 55 is
direct even with ``block_size`` 16. Bytes copied per chunk (``2·B·H·D·itemsize``)::

    engine block_size vs B                    put (encode)        get (decode)
    bs >= B, chunk inside one engine block    0                   0
    bs <  B, B % bs == 0 (e.g. 16 vs 256)     1 chunk (gather)    1 chunk (scatter)
    a chunk straddling engine blocks          1 chunk             1 chunk

Gathers of whole engine blocks are two ``index_select`` calls per chunk and scatters two
``index_copy_`` calls, whatever ``block_size`` is, so a CUDA cache costs a few kernels per
chunk, not one per engine block. :func:`paged_copy_stats` counts what was copied.

Block ids: reading (put) allows a block id to repeat; writing (get) rejects repeats, since
two chunks written into one engine block would clobber each other. Ids past the ones a
call needs are never dereferenced and not range-checked, so a padded block-table row may
be passed as is.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvstore.core.codec import ChunkKey, chunk_nbytes, decode_chunk, encode_blocks
from kvstore.core.hashing import dtype_name
from kvstore.errors import BadShape, InvalidArgument

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "LAYOUTS",
    "ChunkView",
    "PagedCache",
    "PagedCopyStats",
    "Piece",
    "chunk_views",
    "decode_into",
    "encode_paged",
    "gather_chunk",
    "paged_copy_stats",
    "scatter_chunk",
]

LAYOUTS: tuple[str, ...] = ("blocks_first", "kv_first", "kv_pair")
"""Accepted ``layout`` values (see the module docstring)."""

DEFAULT_STAGING_BYTES = 4 << 20
"""Staging memory :func:`encode_paged` allocates at most when no buffer is passed."""

_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class PagedCopyStats:
    """Process-wide totals of this module (monotonic; subtract two snapshots for a delta).

    ``gathered_bytes`` / ``scattered_bytes``: KV bytes copied between the engine cache and
    staging (the copies beyond the codec's own pass). ``direct_chunks`` / ``staged_chunks``:
    chunks :func:`encode_paged` and :func:`decode_into` handled in place / through staging.
    """

    gathered_bytes: int = 0
    scattered_bytes: int = 0
    direct_chunks: int = 0
    staged_chunks: int = 0


_stats_lock = threading.Lock()
_stats = {"gathered_bytes": 0, "scattered_bytes": 0, "direct_chunks": 0, "staged_chunks": 0}


def paged_copy_stats() -> PagedCopyStats:
    """Snapshot of the copy counters; never blocks for long (one lock)."""
    with _stats_lock:
        return PagedCopyStats(**_stats)


def _count(**deltas: int) -> None:
    with _stats_lock:
        for name, value in deltas.items():
            _stats[name] += value


# ----------------------------------------------------------------------------- cache


class Piece(NamedTuple):
    """A run of a chunk's tokens that is one strided view of the engine cache.

    ``block`` is the engine block holding the run's first token, ``start`` that token's
    offset in it and ``length`` the run's tokens. A run longer than ``block_size - start``
    continues into the blocks that follow ``block`` in memory, which only happens where
    :attr:`PagedCache.mergeable` is true.
    """

    block: int
    start: int
    length: int


@dataclass(frozen=True, eq=False)
class PagedCache:
    """One layer's paged KV cache of an engine, validated, as K and V views.

    ``tensor``: a 5-D tensor in ``layout`` (``"blocks_first"`` or ``"kv_first"``), or, with
    ``layout="kv_pair"``, a ``(K, V)`` pair of ``[num_blocks, block_size, H, D]`` views
    of any strides (what :mod:`kvclient.layouts` makes of an engine's own page form, where
    K and V need not share strides: vLLM's CPU pages hold K transposed), or of *tiled*
    ``[num_blocks, T1, T0, H, D1, D0]`` views (token ``t1*T0 + t0``, channel
    ``d1*D0 + d0``; each half its own split) for pages no 4-D view describes (vLLM's AMX
    tiles): a tiled cache is read and written a whole engine block at a time, every chunk
    staged (:attr:`tiled`). Raises
    :class:`InvalidArgument` for a non-tensor or an unknown layout and :class:`BadShape`
    for a tensor that is not 5-D with 2 (K, V) in the layout's place, halves that differ,
    or a dtype the codec cannot encode. Holds no copy of the data.
    """

    tensor: Tensor | tuple[Tensor, Tensor]
    layout: str = "blocks_first"
    kv: tuple[Tensor, Tensor] = field(init=False, repr=False)
    """K and V, each a ``[num_blocks, block_size, H, D]`` view of ``tensor`` (6-D tiled
    views when :attr:`tiled`)."""
    tiled: bool = field(init=False, default=False)
    """Whether K or V is a tiled 6-D view: no chunk is then one strided view (direct)."""
    in_place: bool = field(init=False, default=True)
    """Whether a chunk that is one view of the cache is encoded from and decoded into it
    in place: K's and V's channels are adjacent in memory (the C kernels' rows). Else
    every chunk is staged (vLLM's CPU pages hold K transposed: gathering a chunk and
    running the kernels is ~5x faster than the eager codec on the transposed view)."""

    def __post_init__(self) -> None:
        t = self.tensor
        if self.layout not in LAYOUTS:
            raise InvalidArgument(f"unknown layout {self.layout!r}; expected one of {LAYOUTS}")
        if self.layout == "kv_pair":
            kv = _pair_halves(t)
            tiled = any(h.dim() == 6 for h in kv)
            object.__setattr__(self, "kv", kv)
            object.__setattr__(self, "tiled", tiled)
            object.__setattr__(self, "in_place", not tiled and all(h.stride(-1) == 1 for h in kv))
            return
        if not isinstance(t, Tensor):
            raise InvalidArgument(f"paged cache must be a Tensor, got {type(t).__name__}")
        want = "[num_blocks, 2, block_size, H, D]"
        if self.layout == "kv_first":
            want = "[2, num_blocks, block_size, H, D]"
        kv_dim = 1 if self.layout == "blocks_first" else 0
        if t.dim() != 5 or t.shape[kv_dim] != 2 or 0 in t.shape:
            raise BadShape(f"{self.layout} paged cache must be {want}, got {tuple(t.shape)}")
        if t.dtype not in _KV_DTYPES:
            raise BadShape(f"paged cache dtype {t.dtype} is not float16, bfloat16 or float32")
        both = t.transpose(0, 1) if kv_dim == 1 else t
        object.__setattr__(self, "kv", (both[0], both[1]))

    @property
    def dtype(self) -> torch.dtype:
        """The cache's dtype."""
        return self.kv[0].dtype

    @property
    def device(self) -> torch.device:
        """The cache's device."""
        return self.kv[0].device

    @property
    def num_blocks(self) -> int:
        """Engine blocks in the cache."""
        return _logical(self.kv[0])[0]

    @property
    def block_size(self) -> int:
        """Tokens per engine block."""
        return _logical(self.kv[0])[1]

    @property
    def num_kv_heads(self) -> int:
        """``H``."""
        return _logical(self.kv[0])[2]

    @property
    def head_dim(self) -> int:
        """``D``."""
        return _logical(self.kv[0])[3]

    @property
    def mergeable(self) -> bool:
        """Whether block ``b + 1`` starts in memory right where block ``b`` ends."""
        if self.tiled:
            return False
        bs = self.block_size
        return self.num_blocks == 1 or all(h.stride(0) == bs * h.stride(1) for h in self.kv)

    def read(self, piece: Piece) -> tuple[Tensor, Tensor]:
        """K and V ``[length, H, D]`` of ``piece``: views (:meth:`span`) or, for a tiled
        cache, copies of the piece's tokens."""
        if not self.tiled:
            return self.span(piece)
        self._check_piece(piece)
        lo, hi = piece.start, piece.start + piece.length
        k, v = (self._block_copy(h, piece.block)[lo:hi] for h in self.kv)
        return k, v

    def write(self, piece: Piece, k: Tensor, v: Tensor) -> None:
        """Copy ``k`` and ``v`` ``[length, H, D]`` into ``piece``'s place. A tiled cache
        writes whole engine blocks: a piece of part of one is read, patched and written
        back (the block's other tokens keep their values)."""
        if not self.tiled:
            for dst, src in zip(self.span(piece), (k, v), strict=True):
                dst.copy_(src)
            return
        self._check_piece(piece)
        lo, hi = piece.start, piece.start + piece.length
        for half, src in zip(self.kv, (k, v), strict=True):
            if piece.length == self.block_size:
                half[piece.block].copy_(src.reshape(half.shape[1:]))
                continue
            block = self._block_copy(half, piece.block)
            block[lo:hi] = src
            half[piece.block].copy_(block.reshape(half.shape[1:]))

    def gather_blocks(self, half: int, blocks: Tensor, out: Tensor) -> None:
        """Copy whole engine blocks ``blocks`` of K (``half`` 0) or V into ``out``
        ``[len(blocks), block_size, H, D]`` (contiguous): one kernel, tiled or not (``out``
        is viewed split as the half's blocks are)."""
        h = self.kv[half]
        torch.index_select(h, 0, blocks, out=out.view(len(blocks), *h.shape[1:]))

    def scatter_blocks(self, half: int, blocks: Tensor, src: Tensor) -> None:
        """The reverse of :meth:`gather_blocks`: ``src`` into whole engine blocks."""
        h = self.kv[half]
        h.index_copy_(0, blocks, src.reshape(len(blocks), *h.shape[1:]))

    def _check_piece(self, piece: Piece) -> None:
        block, start, length = piece
        bs = self.block_size
        if not (0 <= block < self.num_blocks and 0 <= start < bs and 0 < length <= bs - start):
            raise InvalidArgument(f"{piece} is outside one block of a tiled cache")

    def _block_copy(self, half: Tensor, block: int) -> Tensor:
        """Engine block ``block`` of one half as a new ``[block_size, H, D]`` tensor."""
        return half[block].reshape(self.block_size, self.num_kv_heads, self.head_dim)

    def expect(
        self, num_kv_heads: int | None = None, head_dim: int | None = None, dtype: Any = None
    ) -> PagedCache:
        """Check ``H``, ``D`` and dtype against what the caller expects; return ``self``.

        ``None`` skips a check. Raises :class:`BadShape` on a mismatch (and
        :class:`InvalidArgument` for an unknown ``dtype`` name).
        """
        for name, want, have in (
            ("num_kv_heads", num_kv_heads, self.num_kv_heads),
            ("head_dim", head_dim, self.head_dim),
        ):
            if want is not None and want != have:
                raise BadShape(f"paged cache has {name}={have}, expected {want}")
        if dtype is not None and dtype_name(dtype) != dtype_name(self.dtype):
            raise BadShape(f"paged cache is {self.dtype}, expected {dtype_name(dtype)}")
        return self

    def span(self, piece: Piece) -> tuple[Tensor, Tensor]:
        """The K and V ``[length, H, D]`` views of ``piece`` (no copy).

        Raises :class:`InvalidArgument` if the piece leaves the cache, or crosses into
        the next block where blocks are not adjacent in memory.
        """
        if self.tiled:
            raise InvalidArgument("a tiled cache has no strided view of a piece: read() it")
        block, start, length = piece
        bs = self.block_size
        if not (0 <= block < self.num_blocks and 0 <= start < bs and length > 0):
            raise InvalidArgument(f"{piece} is outside a cache of {self.num_blocks}x{bs} tokens")
        if start + length <= bs:
            k, v = (h[block, start : start + length] for h in self.kv)
            return k, v
        if not self.mergeable or block * bs + start + length > self.num_blocks * bs:
            raise InvalidArgument(f"{piece} crosses engine blocks that are not one view")
        first = block * bs + start
        shape = (self.num_blocks * bs, self.num_kv_heads, self.head_dim)
        k, v = (h.view(shape)[first : first + length] for h in self.kv)
        return k, v


def _logical(h: Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, H, D)`` of a 4-D half or a tiled 6-D one."""
    s = h.shape
    if h.dim() == 6:
        return int(s[0]), int(s[1] * s[2]), int(s[3]), int(s[4] * s[5])
    return int(s[0]), int(s[1]), int(s[2]), int(s[3])


def _pair_halves(t: Any) -> tuple[Tensor, Tensor]:
    """A ``kv_pair`` cache's (K, V), checked: two ``[num_blocks, block_size, H, D]`` views (or
    tiled 6-D views) of one logical shape, dtype and device."""
    if not (isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, Tensor) for x in t)):
        raise InvalidArgument(
            f"a kv_pair paged cache must be a (K, V) pair, got {type(t).__name__}"
        )
    k, v = t
    dims_ok = k.dim() in (4, 6) and v.dim() in (4, 6)
    if not dims_ok or _logical(k) != _logical(v) or 0 in k.shape or 0 in v.shape:
        raise BadShape(
            "a kv_pair paged cache must be two [num_blocks, block_size, H, D] views (or tiled "
            "[num_blocks, T1, T0, H, D1, D0] ones) of one logical shape, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.dtype != v.dtype or k.device != v.device:
        raise BadShape(f"K is {k.dtype} on {k.device}, V {v.dtype} on {v.device}")
    if k.dtype not in _KV_DTYPES:
        raise BadShape(f"paged cache dtype {k.dtype} is not float16, bfloat16 or float32")
    return k, v


# ----------------------------------------------------------------------------- chunk views


@dataclass(frozen=True, eq=False)
class ChunkView:
    """Where chunk ``index`` of a request lives in a :class:`PagedCache`.

    ``pieces`` cover the chunk's ``block_tokens`` tokens in order. ``blocks`` is set when the
    chunk is made of whole engine blocks (``block_size`` divides ``block_tokens``): their
    ids as an int64 tensor on the cache's device, for one-kernel gathers and scatters.
    ``writable``: built for writing (no block id repeats), which :func:`scatter_chunk` and
    :func:`decode_into` require.
    """

    index: int
    pieces: tuple[Piece, ...]
    paged: PagedCache
    block_tokens: int
    blocks: Tensor | None = field(default=None, repr=False)
    writable: bool = False

    @property
    def direct(self) -> bool:
        """True when the chunk is one strided view of the cache (no staging needed)."""
        return len(self.pieces) == 1 and self.paged.in_place

    @property
    def tensor(self) -> tuple[Tensor, Tensor] | None:
        """The chunk's K and V ``[block_tokens, H, D]`` views of the cache if direct, else
        None."""
        return self.paged.span(self.pieces[0]) if self.direct else None

    @property
    def nbytes(self) -> int:
        """KV bytes of the chunk (what one gather or scatter copies)."""
        p = self.paged
        return 2 * self.block_tokens * p.num_kv_heads * p.head_dim * p.kv[0].element_size()

    def piece_tensors(self) -> list[tuple[Tensor, Tensor]]:
        """The K and V ``[length, H, D]`` views of the pieces, in token order (no copy)."""
        return [self.paged.span(p) for p in self.pieces]


def chunk_views(
    cache: Tensor | PagedCache,
    block_ids: Any,
    block_tokens: int,
    n_chunks: int,
    layout: str | None = None,
    *,
    writable: bool = False,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: Any = None,
) -> list[ChunkView]:
    """Map chunks ``0 .. n_chunks-1`` of a request onto an engine's paged cache.

    ``cache``: a tensor in ``layout`` (default ``"blocks_first"``) or a :class:`PagedCache`
    (then ``layout``, if given, must match its own). ``block_ids``: the request's engine
    blocks in token order, a list/tuple of ints, an integer numpy array or an integer
    tensor on any device (a device tensor costs one host sync); the ids are copied, so
    the caller may change ``block_ids`` afterwards. ``writable=True`` for
    decoding into the cache: a block id used twice is then an error. ``num_kv_heads``,
    ``head_dim``, ``dtype``: what the caller expects the cache to hold (None skips).

    Pure host logic apart from that sync and, when ``block_size`` divides ``block_tokens``,
    one small host-to-device copy of the ids. Raises :class:`BadShape` for a cache of the
    wrong shape, dtype, ``H`` or ``D``; :class:`InvalidArgument` for a bad layout, a
    non-integer or non-1-D ``block_ids``, too few block ids for ``n_chunks * block_tokens``
    tokens, a needed id outside ``[0, num_blocks)`` or, if ``writable``, repeated.
    """
    paged = _paged(cache, layout).expect(num_kv_heads, head_dim, dtype)
    B = _positive_int("block_tokens", block_tokens)
    n = _non_negative_int("n_chunks", n_chunks)
    bs = paged.block_size
    needed = -(-n * B // bs)
    ids = _block_id_array(block_ids)
    _check_ids(ids, needed, paged.num_blocks, writable)
    ids = ids[:needed].astype(np.int64)  # in range now; uint ids would wrap in np.diff
    starts, runs = _runs(ids, bs, paged.mergeable, n * B)
    index = _index_tensor(block_ids, ids, paged) if B % bs == 0 and bs < B else None
    per = B // bs
    return [
        ChunkView(
            j,
            _pieces(starts, runs, j * B, B, bs),
            paged,
            B,
            None if index is None else index.narrow(0, j * per, per),
            writable,
        )
        for j in range(n)
    ]


def _paged(cache: Tensor | PagedCache, layout: str | None) -> PagedCache:
    if isinstance(cache, PagedCache):
        if layout is not None and layout != cache.layout:
            raise InvalidArgument(f"layout={layout!r} but the PagedCache is {cache.layout!r}")
        return cache
    return PagedCache(cache, "blocks_first" if layout is None else layout)


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InvalidArgument(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _non_negative_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise InvalidArgument(f"{name} must be a non-negative int, got {v!r}")
    return int(v)


def _block_id_array(block_ids: Any) -> np.ndarray:
    """``block_ids`` as a 1-D int64 numpy array; raises :class:`InvalidArgument`."""
    if isinstance(block_ids, Tensor):
        if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex:
            raise InvalidArgument(f"block_ids must be integers, got a {block_ids.dtype} tensor")
        if block_ids.dtype == torch.bool:
            raise InvalidArgument("block_ids must be integers, got a bool tensor")
        arr = block_ids.detach().cpu().numpy()
    elif isinstance(block_ids, np.ndarray):
        arr = block_ids
    elif isinstance(block_ids, (list, tuple, range)):
        bad = [x for x in block_ids if isinstance(x, (bool, np.bool_))]
        bad += [x for x in block_ids if not isinstance(x, (int, np.integer))]
        if bad:
            raise InvalidArgument(f"block_ids must be ints, got {bad[0]!r}")
        try:
            arr = np.asarray(block_ids, dtype=np.int64)
        except OverflowError as exc:
            raise InvalidArgument(f"block_ids hold an id beyond int64: {exc}") from exc
    else:
        kind = type(block_ids).__name__
        raise InvalidArgument(f"block_ids must be a list, array or tensor of ints, got {kind}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"block_ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidArgument(f"block_ids must be 1-D, got shape {arr.shape}")
    return arr


def _check_ids(ids: np.ndarray, needed: int, num_blocks: int, writable: bool) -> None:
    if len(ids) < needed:
        raise InvalidArgument(
            f"the chunks need {needed} engine blocks, block_ids has only {len(ids)}"
        )
    used = ids[:needed]
    bad = np.flatnonzero((used < 0) | (used >= num_blocks))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(f"block_ids[{i}] = {used[i]} is outside [0, {num_blocks})")
    if writable and needed:
        uniq, counts = np.unique(used, return_counts=True)
        if (counts > 1).any():
            k = int(np.flatnonzero(counts > 1)[0])
            where = np.flatnonzero(used == uniq[k])
            raise InvalidArgument(
                f"block id {uniq[k]} appears at positions {where.tolist()} of block_ids; "
                "a request cannot write one engine block twice"
            )


def _runs(ids: np.ndarray, bs: int, mergeable: bool, total: int) -> tuple[list[int], list[Piece]]:
    """Split tokens ``0 .. total-1`` into maximal pieces; return (first token, piece)."""
    if not len(ids):
        return [], []
    cut = np.ones(len(ids), dtype=bool)
    if mergeable:
        cut[1:] = np.diff(ids) != 1
    heads = np.flatnonzero(cut).tolist()
    ends = [*heads[1:], len(ids)]
    starts = [h * bs for h in heads]
    runs = [
        Piece(int(ids[h]), 0, min(e * bs, total) - h * bs) for h, e in zip(heads, ends, strict=True)
    ]
    return starts, runs


def _pieces(
    starts: list[int], runs: list[Piece], lo: int, length: int, bs: int
) -> tuple[Piece, ...]:
    """The pieces of tokens ``lo .. lo+length-1``, cut from the runs holding them."""
    out: list[Piece] = []
    r = bisect.bisect_right(starts, lo) - 1
    while length:
        run_start, run = starts[r], runs[r]
        off = lo - run_start
        take = min(run.length - off, length)
        out.append(Piece(run.block + off // bs, off % bs, take))
        lo, length, r = lo + take, length - take, r + 1
    return tuple(out)


def _index_tensor(block_ids: Any, ids: np.ndarray, paged: PagedCache) -> Tensor:
    device = paged.device
    reusable = isinstance(block_ids, Tensor) and block_ids.dtype == torch.int64
    if reusable and block_ids.device == device:
        # A copy: engines update block tables in place, and the views may outlive this call.
        return block_ids.narrow(0, 0, len(ids)).clone()
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device)


# ----------------------------------------------------------------------------- copies


def _check_chunk_tensor(t: Any, view: ChunkView, name: str) -> Tensor:
    p = view.paged
    want = (2, view.block_tokens, p.num_kv_heads, p.head_dim)
    if not isinstance(t, Tensor):
        raise InvalidArgument(f"{name} must be a Tensor, got {type(t).__name__}")
    if tuple(t.shape) != want or t.dtype != p.dtype:
        raise BadShape(f"{name} is {tuple(t.shape)} {t.dtype}; the chunk is {want} {p.dtype}")
    if t.device != p.device:
        raise InvalidArgument(f"{name} is on {t.device}, the paged cache on {p.device}")
    return t


def _gather_into(view: ChunkView, dst: Tensor) -> None:
    """Copy the chunk's tokens into ``dst [2, B, H, D]`` (contiguous when ``blocks``)."""
    if view.blocks is not None:
        per = view.blocks.numel()
        for half in range(2):
            out = dst[half].unflatten(0, (per, view.paged.block_size))
            view.paged.gather_blocks(half, view.blocks, out)
    else:
        offset = 0
        for piece in view.pieces:
            for half, src in enumerate(view.paged.read(piece)):
                dst[half, offset : offset + piece.length].copy_(src)
            offset += piece.length
    _count(gathered_bytes=view.nbytes)


def _scatter_from(src: Tensor, view: ChunkView) -> None:
    """Copy ``src [2, B, H, D]`` into the chunk's place in the cache."""
    if view.blocks is not None:
        per = view.blocks.numel()
        for half in range(2):
            part = src[half].unflatten(0, (per, view.paged.block_size))
            view.paged.scatter_blocks(half, view.blocks, part)
    else:
        offset = 0
        for piece in view.pieces:
            part = src[:, offset : offset + piece.length]
            view.paged.write(piece, part[0], part[1])
            offset += piece.length
    _count(scattered_bytes=view.nbytes)


def _scatter_tail(src: Tensor, view: ChunkView, skip: int) -> None:
    """Copy tokens ``skip ..`` of ``src [2, B, H, D]`` into the chunk's place in the cache."""
    bs, offset = view.paged.block_size, 0
    for piece in view.pieces:
        lo = max(skip - offset, 0)
        if lo < piece.length:
            at = piece.start + lo
            part = Piece(piece.block + at // bs, at % bs, piece.length - lo)
            tail = src[:, offset + lo : offset + piece.length]
            view.paged.write(part, tail[0], tail[1])
        offset += piece.length
    _count(scattered_bytes=view.nbytes * (view.block_tokens - skip) // view.block_tokens)


def gather_chunk(view: ChunkView, out: Tensor | None = None) -> Tensor:
    """Copy one chunk out of the paged cache into ``out`` (or a new tensor); return it.

    ``out``: a contiguous ``[2, block_tokens, H, D]`` tensor of the cache's dtype and
    device, reused across calls as staging. Costs one copy of the chunk (counted in
    :func:`paged_copy_stats`); a direct chunk needs none (use :attr:`ChunkView.tensor`).
    Synchronous on CPU, queued on the current stream on CUDA. Raises :class:`BadShape` or
    :class:`InvalidArgument` for an ``out`` that does not fit.
    """
    if out is None:
        out = _new_staging(view, 1)
    elif not _check_chunk_tensor(out, view, "out").is_contiguous():
        raise InvalidArgument("out must be contiguous")
    _gather_into(view, out)
    return out


def scatter_chunk(chunk: Tensor, view: ChunkView) -> None:
    """Copy a decoded ``[2, block_tokens, H, D]`` chunk into its place in the paged cache.

    Writes only the chunk's tokens; every other token of the cache is left as it was.
    Costs one copy of the chunk (counted). Raises :class:`BadShape` or
    :class:`InvalidArgument` for a ``chunk`` of the wrong shape, dtype or device and
    :class:`InvalidArgument` for a ``view`` not built with ``writable=True``.
    """
    _scatter_from(_check_writable(_check_chunk_tensor(chunk, view, "chunk"), view), view)


def _check_writable(t: Tensor, view: ChunkView) -> Tensor:
    if not view.writable:
        raise InvalidArgument("writing into the cache needs views from chunk_views(writable=True)")
    return t


def _staging_chunk(view: ChunkView, staging: Tensor | None) -> Tensor:
    """The first chunk's worth of ``staging`` (or a new tensor) for one staged chunk."""
    if staging is None:
        return _new_staging(view, 1)
    return _check_staging(staging, view).narrow(1, 0, view.block_tokens)


def _check_staging(staging: Any, view: ChunkView) -> Tensor:
    p = view.paged
    B = view.block_tokens
    if not isinstance(staging, Tensor):
        raise InvalidArgument(f"staging must be a Tensor, got {type(staging).__name__}")
    ok = staging.dim() == 4 and staging.shape[0] == 2 and staging.shape[1] % B == 0
    ok = ok and staging.shape[1] > 0 and staging.shape[2:] == (p.num_kv_heads, p.head_dim)
    if not ok or staging.dtype != p.dtype:
        raise BadShape(
            f"staging is {tuple(staging.shape)} {staging.dtype}; expected "
            f"[2, k*{B}, {p.num_kv_heads}, {p.head_dim}] {p.dtype}"
        )
    if staging.device != p.device or not staging.is_contiguous():
        raise InvalidArgument(f"staging must be contiguous and on {p.device}")
    return staging


def decode_into(
    buf: Any,
    view: ChunkView,
    *,
    expect_key: ChunkKey | None = None,
    staging: Tensor | None = None,
    skip: int = 0,
) -> None:
    """Verify chunk ``buf`` and dequantize it into its place in the paged cache.

    A direct chunk is decoded straight into the engine's memory; a staged one into
    ``staging`` (its first ``block_tokens`` tokens; a new tensor if None), then scattered.
    ``skip`` > 0 leaves the chunk's first ``skip`` tokens in the cache as they are (an
    engine's own prefix: its cached blocks may be shared with running requests): the
    chunk is staged and only its tokens from ``skip`` on are copied. Nothing in the cache
    is written unless the chunk verified and fits, and only the chunk's tokens are.
    Synchronous (the codec's checksum check syncs a device). Raises
    what :func:`~kvstore.core.codec.decode_chunk` raises (:class:`ChunkError` subclasses
    for a bad buffer, :class:`BadShape` for a chunk of another shape or dtype) and
    :class:`BadShape`/:class:`InvalidArgument` for a bad ``staging`` or a ``view`` not built
    with ``writable=True``.
    """
    if not view.writable:
        raise InvalidArgument("writing into the cache needs views from chunk_views(writable=True)")
    if not isinstance(skip, int) or not 0 <= skip < view.block_tokens:
        raise InvalidArgument(f"skip must be an int in [0, {view.block_tokens}), got {skip!r}")
    if skip:
        dst = _staging_chunk(view, staging)
        decode_chunk(buf, out=dst, expect_key=expect_key)
        _scatter_tail(dst, view, skip)
        _count(staged_chunks=1)
        return
    if view.direct:
        decode_chunk(buf, out=view.tensor, expect_key=expect_key)
        _count(direct_chunks=1)
        return
    dst = _staging_chunk(view, staging)
    decode_chunk(buf, out=dst, expect_key=expect_key)
    _scatter_from(dst, view)
    _count(staged_chunks=1)


# ----------------------------------------------------------------------------- encode


def _adjacent(a: ChunkView, b: ChunkView) -> bool:
    """Whether direct chunk ``b`` starts in memory right where direct chunk ``a`` ends."""
    pa, pb = a.pieces[0], b.pieces[0]
    bs = a.paged.block_size
    if a.paged.mergeable:
        return pb.block * bs + pb.start == pa.block * bs + pa.start + a.block_tokens
    return pb.block == pa.block and pb.start == pa.start + a.block_tokens


def _segments(views: Sequence[ChunkView], group: int) -> list[tuple[bool, int, int]]:
    """Cut ``views`` into (direct, start, stop) runs encoded by one ``encode_blocks``.

    A direct run is chunks adjacent in memory (one strided view of the cache); a staged
    run is at most ``group`` staged chunks (what the staging buffer holds).
    """
    out: list[tuple[bool, int, int]] = []
    for i, v in enumerate(views):
        if out and out[-1][0] == v.direct:
            direct, start, _ = out[-1]
            if (direct and _adjacent(views[i - 1], v)) or (not direct and i - start < group):
                out[-1] = (direct, start, i + 1)
                continue
        out.append((v.direct, i, i + 1))
    return out


def _check_views(views: Sequence[ChunkView], keys: Sequence[Any]) -> PagedCache:
    if len(keys) != len(views):
        raise InvalidArgument(f"{len(keys)} keys for {len(views)} chunk views")
    if not all(isinstance(v, ChunkView) for v in views):
        raise InvalidArgument("views must be ChunkViews from chunk_views()")
    paged, B = views[0].paged, views[0].block_tokens
    if any(v.paged is not paged or v.block_tokens != B for v in views):
        raise InvalidArgument("encode_paged needs ChunkViews of one chunk_views() call")
    return paged


def _new_staging(view: ChunkView, chunks: int) -> Tensor:
    p = view.paged
    shape = (2, chunks * view.block_tokens, p.num_kv_heads, p.head_dim)
    return torch.empty(shape, dtype=p.dtype, device=p.device)


def _direct_source(views: Sequence[ChunkView], start: int, stop: int) -> tuple[Tensor, Tensor]:
    """The K and V ``[m*B, H, D]`` views of the cache that direct chunks ``start:stop`` are."""
    first, m = views[start].pieces[0], stop - start
    _count(direct_chunks=m)
    return views[start].paged.span(Piece(first.block, first.start, m * views[start].block_tokens))


def _staged_source(
    views: Sequence[ChunkView], start: int, stop: int, stage: Tensor
) -> Tensor | tuple[Tensor, Tensor]:
    """Gather staged chunks ``start:stop`` into the front of ``stage``; return that part."""
    B, m = views[start].block_tokens, stop - start
    src = stage.narrow(1, 0, m * B)
    for k in range(m):
        _gather_into(views[start + k], src.narrow(1, k * B, B))
    _count(staged_chunks=m)
    return src


def encode_paged(
    views: Sequence[ChunkView],
    keys: Sequence[ChunkKey | None],
    quant: str = "int8",
    *,
    checksum: str | None = None,
    out: Tensor | None = None,
    staging: Tensor | None = None,
) -> list[Tensor]:
    """Encode the chunks ``views`` (from one :func:`chunk_views` call) with ``keys``.

    Returns one 1-D uint8 buffer per view, rows of ``out`` (a ``[N, chunk_nbytes]`` uint8
    tensor on the cache's device) or of a new such tensor, byte-identical to
    :func:`~kvstore.core.codec.encode_chunk` of each chunk's tokens as a contiguous tensor.
    Direct chunks are read in place, runs of them adjacent in memory in one vectorised
    pass; staged chunks are gathered into ``staging`` (contiguous ``[2, k*B, H, D]``, k
    chunks per pass; if None, a buffer of at most :data:`DEFAULT_STAGING_BYTES` is
    allocated for the call), then encoded from there: one copy of each staged chunk.
    Synchronous (the codec syncs a device once per pass). Raises like
    :func:`~kvstore.core.codec.encode_blocks` and :class:`InvalidArgument` for keys and
    views that do not match or views of different calls.
    """
    if not views and not keys:
        return []
    paged = _check_views(views, keys)
    B = views[0].block_tokens
    nbytes = chunk_nbytes(B, paged.num_kv_heads, paged.head_dim, paged.dtype, quant)
    if out is None:
        out = torch.empty(len(views), nbytes, dtype=torch.uint8, device=paged.device)
    elif not isinstance(out, Tensor) or tuple(out.shape) != (len(views), nbytes):
        raise InvalidArgument(f"out must be a [{len(views)}, {nbytes}] uint8 tensor")
    group = max(1, DEFAULT_STAGING_BYTES // views[0].nbytes)
    if staging is not None:
        group = _check_staging(staging, views[0]).shape[1] // B
    segments = _segments(views, group)
    widest = max((stop - start for d, start, stop in segments if not d), default=0)
    stage = staging
    for direct, start, stop in segments:
        src: Tensor | tuple[Tensor, Tensor]
        if direct:
            src = _direct_source(views, start, stop)
        else:
            stage = stage if stage is not None else _new_staging(views[0], widest)
            src = _staged_source(views, start, stop, stage)
        encode_blocks(src, B, keys[start:stop], quant, out=out[start:stop], checksum=checksum)
    return list(out.unbind(0))

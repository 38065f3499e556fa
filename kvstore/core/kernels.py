"""The codec's eager quantization kernels: per-mode INT8 and INT4 encoders and decoders,
tiles and float32 scratch.

:mod:`kvstore.core.codec` owns the chunk format and calls these on views of the chunk
buffers; :mod:`kvstore.core.fused` compiles the INT8 arithmetic from the same constants.
The modes (INT8 ``c``, ``cc``, ``t``, ``ct``; INT4 ``kg``, ``vg``) are described in the
codec's module docstring.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "DECODERS",
    "DEVICE_TILE_BYTES",
    "ENCODERS",
    "LEVELS4",
    "QMAX",
    "TILE_BYTES",
    "TINY",
    "scratch",
    "tile_shape",
    "tiles",
]

TILE_BYTES = 1 << 20
"""Float32 scratch per CPU thread and quantization tile."""
DEVICE_TILE_BYTES = 64 << 20
"""Float32 scratch per tile on other devices."""
TINY = 2.0**-14
"""Smallest normal float16. Scales never go below it, so rounding a scale to float16 is
off by at most 2**-11 relative and ``|x / s|`` stays under 127.07: codes never need a clamp."""
QMAX = 127.0
"""Largest INT8 code magnitude."""
LEVELS4 = 15.0
"""Largest INT4 code: codes are 0..15, ``x ≈ lo + q·step``."""

_SCRATCH_SHAPES = 4
_SCRATCH_KEEP_BYTES = 8 << 20
_scratch_local = threading.local()


def scratch(shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Float32 scratch of ``shape``, valid until this thread's next codec call.

    On CPU each thread keeps its last few shapes (tiles, chunk halves) for reuse: fresh
    ones fault their pages in on every call (8% of an encode). Other devices allocate:
    their caching allocator reuses memory and, unlike this cache, knows about streams.
    """
    if device.type != "cpu" or 4 * math.prod(shape) > _SCRATCH_KEEP_BYTES:
        return torch.empty(shape, dtype=torch.float32, device=device)
    kept: dict[tuple[int, ...], Tensor] | None = getattr(_scratch_local, "kept", None)
    if kept is None:
        kept = _scratch_local.kept = {}
    buf = kept.pop(shape, None)
    if buf is None:
        buf = torch.empty(shape, dtype=torch.float32)
        if len(kept) >= _SCRATCH_SHAPES:
            del kept[next(iter(kept))]  # the least recently used shape
    kept[shape] = buf  # most recently used last
    return buf


# ----------------------------------------------------------------------------- quantization
# Each mode quantizes ``y`` (``[N, T, H, D]`` or ``[T, H, D]``: float32 scratch holding one
# half, K or V, of a tile, which it may overwrite) into int8 codes ``q`` and float16 scales
# ``sc``, views of the chunk buffers shaped to broadcast against ``y`` (``[.., 1, H, D]``
# per channel, ``[.., T, H, 1]`` per token), so statistics keep their reduced dimension.
# Mixed-dtype kernels are 4-6x slower than one widening copy and in-place float32 passes.
# A block (K and V) costs ~40 torch ops, 16 of them full passes (docs/codec.md, Speed).


def _store(values: Tensor, view: Tensor) -> Tensor:
    """Round ``values`` to float16 into ``view``; return the rounded values as float32."""
    return view.copy_(values).float()


def _absmax(y: Tensor, dim: int) -> Tensor:
    # amax and amin beat abs().amax() (no full-size temporary), aminmax and an inf-norm
    # (both over 7x slower on CPU).
    return torch.maximum(y.amax(dim, keepdim=True), y.amin(dim, keepdim=True).neg_())


def _inv_scale(r: Tensor, view: Tensor) -> Tensor:
    """Store the scale for absolute maximum ``r``; return its reciprocal (float32)."""
    return _store(r.mul_(1 / QMAX).clamp_(min=TINY), view).reciprocal_()


def _codes(y: Tensor, q: Tensor) -> None:
    q.copy_(y.round_())  # |y| <= 127.07 by construction of the scales (see TINY)


def _enc_c(y: Tensor, q: Tensor, sc: list[Tensor]) -> None:
    _codes(y.mul_(_inv_scale(_absmax(y, -3), sc[0])), q)


def _enc_cc(y: Tensor, q: Tensor, sc: list[Tensor]) -> None:
    hi, lo = y.amax(-3, keepdim=True), y.amin(-3, keepdim=True)
    # + 0.0: a zero mid-range is +0 whichever zero amax and amin kept (their order varies
    # with the shape), so every path stores the same bytes
    m = _store(torch.lerp(lo, hi, 0.5).add_(0.0), sc[0])
    # m - lo is -(lo - m) bit for bit (rounding to nearest is symmetric), one op instead
    # of two; the sign of a zero cannot matter, the scale floor replaces it.
    inv = _inv_scale(torch.maximum(hi.sub_(m), torch.sub(m, lo, out=lo)), sc[1])
    _codes(y.sub_(m).mul_(inv), q)


def _enc_t(y: Tensor, q: Tensor, sc: list[Tensor]) -> None:
    _codes(y.mul_(_inv_scale(_absmax(y, -1), sc[0])), q)


def _enc_ct(y: Tensor, q: Tensor, sc: list[Tensor]) -> None:
    c = _store(_absmax(y, -3).clamp_(min=TINY), sc[0])
    y.mul_(c.reciprocal_())  # now |y| <= ~1 everywhere
    _codes(y.mul_(_inv_scale(_absmax(y, -1), sc[1])), q)


# Decoders widen the codes into ``w`` (float32: the output itself or scratch), then scale
# in place with float32 scales; the caller copies ``w`` into the output when it is scratch.
# Codes have 7 significant bits and scales 11, so ``q·s`` is exact in float32 and each
# decoded value is rounded once, whatever order or fusion the kernels use.


def _dec_scaled(q: Tensor, sc: list[Tensor], w: Tensor) -> None:
    w.copy_(q).mul_(sc[0])


def _dec_cc(q: Tensor, sc: list[Tensor], w: Tensor) -> None:
    torch.addcmul(sc[0], w.copy_(q), sc[1], out=w)


def _dec_ct(q: Tensor, sc: list[Tensor], w: Tensor) -> None:
    w.copy_(q).mul_(sc[1]).mul_(sc[0])


# INT4 (KIVI-style, asymmetric, grouped): ``kg`` quantizes K per channel over groups of
# tokens, ``vg`` quantizes V per token and head over groups of channels. Each group stores
# its minimum ``lo`` and its step ``(hi - lo) / 15`` in float16 (``sc[0]``, ``sc[1]``:
# ``[.., T/g, H, D]`` for ``kg``, ``[.., T, H, D/g]`` for ``vg``, the group size implied by
# the shapes), both rounded toward -inf, the step from the stored ``lo``: so ``lo`` never
# sits above a value of its group (a float32 group at 1000.3 with a spread of 1e-3 would
# otherwise decode 0.2 off, its float16 ``lo`` rounded to 1000.5), and ``lo + 15·step``
# never passes the group's maximum (no overflow to inf at float16's limit). The codes
# ``round((x - lo) / step)`` then lie in 0..15 by construction (the step's rounding moves
# the top by at most 15 x 2**-10 of a step) and are packed two to a byte along D, the even
# channel in the low nibble (``q``: ``[.., T, H, D/2]`` uint8). Decoding ``lo + q·step``
# rounds once in float32 (``q·step``, 4 x 11 significant bits, is exact), then once more
# into a float16 or bfloat16 output.


def _store_down(values: Tensor, view: Tensor) -> Tensor:
    """Round ``values`` toward -inf to float16 into ``view``; return them as float32. A
    value beyond float16's range stays infinite (the codec refuses the chunk then)."""
    near = values.to(torch.float16)
    below = torch.nextafter(near, torch.full_like(near, -math.inf))
    down = (near.float() > values) & torch.isfinite(near)
    return view.copy_(torch.where(down, below, near)).float()


def _grouped(y: Tensor, groups: int, dim: int) -> Tensor:
    """``y`` with dimension ``dim`` (-3 tokens, -1 channels) cut into ``groups`` groups."""
    return y.unflatten(dim, (groups, y.shape[dim] // groups))


def _enc_grouped(y: Tensor, q: Tensor, sc: list[Tensor], dim: int) -> None:
    # ``z``: groups at ``dim - 1``, their members at ``dim``; a scale view unsqueezed at
    # ``dim`` broadcasts against it
    z = _grouped(y, sc[0].shape[dim], dim)
    lo, hi = z.amin(dim, keepdim=True), z.amax(dim, keepdim=True)
    lo16 = _store_down(lo, sc[0].unsqueeze(dim))
    step = _store_down(hi.sub_(lo16).mul_(1 / LEVELS4).clamp_(min=TINY), sc[1].unsqueeze(dim))
    z.sub_(lo16).mul_(step.reciprocal_()).round_()
    pairs = y.unflatten(-1, (-1, 2))
    q.copy_(torch.add(pairs[..., 0], pairs[..., 1], alpha=16))  # exact integers 0..255


def _enc_kg(y: Tensor, q: Tensor, sc: list[Tensor]) -> None:
    _enc_grouped(y, q, sc, -3)


def _enc_vg(y: Tensor, q: Tensor, sc: list[Tensor]) -> None:
    _enc_grouped(y, q, sc, -1)


def _dec_grouped(q: Tensor, sc: list[Tensor], w: Tensor, dim: int) -> None:
    pairs = w.unflatten(-1, (-1, 2))
    pairs[..., 0].copy_(torch.bitwise_and(q, 15))
    pairs[..., 1].copy_(torch.bitwise_right_shift(q, 4))
    z = _grouped(w, sc[0].shape[dim], dim)
    # q·step then + lo: the product is exact, so this is addcmul's value, and 3x faster
    # than addcmul's broadcast along the last dimension (V's groups) on CPU
    z.mul_(sc[1].unsqueeze(dim)).add_(sc[0].unsqueeze(dim))


def _dec_kg(q: Tensor, sc: list[Tensor], w: Tensor) -> None:
    _dec_grouped(q, sc, w, -3)


def _dec_vg(q: Tensor, sc: list[Tensor], w: Tensor) -> None:
    _dec_grouped(q, sc, w, -1)


Encoder = Callable[[Tensor, Tensor, list[Tensor]], None]
Decoder = Callable[[Tensor, list[Tensor], Tensor], None]
ENCODERS: dict[str, Encoder] = {"c": _enc_c, "cc": _enc_cc, "t": _enc_t, "ct": _enc_ct,
                                "kg": _enc_kg, "vg": _enc_vg}  # fmt: skip
DECODERS: dict[str, Decoder] = {"c": _dec_scaled, "cc": _dec_cc, "t": _dec_scaled, "ct": _dec_ct,
                                "kg": _dec_kg, "vg": _dec_vg}  # fmt: skip


def tile_shape(n: int, t: int, h: int, d: int, device: torch.device) -> tuple[int, int]:
    """(blocks, heads) per quantization tile: as many as fit the float32 scratch budget.

    Heads are independent under every mode (statistics are per channel ``(h, d)`` over T
    or per token ``(t, h)`` over D), so a block too large for one tile is cut along H.
    On CPU the budget keeps each thread's share in L2; a GPU takes big tiles (fewer
    kernel launches).
    """
    cpu = device.type == "cpu"
    budget = TILE_BYTES * torch.get_num_threads() if cpu else DEVICE_TILE_BYTES
    head_bytes = 4 * t * d
    if head_bytes * h <= budget:
        return max(1, min(n, budget // (head_bytes * h))), h
    return 1, max(1, budget // head_bytes)


def tiles(v: Tensor, blocks: int, heads: int) -> list[Tensor]:
    """Views of ``v [N, T|1, H, D|1]`` tile by tile (blocks outer, heads inner) in one or a
    few ops; tiles cut along H (``blocks`` is then 1) drop the block dimension."""
    if heads >= v.shape[2]:
        return [v] if blocks >= v.shape[0] else list(v.split(blocks))
    columns = [part.unbind(0) for part in v.split(heads, 2)]
    return [tile for row in zip(*columns, strict=True) for tile in row]

"""The codec's INT8 kernels in C, for CPU tensors: one call per half (K or V) of a layer.

:mod:`kvstore.core.codec` offers each INT8 quantization and dequantization to
:func:`quantize` and :func:`dequantize` first; they return False (nothing written) where
the C kernels do not apply, and the codec runs :mod:`kvstore.core.fused` or its eager
kernels instead. The bytes are the eager path's, bit for bit (``_native.c`` says how;
``tests/test_native.py`` compares them).

A head dim that is not a multiple of 8 (the kernels' vector width) is encoded on a copy with
its channels padded with zeros to the next multiple (:func:`_quantize_padded`): a zero
channel changes no other channel's statistics, nor a token's absolute maximum (a
channel-smoothed zero stays zero), so the real channels get the unpadded bytes, bit for
bit. The copies cost far less than the eager encode they replace (``bench/head_dims.py``:
a layer of 9,216 tokens at D=30 in 3.9 against 12.0 ms; 1.5 ms at D=32). Decoding such a
chunk stays eager's: padded, its per-chunk copies made it slower (3.3 against 2.1 ms).

Where they apply: the extension was built (``pip install`` compiles
``kvstore/core/_native.c``; it is optional, and a build without a C compiler installs
without it), the CPU has AVX2, FMA and F16C, the tensors are on the CPU in float16,
bfloat16 or float32 with contiguous channels, D is 8 to 4096 (decode: a multiple of 8), and the
codec's path (:func:`kvstore.core.fused.get_mode`) is ``auto`` or ``native``. ``eager``
and ``fused`` turn them off.

Why C: the eager encode is ~40 torch ops and 16 full passes per block, and the compiled
(Inductor) CPU code loses to it on decode (docs/codec.md, "Fused kernels"). Each kernel
here reads the input twice (statistics, then codes; the second read hits cache) and writes
each code once, with no scratch. The GIL is released while a kernel runs, so codec calls
on several threads run in parallel, and a big layer's K and V run on two threads
(:data:`PARALLEL_BYTES`).

Decoding into float16 or bfloat16 takes 512-bit rows where the CPU has AVX-512 with BF16
(the same bytes; ``KVSTORE_CODEC_ISA=avx2`` keeps it on AVX2, :func:`set_isa` switches it
at run time); everything else runs AVX2.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from kvstore.core import fused

__all__ = ["ISAS", "available", "dequantize", "isa", "quantize", "set_isa"]

log = logging.getLogger(__name__)

_MODES = {"c": 1, "cc": 2, "t": 3, "ct": 4}
_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_MAX_D = 4096
_MAX_HD = 1 << 20  # _native.c's MAX_HD: channels per block (its scratch)
PARALLEL_BYTES = 256 << 10
"""A half (K or V) of at least this many input bytes runs beside the other one on a second
thread when torch may use more than one (``torch.get_num_threads()``): the kernels are
single-threaded and release the GIL, and a hand-off costs tens of µs, which small halves
do not repay."""
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _load() -> ModuleType | None:
    try:
        from kvstore.core import _native  # type: ignore[attr-defined]
    except ImportError as exc:
        log.info("codec C kernels not built (%s): the eager kernels run", exc)
        return None
    if not _native.supported():
        log.info("codec C kernels need AVX2, FMA and F16C: the eager kernels run")
        return None
    return _native  # type: ignore[no-any-return]


_lib = _load()

ISAS = ("avx2", "avx512")
"""The instruction sets decode can use, in order: the C kernels' codes for them."""


def set_isa(name: str) -> str:
    """Decode with ``name`` (one of :data:`ISAS`, or ``"auto"``: the best this CPU has;
    one it lacks falls back to the best it has); returns the one in use. Raises
    :class:`ValueError` for another name or where the kernels are not available."""
    if name not in (*ISAS, "auto"):
        raise ValueError(f"unknown ISA {name!r}; expected one of {[*ISAS, 'auto']}")
    global _isa
    if _lib is None:
        raise ValueError("the codec's C kernels are not available here")
    _isa = ISAS[_lib.set_isa(ISAS.index(name) if name in ISAS else -1)]
    return _isa


def isa() -> str | None:
    """The instruction set decode uses (None where the kernels are not available)."""
    return _isa


_isa: str | None = None
if _lib is not None:
    _asked = os.environ.get("KVSTORE_CODEC_ISA", "auto").strip().lower() or "auto"
    if _asked not in (*ISAS, "auto"):
        log.warning("KVSTORE_CODEC_ISA=%r is not one of %s: using the best", _asked, ISAS)
        _asked = "auto"
    set_isa(_asked)


def available() -> bool:
    """Whether the C kernels are built and this CPU can run them (whatever the mode)."""
    return _lib is not None


def _enabled(dtype: torch.dtype, h: int, d: int, modes: Sequence[str]) -> bool:
    """Whether the kernels run at all for this dtype, head count, head dim and modes (the
    tensors' own checks follow in each caller)."""
    if _lib is None or dtype not in _DTYPES or fused.get_mode() not in ("auto", "native"):
        return False
    if not 8 <= d <= _MAX_D or h * _padded(d) > _MAX_HD:
        return False
    return all(m in _MODES for m in modes)


def _padded(d: int) -> int:
    """The head dim the kernels run ``d`` at: the next multiple of 8."""
    return -(-d // 8) * 8


_PER_CHANNEL = {"c": (True,), "cc": (True, True), "t": (False,), "ct": (True, False)}
"""Per mode, whether each of its scale views is per channel (else per token)."""


def _reset_after_fork() -> None:  # a forked child has no helper thread
    global _helper, _helper_lock
    _helper, _helper_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _both_halves(run: Callable[[int], None], half_bytes: int) -> None:
    """``run(0)`` and ``run(1)``: side by side on two threads where that pays, else in turn."""
    global _helper
    if half_bytes < PARALLEL_BYTES or torch.get_num_threads() < 2:
        run(0)
        run(1)
        return
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="kvstore-codec")
        helper = _helper
    try:
        other = helper.submit(run, 1)
    except RuntimeError:  # the interpreter is shutting down: no new futures
        run(0)
        run(1)
        return
    try:
        run(0)
    finally:
        other.result()


def _consistent(
    k: Tensor,
    v: Tensor,
    codes: Tensor,
    scales: tuple[list[Tensor], list[Tensor]],
    modes: tuple[str, str],
) -> bool:
    """What the C code reads and writes through pointers lies inside these tensors."""
    n, t, h, d = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or codes.dtype != torch.int8:
        return False
    if tuple(codes.shape) != (n, 2, t, h, d):
        return False
    per_channel, per_token = (n, 1, h, d), (n, t, h, 1)
    want = {"c": [per_channel], "cc": [per_channel] * 2, "t": [per_token],
            "ct": [per_channel, per_token]}  # fmt: skip
    for views, mode in zip(scales, modes, strict=True):
        if [tuple(x.shape) for x in views] != want[mode]:
            return False
        if any(x.dtype != torch.float16 or x.device.type != "cpu" for x in views):
            return False
    return True


class _Plan(NamedTuple):
    """What decoding a chunk of one layout takes, but its addresses: per half the mode's
    code, the codes' offset and the scale arguments (offsets in place of pointers)."""

    halves: tuple[tuple[int, int, tuple[int, ...]], ...]
    nbytes: int  # the chunk bytes the kernels read: buf must hold at least these


@lru_cache(maxsize=256)
def _plan(
    modes: tuple[str, str],
    shape: tuple[int, int, int],
    scale_slots: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...],
    offsets: tuple[int, int],
) -> _Plan:
    t, h, d = shape
    scales: tuple[list[int], list[int]] = ([], [])
    ends = [offsets[1] + 2 * t * h * d]
    for half, dims, strides, at in scale_slots:
        scales[half].extend((offsets[0] + 2 * at, 0, *strides))
        last = sum((n - 1) * s for n, s in zip(dims, strides, strict=True))
        ends.append(offsets[0] + 2 * (at + 1 + last))
    halves = tuple(
        (_MODES[modes[i]], offsets[1] + i * t * h * d, (*scales[i][:5], *scales[i][-5:]))
        for i in (0, 1)
    )
    return _Plan(halves, max(ends))


def _scale_args(views: Sequence[Tensor]) -> list[int]:
    """Pointer and (N, T, H, D) element strides of a half's scale views (``[N, ...]`` or
    one chunk's ``[...]``: N's stride 0); a one-scale mode passes its view twice."""
    out: list[int] = []
    for v in (views[0], views[-1]):
        strides = v.stride() if v.dim() == 4 else (0, *v.stride())
        out += [v.data_ptr(), *strides]
    return out


def quantize(
    k: Tensor,
    v: Tensor,
    codes: Tensor,
    scales: tuple[list[Tensor], list[Tensor]],
    modes: tuple[str, str],
) -> bool:
    """Quantize K and V ``[N, T, H, D]`` into ``codes [N, 2, T, H, D]`` (int8 views of the
    chunk rows) and ``scales`` (K's and V's float16 views ``[N, ...]``), as the codec's
    eager loop does; False (nothing written) where the C kernels do not apply."""
    n, t, h, d = k.shape
    if not _enabled(k.dtype, h, d, modes):
        return False
    if not all(x.device.type == "cpu" and x.stride(-1) == 1 for x in (k, v, codes)):
        return False
    if not _consistent(k, v, codes, scales, modes):
        raise ValueError("native.quantize: K, V, codes and scales do not match (a codec bug)")
    if d % 8:
        return _quantize_padded(k, v, codes, scales, modes)
    assert _lib is not None
    lib = _lib

    def run(half: int) -> None:
        x, q = (k, v)[half], codes[:, half]
        lib.encode(
            _MODES[modes[half]], _DTYPES[k.dtype], n, t, h, d,
            x.data_ptr(), *x.stride()[:3], q.data_ptr(), *q.stride()[:3],
            *_scale_args(scales[half]),
        )  # fmt: skip

    _both_halves(run, k.numel() * k.element_size())
    return True


PAD_TILE_BYTES = 4 << 20
"""Blocks of a padded encode are copied in tiles of about this many input bytes, into
scratch reused from call to call: a fresh zeroed copy of a whole layer cost more in page
faults (11 ms for 30 MB) than the encode it served."""
_scratch = threading.local()


def _scratch_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A reused tensor of ``shape`` for this thread (grown when too small; bounded by the
    largest tile seen)."""
    bufs: dict[tuple[str, torch.dtype], Tensor] = _scratch.__dict__.setdefault("bufs", {})
    numel = math.prod(shape)
    buf = bufs.get((name, dtype))
    if buf is None or buf.numel() < numel:
        buf = bufs[name, dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def _quantize_padded(
    k: Tensor,
    v: Tensor,
    codes: Tensor,
    scales: tuple[list[Tensor], list[Tensor]],
    modes: tuple[str, str],
) -> bool:
    """:func:`quantize` of a head dim that is not a multiple of 8, tile by tile: K and V
    copied with their channels padded with zeros, encoded, and the real channels' codes
    and scales copied out."""
    n, t, h, d = k.shape
    dp = _padded(d)
    g = max(1, min(n, PAD_TILE_BYTES // (t * h * dp * k.element_size())))
    kp = _scratch_tensor("k", (g, t, h, dp), k.dtype)
    vp = _scratch_tensor("v", (g, t, h, dp), v.dtype)
    cp = _scratch_tensor("codes", (g, 2, t, h, dp), torch.int8)
    kp[..., d:] = 0
    vp[..., d:] = 0
    wide = [_scratch_tensor(f"scales{i}", (g, 1, h, dp), torch.float16) for i in range(4)]
    for i in range(0, n, g):
        m = min(g, n - i)
        kp[:m, ..., :d] = k[i : i + m]
        vp[:m, ..., :d] = v[i : i + m]
        sp: tuple[list[Tensor], list[Tensor]] = ([], [])
        back: list[tuple[Tensor, Tensor]] = []  # (a per-channel view, its padded scales)
        pads = iter(wide)
        for half in (0, 1):
            for view, per_channel in zip(scales[half], _PER_CHANNEL[modes[half]], strict=True):
                sp[half].append(next(pads)[:m] if per_channel else view[i : i + m])
                if per_channel:
                    back.append((view[i : i + m], sp[half][-1]))
        quantize(kp[:m], vp[:m], cp[:m], sp, modes)
        codes[i : i + m].copy_(cp[:m, ..., :d])
        for view, pad in back:
            view.copy_(pad[..., :d])
    return True


def dequantize(
    buf: Tensor,
    modes: tuple[str, str],
    shape: tuple[int, int, int],
    scale_slots: Sequence[tuple[int, tuple[int, ...], tuple[int, ...], int]],
    offsets: tuple[int, int],
    out: tuple[Tensor, Tensor],
) -> bool:
    """Dequantize the 1-D chunk ``buf`` (uint8) into ``out``, K and V ``[T, H, D]`` (any
    strides but the channels'), as the codec's eager decoders do; False (nothing written)
    where the C kernels do not apply. ``shape`` is (T, H, D); ``scale_slots`` and
    ``offsets`` (scale region, payload) say where the chunk's scales and codes lie, as the
    codec's layout does. Built from pointers: a chunk of 16 tokens decodes in ~20 µs, and
    every torch view of it would cost 3-10 µs more."""
    t, h, d = shape
    dtype = out[0].dtype
    if d % 8 or not _enabled(dtype, h, d, modes) or buf.device.type != "cpu":
        return False  # (a padded decode measured slower than eager's: 3.3 against 2.1 ms)
    strides = (out[0].stride(), out[1].stride())  # one call each: torch attributes cost µs here
    for o, st in zip(out, strides, strict=True):
        if st[2] != 1 or o.device.type != "cpu":
            return False
        if any(s == 0 and n > 1 for s, n in zip(st, o.shape, strict=True)):
            return False  # eager's copy_ raises for outputs whose elements share memory
    plan = _plan(modes, shape, tuple(scale_slots), offsets)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < plan.nbytes:
        raise ValueError("native.dequantize: the chunk is shorter than its layout (a codec bug)")
    if out[0].shape != shape or out[1].shape != shape or out[1].dtype != dtype:
        raise ValueError("native.dequantize: out does not match the chunk (a codec bug)")
    base, lib, dt = buf.data_ptr(), _lib, _DTYPES[dtype]
    assert lib is not None

    def run(half: int) -> None:
        mode, codes, sc = plan.halves[half]
        s0, s1, st = base + sc[0], base + sc[5], strides[half]
        lib.decode(
            mode, dt, 1, t, h, d, base + codes, 0, h * d, d, out[half].data_ptr(), 0, st[0],
            st[1], s0, *sc[1:5], s1, *sc[6:],
        )  # fmt: skip

    _both_halves(run, t * h * d * out[0].element_size())
    return True

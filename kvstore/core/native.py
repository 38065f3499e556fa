"""The codec's INT8 kernels in C, for CPU tensors: one call per half (K or V) of a layer.

:mod:`kvstore.core.codec` offers each INT8 quantization and dequantization to
:func:`quantize` and :func:`dequantize` first; they return False (nothing written) where
the C kernels do not apply, and the codec runs :mod:`kvstore.core.fused` or its eager
kernels instead. The bytes are the eager path's, bit for bit (``_native.c`` says how;
``tests/test_native.py`` compares them).

Any head dim from 8 on runs in place: where the vector width (8 channels; 16 for decode's
stores) does not divide D, each row ends with one more vector that overlaps the one before
it (``_native.c`` says why that gives the same bytes). Measured on a layer of 9,216 tokens,
H=8, bfloat16 (one thread): encode at D=30 in 2.7 ms against 5.1 ms on a copy padded with
zeros to D=32 (what ran before; 2.9 against 5.7 at D=50, 28.8 against 39.6 at D=250), and
decode, which ran eager's kernels at such a D (2.1-2.3 ms at D=30), in 0.86 ms at D=30,
0.82 at D=32; 1.17 at D=50, 0.96 at D=48; 0.75 at D=17, 0.66 at D=16
(``bench/head_dims.py`` prints the table).

Where they apply: the extension was built (``pip install`` compiles
``kvstore/core/_native.c``; it is optional, and a build without a C compiler installs
without it), the CPU has AVX2, FMA and F16C, the tensors are on the CPU in float16,
bfloat16 or float32 with contiguous channels, D is 8 to 4096, and the codec's path
(:func:`kvstore.core.fused.get_mode`) is ``auto`` or ``native``. ``eager`` and ``fused``
turn them off.

Why C: the eager encode is ~40 torch ops and 16 full passes per block, and the compiled
(Inductor) CPU code loses to it on decode (docs/codec.md, "Fused kernels"). Each kernel
here reads the input twice (statistics, then codes; the second read hits cache) and writes
each code once, with no scratch. The GIL is released while a kernel runs, so codec calls
on several threads run in parallel, and a big layer's K and V run on two threads
(:data:`PARALLEL_BYTES`).

Encoding (any head dim from 16 on) and decoding into float16 or bfloat16 take 512-bit
rows where the CPU has AVX-512 with BF16 (the same bytes; ``KVSTORE_CODEC_ISA=avx2`` keeps
both on AVX2, :func:`set_isa` switches them at run time); everything else runs AVX2.
Measured on this AMD EPYC (2 cores, shared and noisy; ``int8-kcc-vct``, a 2048-token
bfloat16 layer, H=8, D=128, in 256-token blocks, one thread, best of 10-20 batches): the
two encode kernels 0.70-0.79 ms on AVX2, 0.51-0.61 ms on AVX-512.
"""

from __future__ import annotations

import logging
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
_PARALLEL_VALUES = PARALLEL_BYTES // 4
"""Values per half below which no dtype reaches :data:`PARALLEL_BYTES` (float32 is 4 bytes):
decode runs both halves in turn without asking for the element size."""
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
"""The instruction sets the kernels can use, in order: the C kernels' codes for them."""


def set_isa(name: str) -> str:
    """Encode and decode with ``name`` (one of :data:`ISAS`, or ``"auto"``: the best this
    CPU has; one it lacks falls back to the best it has); returns the one in use. Raises
    :class:`ValueError` for another name or where the kernels are not available."""
    if name not in (*ISAS, "auto"):
        raise ValueError(f"unknown ISA {name!r}; expected one of {[*ISAS, 'auto']}")
    global _isa
    if _lib is None:
        raise ValueError("the codec's C kernels are not available here")
    _isa = ISAS[_lib.set_isa(ISAS.index(name) if name in ISAS else -1)]
    return _isa


def isa() -> str | None:
    """The instruction set the kernels use (None where they are not available)."""
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
    if _lib is None or fused.get_mode() not in ("auto", "native"):
        return False
    return _fits(dtype, h, d, tuple(modes))


@lru_cache(maxsize=256)
def _fits(dtype: torch.dtype, h: int, d: int, modes: tuple[str, ...]) -> bool:
    """:func:`_enabled` but for the mode: cached, as decode asks it per chunk."""
    if dtype not in _DTYPES or not 8 <= d <= _MAX_D or h * _row_floats(d) > _MAX_HD:
        return False
    return all(m in _MODES for m in modes)


def _row_floats(d: int) -> int:
    """A head's row in the kernels' scratch (_native.c's ROW_FLOATS): ``d`` rounded up to 16."""
    return -(-d // 16) * 16


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
        if any(x.dtype != torch.float16 or not x.is_cpu for x in views):
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
    if not all(x.is_cpu and x.stride(-1) == 1 for x in (k, v, codes)):
        return False
    if not _consistent(k, v, codes, scales, modes):
        raise ValueError("native.quantize: K, V, codes and scales do not match (a codec bug)")
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
    _, h, d = shape
    k, v = out
    dtype = k.dtype
    # torch attributes cost µs here, so each is read once, and the cheap ones first
    # (is_cpu: 0.04 µs, device.type: 0.25-0.45 µs)
    if not (buf.is_cpu and k.is_cpu and v.is_cpu and _enabled(dtype, h, d, modes)):
        return False
    ks, vs = k.stride(), v.stride()
    if ks[2] != 1 or vs[2] != 1:
        return False
    for o, st in ((k, ks), (v, vs)):
        if 0 in st and any(s == 0 and n > 1 for s, n in zip(st, o.shape, strict=True)):
            return False  # eager's copy_ raises for outputs whose elements share memory
    plan = _plan(modes, shape, tuple(scale_slots), offsets)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < plan.nbytes:
        raise ValueError("native.dequantize: the chunk is shorter than its layout (a codec bug)")
    if k.shape != shape or v.shape != shape or v.dtype != dtype:
        raise ValueError("native.dequantize: out does not match the chunk (a codec bug)")
    decode_at(plan, shape, dtype, buf.data_ptr(), (k.data_ptr(), v.data_ptr()), (ks, vs))
    return True


def plan_of(
    modes: tuple[str, str],
    shape: tuple[int, int, int],
    scale_slots: Sequence[tuple[int, tuple[int, ...], tuple[int, ...], int]],
    offsets: tuple[int, int],
) -> _Plan:
    """What decoding a chunk of this layout takes but its addresses (cached; the caller
    keeps it, as the codec does per header form)."""
    return _plan(modes, shape, tuple(scale_slots), offsets)


def decode_at(
    plan: _Plan,
    shape: Sequence[int],
    dtype: torch.dtype,
    base: int,
    ptrs: tuple[int, int],
    strides: tuple[Sequence[int], Sequence[int]],
) -> None:
    """Dequantize the chunk at address ``base`` (at least ``plan.nbytes`` bytes) into K and
    V at ``ptrs`` with element ``strides`` (T, H; channels contiguous), ``dtype`` values of
    ``shape`` (T, H, D). Only :func:`dequantize` and callers that checked as it does (every
    shape, stride and length) may call this: it writes through raw pointers."""
    t, h, d = shape
    lib, dt = _lib, _DTYPES[dtype]
    assert lib is not None
    (km, kc, ka), (vm, vc, va) = plan.halves
    (kp, vp), (ks, vs) = ptrs, strides
    if t * h * d < _PARALLEL_VALUES or torch.get_num_threads() < 2:
        # one half after the other, without a closure or the helper (~1.5 µs a chunk)
        lib.decode(km, dt, 1, t, h, d, base + kc, 0, h * d, d, kp, 0, ks[0], ks[1],
                   base + ka[0], *ka[1:5], base + ka[5], *ka[6:])  # fmt: skip
        lib.decode(vm, dt, 1, t, h, d, base + vc, 0, h * d, d, vp, 0, vs[0], vs[1],
                   base + va[0], *va[1:5], base + va[5], *va[6:])  # fmt: skip
        return

    def run(half: int) -> None:
        mode, codes, sc = plan.halves[half]
        s0, s1, st = base + sc[0], base + sc[5], strides[half]
        lib.decode(
            mode, dt, 1, t, h, d, base + codes, 0, h * d, d, ptrs[half], 0, st[0],
            st[1], s0, *sc[1:5], s1, *sc[6:],
        )  # fmt: skip

    _both_halves(run, t * h * d * dtype.itemsize)

"""Fused INT8 kernels for :mod:`kvstore.core.codec`: its quantization math, compiled.

The eager codec spends ~40 torch ops per block (docs/codec.md, Speed). Here the same math
is written once as pure tensor functions and handed to ``torch.compile`` (Inductor: C++
with OpenMP on CPU, Triton on CUDA, from this one source): one compiled call quantizes a
whole layer (K and V of every block) and one dequantizes a chunk. The chunk format does
not change and neither do its bytes: every rounding step of the eager path is kept as its
own operation, in the same order, and ``emulate_precision_casts`` stops Inductor from
skipping the float16 rounding of a scale it reads back. Without that option, on realistic
bf16 KV (24 blocks x 16 tokens, H=8, D=128), 3,295 of 393,216 K codes and 1,124 V codes
differed by one and 156 of 24,576 K scales by one float16 ulp; with it, none. Tests hold
every scheme, dtype and shape they try to the eager bytes.

What the compiled code does not do: headers, padding, the NaN/inf check and checksums stay
in :mod:`~kvstore.core.codec`, which calls :func:`quantize` / :func:`dequantize` in place
of its eager loops and runs those whenever these return False. A graph writes codes (or
values) into this thread's scratch buffers, which the codec then copies into the chunk
rows (or the caller's ``out``) with one ``copy_`` per half. Measured alternatives: writing
into views of the rows made Inductor stage the result and copy it anyway, or compute both
halves for every element; a strided caller buffer would put its strides in the graph's
guards (a recompile per layer length). Fresh graph outputs cost a page fault per page on
every call (a float32 decode took 1.6 ms against 0.6 ms eager), hence the scratch.

Which path runs: :func:`set_mode`, else the environment variable ``KVSTORE_CODEC`` (read
here only, on first use) — ``eager`` (never compile, no C kernels), ``fused`` (always
try), ``native`` (the C kernels of :mod:`kvstore.core.native` where they apply, else
eager) or ``auto`` (default: the C kernels where they apply, else fused on the devices in
:data:`AUTO_DEVICES` where their compiler is available — Triton on CUDA — else eager).
A compilation or kernel failure is logged once, switches this process to the eager path
and is never raised to the caller.

Compiled graphs are cached per (direction, device, dtype, modes, T, H, D); the block
count of an encode is a dynamic dimension (marked on the first multi-block call), so a
layer of 3 blocks and one of 24 share a graph; one-block encodes (``encode_chunk``) get
their own. :func:`compile_log` lists each graph's first-call time. Thread-safe: first
calls of a graph are serialised, later calls run concurrently.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kvstore.core import kernels

__all__ = [
    "AUTO_DEVICES",
    "ENV_VAR",
    "MODES",
    "CompileRecord",
    "compile_log",
    "dequantize",
    "get_mode",
    "quantize",
    "reference_quantize",
    "set_mode",
]

logger = logging.getLogger(__name__)

ENV_VAR = "KVSTORE_CODEC"
MODES = ("eager", "fused", "native", "auto")
"""Accepted values of :data:`ENV_VAR` and :func:`set_mode`."""

AUTO_DEVICES: frozenset[str] = frozenset()
"""Device types where ``auto`` runs the fused kernels: none yet. Not CPU: on the 2-core
AVX2 machine here the compiled CPU decode measured slower than the tuned eager path
(bench/codec.py and docs/codec.md, "Fused kernels"). Not CUDA either until the Triton
path has been compiled, run and measured on a GPU: its first call compiles (seconds),
which must not land inside an engine's first put. ``KVSTORE_CODEC=fused`` runs them."""

_TINY = kernels.TINY  # the eager kernels' constants, so both paths agree bit for bit
_INV_QMAX = 1 / kernels.QMAX
_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"emulate_precision_casts": True}
_BACKEND: Any = "inductor"  # tests swap in a backend that fails


class CompileRecord(NamedTuple):
    """One compiled graph: what it is for and how long its first call took."""

    what: str
    """Direction (``encode``, ``encode1`` for one block, ``decode``), device, dtype, the
    K and V modes, and T H D."""
    seconds: float
    ok: bool


# ----------------------------------------------------------------------------- the math
# Each mirrors codec's eager encoder of the same name op for op (codec's comments say why
# each step is what it is); ``y`` is float32 ``[N, T, H, D]``. Each returns the codes'
# ingredients instead of writing them: the float16 scales to store, and the factors of
# ``round((y - sub) * chan * tok)`` (None: skipped, which is what eager does too).


def _amax(y: Tensor, dim: int) -> Tensor:
    return _over(torch.amax, y, dim)


def _amin(y: Tensor, dim: int) -> Tensor:
    return _over(torch.amin, y, dim)


def _over(op: Callable[..., Tensor], y: Tensor, dim: int) -> Tensor:
    """``op(y, dim, keepdim=True)``; over T (dim -3) in two steps, runs of up to 16
    tokens first. Inductor walks a T-reduction column group by column group down
    the rows, a stride the prefetchers miss (35% of an encode's samples on two loads);
    a run of 16 rows stays in L1 for the next group (measured 1.1 vs 1.9 ms per layer
    half). Max and min are exact, so the order cannot change a value."""
    t = y.shape[-3]
    run = next((r for r in (16, 8, 4, 2) if dim == -3 and t % r == 0 and t > r), 0)
    if not run:
        return op(y, dim, keepdim=True)
    return op(op(y.unflatten(-3, (t // run, run)), -3), -3, keepdim=True)


def _absmax(y: Tensor, dim: int) -> Tensor:
    return torch.maximum(_amax(y, dim), _amin(y, dim).neg())


def _scale(r: Tensor) -> tuple[Tensor, Tensor]:
    s16 = (r * _INV_QMAX).clamp_min(_TINY).to(torch.float16)
    return s16, s16.float().reciprocal()


_Factors = tuple[Tensor | None, Tensor | None, Tensor | None]
_SCALES = {"c": 1, "t": 1, "cc": 2, "ct": 2}  # float16 scale tensors per mode


def _stats(mode: str, y: Tensor) -> tuple[list[Tensor], _Factors]:
    if mode == "c":
        s, inv = _scale(_absmax(y, -3))
        return [s], (None, inv, None)
    if mode == "t":
        s, inv = _scale(_absmax(y, -1))
        return [s], (None, None, inv)
    if mode == "cc":
        hi, lo = _amax(y, -3), _amin(y, -3)
        m16 = (hi - (hi - lo) * 0.5 + 0.0).to(torch.float16)  # kernels._enc_cc's, exactly
        m = m16.float()
        s, inv = _scale(torch.maximum(hi - m, m - lo))
        return [m16, s], (m, inv, None)
    c16 = _absmax(y, -3).clamp_min(_TINY).to(torch.float16)  # "ct"
    inv_c = c16.float().reciprocal()
    s, inv = _scale(_absmax(y * inv_c, -1))
    return [c16, s], (None, inv_c, inv)


def _codes(y: Tensor, factors: _Factors) -> Tensor:
    sub, chan, tok = factors
    if sub is not None:
        y = y - sub
    if chan is not None:
        y = y * chan
    if tok is not None:
        y = y * tok
    return y.round().to(torch.int8)  # |y| <= 127.07 by construction (codec's _TINY)


def _encode_graph(
    k: Tensor, v: Tensor, qk: Tensor, qv: Tensor, modes: tuple[str, str]
) -> list[Tensor]:
    """Quantize ``k``, ``v`` ``[N, T, H, D]`` (any float dtype) into ``qk``, ``qv`` (int8
    scratch of the same shape); return K's then V's float16 scales (codec's view shapes)."""
    scales: list[Tensor] = []
    realized: list[Tensor] = []
    for half, q, mode in zip((k, v), (qk, qv), modes, strict=True):
        y = half.float()
        stored, factors = _stats(mode, y)
        q.copy_(_codes(y, factors))
        scales += stored
        realized += [f for f in factors if f is not None]
    # The float32 factors are returned (and dropped by the caller) so that Inductor stores
    # them once: otherwise the codes loop re-reads the float16 scales and re-derives them
    # per element, through at::vec's partial float16 loads (a store-forwarding stall).
    return scales + realized


def _decode_graph(
    qk: Tensor, qv: Tensor, scales: list[Tensor], wk: Tensor, wv: Tensor, modes: tuple[str, str]
) -> None:
    """Dequantize codes ``qk``, ``qv`` ``[T, H, D]`` with the scales (float32 values of
    the stored float16 ones, K's then V's) into ``wk``, ``wv`` (scratch of the output
    dtype). Float32 scale inputs, as eager reads them: float16 ones took two partial
    vector loads per element, half of this kernel's time.

    As eager: each ``q·s`` is exact in float32 (7 x 11 significant bits) and so is a
    product of two scales (11 x 11), so every value is rounded once, to the same real
    number, whatever the order (codec's decoder comment), then cast."""
    at = 0
    for q, w, mode in zip((qk, qv), (wk, wv), modes, strict=True):
        x = q.float()
        if mode in ("c", "t"):
            x = x * scales[at]
            at += 1
        elif mode == "cc":
            x = scales[at] + x * scales[at + 1]
            at += 2
        else:  # "ct": (q · s_token) · c_channel
            x = x * scales[at + 1] * scales[at]
            at += 2
        w.copy_(x)


def reference_quantize(k: Tensor, v: Tensor, modes: tuple[str, str]) -> list[Tensor]:
    """The fused encoder's math run eagerly: [K codes, V codes, *scales] (for tests)."""
    qk = torch.empty(k.shape, dtype=torch.int8, device=k.device)
    qv = torch.empty(v.shape, dtype=torch.int8, device=v.device)
    with torch.no_grad():
        got = _encode_graph(k, v, qk, qv, modes)
    return [qk, qv, *got[: _SCALES[modes[0]] + _SCALES[modes[1]]]]


# ----------------------------------------------------------------------------- mode


class _State:
    """The process's choice of path and its compiled graphs (one instance, below)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mode: str | None = None
        self.failed = False
        self.graphs: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.warm: set[tuple[Any, ...]] = set()
        self.log: list[CompileRecord] = []
        self.compilers: dict[str, bool] = {}


_state = _State()


def _checked_mode(mode: str, where: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{where}={mode!r}; expected one of {', '.join(MODES)}")
    return mode


def get_mode() -> str:
    """The path in force: ``set_mode``'s, else ``$KVSTORE_CODEC`` (read once), else auto.

    An unknown value in the environment is logged and treated as ``auto``."""
    if _state.mode is None:
        raw = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        try:
            _state.mode = _checked_mode(raw, ENV_VAR)
        except ValueError as exc:
            logger.warning("%s; using auto", exc)
            _state.mode = "auto"
    return _state.mode


def set_mode(mode: str | None) -> None:
    """Choose ``"eager"``, ``"fused"`` or ``"auto"`` for this process (None: re-read the
    environment on next use); also forgets an earlier compile failure. Compiled graphs
    are kept. Raises ValueError for another value."""
    _state.mode = None if mode is None else _checked_mode(mode, "mode")
    _state.failed = False


def compile_log() -> list[CompileRecord]:
    """Every graph compiled in this process so far, in order, with its first-call time."""
    with _state.lock:
        return list(_state.log)


def _has_compiler(device: torch.device) -> bool:
    """Whether torch.compile can generate code for ``device`` here (cached)."""
    kind = device.type
    if kind not in _state.compilers:
        if kind == "cpu":
            found = bool(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))
        elif kind == "cuda":
            from torch.utils._triton import has_triton

            found = has_triton()
        else:
            found = False
        _state.compilers[kind] = found
    return _state.compilers[kind]


def _wanted(device: torch.device) -> bool:
    mode = get_mode()
    if mode in ("eager", "native") or _state.failed:
        return False
    if mode == "fused":
        return True
    return device.type in AUTO_DEVICES and _has_compiler(device)


# ----------------------------------------------------------------------------- compiling

_FAILED = object()
_SCRATCH_SHAPES = 8
_SCRATCH_KEEP_BYTES = 16 << 20  # a 16k-token bf16 layer's half, H=8 D=128
_scratch_local = threading.local()


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slot: int) -> Tensor:
    """This thread's reusable buffer for ``(shape, dtype, slot)``, valid until its next
    codec call: graph outputs are fresh allocations whose pages fault in on every call
    (measured: a float32 decode took 1.6 ms against 0.6 ms eager before this), and
    separate buffers (not views of the rows) keep a graph's inputs from aliasing."""
    big = math.prod(shape) * dtype.itemsize > _SCRATCH_KEEP_BYTES  # not kept: memory
    if device.type != "cpu" or big:
        return torch.empty(shape, dtype=dtype, device=device)  # GPUs: the caching allocator
    kept: dict[tuple[Any, ...], Tensor] | None = getattr(_scratch_local, "kept", None)
    if kept is None:
        kept = _scratch_local.kept = {}
    key = (shape, dtype, slot)
    buf = kept.pop(key, None)
    if buf is None:
        buf = torch.empty(shape, dtype=dtype)
        if len(kept) >= _SCRATCH_SHAPES:
            del kept[next(iter(kept))]
    kept[key] = buf
    return buf


def _compiled(key: tuple[Any, ...], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` of a private copy of ``fn`` for ``key``: Dynamo caches graphs and
    counts recompiles per code object, so each key gets its own code object and one key's
    shapes never evict another's graphs."""
    graph = _state.graphs.get(key)
    if graph is None:
        name = "_".join(str(p).replace(".", "_") for p in key)
        private = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)
        options = _OPTIONS if _BACKEND == "inductor" else None
        graph = torch.compile(private, fullgraph=True, backend=_BACKEND, options=options)
        _state.graphs[key] = graph
    return graph


def _run(key: tuple[Any, ...], fn: Callable[..., Any], *args: Any) -> Any:
    """Call the graph for ``key``; :data:`_FAILED` (and eager from now on) if it fails.
    A graph's first call compiles, under the lock, timed into :func:`compile_log`."""
    try:
        with torch.no_grad():
            if key in _state.warm:
                return _compiled(key, fn)(*args)
            with _state.lock:
                if key in _state.warm:  # another thread compiled it meanwhile
                    return _compiled(key, fn)(*args)
                return _first_call(key, fn, *args)
    except Exception as exc:  # compiler missing or broken, kernel failure: never the caller's
        if not _state.failed:
            logger.warning(
                "fused codec failed for %s (%s: %s); using the eager codec from now on",
                _describe(key), type(exc).__name__, exc, exc_info=True,
            )  # fmt: skip
        _state.failed = True
        return _FAILED


def _first_call(key: tuple[Any, ...], fn: Callable[..., Any], *args: Any) -> Any:
    start = time.perf_counter()
    ok = False
    try:
        result = _compiled(key, fn)(*args)
        ok = True
    finally:
        _state.log.append(CompileRecord(_describe(key), time.perf_counter() - start, ok))
    _state.warm.add(key)
    return result


def _describe(key: tuple[Any, ...]) -> str:
    return " ".join(str(p) for p in key)


# ----------------------------------------------------------------------------- entry points


def quantize(
    k: Tensor,
    v: Tensor,
    codes: Tensor,
    scales: tuple[list[Tensor], list[Tensor]],
    modes: tuple[str, str],
) -> bool:
    """Quantize K and V ``[N, T, H, D]`` into ``codes [N, 2, T, H, D]`` (int8 views of the
    chunk rows) and ``scales`` (K's and V's float16 views ``[N, ...]``), as codec's eager
    loop does; False (nothing written) where the eager path should run instead."""
    n, device = k.shape[0], k.device
    if not _wanted(device):
        return False
    key = ("encode" if n > 1 else "encode1", device.type, k.dtype, *modes, *k.shape[1:])
    qk, qv = (_scratch(tuple(k.shape), torch.int8, device, i) for i in (0, 1))
    if n > 1 and key not in _state.warm:
        for t in (k, v, qk, qv):
            torch._dynamo.mark_dynamic(t, 0)
    got = _run(key, _encode_graph, k, v, qk, qv, modes)
    if got is _FAILED:
        return False
    codes[:, 0].copy_(qk)
    codes[:, 1].copy_(qv)
    for view, value in zip([*scales[0], *scales[1]], got, strict=False):
        view.copy_(value)
    return True


def dequantize(
    q: Tensor, scales: Sequence[list[Tensor]], modes: tuple[str, str], out: tuple[Tensor, Tensor]
) -> bool:
    """Dequantize codes ``q [2, T, H, D]`` with the scales (K's, V's views, as float32)
    into ``out``, K and V ``[T, H, D]`` (any strides), as codec's eager decoder does;
    False (nothing written) where the eager path should run instead."""
    dtype, device = out[0].dtype, out[0].device
    if not _wanted(device):
        return False
    key = ("decode", device.type, dtype, *modes, *q.shape[1:])
    wk, wv = (_scratch(tuple(q.shape[1:]), dtype, device, i) for i in (0, 1))
    got = _run(key, _decode_graph, q[0], q[1], [*scales[0], *scales[1]], wk, wv, modes)
    if got is _FAILED:
        return False
    out[0].copy_(wk)
    out[1].copy_(wv)
    return True

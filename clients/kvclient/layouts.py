"""Engine page forms → the pool's canonical KV: per token, K and V of every KV head.

An engine keeps one layer's KV in pages whose inner arrangement is the attention backend's
business. The pool must not store those bytes: a chunk holds the namespace's canonical
``[2, T, H, D]`` (K then V, token-major), so engines with another block size, another
backend or another CPU ISA read the same K and V (docs/engine-integration.md, "Layouts").
:func:`halves` maps a page form onto two strided ``[num_blocks, block_size, H, D]`` views,
K and V (no copy), which :class:`~kvclient.paged.PagedCache` takes as ``"kv_pair"``; the
codec reads and writes them in place, or through a per-chunk gather where they are not one
view. The forms::

    "kv_first"      [2, B, N, H, D]                 vLLM < 0.32 FlashAttention
    "blocks_first"  [B, 2, N, H, D]                 vLLM < 0.32 FlashInfer
    "bhnc"          [B, H, N, 2*D], K = C[:D], V = C[D:], any physical order
                    (vLLM >= 0.32: FlashAttention, FlashInfer, Triton, FlexAttention;
                    NHD = LBNHC and HND = LBHNC alike)
    "cpu_dn"        [B, H, N, 2*D] whose memory is [B, H, 2N, D]: per head, K as
                    [D, N] (transposed), then V as [N, D] (vLLM's CPU backend, ISAs
                    vec and vec16)
    "cpu_amx"       the same memory in AMX tiles (vLLM's CPU backend, ISA amx: bfloat16
                    on CPUs with AMX): per head, K in 16-token tiles of channel pairs
                    (token t, channel d at (t//16)*16*D + (d//2)*32 + (t%16)*2 + d%2),
                    then V in 16-channel tiles of token pairs (at N*D + (d//16)*16*N +
                    (t//2)*32 + (d%16)*2 + t%2). No 4-D view describes these: the halves
                    are tiled 6-D views, read and written a block at a time

(B engine blocks, N tokens per block, H KV heads, D head size.) Never a guess:
:func:`certify` writes a known K and V through the engine's own cache-write path into a
two-block scratch cache shaped and strided like the real one, reads them back through the
form's views and refuses the form unless every element matches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvstore.errors import KVStoreError

__all__ = [
    "FORMS",
    "PROBE_BASE",
    "PROBE_DIGITS",
    "LayoutError",
    "Writer",
    "certify",
    "halves",
    "probe_index",
    "probe_kv",
    "scratch_like",
]

FORMS: tuple[str, ...] = ("kv_first", "blocks_first", "bhnc", "cpu_dn", "cpu_amx")
"""Page forms :func:`halves` maps (see the module docstring)."""

Writer = Callable[[Tensor, Tensor, Tensor, Tensor], None]
"""An engine's cache write: ``(key [T, H, D], value [T, H, D], cache, slot_mapping [T])``
stores token ``i`` at slot ``slot_mapping[i]`` (block ``s // N``, offset ``s % N``)."""


class LayoutError(KVStoreError, ValueError):
    """An engine cache whose page form kvstore cannot map onto canonical K and V."""


def _block_dim(form: str) -> int:
    return 1 if form == "kv_first" else 0


def halves(t: Tensor, form: str, head_dim: int) -> tuple[Tensor, Tensor]:
    """K and V of cache ``t`` in page form ``form``, each ``[B, N, H, D]`` (views, no copy;
    for ``cpu_amx`` tiled ``[B, T1, T0, H, D1, D0]`` views, token ``t1*T0 + t0`` and
    channel ``d1*D0 + d0``, as :class:`~kvclient.paged.PagedCache` takes them).

    Raises :class:`LayoutError` for an unknown form or a tensor whose shape or strides the
    form does not describe.
    """
    D = head_dim
    if form not in FORMS:
        raise LayoutError(f"unknown page form {form!r}; expected one of {FORMS}")
    if form in ("kv_first", "blocks_first"):
        kv_dim = 0 if form == "kv_first" else 1
        if t.dim() != 5 or t.shape[kv_dim] != 2 or t.shape[-1] != D:
            raise LayoutError(f"a {form} cache is 5-D with K, V at dim {kv_dim}: {_fmt(t)}")
        return t.select(kv_dim, 0), t.select(kv_dim, 1)
    if t.dim() != 4 or t.shape[-1] != 2 * D:
        raise LayoutError(f"a {form} cache is [B, H, N, 2*{D}]: {_fmt(t)}")
    if form == "bhnc":
        k, v = t[..., :D], t[..., D:]
        return k.transpose(1, 2), v.transpose(1, 2)
    B, H, N, _ = t.shape
    s = t.stride()
    if s[3] != 1 or s[2] != 2 * D:  # the kernel views each head's [N, 2D] as [2N, D]
        raise LayoutError(f"a cpu_dn cache needs each head's [N, 2*D] contiguous: {_fmt(t)}")
    off = t.storage_offset()
    if form == "cpu_amx":
        if N % 16 or D % 16:
            raise LayoutError(f"AMX tiles need block_size and head size multiples of 16: {_fmt(t)}")
        k = t.as_strided((B, N // 16, 16, H, D // 2, 2), (s[0], 16 * D, 2, s[1], 32, 1), off)
        v = t.as_strided((B, N // 2, 2, H, D // 16, 16), (s[0], 32, 1, s[1], 16 * N, 2),
                         off + N * D)  # fmt: skip
        return k, v
    k = t.as_strided((B, N, H, D), (s[0], 1, s[1], N), off)
    v = t.as_strided((B, N, H, D), (s[0], D, s[1], 1), off + N * D)
    return k, v


def scratch_like(t: Tensor, form: str, num_blocks: int = 2) -> Tensor:
    """A new tensor like ``t`` (shape, dtype, device and stride order) with ``num_blocks``
    engine blocks: what :func:`certify` writes its probe into."""
    shape = list(t.shape)
    shape[_block_dim(form)] = num_blocks
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda i: (-strides[i], i))  # outermost first
    dense = torch.empty([shape[i] for i in order], dtype=t.dtype, device=t.device)
    back = [order.index(i) for i in range(t.dim())]
    return dense.permute(back).fill_(0)


PROBE_BASE = 241
"""Probe values are base-241 digits of each element's index: integers below 256, which
every KV dtype holds exactly (bfloat16 holds no larger odd integers)."""

PROBE_DIGITS = 3
"""Probe passes: 241**3 (14 million) K and V elements each named uniquely."""


def probe_kv(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
             digit: int = 0) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One probe pass: K and V ``[tokens, H, D]`` holding digit ``digit`` (base
    :data:`PROBE_BASE`) of each element's index, K's elements numbered ``0 .. n-1`` in
    token, head, channel order and V's ``n .. 2n-1``. Read back after :data:`PROBE_DIGITS`
    passes, the digits name every element, so any element out of place, K for V included,
    is seen (:func:`probe_index`)."""
    n = tokens * heads * head_dim
    idx = torch.arange(2 * n, dtype=torch.int64).view(2, tokens, heads, head_dim)
    value = (idx // PROBE_BASE**digit) % PROBE_BASE
    return value[0].to(dtype=dtype, device=device), value[1].to(dtype=dtype, device=device)


def probe_index(digits: list[Tensor]) -> Tensor:
    """The element indices that :data:`PROBE_DIGITS` passes' read-back ``digits`` spell."""
    index = torch.zeros(digits[0].shape, dtype=torch.int64)
    for p, d in enumerate(digits):
        index += d.to(device="cpu", dtype=torch.int64) * PROBE_BASE**p
    return index


def certify(t: Tensor, form: str, head_dim: int, write: Writer, what: str) -> None:
    """Prove that ``form`` reads what the engine's ``write`` stores: write probes of two
    blocks through it into :func:`scratch_like` ``t`` and check that every K and V element
    read back through :func:`halves` is the one written there. Raises :class:`LayoutError`,
    naming ``what`` (the backend and cache), on any difference or when the write fails."""
    scratch = scratch_like(t, form)
    k_view, v_view = halves(scratch, form, head_dim)
    N = int(t.shape[2])  # tokens per block in every form's tensor
    H = k_view.numel() // (2 * N * head_dim)
    if 2 * (2 * N * H * head_dim) > PROBE_BASE**PROBE_DIGITS:
        raise LayoutError(f"{what}: a block too large to probe ({N} tokens, {H} heads)")
    slots = torch.arange(2 * N, dtype=torch.int64, device=t.device)
    read: list[Tensor] = []
    for digit in range(PROBE_DIGITS):
        key, value = probe_kv(2 * N, H, head_dim, t.dtype, t.device, digit)
        try:
            write(key, value, scratch, slots)
        except Exception as exc:
            raise LayoutError(f"{what}: the engine's cache write failed on a probe: {exc}") from exc
        got = torch.stack([k_view.reshape(2 * N, H, head_dim), v_view.reshape(2 * N, H, head_dim)])
        read.append(got)  # reshape: a copy where the view is tiled
    want = torch.arange(read[0].numel(), dtype=torch.int64).view(read[0].shape)
    got_index = probe_index(read)
    if not torch.equal(got_index, want):
        bad = int((got_index != want).sum())
        raise LayoutError(
            f"{what}: the engine writes K and V where page form {form!r} does not read them "
            f"({bad} of {want.numel()} probe elements out of place); kvstore refuses to store "
            "this cache rather than store bytes that are not K and V"
        )


def _fmt(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, strides {tuple(t.stride())}, {t.dtype}"

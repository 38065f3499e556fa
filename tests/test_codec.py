"""The chunk codec: round trips, pinned bytes, tilings, sizes, accuracy, checksums, bad input."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstore.core import checksum, codec, fused, hashing, headers, kernels
from kvstore.core.codec import (
    DEFAULT_INT8,
    HEADER_NBYTES,
    QUANT_SCHEMES,
    SCHEMES,
    ChunkKey,
    ChunkSpec,
    chunk_nbytes,
    copy_stats,
    decode_chunk,
    encode_blocks,
    encode_chunk,
    header_form,
    read_header,
    verify_chunk,
    verify_host_bytes,
)
from kvstore.core.headers import HeaderChecks
from kvstore.core.kvgen import attention_error, compare_schemes, realistic_kv
from kvstore.errors import (
    BadShape,
    ChecksumError,
    ChunkError,
    ChunkFormatError,
    ChunkKeyMismatch,
    ChunkVersionError,
    InvalidArgument,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
INT8 = [s for s in SCHEMES if s.startswith("int8-")]
INT4 = [s for s in SCHEMES if s.startswith("int4-")]
KEY = ChunkKey(bytes(range(16)), 7, 1)
MODES = {  # how each scheme quantizes K and V (module docstring of codec)
    "int8-kc-vt": ("c", "t"),
    "int8-kt-vt": ("t", "t"),
    "int8-kcc-vt": ("cc", "t"),
    "int8-kcc-vct": ("cc", "ct"),
    "int4-g32": ("kg32", "vg32"),
    "int4-g128": ("kg128", "vg128"),
}
EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def _group_bound(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Largest error INT4 ``mode`` (``kg<G>``, ``vg<G>``) may make on ``x [T, H, D]``: half a
    step, plus the float16 rounding of the group's minimum (codes are clamped to 0..15, so
    the rounding can cost the values below it) and of its step (times at most 15 codes)."""
    t, h, d = x.shape
    dim = 0 if mode.startswith("k") else 2
    g = codec.group_size(x.shape[dim], int(mode[2:]))
    z = x.view(t // g, g, h, d) if dim == 0 else x.view(t, h, d // g, g)
    at = 1 if dim == 0 else -1
    lo, hi = z.amin(at, keepdim=True), z.amax(at, keepdim=True)
    step = ((hi - lo) / 15).clamp_min(2.0**-14)
    bound = step / 2 * (1 + 2.0**-8) + lo.abs() * 2.0**-10 + 15 * step * 2.0**-10
    return bound.expand_as(z).reshape(t, h, d)


def _half_bound(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Largest error INT8 ``mode`` may make on ``x [T, H, D]`` (float64): half a step."""
    if mode[:2] in ("kg", "vg"):
        return _group_bound(x, mode)
    amax_t = x.abs().amax(0, keepdim=True)
    if mode == "c":
        step = amax_t / 127
    elif mode == "cc":
        hi, lo = x.amax(0, keepdim=True), x.amin(0, keepdim=True)
        step = ((hi - lo) / 2 + (hi + lo).abs() / 2 * 2.0**-10) / 127
    elif mode == "t":
        step = x.abs().amax(-1, keepdim=True) / 127
    else:  # "ct": |x / c| <= 1 per channel, so a step is at most c / 127
        step = amax_t / 127
    return (step.clamp_min(2.0**-14) / 2 * (1 + 2.0**-8)).expand_as(x)


def _assert_close_to_scheme(x: torch.Tensor, y: torch.Tensor, scheme: str) -> None:
    """Every element of ``y`` is within the scheme's quantization bound of ``x``."""
    assert y.dtype == x.dtype and y.shape == x.shape
    x64, y64 = x.double(), y.double()
    for half, mode in enumerate(MODES[scheme]):
        bound = _half_bound(x64[half], mode)
        bound = bound + (x64[half].abs() + bound) * EPS[x.dtype] * 1.01 + 1e-7
        err = (y64[half] - x64[half]).abs()
        assert bool((err <= bound).all()), f"{scheme} half {half}: max excess {(err - bound).max()}"


def _kv(t: int, h: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return realistic_kv(t, h, d, dtype, seed=seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_decodes(x: torch.Tensor, buf: object, scheme: str) -> None:
    y = decode_chunk(buf)
    if scheme == "raw":
        assert torch.equal(_bits(y), _bits(x))
    else:
        _assert_close_to_scheme(x, y, scheme)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", sorted(QUANT_SCHEMES))
@pytest.mark.parametrize("contiguous", [True, False])
def test_round_trip(dtype: torch.dtype, quant: str, contiguous: bool) -> None:
    layer = _kv(40, 3, 16, dtype, seed=1)
    t = layer[:, 8:24] if not contiguous else layer[:, 8:24].contiguous()
    assert t.is_contiguous() == contiguous
    buf = encode_chunk(t, quant=quant, key=KEY)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.device == t.device
    assert buf.numel() == chunk_nbytes(16, 3, 16, dtype, quant)
    header = read_header(buf)
    assert header.key == KEY and header.shape == (2, 16, 3, 16) and header.dtype == dtype
    assert header.scheme == QUANT_SCHEMES[quant]
    assert header.quant == ("none" if QUANT_SCHEMES[quant] == "raw" else quant[:4])
    _assert_decodes(t, buf, QUANT_SCHEMES[quant])


@pytest.mark.parametrize("scheme", INT8 + INT4)
def test_quantized_bound_on_hard_values(scheme: str) -> None:
    """Constant, zero, tiny and huge-offset channels and tokens stay within the bound."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, 2, 8, generator=g, dtype=torch.float32)
    x[:, 6] *= 3e3  # loud token (stays finite in float16)
    x[:, :, 0, 0] = 3.0  # constant channel
    x[:, :, 0, 1] = 0.0  # zero channel
    x[:, :, 0, 2] *= 1e-6  # tiny channel (below the smallest float16 normal scale)
    x[:, :, 1, 3] = 1000.0 + x[:, :, 1, 3] * 1e-3  # large offset, small spread
    x[:, 5] = 0.0  # zero token
    for dtype in DTYPES:
        xd = x.to(dtype)
        _assert_close_to_scheme(xd, decode_chunk(encode_chunk(xd, scheme)), scheme)


def test_default_and_aliases() -> None:
    assert QUANT_SCHEMES["int8"] == DEFAULT_INT8 and QUANT_SCHEMES["none"] == "raw"
    assert QUANT_SCHEMES["int4"] == codec.DEFAULT_INT4 in INT4
    # a namespace may declare every quant the codec takes but the internal name "raw"
    assert set(hashing.QUANTS) == set(QUANT_SCHEMES) - {"raw"}
    t = _kv(8, 2, 8, torch.float16)
    assert torch.equal(encode_chunk(t, "int8"), encode_chunk(t, DEFAULT_INT8))
    assert torch.equal(encode_chunk(t, "none"), encode_chunk(t, "raw"))


def test_bfloat16_raw_is_bit_exact() -> None:
    t = torch.randn(2, 8, 2, 8).to(torch.bfloat16)
    t[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    y = decode_chunk(encode_chunk(t, "none"))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), t.view(torch.int16))


def test_requires_grad_input() -> None:
    t = torch.randn(2, 8, 2, 8, requires_grad=True)
    y = decode_chunk(encode_chunk(t, "int8-kc-vt"))
    _assert_close_to_scheme(t.detach(), y, "int8-kc-vt")


# ----------------------------------------------------------------------------- pinned bytes


def _pinned_kv(dtype: torch.dtype) -> torch.Tensor:
    """Exactly representable KV (integer patterns over powers of two, an offset K channel,
    a loud V channel): its bytes depend on no random generator and no libm."""
    i = torch.arange(2 * 4 * 2 * 8, dtype=torch.float64).view(2, 4, 2, 8)
    x = ((i * 37) % 251 - 125) / 64
    x[0, :, 1, 3] += 96
    x[1, :, 0, 5] *= 8
    return x.to(dtype)


# xxh3_64 of each encoded chunk and of its decoded bytes, as the codec wrote them before
# its speed rework: a change here is a format change (bump FORMAT_VERSION), not a tweak.
PINNED = {
    ("float16", "raw", "xxh3_64"): ("38d87c8f1ab24b72", "89427181994e0232"),
    ("float16", "raw", "mulsum64"): ("b82538d514b3114b", "89427181994e0232"),
    ("float16", "int8-kc-vt", "xxh3_64"): ("0963cb1aea571f2d", "1cee376ae2dffb41"),
    ("float16", "int8-kc-vt", "mulsum64"): ("fd1b843f253d8d60", "1cee376ae2dffb41"),
    ("float16", "int8-kt-vt", "xxh3_64"): ("bff9d0d01a9acadd", "229ed3acfb77c9cf"),
    ("float16", "int8-kt-vt", "mulsum64"): ("ef606c24af8e2532", "229ed3acfb77c9cf"),
    ("float16", "int8-kcc-vt", "xxh3_64"): ("509a337276d66fc5", "20fe9973a10861d4"),
    ("float16", "int8-kcc-vt", "mulsum64"): ("c8f763a1c2bcea6c", "20fe9973a10861d4"),
    ("float16", "int8-kcc-vct", "xxh3_64"): ("3861d05ad46b62d0", "092c253cbd96bea3"),
    ("float16", "int8-kcc-vct", "mulsum64"): ("7f9bdd5bb3cd74ba", "092c253cbd96bea3"),
    ("bfloat16", "raw", "xxh3_64"): ("be493a2a8049a1c8", "ea7f5bf4e0edee64"),
    ("bfloat16", "int8-kc-vt", "xxh3_64"): ("df793281cc978a0d", "587c287828368216"),
    ("bfloat16", "int8-kt-vt", "xxh3_64"): ("9f8340b877121a03", "4aa978f7ef237777"),
    ("bfloat16", "int8-kcc-vt", "xxh3_64"): ("90da2af9cca57be3", "d2dd3c0c623c2573"),
    ("bfloat16", "int8-kcc-vct", "xxh3_64"): ("c6705afdf5b1f622", "f0ed9cca1f43f952"),
    ("float32", "raw", "xxh3_64"): ("1a013ab5c21f7f1b", "3f141321bfd9a59f"),
    ("float32", "int8-kc-vt", "xxh3_64"): ("7d33effa4f2255f0", "71c4530f486df666"),
    ("float32", "int8-kt-vt", "xxh3_64"): ("31baff2e919ab818", "8ab01a5556f247a6"),
    ("float32", "int8-kcc-vt", "xxh3_64"): ("a1062c16ed3eb989", "f39d8e58d20ca907"),
    ("float32", "int8-kcc-vct", "xxh3_64"): ("24c64f50093724e7", "bd8822d636fe198f"),
    ("float16", "int4-g32", "xxh3_64"): ("642297c0f76e8987", "eb7fa59ea8804cc5"),
    ("float16", "int4-g32", "mulsum64"): ("57cbdf9136f10f29", "eb7fa59ea8804cc5"),
    ("bfloat16", "int4-g32", "xxh3_64"): ("f9e80d280a25c3dc", "d140e0a5f6b61918"),
    ("float32", "int4-g32", "xxh3_64"): ("ea501cbc26f3a3ad", "07f5f5c1e17b3fca"),
    ("float16", "int4-g128", "xxh3_64"): ("5405ba13e3ad50a8", "eb7fa59ea8804cc5"),
}


@pytest.mark.parametrize(("dtype", "scheme", "kind"), sorted(PINNED))
def test_chunk_bytes_are_pinned(dtype: str, scheme: str, kind: str) -> None:
    buf = encode_chunk(_pinned_kv(getattr(torch, dtype)), scheme, KEY, checksum=kind)
    decoded = decode_chunk(buf).contiguous().view(torch.uint8)
    digests = (xxhash.xxh3_64_hexdigest(buf.numpy()), xxhash.xxh3_64_hexdigest(decoded.numpy()))
    assert digests == PINNED[(dtype, scheme, kind)]


@pytest.mark.parametrize("scheme", INT4)
@pytest.mark.parametrize("shape", [(16, 2, 8), (48, 3, 80), (6, 1, 2)])
def test_int4_bytes_follow_the_documented_layout(scheme: str, shape: tuple[int, int, int]) -> None:
    """Decode an INT4 chunk by hand from the layout the codec's docstring gives — K's
    ``lo[T/gk, H, D]`` and ``step``, then V's ``lo[T, H, D/gv]`` and ``step``, float16, at 64;
    codes two to a byte along D, the even channel low — and get decode_chunk's values."""
    t, h, d = shape
    x = _kv(t, h, d, torch.float32, seed=2) if d >= 8 else torch.randn(2, t, h, d)
    buf = encode_chunk(x, scheme, KEY).numpy()
    g = int(scheme.split("-g")[1])
    gk, gv = codec.group_size(t, g), codec.group_size(d, g)
    n_k, n_v = (t // gk) * h * d, t * h * (d // gv)
    scales = np.frombuffer(buf[64 : 64 + 2 * (2 * n_k + 2 * n_v)], np.float16).astype(np.float64)
    k_lo = scales[:n_k].reshape(t // gk, 1, h, d)
    k_step = scales[n_k : 2 * n_k].reshape(t // gk, 1, h, d)
    v_lo = scales[2 * n_k : 2 * n_k + n_v].reshape(t, h, d // gv, 1)
    v_step = scales[2 * n_k + n_v :].reshape(t, h, d // gv, 1)
    start = 64 + -(-2 * (2 * n_k + 2 * n_v) // 64) * 64
    packed = buf[start : start + t * h * d].reshape(2, t, h, d // 2)
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(2, t, h, d).astype(np.float64)
    k = (k_lo + codes[0].reshape(t // gk, gk, h, d) * k_step).reshape(t, h, d)
    v = (v_lo + codes[1].reshape(t, h, d // gv, gv) * v_step).reshape(t, h, d)
    got = decode_chunk(buf).double().numpy()
    assert np.array_equal(got, np.stack([k, v]).astype(np.float32))
    assert codes.max() <= 15


# ----------------------------------------------------------------------------- out= paths


@pytest.mark.parametrize("quant", ["int8", "int4", "none"])
def test_encode_into_slot_view(quant: str) -> None:
    t = _kv(48, 2, 16, torch.bfloat16)[:, 16:32]
    n = chunk_nbytes(16, 2, 16, torch.bfloat16, quant)
    arena = torch.full((n + 256,), 0xA5, dtype=torch.uint8)
    slot = arena[128 : 128 + n]
    before = copy_stats()
    got = encode_chunk(t, quant, KEY, out=slot)
    after = copy_stats()
    assert got.data_ptr() == slot.data_ptr() and got.numel() == n
    assert bool((arena[:128] == 0xA5).all()) and bool((arena[128 + n :] == 0xA5).all())
    assert torch.equal(got, encode_chunk(t, quant, KEY))  # dirty slot: padding was zeroed
    assert after.extra_copies == before.extra_copies
    assert after.encoded_bytes - before.encoded_bytes == n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", ["int8", "int8-kc-vt", "int4", "none"])
def test_decode_into_layer_slice_and_paged_blocks(dtype: torch.dtype, quant: str) -> None:
    t = _kv(16, 2, 8, dtype, seed=5)
    buf = encode_chunk(t, quant, KEY)
    expect = decode_chunk(buf)
    layer = torch.full((2, 64, 2, 8), 7.0, dtype=dtype)
    before = copy_stats()
    got = decode_chunk(buf, out=layer[:, 16:32], expect_key=KEY)
    assert copy_stats().extra_copies == before.extra_copies
    assert got.data_ptr() == layer[:, 16:32].data_ptr()
    assert torch.equal(layer[:, 16:32], expect)
    assert bool((layer[:, :16] == 7).all()) and bool((layer[:, 32:] == 7).all())
    blocks_first = torch.zeros(4, 2, 16, 2, 8, dtype=dtype)  # [num_blocks, 2, bs, H, D]
    decode_chunk(buf, out=blocks_first[2])
    assert torch.equal(blocks_first[2], expect) and not blocks_first[[0, 1, 3]].any()
    kv_first = torch.zeros(2, 4, 16, 2, 8, dtype=dtype)  # [2, num_blocks, bs, H, D]
    decode_chunk(buf, out=kv_first[:, 1])
    assert torch.equal(kv_first[:, 1], expect) and not kv_first[:, [0, 2, 3]].any()


def test_decode_out_and_device_checks() -> None:
    buf = encode_chunk(_kv(8, 2, 8, torch.float16), "int8")
    with pytest.raises(BadShape):
        decode_chunk(buf, out=torch.empty(2, 8, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(BadShape):
        decode_chunk(buf, out=torch.empty(2, 8, 2, 4, dtype=torch.float16))
    with pytest.raises(InvalidArgument):
        decode_chunk(buf, out=np.zeros((2, 8, 2, 8), np.float16))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        decode_chunk(buf, device="meta", out=torch.empty(2, 8, 2, 8, dtype=torch.float16))
    assert decode_chunk(buf, device="cpu").device.type == "cpu"
    with pytest.raises(InvalidArgument):
        decode_chunk(buf, device="no-such-device")


# ----------------------------------------------------------------------------- batched encode


@pytest.mark.parametrize("quant", ["int8", "int8-kt-vt", "int4", "int4-g128", "none"])
def test_encode_blocks_matches_per_chunk(quant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    b, n = 16, 3
    layer = _kv(n * b + 5, 2, 8, torch.float16, seed=9)  # a partial tail is ignored
    keys = [ChunkKey(bytes([i]) * 16, 4, 0) for i in range(n)]
    singles = [encode_chunk(layer[:, i * b : (i + 1) * b], quant, keys[i]) for i in range(n)]
    chunks = encode_blocks(layer, b, keys, quant)
    assert all(torch.equal(c, s) for c, s in zip(chunks, singles, strict=True))
    monkeypatch.setattr(kernels, "TILE_BYTES", 1)  # one block and one head per tile
    assert all(
        torch.equal(c, s)
        for c, s in zip(encode_blocks(layer, b, keys, quant), singles, strict=True)
    )
    nbytes = singles[0].numel()
    arena = torch.zeros(n, nbytes + 64, dtype=torch.uint8)  # strided rows
    rows = encode_blocks(layer, b, keys, quant, out=arena[:, :nbytes])
    assert all(r.data_ptr() == arena[i].data_ptr() for i, r in enumerate(rows))
    assert all(torch.equal(r, s) for r, s in zip(rows, singles, strict=True))
    assert not arena[:, nbytes:].any()
    slots = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]
    listed = encode_blocks(layer, b, keys, quant, out=slots)
    assert all(torch.equal(x, s) for x, s in zip(listed, singles, strict=True))
    for i in range(n):
        _assert_decodes(layer[:, i * b : (i + 1) * b], rows[i], QUANT_SCHEMES[quant])


@pytest.mark.parametrize(
    ("quant", "fused_path"),
    [("int8", False), ("int8-kc-vt", False), ("none", False), ("int8", True)],
)
def test_k_and_v_apart_encode_and_decode_like_one_tensor(
    quant: str, fused_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines keep K and V in separate tensors: a (K, V) pair is encoded byte for byte like
    the stacked ``[2, T, H, D]`` layer, with no stack, and decodes into a pair in place."""
    if fused_path:
        monkeypatch.setattr(fused, "_wanted", lambda device: True)
    b, n = 16, 3
    stacked = _kv(n * b + 3, 2, 8, torch.bfloat16, seed=4)
    k = stacked[0].clone().transpose(0, 1).contiguous().transpose(0, 1)  # strided: [T, H, D]
    v = stacked[1].clone()
    keys = [ChunkKey(bytes([i + 1]) * 16, 2, 0) for i in range(n)]
    want = encode_blocks(stacked, b, keys, quant)
    got = encode_blocks((k, v), b, keys, quant)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    one = encode_chunk((k[:b], v[:b]), quant, keys[0])
    assert torch.equal(one, want[0])
    slots = [torch.empty_like(w) for w in want]
    listed = encode_blocks([k, v], b, keys, quant, out=slots)
    assert all(torch.equal(x, w) for x, w in zip(listed, want, strict=True))
    ko, vo = torch.full_like(k, 7.0), torch.full_like(v, 7.0)
    for i in range(n):
        pair = (ko[i * b : (i + 1) * b], vo[i * b : (i + 1) * b])
        back = decode_chunk(want[i], out=pair, expect_key=keys[i])
        assert back[0].data_ptr() == pair[0].data_ptr()
        ref = decode_chunk(want[i])
        assert torch.equal(ko[i * b : (i + 1) * b], ref[0])
        assert torch.equal(vo[i * b : (i + 1) * b], ref[1])
    assert bool((ko[n * b :] == 7).all()) and bool((vo[n * b :] == 7).all())  # tail untouched


def test_k_and_v_pairs_are_checked() -> None:
    k = torch.zeros(16, 2, 8, dtype=torch.float16)
    for bad in [(k, k[:, :1]), (k, k.float()), (k, k.unsqueeze(0)), (k[0], k[0])]:
        with pytest.raises(BadShape):
            encode_chunk(bad)
    for bad in [(k,), (k, k, k), (k, "v"), [1, 2]]:
        with pytest.raises(InvalidArgument):
            encode_chunk(bad)  # type: ignore[arg-type]
    buf = encode_chunk((k, k))
    with pytest.raises(BadShape, match="chunk is"):
        decode_chunk(buf, out=(k[:8], k[:8]))
    with pytest.raises(BadShape):
        decode_chunk(buf, out=(k.float(), k.float()))
    with pytest.raises(InvalidArgument):
        decode_chunk(buf, out=[1, 2])  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("budget", "tile"),
    [(512, (1, 1)), (1024, (1, 2)), (3072, (2, 3)), (1 << 30, (3, 3))],  # bytes -> (blocks, heads)
)
@pytest.mark.parametrize("quant", ["int8", "int8-kt-vt", "int8-kc-vt", "int4"])
def test_every_tiling_gives_the_same_bytes(
    budget: int, tile: tuple[int, int], quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiles cut along H (with a remainder head) or grouping blocks (with a remainder)."""
    layer = _kv(3 * 16 + 5, 3, 8, torch.bfloat16, seed=4)  # a float32 head of 16 tokens: 512 B
    keys = [ChunkKey(bytes([i]) * 16, 2, 0) for i in range(3)]
    blocks = [layer[:, i * 16 : (i + 1) * 16] for i in range(3)]
    kinds = ("xxh3_64", "mulsum64")
    expect = {k: [encode_chunk(b, quant, keys[i], checksum=k) for i, b in enumerate(blocks)]
              for k in kinds}  # fmt: skip
    monkeypatch.setattr(kernels, "TILE_BYTES", budget // torch.get_num_threads())
    if budget % torch.get_num_threads() == 0:
        assert kernels.tile_shape(3, 16, 3, 8, layer.device) == tile
    for k in kinds:
        rows = encode_blocks(layer, 16, keys, quant, checksum=k)
        assert all(torch.equal(r, e) for r, e in zip(rows, expect[k], strict=True))
        singles = [encode_chunk(b, quant, keys[i], checksum=k) for i, b in enumerate(blocks)]
        assert all(torch.equal(c, e) for c, e in zip(singles, expect[k], strict=True))


def test_threads_keep_their_own_bounded_scratch() -> None:
    layers = [_kv(64, 2, 16, torch.float16, seed=s) for s in range(4)]
    keys = [ChunkKey(bytes([i]) * 16, 0, 0) for i in range(4)]
    expect = [torch.stack(encode_blocks(layer, 16, keys)) for layer in layers]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda layer: torch.stack(encode_blocks(layer, 16, keys)), layers))
            assert all(torch.equal(g, e) for g, e in zip(got, expect, strict=True))
    fused.set_mode("eager")  # the eager path's scratch (kvstore.core.fused keeps its own)
    try:
        for t in range(1, 2 * kernels._SCRATCH_SHAPES + 2):  # more shapes than a thread keeps
            decode_chunk(encode_chunk(_kv(t, 2, 8, torch.float16)))
    finally:
        fused.set_mode(None)
    assert 0 < len(kernels._scratch_local.kept) <= kernels._SCRATCH_SHAPES


def test_encode_blocks_rejects_bad_arguments() -> None:
    layer = _kv(40, 2, 8, torch.float16)
    with pytest.raises(BadShape):
        encode_blocks(layer, 16, [KEY, KEY, KEY])
    with pytest.raises(InvalidArgument):
        encode_blocks(layer, 0, [KEY])
    with pytest.raises(InvalidArgument):
        encode_blocks(layer, 16, [])
    with pytest.raises(InvalidArgument):
        encode_blocks(layer, 16, [KEY, KEY], out=torch.empty(2, 10, dtype=torch.uint8))
    with pytest.raises(InvalidArgument):
        encode_blocks(layer, 16, [KEY, KEY], out=[torch.empty(10, dtype=torch.uint8)])


# ----------------------------------------------------------------------------- sizes, accuracy


def test_chunk_nbytes_is_exact_and_within_bound() -> None:
    fp16 = 2 * 256 * 8 * 128 * 2
    for scheme in INT8:
        assert chunk_nbytes(256, 8, 128, torch.float16, scheme) <= 0.52 * fp16
    assert chunk_nbytes(256, 8, 128, "bf16", "none") == fp16 + HEADER_NBYTES + 8
    for dtype in DTYPES:
        for quant in QUANT_SCHEMES:
            for shape in [(1, 1, 1), (3, 5, 7), (17, 2, 64)]:
                t = torch.zeros(2, *shape, dtype=dtype)
                if quant.startswith("int4") and shape[2] % 2:  # two channels to a byte
                    with pytest.raises(BadShape, match="even"):
                        chunk_nbytes(*shape, dtype, quant)
                    with pytest.raises(BadShape, match="even"):
                        encode_chunk(t, quant)
                    continue
                assert encode_chunk(t, quant).numel() == chunk_nbytes(*shape, dtype, quant)
                assert chunk_nbytes(*shape, dtype, quant) % 8 == 0
    with pytest.raises(BadShape):
        chunk_nbytes(0, 8, 128, torch.float16)
    with pytest.raises(InvalidArgument):
        chunk_nbytes(256, 8, 128, torch.int8)
    with pytest.raises(InvalidArgument):
        chunk_nbytes(256, 8, 128, torch.float16, "int3")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_default_int8_attention_accuracy(dtype: torch.dtype) -> None:
    rows = compare_schemes(dtype=dtype, chunks=3, queries=64, schemes=("int8-kc-vt", "int8"))
    plain, default = rows
    assert default.median_rel_err <= 0.015
    assert default.median_rel_err <= plain.median_rel_err
    assert default.mean_cosine >= 0.9999 and default.size_ratio <= 0.52


def test_int4_size_and_attention_accuracy() -> None:
    """INT4 is about a third of fp16 bytes at groups of 32 and a quarter at 128, its
    attention error ~12x INT8's (docs/codec.md), and smaller groups are more accurate."""
    rows = compare_schemes(chunks=3, queries=64, schemes=("int8", "int4-g32", "int4-g128"))
    int8, g32, g128 = rows
    assert g32.size_ratio <= 0.32 and g128.size_ratio <= 0.27
    assert int8.median_rel_err < g32.median_rel_err < g128.median_rel_err <= 0.2
    assert g32.median_rel_err <= 0.14 and g32.mean_cosine >= 0.99


def test_attention_error_of_identical_kv_is_zero() -> None:
    kv = _kv(32, 2, 16, torch.float32)
    rel, cos = attention_error(kv, kv.clone(), torch.randn(5, 2, 16))
    assert rel.shape == (10,) and float(rel.max()) == 0.0 and float(cos.min()) > 0.999999


def test_realistic_kv_shape_determinism_and_structure() -> None:
    a = realistic_kv(256, 4, 64, torch.bfloat16, seed=11)
    assert a.shape == (2, 256, 4, 64) and a.dtype == torch.bfloat16
    assert torch.equal(
        a.view(torch.int16), realistic_kv(256, 4, 64, torch.bfloat16, 11).view(torch.int16)
    )
    assert not torch.equal(a, realistic_kv(256, 4, 64, torch.bfloat16, seed=12))
    k, v = a[0].float(), a[1].float()
    channel = k.abs().mean(0)  # [H, D]
    assert bool((channel.amax(-1) >= 10 * channel.median(-1).values).all())  # outliers per head
    kurt = ((v - v.mean()) ** 4).mean() / v.var() ** 2
    assert 2.5 < float(kurt) < 6.0  # V near Gaussian (3)
    with pytest.raises(InvalidArgument):
        realistic_kv(0, 4, 64)


# ----------------------------------------------------------------------------- buffer kinds


def test_decode_from_every_buffer_kind() -> None:
    t = _kv(16, 2, 8, torch.bfloat16)
    buf = encode_chunk(t, "int8", KEY)
    expect = decode_chunk(buf)
    arr = buf.numpy()
    ro = arr.copy()
    ro.flags.writeable = False
    kinds = [buf, buf.view(torch.int8), arr, ro, arr.tobytes(), bytearray(arr.tobytes())]
    kinds.append(memoryview(arr.tobytes()))
    for kind in kinds:
        assert torch.equal(decode_chunk(kind, expect_key=KEY), expect)
        assert verify_chunk(kind, expect_key=KEY) == read_header(kind)
    backing = bytearray(arr.nbytes + 1)
    backing[1:] = arr.tobytes()
    before = copy_stats()
    assert torch.equal(decode_chunk(memoryview(backing)[1:]), expect)  # misaligned: staged
    assert copy_stats().extra_copies == before.extra_copies + 1
    strided = np.zeros(arr.nbytes * 2, np.uint8)
    strided[::2] = arr
    assert torch.equal(decode_chunk(strided[::2]), expect)


@pytest.mark.parametrize("bad", [1234, "chunk", torch.zeros(4, 4, dtype=torch.uint8),
                                 torch.zeros(16), np.zeros(16, np.float32)])  # fmt: skip
def test_decode_rejects_non_buffers(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        decode_chunk(bad)


# ----------------------------------------------------------------------------- encode input


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(2, 4, 8),
        torch.zeros(3, 4, 2, 8),
        torch.zeros(1, 4, 2, 8),
        torch.zeros(2, 0, 2, 8),
        torch.zeros(2, 4, 2, 8, dtype=torch.float64),
        torch.zeros(2, 4, 2, 8, dtype=torch.int8),
    ],
)
def test_encode_rejects_bad_tensors(bad: torch.Tensor) -> None:
    with pytest.raises(BadShape):
        encode_chunk(bad)


def test_encode_rejects_bad_arguments() -> None:
    t = torch.zeros(2, 4, 2, 8)
    n = chunk_nbytes(4, 2, 8, torch.float32, "int8")
    with pytest.raises(InvalidArgument):
        encode_chunk(np.zeros((2, 4, 2, 8)))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        encode_chunk(t, quant="fp8")
    with pytest.raises(InvalidArgument):
        encode_chunk(t, checksum="crc32")
    for key in [ChunkKey(b"short", 0, 0), ChunkKey(bytes(16), -1, 0), ChunkKey(bytes(16), 0, 2**32),
                ChunkKey(bytes(16), True, 0), ChunkKey(bytes(16), 0, -1), ChunkKey("x" * 16, 0, 0),
                (bytes(16), True, 0), (bytes(16), 0), bytes(16), "key"]:  # fmt: skip
        with pytest.raises(InvalidArgument):
            encode_chunk(t, key=key)  # type: ignore[arg-type]
    raw = torch.empty(2 * n + 8, dtype=torch.uint8)
    for out in [raw[: n - 1], raw[:n].view(torch.int8), raw[1 : n + 1], raw[: 2 * n : 2]]:
        with pytest.raises(InvalidArgument):
            encode_chunk(t, out=out)
    assert read_header(encode_chunk(t, key=None)).key == ChunkKey(bytes(16), 0, 0)
    assert read_header(encode_chunk(t, key=b"")).key == ChunkKey(bytes(16), 0, 0)


@pytest.mark.parametrize("scheme", INT8 + INT4)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_quantized_rejects_non_finite_and_out_of_range(scheme: str, value: float) -> None:
    t = torch.randn(2, 8, 2, 8)
    t[1, 3, 1, 5] = value
    with pytest.raises(InvalidArgument):
        encode_chunk(t, scheme)
    t[1, 3, 1, 5] = 0.0
    t[0, 2, 0, 1] = value
    with pytest.raises(InvalidArgument):
        encode_chunk(t, scheme)


# ----------------------------------------------------------------------------- keys, checksums


def test_key_mismatch() -> None:
    buf = encode_chunk(torch.randn(2, 4, 1, 8), "int8", KEY)
    assert verify_chunk(buf, expect_key=KEY).key == KEY
    for other in [KEY._replace(layer=8), KEY._replace(shard=0), KEY._replace(block_hash=bytes(16))]:
        with pytest.raises(ChunkKeyMismatch, match="expected"):
            decode_chunk(buf, expect_key=other)
        with pytest.raises(ChunkKeyMismatch):
            verify_chunk(buf, expect_key=other)


def _ref_mulsum64(data: bytes) -> int:
    """The documented device checksum, in plain Python (a CUDA build must match it)."""
    mask, total = 2**64 - 1, 0
    for i in range(len(data) // 8):
        z = (i + 1) * 0x9E3779B97F4A7C15 & mask
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        z ^= z >> 31
        total = (total + int.from_bytes(data[8 * i : 8 * i + 8], "little") * (z | 1)) & mask
    return total


@pytest.mark.parametrize("quant", ["int8", "none"])
def test_device_checksum_kind_on_cpu(quant: str) -> None:
    t = _kv(16, 2, 8, torch.float16)
    buf = encode_chunk(t, quant, KEY, checksum="mulsum64")
    header = verify_chunk(buf)
    assert header.checksum == "mulsum64"
    body, stored = buf[:-8].numpy().tobytes(), buf[-8:].numpy().tobytes()
    assert int.from_bytes(stored, "little") == _ref_mulsum64(body)
    assert torch.equal(decode_chunk(buf), decode_chunk(encode_chunk(t, quant, KEY)))
    plain = encode_chunk(t, quant, KEY)
    assert read_header(plain).checksum == "xxh3_64"
    assert int.from_bytes(plain[-8:].numpy().tobytes(), "little") == xxhash.xxh3_64_intdigest(
        plain[:-8].numpy().tobytes()
    )
    keys = [KEY, KEY._replace(layer=1)]
    layer = _kv(32, 2, 8, torch.float16)
    rows = encode_blocks(layer, 16, keys, quant, checksum="mulsum64")
    # The CPU kernel (mv) and the one other devices run (mul + sum) agree bit for bit.
    covered = torch.stack(rows)[:, :-8]
    assert torch.equal(checksum.mulsum64(covered), checksum.mulsum64(covered, generic=True))
    for i, row in enumerate(rows):
        assert torch.equal(row, encode_chunk(layer[:, i * 16 : (i + 1) * 16], quant, keys[i],
                                             checksum="mulsum64"))  # fmt: skip


def test_scale_check_and_checksum_writers_agree_on_every_path() -> None:
    """The host (numpy) and device (torch) paths of the NaN/inf check and of xxh3."""
    layout = codec._layout(8, 2, 8, torch.float32, SCHEMES[DEFAULT_INT8])
    rows = encode_chunk(torch.randn(2, 8, 2, 8), "int8").view(1, -1)
    for host in (None, rows.numpy()):
        codec._require_finite(rows, host, layout)
    for value in (float("inf"), -float("inf"), float("nan"), -float("nan")):
        bad = rows.clone()
        bad.view(torch.float16)[0, HEADER_NBYTES // 2 + 5] = value  # one stored scale
        for host in (None, bad.numpy()):
            with pytest.raises(InvalidArgument):
                codec._require_finite(bad, host, layout)
    for value in (65504.0, -65504.0, -0.0, 2.0**-24):  # float16's largest and smallest
        edge = rows.clone()
        edge.view(torch.float16)[0, HEADER_NBYTES // 2 + 5] = value
        for host in (None, edge.numpy()):
            codec._require_finite(edge, host, layout)
    copies: list[int] = []
    again = rows.clone()
    again[:, -8:] = 0
    checksum.write_checksums(again, layout.checksum_offset, "xxh3_64", copies.append)
    assert torch.equal(again, rows) and not copies  # a CPU row is hashed in place


# ----------------------------------------------------------------------------- malformed input


def _small_chunk(quant: str = "int8", checksum: str | None = None) -> bytes:
    t = torch.randn(2, 2, 1, 4, generator=torch.Generator().manual_seed(0))
    return encode_chunk(t, quant, KEY, checksum=checksum).numpy().tobytes()


def _patch(buf: bytes, offset: int, fmt: str, value: int, fix_check: bool = True) -> bytes:
    b = bytearray(buf)
    struct.pack_into(fmt, b, offset, value)
    if fix_check:
        struct.pack_into("<I", b, 60, xxhash.xxh3_64_intdigest(bytes(b[:60])) & 0xFFFFFFFF)
    return bytes(b)


@pytest.mark.parametrize("quant", ["int8", "int4", "none"])
def test_every_truncation_and_extension(quant: str) -> None:
    buf = _small_chunk(quant)
    for n in range(len(buf)):
        with pytest.raises(ChunkFormatError):
            decode_chunk(buf[:n])
        with pytest.raises(ChunkFormatError):
            read_header(np.frombuffer(buf[:n], np.uint8))
    with pytest.raises(ChunkFormatError, match="too long"):
        decode_chunk(buf + b"\0")


@pytest.mark.parametrize("checksum", ["xxh3_64", "mulsum64"])
@pytest.mark.parametrize("quant", ["int8", "int4", "none"])
def test_every_single_bit_flip_is_caught(quant: str, checksum: str) -> None:
    buf = _small_chunk(quant, checksum)
    for i in range(len(buf) * 8):
        b = bytearray(buf)
        b[i // 8] ^= 1 << (i % 8)
        with pytest.raises(ChunkError):
            decode_chunk(bytes(b))


@pytest.mark.parametrize("scheme", INT4)
def test_an_int4_header_with_an_odd_head_dim_is_refused(scheme: str) -> None:
    """INT4 packs two channels to a byte: a chunk whose sizes, header check and checksum
    are all consistent with D=7 is a malformed chunk, not a crash in the decoder."""
    layout = codec._layout(4, 2, 7, torch.float16, SCHEMES[scheme])
    buf = np.zeros(layout.nbytes, np.uint8)
    buf[:HEADER_NBYTES] = np.frombuffer(codec._pack_header(KEY, layout, 1), np.uint8)
    end = layout.checksum_offset
    buf[end:] = np.frombuffer(struct.pack("<Q", xxhash.xxh3_64_intdigest(buf[:end].data)), np.uint8)
    for call in (read_header, verify_chunk, decode_chunk):
        with pytest.raises(ChunkFormatError, match="D=7"):
            call(buf)


def test_int4_holds_offset_float32_groups_and_never_overflows_float16() -> None:
    """The INT4 group's ``lo`` and step are rounded toward -inf: a float32 channel at 1000.3
    with a spread of 3e-3 (its nearest float16 is 1000.5, above every value) decodes
    within its bound, and float16 groups spanning 0..65504 decode to finite values."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 32, 2, 8, generator=g)
    x[0, :, 1, 3] = 1000.3 + 3e-3 * torch.rand(32, generator=g)  # a K channel: one group
    x[1, 5, 0, :] = 1000.3 + 3e-3 * torch.rand(8, generator=g)  # a V token's group
    for scheme in INT4:
        y = decode_chunk(encode_chunk(x, scheme))
        _assert_close_to_scheme(x, y, scheme)
        # lo rounds down to 1000.0: at most half a step of (1000.303 - 1000) / 15; the
        # float16 nearest to 1000.3, 1000.5, lies above every value and decoded the whole
        # group 0.2 off
        assert float((y - x)[0, :, 1, 3].abs().max()) < 0.011
        assert float((y - x)[1, 5, 0, :].abs().max()) < 0.011
        edge = torch.zeros(2, 16, 1, 8, dtype=torch.float16)
        edge[:, ::2] = 65504.0
        out = decode_chunk(encode_chunk(edge, scheme))
        assert bool(torch.isfinite(out).all())
        _assert_close_to_scheme(edge, out, scheme)


def test_wrong_magic_version_and_inconsistent_headers() -> None:
    buf = _small_chunk()
    with pytest.raises(ChunkFormatError, match="magic"):
        decode_chunk(b"XXXX" + buf[4:])
    for fix in (True, False):
        with pytest.raises(ChunkVersionError):
            read_header(_patch(buf, 4, "<H", 2, fix))
    with pytest.raises(ChunkFormatError):
        read_header(_patch(buf, 6, "<H", 128))  # header size
    cases = [(32, "<I", 3), (36, "<I", 2), (32, "<I", 0), (44, "<B", 9), (45, "<B", 99),
             (46, "<B", 7), (47, "<B", 1), (48, "<Q", 17), (56, "<I", 0)]  # fmt: skip
    for offset, fmt, value in cases:
        with pytest.raises(ChunkFormatError):
            read_header(_patch(buf, offset, fmt, value))
    with pytest.raises(ChunkFormatError):  # a raw chunk's header on an int8-sized buffer
        read_header(_patch(buf, 45, "<B", SCHEMES["raw"]))
    with pytest.raises(ChecksumError):  # header edited without fixing the header check
        read_header(_patch(buf, 24, "<I", 8, fix_check=False))
    with pytest.raises(ChecksumError):  # a consistent header, but the chunk checksum fails
        verify_chunk(_patch(buf, 24, "<I", 8))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_random_garbage_never_decodes(data: bytes) -> None:
    with pytest.raises(ChunkError):
        decode_chunk(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=400))
def test_garbage_behind_a_valid_header_never_decodes(tail: bytes) -> None:
    buf = _small_chunk()
    with pytest.raises(ChunkError):
        decode_chunk(buf[:HEADER_NBYTES] + tail)


def _streamed(
    buf: bytes,
    cuts: list[int],
    expect_key: ChunkKey = KEY,
    learnt: bytes | None = None,
    spec: ChunkSpec = ChunkSpec(64, 4, 32, torch.float16, "none"),
) -> object:
    """verify a chunk as a node's tcp:// receive does (StreamedChunk), as if its bytes
    arrived in pieces ending at ``cuts`` into a zeroed slot, by header checks that passed
    ``learnt`` (an honest chunk of the same form) first or none: None if it passes, else
    the error's type."""
    from kvstore.node.checks import StreamedChunk

    checks = HeaderChecks(spec)
    if learnt is not None:
        checks.verify_host(np.frombuffer(learnt, np.uint8), KEY)
    slot = np.zeros(len(buf), np.uint8)
    stream = StreamedChunk(slot, expect_key)
    for upto in [*cuts, len(buf)]:
        slot[:upto] = np.frombuffer(buf[:upto], np.uint8)
        stream.advance(upto)
    try:
        stream.verify(checks)
    except ChunkError as exc:
        return type(exc)
    return None


def _whole(buf: bytes, expect_key: ChunkKey | None = KEY, spec: ChunkSpec | None = None) -> object:
    try:
        verify_chunk(buf, expect_key=expect_key, expect_spec=spec)
    except ChunkError as exc:
        return type(exc)
    return None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_chunk_checked_in_pieces_agrees_with_verify_chunk(data: st.DataObject) -> None:
    """Whatever the pieces, the damage and what the node's checks learnt before, a node's
    streamed check (tcp:// puts) says what one pass of verify_chunk says."""
    quant = data.draw(st.sampled_from(sorted(QUANT_SCHEMES)))
    kind = data.draw(st.sampled_from(["xxh3_64", "mulsum64"]))
    kv = _kv(16, 2, 8, torch.bfloat16)
    honest = encode_chunk(kv, quant, KEY, checksum=kind).numpy().tobytes()
    buf = bytearray(honest)
    for bit in data.draw(st.lists(st.integers(0, len(buf) * 8 - 1), max_size=2, unique=True)):
        buf[bit // 8] ^= 1 << (bit % 8)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(buf)), max_size=6)))
    key = data.draw(st.sampled_from([KEY, KEY._replace(layer=3)]))  # (a node knows it)
    learnt = data.draw(st.sampled_from([None, honest]))
    spec = ChunkSpec(16, 2, 8, torch.bfloat16, quant)
    assert _streamed(bytes(buf), cuts, key, learnt, spec) == _whole(bytes(buf), key, spec)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_verify_host_bytes_agrees_with_verify_chunk(data: st.DataObject) -> None:
    """The numpy-bytes check of small received chunks says what verify_chunk says, for
    every scheme, checksum kind, damage, expected key and spec."""
    quant = data.draw(st.sampled_from(sorted(QUANT_SCHEMES)))
    kind = data.draw(st.sampled_from(["xxh3_64", "mulsum64"]))
    buf = bytearray(encode_chunk(_kv(16, 2, 8, torch.bfloat16), quant, KEY, checksum=kind).numpy())
    for bit in data.draw(st.lists(st.integers(0, len(buf) * 8 - 1), max_size=2, unique=True)):
        buf[bit // 8] ^= 1 << (bit % 8)
    key = data.draw(st.sampled_from([KEY, KEY._replace(layer=3), None]))
    spec = data.draw(st.sampled_from([None, ChunkSpec(16, 2, 8, torch.bfloat16, "int8"),
                                      ChunkSpec(16, 2, 8, torch.float16, "none")]))  # fmt: skip

    def outcome(check: Any) -> object:
        try:
            return check(np.frombuffer(bytes(buf), np.uint8), key, spec)
        except ChunkError as exc:
            return type(exc)

    assert outcome(verify_host_bytes) == outcome(verify_chunk)


def test_a_chunk_checked_in_pieces_catches_damage_in_every_piece_and_reads_it_once() -> None:
    """A node's streamed check of a tcp:// chunk: damage in any piece is refused as one
    pass refuses it; once its form is known the payload is judged by the bytes as they
    arrived (hashed piece by piece, not read again); a chunk not advanced over to its end
    is hashed again, never judged by half its bytes."""
    from kvstore.node.checks import StreamedChunk

    buf = encode_chunk(_kv(64, 4, 32, torch.float16), "none", KEY).numpy().tobytes()
    step = len(buf) // 5
    cuts = list(range(step, len(buf), step))
    for learnt in (None, buf):
        assert _streamed(buf, cuts, learnt=learnt) is None
        for at in [5, 70, *(c + 3 for c in cuts[:-1]), len(buf) - 9, len(buf) - 1]:
            bad = bytearray(buf)
            bad[at] ^= 0x10
            caught = _streamed(bytes(bad), cuts, learnt=learnt)
            assert caught == _whole(bytes(bad)) and issubclass(caught, ChunkError), at  # type: ignore[arg-type]
    checks = HeaderChecks(ChunkSpec(64, 4, 32, torch.float16, "none"))
    checks.verify_host(np.frombuffer(buf, np.uint8), KEY)  # (the form is known)
    slot = np.frombuffer(bytearray(buf), np.uint8)
    stream = StreamedChunk(slot, KEY)
    stream.advance(len(buf))
    slot[HEADER_NBYTES + 100] ^= 1  # (after it arrived: left to the reader's own check)
    stream.verify(checks)
    with pytest.raises(ChecksumError):
        verify_chunk(slot)
    half = StreamedChunk(np.frombuffer(buf, np.uint8), KEY)
    half.advance(len(buf) // 2)
    half.verify(checks)  # (an honest chunk: hashed again, whole, and passed)
    with pytest.raises(ChunkFormatError):
        StreamedChunk(np.zeros(10, np.uint8), KEY).verify(checks)


def _same_bit_in_two_words(flips: list[int]) -> bool:
    positions = [bit % 64 for bit in flips]  # bit position inside its little-endian word
    return len(set(positions)) < len(positions)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_bit_flips_in_larger_chunks(data: st.DataObject) -> None:
    quant = data.draw(st.sampled_from(sorted(QUANT_SCHEMES)))
    kind = data.draw(st.sampled_from(["xxh3_64", "mulsum64"]))
    buf = bytearray(encode_chunk(_kv(16, 2, 8, torch.bfloat16), quant, KEY, checksum=kind).numpy())
    flips = data.draw(
        st.lists(st.integers(0, len(buf) * 8 - 1), min_size=1, max_size=3, unique=True)
    )
    # mulsum64 guarantees one-bit errors; flips at one bit position k of two different
    # words change the sum by 2**k·(±m_i ± m_j), which can vanish mod 2**64 (see below).
    assume(kind == "xxh3_64" or not _same_bit_in_two_words(flips))
    for bit in flips:
        buf[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ChunkError):
        decode_chunk(buf)


def test_mulsum64_misses_the_top_bit_flipped_in_two_words() -> None:
    """A known blind spot of the format's device checksum (m_i ± m_j is even, so 2**63
    times it is 0 mod 2**64); xxh3_64 catches the same damage."""
    for kind, caught in (("mulsum64", False), ("xxh3_64", True)):
        buf = bytearray(
            encode_chunk(_kv(16, 2, 8, torch.float16), "int8", KEY, checksum=kind).numpy()
        )
        for byte in (HEADER_NBYTES + 7, HEADER_NBYTES + 15):  # bit 63 of two scale words
            buf[byte] ^= 0x80
        if caught:
            with pytest.raises(ChecksumError):
                verify_chunk(bytes(buf))
        else:
            assert verify_chunk(bytes(buf)).checksum == "mulsum64"


def test_header_form_is_what_a_check_depends_on_less_the_key() -> None:
    """Chunks of one shape, dtype and scheme under other keys share a form; another dtype,
    a broken header check or another key than the one named gives another form or None."""
    kv = torch.randn(2, 16, 2, 8)
    other = ChunkKey(bytes(16), 3, 0)
    a = encode_chunk(kv.half(), quant="int8", key=KEY).numpy()
    b = encode_chunk(kv.half() * 2, quant="int8", key=other).numpy()
    c = encode_chunk(kv.bfloat16(), quant="int8", key=KEY).numpy()
    form = header_form(a[:HEADER_NBYTES].tobytes(), a.size, KEY)
    assert form is not None
    assert header_form(b[:HEADER_NBYTES].tobytes(), b.size, other) == form
    assert header_form(c[:HEADER_NBYTES].tobytes(), c.size, KEY) not in (None, form)
    assert header_form(a[:HEADER_NBYTES].tobytes(), a.size + 1, KEY) != form  # (size counts)
    assert header_form(a[:HEADER_NBYTES].tobytes(), a.size, other) is None
    broken = bytearray(a[:HEADER_NBYTES].tobytes())
    broken[36] ^= 1  # a shape byte, the header check left as it was
    assert header_form(bytes(broken), a.size, KEY) is None
    assert header_form(a[: HEADER_NBYTES - 1].tobytes(), a.size, KEY) is None


def test_header_checks_parse_a_form_once_and_refuse_alike_after() -> None:
    """HeaderChecks answers as check_header on tensors, numpy arrays and bytes: the first
    chunk of a form parsed (its header returned), later ones only compared (None), and a
    wrong key, a wrong spec or a corrupted header raise as check_header does."""
    kv = torch.randn(2, 16, 2, 8).half()
    spec = ChunkSpec(16, 2, 8, torch.float16, "int8")
    checks = HeaderChecks(spec)
    first = encode_chunk(kv, quant="int8", key=KEY)
    assert checks.check(first, KEY) == codec.check_header(first, KEY, spec)
    other = ChunkKey(bytes(16), 2, 0)
    buf = encode_chunk(kv * 2, quant="int8", key=other)
    assert checks.check(buf, other) is None
    assert checks.check(buf.numpy(), other) is None
    assert checks.check(buf.numpy().tobytes(), other) is None
    with pytest.raises(ChunkKeyMismatch):
        checks.check(buf, KEY)
    with pytest.raises(ChunkError):  # another dtype than the spec's
        checks.check(encode_chunk(kv.bfloat16(), quant="int8", key=KEY), KEY)
    broken = first.clone()
    broken[40] ^= 1  # the head dim, under an unchanged header check
    with pytest.raises(ChecksumError):
        checks.check(broken, KEY)


def _resealed(chunk: torch.Tensor, at: int, bit: int) -> torch.Tensor:
    """``chunk`` with header byte ``at`` changed by ``bit`` and its header check redone, so
    only the changed field can refuse it."""
    out = chunk.clone()
    out[at] ^= bit
    head = out[:60].numpy().tobytes()
    out[60:64] = torch.frombuffer(
        bytearray(struct.pack("<I", xxhash.xxh3_64_intdigest(head) & 0xFFFFFFFF)),
        dtype=torch.uint8,
    )
    return out


def test_header_checks_refuse_exactly_what_check_header_refuses() -> None:
    """With the form cache warm, every header field but the key changed (and the header
    check redone), another block, layer or shard, and a buffer 8 bytes short or long: each
    passes HeaderChecks exactly when it passes check_header, raising the same, and a refused
    chunk is refused again (its form is never remembered)."""
    spec = ChunkSpec(16, 2, 8, torch.float16, "int8")
    key = ChunkKey(bytes(range(16)), 3, 1)
    honest = encode_chunk(torch.randn(2, 16, 2, 8).half(), quant="int8", key=key)
    checks = HeaderChecks(spec)
    checks.check(honest, key)
    cases = [(_resealed(honest, at, bit), key) for at in [*range(8), *range(32, 60)]
             for bit in (0x01, 0x80)]  # fmt: skip
    cases += [(honest, key._replace(block_hash=bytes(16))), (honest, key._replace(layer=2)),
              (honest, key._replace(shard=0)), (honest[:-8].clone(), key),
              (torch.cat([honest, torch.zeros(8, dtype=torch.uint8)]), key)]  # fmt: skip
    refused = 0
    for buf, k in cases:
        try:
            codec.check_header(buf, k, spec)
        except ChunkError as exc:
            refused += 1
            for _ in range(2):
                with pytest.raises(type(exc)):
                    checks.check(buf, k)
        else:
            checks.check(buf, k)
    assert refused >= len(cases) - 8, "nearly every changed field refuses the chunk"
    assert checks.check(honest, key) is None


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls into C's ``known_headers`` from here on (each still made)."""
    calls: list[int] = []
    real = headers._known_headers
    assert real is not None

    def counted(*args: Any) -> Any:
        calls.append(len(args[0]))
        return real(*args)

    monkeypatch.setattr(headers, "_known_headers", counted)
    return calls


@pytest.mark.parametrize("built", [True, False], ids=["c", "no-extension"])
def test_header_checks_in_one_call_leave_out_only_what_check_header_passes(
    built: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HeaderChecks.unknown, one call into C for a batch, lists every chunk whose header is
    not of a form this spec passed, names another key or fails its header check; the
    chunks it leaves out all pass check_header, and honest chunks of a known form under
    their own keys are left out. A node's ChunkChecks.headers then refuses the same
    positions with the extension and without it (every header checked in Python)."""
    from kvstore.core.hashing import Namespace
    from kvstore.node.checks import ChunkChecks, LandedChunk

    if not built:
        monkeypatch.setattr(headers, "_known_headers", None)
    elif headers._known_headers is None:
        pytest.skip("the C extension is not built here")
    spec = ChunkSpec(16, 2, 8, torch.float16, "int8")
    key = ChunkKey(bytes(range(16)), 3, 1)
    honest = encode_chunk(torch.randn(2, 16, 2, 8).half(), quant="int8", key=key)
    size = honest.numel()
    checks = HeaderChecks(spec)
    if built:  # (no form passed yet: every header takes the full check)
        assert checks.unknown([honest.data_ptr()], size, [key]) == [0]
    checks.check(honest, key)
    unchecked = honest.clone()
    unchecked[61] ^= 0x10  # the header check itself, not redone
    cases = [(_resealed(honest, at, bit), key) for at in [*range(8), *range(24, 60)]
             for bit in (0x01, 0x80)]  # fmt: skip
    cases += [(unchecked, key), (honest, key._replace(block_hash=bytes(16))),
              (honest, key._replace(layer=2)), (honest, key._replace(shard=0))]  # fmt: skip
    others = [ChunkKey(bytes([i]) * 16, i, i % 2) for i in range(4)]
    good = [(encode_chunk(torch.randn(2, 16, 2, 8).half(), quant="int8", key=k), k) for k in others]
    batch = [*cases, *good, (honest, key)]
    listed = checks.unknown([b.data_ptr() for b, _ in batch], size, [k for _, k in batch])
    refused = set()
    for i, (buf, k) in enumerate(batch):
        try:
            codec.check_header(buf, k, spec)
        except ChunkError:
            refused.add(i)
    if built:
        assert refused <= set(listed)
        assert set(listed).isdisjoint(range(len(cases), len(batch)))  # (the honest ones)
        assert len(refused) >= len(cases) - 8, "nearly every changed field refuses the chunk"
    else:
        assert list(listed) == list(range(len(batch)))  # (every header checked in Python)

    ns = Namespace(model="m", revision="r", num_layers=4, num_kv_heads=2, head_dim=8,
                   dtype="float16", block_tokens=16, tp_size=2)  # fmt: skip
    arena = torch.empty(len(batch) * size, dtype=torch.uint8)  # (chunks side by side)
    items = []
    for i, (buf, k) in enumerate(batch):
        arena[i * size : (i + 1) * size] = buf
        items.append(LandedChunk(i, k.block_hash, k.layer * 2 + k.shard, arena[i * size :][:size]))
    calls = _count_calls(monkeypatch) if built else []
    node = ChunkChecks(threads=1)
    try:
        node.header_checks(ns).check(honest, key)
        assert set(node.headers("peer", ns, items)) == refused
        assert len(calls) == (1 if built else 0)  # (the batch in one call into C)
    finally:
        node.close()


@pytest.mark.parametrize("built", [True, False], ids=["c", "no-extension"])
def test_whole_chunks_in_one_call_leave_out_only_what_verify_passes(
    built: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HeaderChecks.unverified, for whole chunks, also compares each chunk's xxh3_64
    checksum: a flipped payload bit, a flipped stored checksum, another key or a chunk of
    a form not passed with xxh3 is listed, honest chunks are left out, and every chunk
    left out passes verify_chunk. A node's ChunkChecks.check (the scrub's) refuses the
    same chunks with the extension and without it."""
    from kvstore.core.hashing import Namespace
    from kvstore.node.checks import ChunkChecks, LandedChunk

    if not built:
        monkeypatch.setattr(headers, "_known_headers", None)
    elif headers._known_headers is None:
        pytest.skip("the C extension is not built here")
    spec = ChunkSpec(16, 2, 8, torch.float16, "int8")
    keys = [ChunkKey(bytes([i]) * 16, i % 4, i % 2) for i in range(8)]
    kv = torch.randn(2, 16, 2, 8).half()
    chunks = [encode_chunk(kv * (i + 1), quant="int8", key=k) for i, k in enumerate(keys)]
    size = chunks[0].numel()
    checks = HeaderChecks(spec)
    checks.verify_host(chunks[0].numpy(), keys[0])  # (the form passes with xxh3)
    chunks[1][-100] ^= 0x04  # payload
    chunks[2][-1] ^= 0x01  # the stored checksum
    chunks[3] = encode_chunk(kv, quant="int8", key=keys[3], checksum="mulsum64")
    batch = [(c, k) for c, k in zip(chunks, keys, strict=True)]
    batch[4] = (chunks[4], keys[5])  # another key
    refused = set()
    for i, (buf, k) in enumerate(batch):
        try:
            verify_chunk(buf, k, spec)
        except ChunkError:
            refused.add(i)
    assert refused == {1, 2, 4}
    listed = checks.unverified([c.data_ptr() for c, _ in batch], size, [k for _, k in batch])
    if built:
        assert set(listed) == {1, 2, 3, 4}  # (3: a mulsum64 form)
    else:
        assert list(listed) == list(range(len(batch)))  # (every chunk verified in Python)

    ns = Namespace(model="m", revision="r", num_layers=4, num_kv_heads=2, head_dim=8,
                   dtype="float16", block_tokens=16, tp_size=2)  # fmt: skip
    calls = _count_calls(monkeypatch) if built else []
    node = ChunkChecks(threads=1)
    try:
        items = [LandedChunk(i, k.block_hash, k.layer * 2 + k.shard, buf)
                 for i, (buf, k) in enumerate(batch)]  # fmt: skip
        for _ in range(2):  # (forms unknown, then known)
            assert set(node.check("peer", ns, items)) == refused
        assert len(calls) == (2 if built else 0)  # (one call into C a batch)
    finally:
        node.close()


def test_a_header_changed_while_it_is_checked_is_judged_on_what_was_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer may still WRITE a slot while the node checks it: a header that changes from a
    wrong dtype to the right one between the two steps of a check is refused on the bytes
    read, and its form is not remembered (a later chunk of it is refused too)."""
    spec = ChunkSpec(16, 2, 8, torch.float16, "int8")
    kv = torch.randn(2, 16, 2, 8)
    good = encode_chunk(kv.half(), quant="int8", key=KEY)
    slot = encode_chunk(kv.bfloat16(), quant="int8", key=KEY)  # same size, wrong dtype
    real = headers.header_form

    def racing(raw: bytes, size: int, key: ChunkKey) -> Any:
        form = real(raw, size, key)
        slot[:HEADER_NBYTES] = good[:HEADER_NBYTES]  # the peer's WRITE lands meanwhile
        return form

    checks = HeaderChecks(spec)
    monkeypatch.setattr(headers, "header_form", racing)
    with pytest.raises(ChunkError):
        checks.check(slot, KEY)
    monkeypatch.setattr(headers, "header_form", real)
    other = ChunkKey(bytes(16), 0, 0)
    with pytest.raises(ChunkError):
        checks.check(encode_chunk(kv.bfloat16(), quant="int8", key=other), other)


# -- a header form met before: decode_chunk's short way ---------------------------------------


def _both_ways(buf: Any, make_out: Any, prime: Any = None, **kw: Any) -> tuple[Any, Any]:
    """decode_chunk of ``buf`` into a fresh ``make_out()`` with no header form known (the
    long way), then with its form known (the short way; ``prime``: a good chunk of the form,
    else ``buf``): each outcome, the output's bytes or the error's type and message, and
    what the output held after an error."""
    outcomes = []
    for known in (False, True):
        codec._FORMS.clear()
        if known:
            read_header(buf if prime is None else prime)  # (parsed: the form is known now)
        out = make_out()
        try:
            decode_chunk(buf, out=out, **kw)
        except Exception as exc:  # (the outcome is what is compared)
            held = [x.clone() for x in out] if isinstance(out, tuple) else out.clone()
            outcomes.append((type(exc), str(exc), held))
            continue
        outcomes.append(tuple(x.clone() for x in out) if isinstance(out, tuple) else out.clone())
    return outcomes[0], outcomes[1]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("quant", [*INT8, "int4-g32", "raw"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_known_header_form_decodes_the_bytes_the_long_way_does(
    quant: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into a tensor, a (K, V) pair, a slice of a wider layer and a strided pair, with and
    without the key and spec to expect: the same bytes either way (the short way taken
    wherever the C kernels decode the scheme)."""
    short_ways: list[bool] = []
    real = codec._decode_known

    def spy(*args: Any) -> bool:
        short_ways.append(real(*args))
        return short_ways[-1]

    monkeypatch.setattr(codec, "_decode_known", spy)
    x = realistic_kv(24, 3, 32, dtype, seed=3)
    buf = encode_chunk(x, quant, KEY)
    spec = ChunkSpec(24, 3, 32, dtype, "none" if quant == "raw" else quant)
    wide = torch.zeros(2, 40, 3, 48, dtype=dtype)

    def strided_pair() -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(3, 24, 32, dtype=dtype).transpose(0, 1) for _ in range(2))

    outs = {
        "tensor": lambda: torch.full_like(x, 3.0),
        "pair": lambda: (torch.full_like(x[0], 3.0), torch.full_like(x[1], 3.0)),
        "slice": lambda: wide.clone()[:, 8:32, :, :32],
        "strided pair": strided_pair,
    }
    for name, make in outs.items():
        for kw in ({}, {"expect_key": KEY, "expect_spec": spec}):
            short_ways.clear()
            long, short = _both_ways(buf, make, **kw)
            assert isinstance(long, (torch.Tensor, tuple)), (name, long)
            assert _same(long, short), (name, kw)
            kernels_decode = quant in INT8 and codec.native.available()
            assert short_ways == [False, kernels_decode], (name, kw)


def test_every_check_fails_alike_with_a_known_header_form() -> None:
    """A chunk whose form is known still has its header check, key, spec, checksum and the
    output's shape, dtype and memory checked: the same error either way, and nothing
    written into the output."""
    x = realistic_kv(16, 2, 16, torch.bfloat16, seed=4)
    good = encode_chunk(x, "int8", KEY)
    spec = ChunkSpec(16, 2, 16, torch.bfloat16, "int8")

    def flipped(at: int) -> torch.Tensor:
        bad = good.clone()
        bad[at] ^= 0x10
        return bad

    out = lambda: torch.full_like(x, 5.0)  # noqa: E731
    cases: list[tuple[Any, Any, dict[str, Any], type[Exception]]] = [
        (flipped(HEADER_NBYTES + 40), out, {}, ChecksumError),  # a scale
        (flipped(good.numel() - 30), out, {}, ChecksumError),  # a code
        (flipped(good.numel() - 1), out, {}, ChecksumError),  # the checksum
        (flipped(10), out, {}, ChecksumError),  # the key: the header check fails
        (good, out, {"expect_key": ChunkKey(KEY[0], 8, 1)}, ChunkKeyMismatch),
        (good, out, {"expect_key": 7}, InvalidArgument),  # (not a key at all)
        (good, out, {"expect_spec": spec._replace(heads=4)}, ChunkError),
        (good, out, {"expect_spec": spec._replace(quant="int4")}, ChunkError),
        (good, lambda: torch.full_like(x, 5.0).float(), {}, BadShape),
        (good, lambda: torch.zeros(2, 15, 2, 16, dtype=torch.bfloat16), {}, BadShape),
        (good, lambda: (torch.zeros(16, 2, 16, dtype=torch.bfloat16),) * 1, {}, Exception),
    ]
    for buf, make, kw, kind in cases:
        long, short = _both_ways(buf, make, good, **kw)
        assert isinstance(long, tuple) and len(long) == 3 and issubclass(long[0], kind), long
        assert short[:2] == long[:2]
        assert _same(short[2], make()), "the output was written before every check passed"


def test_a_known_form_decodes_from_an_unaligned_or_shared_buffer_as_before() -> None:
    """What the short way does not take goes the long way: a misaligned buffer (copied), a
    numpy array, bytes, and an output whose elements share memory."""
    x = realistic_kv(16, 2, 16, torch.float16, seed=5)
    good = encode_chunk(x, "int8", KEY)
    backing = torch.zeros(good.numel() + 8, dtype=torch.uint8)
    backing[3 : 3 + good.numel()] = good
    for buf in (backing[3 : 3 + good.numel()], good.numpy(), good.numpy().tobytes()):
        long, short = _both_ways(buf, lambda: torch.zeros_like(x))
        assert isinstance(long, torch.Tensor) and _same(long, short)
    shared = lambda: torch.zeros(1, 1, 1, 16, dtype=torch.float16).expand(2, 16, 2, 16)  # noqa: E731
    long, short = _both_ways(good, shared)
    assert type(long) is type(short)
    assert _same(long[:2], short[:2]) if isinstance(long, tuple) else _same(long, short)
